-- Give back the reservations of one key whose replica is dead or whose lease ran out (a crashed or
-- stuck gateway). Each gets a zero-cost record with status "reaped"; if its gateway was only slow
-- and settles later, settle.lua still charges the real cost (record marked late).
--
-- KEYS[1] {vk:<id>}:key  HASH    KEYS[2] {vk:<id>}:res  HASH    KEYS[3] {vk:<id>}:cost  STREAM
-- ARGV  1 key id   2 keep "reaped:" markers this many ms   3 trim records older than this many ms
--       (0: keep all)   4.. ids of the live replicas
-- Returns the number of reservations given back.

-- num(), int(), now_ms(), reservation(), release() and append_cost() come from _prelude.lua.
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
local now = now_ms()
local live = {}
for i = 4, #ARGV do live[ARGV[i]] = true end
local tp = redis.call('HMGET', KEYS[1], 'tenant', 'project')
local entries = redis.call('HGETALL', KEYS[2])
local reaped = 0
for i = 1, #entries, 2 do
  local id, v = entries[i], entries[i + 1]
  if string.sub(id, 1, 7) == 'reaped:' then
    if now - num(v) > num(ARGV[2]) then redis.call('HDEL', KEYS[2], id) end
  else
    local res = reservation(v)
    if not live[res.replica] or now > res.deadline then
      redis.call('HDEL', KEYS[2], id)
      redis.call('HSET', KEYS[2], 'reaped:' .. id, int(now))
      release(KEYS[1], res, res.tokens, now)
      redis.call('HINCRBY', KEYS[1], 'reaped', 1)
      append_cost(KEYS[3], ARGV[3], now, {
        model = res.model, key = ARGV[1], tenant = tp[1] or '', project = tp[2] or '', prompt_tokens = '0',
        completion_tokens = '0', cost_micro_usd = '0', latency_ms = '0', ttft_ms = '0', status = 'reaped',
        stream = '0', estimated = '1', priced = '1', late = '0'})
      reaped = reaped + 1
    end
  end
end
return reaped
