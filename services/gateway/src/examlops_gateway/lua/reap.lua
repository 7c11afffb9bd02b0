-- Give back the reservations of one key whose replica is dead or whose lease ran out (a crashed or
-- stuck gateway). Each gets a zero-cost record with status "reaped"; if its gateway was only slow
-- and settles later, settle.lua still charges the real cost (record marked late).
--
-- KEYS[1] {vk:<id>}:key  HASH    KEYS[2] {vk:<id>}:res  HASH    KEYS[3] {vk:<id>}:cost  STREAM
-- ARGV  1 key id   2 keep "reaped:" markers this many ms   3 trim records older than this many ms
--       (0: keep all)   4.. ids of the live replicas
-- Returns the number of reservations given back.

-- num() and split() come from _prelude.lua, prepended when the script is loaded.
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
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
    local p = split(v)
    if not live[p[5]] or now > num(p[6]) then
      redis.call('HDEL', KEYS[2], id)
      redis.call('HSET', KEYS[2], 'reaped:' .. id, string.format('%d', now))
      if num(p[1]) > 0 then redis.call('HINCRBY', KEYS[1], 'reserved', -num(p[1])) end
      local refund = math.min(num(p[2]) * num(p[3]), math.max(0, num(p[4]) - now))
      if refund > 0 then
        local tat = num(redis.call('HGET', KEYS[1], 'tpm_tat'))
        redis.call('HSET', KEYS[1], 'tpm_tat', string.format('%.3f', tat - refund))
      end
      redis.call('HINCRBY', KEYS[1], 'reaped', 1)
      local args = {'XADD', KEYS[3]}
      if num(ARGV[3]) > 0 then
        args[#args + 1] = 'MINID'
        args[#args + 1] = '~'
        args[#args + 1] = string.format('%d', now - num(ARGV[3]))
      end
      local fields = {'*', 'model', p[7] or '', 'key', ARGV[1], 'tenant', tp[1] or '', 'project', tp[2] or '',
        'prompt_tokens', '0', 'completion_tokens', '0', 'cost_micro_usd', '0', 'latency_ms', '0',
        'ttft_ms', '0', 'status', 'reaped', 'stream', '0', 'estimated', '1', 'priced', '1', 'late', '0'}
      for _, x in ipairs(fields) do args[#args + 1] = x end
      redis.call(unpack(args))
      reaped = reaped + 1
    end
  end
end
return reaped
