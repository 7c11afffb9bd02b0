-- Settle one request exactly once: give back its reservation, charge the real cost and append its
-- cost record, atomically, so the key's spend is always the sum of its cost records.
--
-- KEYS[1] {vk:<id>}:key  HASH    KEYS[2] {vk:<id>}:res  HASH    KEYS[3] {vk:<id>}:cost  STREAM
-- ARGV  1 reservation id ('' for the admin key, which reserves nothing)   2 cost in micro-USD
--       3 prompt tokens   4 completion tokens   5 key id   6 model   7 status   8 latency ms
--       9 time to first chunk ms   10 stream (1/0)   11 usage estimated (1/0)   12 priced (1/0)
--      13 trim records older than this many ms (0: keep all)
-- Returns {"ok", tenant, project} or {"duplicate"} when this reservation was settled already.

-- num() and split() come from _prelude.lua, prepended when the script is loaded.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local late = '0'

if ARGV[1] ~= '' then
  local r = redis.call('HGET', KEYS[2], ARGV[1])
  if r then
    local p = split(r)
    redis.call('HDEL', KEYS[2], ARGV[1])
    if num(p[1]) > 0 then redis.call('HINCRBY', KEYS[1], 'reserved', -num(p[1])) end
    -- Tokens per minute: give back the unused part of the bound, but never more than what of this
    -- reservation is still in the bucket (the rest has drained already and is no one's to give).
    local per_token = num(p[3])
    local unused = num(p[2]) - num(ARGV[3]) - num(ARGV[4])
    if per_token > 0 and unused > 0 then
      local refund = math.min(unused * per_token, math.max(0, num(p[4]) - now))
      if refund > 0 then
        local tat = num(redis.call('HGET', KEYS[1], 'tpm_tat'))
        redis.call('HSET', KEYS[1], 'tpm_tat', string.format('%.3f', tat - refund))
      end
    end
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
local args = {'XADD', KEYS[3]}
if num(ARGV[13]) > 0 then
  args[#args + 1] = 'MINID'
  args[#args + 1] = '~'
  args[#args + 1] = string.format('%d', now - num(ARGV[13]))
end
local fields = {'*', 'model', ARGV[6], 'key', ARGV[5], 'tenant', tp[1] or '', 'project', tp[2] or '',
  'prompt_tokens', ARGV[3], 'completion_tokens', ARGV[4], 'cost_micro_usd', ARGV[2], 'latency_ms', ARGV[8],
  'ttft_ms', ARGV[9], 'status', ARGV[7], 'stream', ARGV[10], 'estimated', ARGV[11], 'priced', ARGV[12],
  'late', late}
for _, v in ipairs(fields) do args[#args + 1] = v end
redis.call(unpack(args))
return {'ok', tp[1] or '', tp[2] or ''}
