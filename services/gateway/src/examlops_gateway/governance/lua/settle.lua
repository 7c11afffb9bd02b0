-- Settle one request exactly once: give back its reservation, charge the real cost and append its
-- cost record, atomically, so the key's spend is always the sum of its cost records.
--
-- KEYS[1] {vk:<id>}:key  HASH    KEYS[2] {vk:<id>}:res  HASH    KEYS[3] {vk:<id>}:cost  STREAM
-- ARGV (built by _scripts.SettleArgs)
--       1 reservation id ('' for the admin key, which reserves nothing)   2 cost in micro-USD
--       3 prompt tokens   4 completion tokens   5 key id   6 model   7 status   8 latency ms
--       9 time to first chunk ms   10 stream (1/0)   11 usage estimated (1/0)   12 priced (1/0)
--      13 trim records older than this many ms (0: keep all)   14 what the guardrails did ('': nothing)
--      15 what the response cache did (hit-exact, hit-semantic, miss, bypass; '': no cache policy)
--      16 the cost provider (prices, gpu-hour, module:Class)   17 its basis ('' for prices)
--      18 micro-USD the provider asked above the reservation and was not charged (clamped)
-- Returns {"ok", tenant, project} or {"duplicate"} when this reservation was settled already (a
-- retried settle whose first reply was lost), so the gateway may retry until Redis answers.
--
-- A reservation the reaper returned first (its gateway looked dead, or its lease ran out) left a
-- marker "reaped:<res_id>" -> "ms|cost|prompt|completion" naming what the reaper already charged
-- (progress.lua's last note); this late settle charges the rest, so the real cost is charged once.

-- num(), int(), split(), now_ms(), reservation(), release() and append_cost() come from _prelude.lua.
local now = now_ms()
local late = '0'
local cost, prompt, completion = num(ARGV[2]), num(ARGV[3]), num(ARGV[4])

if ARGV[1] ~= '' then
  redis.call('HDEL', KEYS[2], 'owed:' .. ARGV[1])
  local r = redis.call('HGET', KEYS[2], ARGV[1])
  local marker = redis.call('HGET', KEYS[2], 'reaped:' .. ARGV[1])
  if r then
    redis.call('HDEL', KEYS[2], ARGV[1])
    local res = reservation(r)
    release(KEYS[1], res, res.tokens - prompt - completion, now)
  elseif marker then
    redis.call('HDEL', KEYS[2], 'reaped:' .. ARGV[1])
    late = '1'  -- the reaper returned the reservation already; the rest of the real cost is still owed
    local m = split(marker)
    cost = math.max(0, cost - num(m[2]))
    prompt = math.max(0, prompt - num(m[3]))
    completion = math.max(0, completion - num(m[4]))
  else
    return {'duplicate'}
  end
end

redis.call('HINCRBY', KEYS[1], 'spent', int(cost))
redis.call('HINCRBY', KEYS[1], 'requests', 1)
redis.call('HINCRBY', KEYS[1], 'prompt_tokens', int(prompt))
redis.call('HINCRBY', KEYS[1], 'completion_tokens', int(completion))
local tp = redis.call('HMGET', KEYS[1], 'tenant', 'project')
append_cost(KEYS[3], ARGV[13], now, {
  model = ARGV[6], key = ARGV[5], tenant = tp[1] or '', project = tp[2] or '', prompt_tokens = int(prompt),
  completion_tokens = int(completion), cost_micro_usd = int(cost), latency_ms = ARGV[8], ttft_ms = ARGV[9],
  status = ARGV[7], stream = ARGV[10], estimated = ARGV[11], priced = ARGV[12], late = late,
  guarded = ARGV[14] or '', cache = ARGV[15] or '', provider = ARGV[16] or '', basis = ARGV[17] or '',
  clamped = ARGV[18] or '0'})
return {'ok', tp[1] or '', tp[2] or ''}
