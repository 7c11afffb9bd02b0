-- Give back the reservations of one key whose replica is dead or whose lease ran out (a crashed or
-- stuck gateway). Each gets a record with status "reaped" charging what its gateway last noted as
-- delivered (progress.lua's "owed:<res_id>", else 0); if its gateway was only slow and settles
-- later, settle.lua charges the rest of the real cost (record marked late).
--
-- KEYS[1] {vk:<id>}:key  HASH    KEYS[2] {vk:<id>}:res  HASH    KEYS[3] {vk:<id>}:cost  STREAM
-- ARGV  1 key id   2 keep "reaped:" markers this many ms   3 trim records older than this many ms
--       (0: keep all)   4.. ids of the live replicas
-- Returns the number of reservations given back.

-- num(), int(), split(), now_ms(), reservation(), release() and append_cost() come from _prelude.lua.
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
    if now - num(split(v)[1]) > num(ARGV[2]) then redis.call('HDEL', KEYS[2], id) end
  elseif string.sub(id, 1, 5) ~= 'owed:' then  -- a progress note goes with its reservation
    local res = reservation(v)
    if not live[res.replica] or now > res.deadline then
      local owed = split(redis.call('HGET', KEYS[2], 'owed:' .. id) or '0|0|0')
      local cost, prompt, completion = num(owed[1]), num(owed[2]), num(owed[3])
      redis.call('HDEL', KEYS[2], id, 'owed:' .. id)
      redis.call('HSET', KEYS[2], 'reaped:' .. id, table.concat({int(now), int(cost), int(prompt), int(completion)}, '|'))
      release(KEYS[1], res, res.tokens - prompt - completion, now)
      redis.call('HINCRBY', KEYS[1], 'reaped', 1)
      if cost > 0 then redis.call('HINCRBY', KEYS[1], 'spent', int(cost)) end
      redis.call('HINCRBY', KEYS[1], 'prompt_tokens', int(prompt))
      redis.call('HINCRBY', KEYS[1], 'completion_tokens', int(completion))
      append_cost(KEYS[3], ARGV[3], now, {
        model = res.model, key = ARGV[1], tenant = tp[1] or '', project = tp[2] or '', prompt_tokens = int(prompt),
        completion_tokens = int(completion), cost_micro_usd = int(cost), latency_ms = '0', ttft_ms = '0',
        status = 'reaped', stream = '0', estimated = '1', priced = '1', late = '0'})
      reaped = reaped + 1
    end
  end
end
return reaped
