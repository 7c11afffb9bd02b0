-- This replica is alive for another ttl ms (Redis' clock); returns the ids of every live replica.
-- KEYS[1] {exa:gw}:replicas  ZSET  replica id -> alive-until ms
-- ARGV  1 replica id   2 ttl ms
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], string.format('%d', now + tonumber(ARGV[2])), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', now - 86400000))
return redis.call('ZRANGEBYSCORE', KEYS[1], string.format('%d', now), '+inf')
