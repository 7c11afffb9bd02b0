-- Helpers every governance script shares; _scripts.load_script puts this in front of each one
-- (Redis scripts cannot import each other). Times are Redis' own clock in ms, shared by every replica.
local function num(x) return tonumber(x) or 0 end
local function int(x) return string.format('%d', x) end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
end
local function split(s)
  local p, i = {}, 1
  while true do
    local j = string.find(s, '|', i, true)
    if not j then p[#p + 1] = string.sub(s, i); return p end
    p[#p + 1] = string.sub(s, i, j - 1)
    i = j + 1
  end
end

-- The key check, the only one: is the presented key (its sha256) valid now, and may it use `model`
-- (nil: no model, as when listing)? `f` is HMGET of KEY_FIELDS first. Returns nil, or a refusal
-- {"deny", code, detail}.
local KEY_FIELDS = {'hash', 'revoked_ms', 'expires_ms', 'models'}
local function check_key(f, presented, model, now)
  if not f[1] or f[1] ~= presented then return {'deny', 'invalid_api_key', ''} end
  if num(f[2]) > 0 then return {'deny', 'key_revoked', ''} end
  if num(f[3]) > 0 and now >= num(f[3]) then return {'deny', 'key_expired', ''} end
  if model and not string.find(f[4] or '', ',' .. model .. ',', 1, true) then
    return {'deny', 'model_not_allowed', f[4] or ''}
  end
  return nil
end

-- A reservation as reserve.lua writes it: "cost|tokens|ms_per_token|tpm_end|replica|deadline_ms|model|max_tokens".
local function reservation(s)
  local p = split(s)
  return {cost = num(p[1]), tokens = num(p[2]), per_token = num(p[3]), tpm_end = num(p[4]), replica = p[5],
          deadline = num(p[6]), model = p[7] or '', max_tokens = p[8]}
end

-- Give a reservation back to its key: the money, and `unused` of its tokens to the TPM bucket, but
-- never more than what of this reservation is still in the bucket (the rest has drained already
-- and is no one's to give).
local function release(key, r, unused, now)
  if r.cost > 0 then redis.call('HINCRBY', key, 'reserved', int(-r.cost)) end
  if r.per_token > 0 and unused > 0 then
    local refund = math.min(unused * r.per_token, math.max(0, r.tpm_end - now))
    if refund > 0 then
      local tat = num(redis.call('HGET', key, 'tpm_tat'))
      redis.call('HSET', key, 'tpm_tat', string.format('%.3f', tat - refund))
    end
  end
end

-- Append one cost record (settle.lua, reap.lua) to `stream`, trimming records older than
-- `trim_ms` (0: keep all). `rec` names every field of COST_FIELDS.
local COST_FIELDS = {'model', 'key', 'tenant', 'project', 'prompt_tokens', 'completion_tokens', 'cost_micro_usd',
                     'latency_ms', 'ttft_ms', 'status', 'stream', 'estimated', 'priced', 'late', 'guarded',
                     'cache', 'provider', 'basis', 'clamped'}
local function append_cost(stream, trim_ms, now, rec)
  local args = {'XADD', stream}
  if num(trim_ms) > 0 then
    args[#args + 1] = 'MINID'
    args[#args + 1] = '~'
    args[#args + 1] = int(now - num(trim_ms))
  end
  args[#args + 1] = '*'
  for _, name in ipairs(COST_FIELDS) do
    args[#args + 1] = name
    args[#args + 1] = rec[name] or ''  -- a record from before a field existed (reap.lua) leaves it empty
  end
  return redis.call(unpack(args))
end
