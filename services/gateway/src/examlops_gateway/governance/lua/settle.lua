-- Settle one request exactly once: give back its reservation, charge the real cost and append its
-- cost record, atomically, so the key's spend is always the sum of its cost records.
--
-- KEYS[1] {vk:<id>}:key  HASH    KEYS[2] {vk:<id>}:res  HASH    KEYS[3] {vk:<id>}:cost  STREAM
-- ARGV (built by _scripts.SettleArgs)
--       1 reservation id ('' for the admin key, which reserves nothing)   2 cost in micro-USD
--       3 prompt tokens   4 completion tokens   5 key id   6 model   7 status   8 latency ms
--       9 time to first chunk ms   10 stream (1/0)   11 usage estimated (1/0)   12 priced (1/0)
--      13 trim records older than this many ms (0: keep all)
-- Returns {"ok", tenant, project} or {"duplicate"} when this reservation was settled already.

-- num(), now_ms(), reservation(), release() and append_cost() come from _prelude.lua.
local now = now_ms()
local late = '0'

if ARGV[1] ~= '' then
  local r = redis.call('HGET', KEYS[2], ARGV[1])
  if r then
    redis.call('HDEL', KEYS[2], ARGV[1])
    local res = reservation(r)
    release(KEYS[1], res, res.tokens - num(ARGV[3]) - num(ARGV[4]), now)
  elseif redis.call('HDEL', KEYS[2], 'reaped:' .. ARGV[1]) == 1 then
    late = '1'  -- the reaper returned the reservation already; the real cost is still owed
  else
    return {'duplicate'}
  end
end

redis.call('HINCRBY', KEYS[1], 'spent', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'requests', 1)
redis.call('HINCRBY', KEYS[1], 'prompt_tokens', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'completion_tokens', ARGV[4])
local tp = redis.call('HMGET', KEYS[1], 'tenant', 'project')
append_cost(KEYS[3], ARGV[13], now, {
  model = ARGV[6], key = ARGV[5], tenant = tp[1] or '', project = tp[2] or '', prompt_tokens = ARGV[3],
  completion_tokens = ARGV[4], cost_micro_usd = ARGV[2], latency_ms = ARGV[8], ttft_ms = ARGV[9],
  status = ARGV[7], stream = ARGV[10], estimated = ARGV[11], priced = ARGV[12], late = late})
return {'ok', tp[1] or '', tp[2] or ''}
