-- Admission of one request on one virtual key, in one round trip: authenticate, allow-list,
-- budget (reserve the request's maximum cost), requests per minute and tokens per minute (GCRA).
-- Every check runs before any write, so a refused request changes nothing.
--
-- KEYS[1] {vk:<id>}:key  HASH  the key: hash, models, budget, limits, counters (see _keys.py)
-- KEYS[2] {vk:<id>}:res  HASH  open reservations, res_id -> "cost|tokens|ms_per_token|tpm_end|
--                              replica|deadline_ms|model|max_tokens"
-- ARGV (built by _scripts.ReserveArgs)
--       1 sha256 of the presented key      2 model             3 reservation id   4 replica id
--       5 prompt tokens, an upper bound    6 prompt tokens x input micro-USD per Mtok
--       7 n x output micro-USD per Mtok    8 n (choices; 0: no output, an embedding)
--       9 max_tokens asked (0: none)
--      10 max_tokens when none is asked and the key is bounded  11 priced (1/0)  12 lease in ms
-- Returns {"ok", max_tokens, reserved micro-USD, tenant, project, bounded (1/0), guardrails (",a,b,"),
--          budgeted (1/0)}
--      or {"deny", code, detail}         (decoded by _scripts.Admission.from_reply)
-- Money is integer micro-USD.

-- num(), int(), now_ms(), check_key() and reservation() come from _prelude.lua.
local f = redis.call('HMGET', KEYS[1], KEY_FIELDS[1], KEY_FIELDS[2], KEY_FIELDS[3], KEY_FIELDS[4], 'budget',
                     'spent', 'reserved', 'rpm', 'rpm_tat', 'tpm', 'tpm_tat', 'tenant', 'project', 'guardrails')
local now = now_ms()
local refused = check_key(f, ARGV[1], ARGV[2], now)
if refused then return refused end

-- A retried call (the reply was lost) must not reserve twice: answer what was decided.
local seen = redis.call('HGET', KEYS[2], ARGV[3])
if seen then
  local r = reservation(seen)
  local bounded = (num(f[5]) >= 0 or num(f[10]) > 0) and '1' or '0'
  return {'ok', r.max_tokens, int(r.cost), f[12] or '', f[13] or '', bounded, f[14] or '',
          num(f[5]) >= 0 and '1' or '0'}
end

local budget, rpm, tpm = num(f[5]), num(f[8]), num(f[10])
local prompt, pnum, onum, n = num(ARGV[5]), num(ARGV[6]), num(ARGV[7]), num(ARGV[8])
local m = num(ARGV[9])
local bounded = budget >= 0 or tpm > 0
if bounded and m == 0 then m = num(ARGV[10]) end

-- Tokens per minute: one request may not need more than the whole bucket: its prompt and at least one
-- output token per choice (an embedding has n = 0: it makes no output, so only its prompt counts).
if tpm > 0 then
  if prompt + n > tpm then return {'deny', 'tpm_too_small', int(tpm)} end
  if n > 0 and m > math.floor((tpm - prompt) / n) then m = math.floor((tpm - prompt) / n) end
end

-- Budget: cap max_tokens to what is left, then reserve the request's maximum cost.
local cost = 0
if budget >= 0 then
  if ARGV[11] ~= '1' then return {'deny', 'model_not_priced', ''} end
  local avail = budget - num(f[6]) - num(f[7])
  if onum > 0 then
    local afford = math.floor((avail * 1000000 - pnum) / onum)
    if afford < m then m = afford end
  end
  if m < 1 then return {'deny', 'budget_exceeded', int(avail)} end
  cost = math.ceil((pnum + onum * m) / 1000000)
  while cost > avail and m > 1 do  -- the division above is in floating point
    m = m - 1
    cost = math.ceil((pnum + onum * m) / 1000000)
  end
  if cost > avail then return {'deny', 'budget_exceeded', int(avail)} end
end

-- Requests per minute, GCRA: a burst of rpm, refilled at rpm per minute.
local rpm_tat = 0
if rpm > 0 then
  rpm_tat = math.max(num(f[9]), now) + 60000 / rpm
  if rpm_tat - now > 60000.001 then
    return {'deny', 'rpm_exceeded', int(math.ceil(rpm_tat - now - 60000))}
  end
end

-- Tokens per minute, GCRA over the request's token bound; settle gives back what was not used.
local tokens, per_token, tpm_tat = 0, 0, 0
if tpm > 0 then
  tokens = prompt + n * m
  per_token = 60000 / tpm
  tpm_tat = math.max(num(f[11]), now) + tokens * per_token
  if tpm_tat - now > 60000.001 then
    return {'deny', 'tpm_exceeded', int(math.ceil(tpm_tat - now - 60000))}
  end
end

if rpm > 0 then redis.call('HSET', KEYS[1], 'rpm_tat', string.format('%.3f', rpm_tat)) end
if tpm > 0 then redis.call('HSET', KEYS[1], 'tpm_tat', string.format('%.3f', tpm_tat)) end
if cost > 0 then redis.call('HINCRBY', KEYS[1], 'reserved', int(cost)) end
redis.call('HSET', KEYS[2], ARGV[3], table.concat({int(cost), int(tokens), string.format('%.6f', per_token),
  string.format('%.3f', tpm_tat), ARGV[4], int(now + num(ARGV[12])), ARGV[2], int(m)}, '|'))
return {'ok', int(m), int(cost), f[12] or '', f[13] or '', bounded and '1' or '0', f[14] or '',
        budget >= 0 and '1' or '0'}
