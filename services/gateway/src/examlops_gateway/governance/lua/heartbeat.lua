-- This replica is alive for another ttl ms (Redis' clock); returns the ids of every live replica.
-- KEYS[1] {exa:gw}:replicas  ZSET  replica id -> alive-until ms
-- ARGV  1 replica id   2 ttl ms

-- int() and now_ms() come from _prelude.lua.
local now = now_ms()
redis.call('ZADD', KEYS[1], int(now + tonumber(ARGV[2])), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', int(now - 86400000))
return redis.call('ZRANGEBYSCORE', KEYS[1], int(now), '+inf')
