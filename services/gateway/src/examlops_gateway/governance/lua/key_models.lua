-- The models a virtual key may use, if the key is valid now (GET /v1/models). The same check as
-- reserve.lua's (check_key), on the same clock (Redis TIME), so both agree at every instant.
--
-- KEYS[1] {vk:<id>}:key  HASH
-- ARGV  1 sha256 of the presented key
-- Returns {"ok", models (",a,b,")} or {"deny", code, detail}.

-- now_ms(), check_key() and KEY_FIELDS come from _prelude.lua.
local f = redis.call('HMGET', KEYS[1], unpack(KEY_FIELDS))
local refused = check_key(f, ARGV[1], nil, now_ms())
if refused then return refused end
return {'ok', f[4] or ''}
