"""Lua scripts that make the Redis Streams transport's multi-step operations atomic.

* PUBLISH: add as many payloads as fit under `max_len` (backlog = XLEN, because the stream only
  ever holds entries that some consumer group has not acked yet) and return their ids.
* ACK: XACK, then trim the acked prefix: XTRIM MINID below the first entry that any group still
  needs (its oldest pending entry, or the one after its last-delivered id). Unconsumed entries
  are never trimmed; entries acked out of order behind an older pending one stay until it goes.
* DEAD_LETTER: append an entry with its reason to `<stream>:dead`, ack it, trim.
* RECLAIM: XAUTOCLAIM entries idle longer than `claim_idle_ms`, read their delivery counters,
  move the ones delivered more than `max_deliveries` times to the dead-letter stream (and ack
  them), and return the rest with their counters.
"""

from __future__ import annotations

# Shared Lua: compare two stream ids "ms-seq".
_ID_LT = """
local function split_id(id)
  local dash = string.find(id, '-', 1, true)
  return tonumber(string.sub(id, 1, dash - 1)), tonumber(string.sub(id, dash + 1))
end
local function id_lt(a, b)
  local ams, aseq = split_id(a)
  local bms, bseq = split_id(b)
  return ams < bms or (ams == bms and aseq < bseq)
end
"""

PUBLISH = """
-- KEYS[1] stream; ARGV[1] max_len; ARGV[2..] payloads. Returns the ids added (maybe none).
local room = tonumber(ARGV[1]) - redis.call('XLEN', KEYS[1])
local ids = {}
for i = 2, #ARGV do
  if room <= 0 then break end
  ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', 'd', ARGV[i])
  room = room - 1
end
return ids
"""

_TRIM = (
    _ID_LT
    + """
local function trim_acked(stream)
  if redis.call('EXISTS', stream) == 0 then return end
  local bound = nil
  for _, info in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local fields = {}
    for j = 1, #info, 2 do fields[info[j]] = info[j + 1] end
    local first_needed
    if tonumber(fields['pending']) > 0 then
      first_needed = redis.call('XPENDING', stream, fields['name'])[2]
    else
      local ms, seq = split_id(fields['last-delivered-id'])
      first_needed = string.format('%d-%d', ms, seq + 1)
    end
    if bound == nil or id_lt(first_needed, bound) then bound = first_needed end
  end
  if bound ~= nil then redis.call('XTRIM', stream, 'MINID', bound) end
end
"""
)

ACK = (
    _TRIM
    + """
-- KEYS[1] stream; ARGV[1] group; ARGV[2..] ids. Returns how many were acked.
local ids = {}
for i = 2, #ARGV do ids[#ids + 1] = ARGV[i] end
local acked = 0
if #ids > 0 then acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(ids)) end
trim_acked(KEYS[1])
return acked
"""
)

RECLAIM = (
    _TRIM
    + """
-- KEYS[1] stream; KEYS[2] dead-letter stream; ARGV: group, consumer, claim_idle_ms, count,
-- max_deliveries, dead_maxlen. Returns {{id, payload, deliveries}, ...} of reclaimed live entries.
local group, consumer = ARGV[1], ARGV[2]
local claimed = redis.call('XAUTOCLAIM', KEYS[1], group, consumer, ARGV[3], '0-0', 'COUNT', ARGV[4])[2]
local out = {}
for _, entry in ipairs(claimed) do
  local id, fields = entry[1], entry[2]
  local payload = ''
  for j = 1, #fields, 2 do if fields[j] == 'd' then payload = fields[j + 1] end end
  local deliveries = redis.call('XPENDING', KEYS[1], group, id, id, 1)[1][4]
  if deliveries > tonumber(ARGV[5]) then
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'd', payload, 'id', id, 'group', group,
      'attempts', deliveries - 1,
      'reason', 'delivered ' .. (deliveries - 1) .. ' times without ack (max_deliveries ' .. ARGV[5] .. ')')
    redis.call('XACK', KEYS[1], group, id)
  else
    out[#out + 1] = {id, payload, deliveries}
  end
end
if #out < #claimed then trim_acked(KEYS[1]) end
return out
"""
)

DEAD_LETTER = (
    _TRIM
    + """
-- KEYS[1] stream; KEYS[2] dead-letter stream; ARGV: group, id, payload, attempts, reason, dead_maxlen.
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'd', ARGV[3], 'id', ARGV[2], 'group', ARGV[1],
  'attempts', ARGV[4], 'reason', ARGV[5])
local acked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
trim_acked(KEYS[1])
return acked
"""
)
