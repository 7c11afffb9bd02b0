-- Helpers every governance script shares; _governor.load_script puts this in front of each one
-- (Redis scripts cannot import each other).
local function num(x) return tonumber(x) or 0 end
local function split(s)
  local p, i = {}, 1
  while true do
    local j = string.find(s, '|', i, true)
    if not j then p[#p + 1] = string.sub(s, i); return p end
    p[#p + 1] = string.sub(s, i, j - 1)
    i = j + 1
  end
end
