"""Lua scripts that make the Redis Streams transport's multi-step operations atomic.

* RESERVE: grant a producer credits (publish rights) while XLEN + credits already granted stays
  below `max_len` (XLEN is the backlog, because the stream only ever holds entries that some group
  has not acked yet). Grants are leased, so a dead producer's credits come back. The producer then
  spends them in a MULTI/EXEC of XADDs plus an HINCRBY of -n, which keeps XLEN + credits <= max_len
  without passing 64 KB payloads through Lua (that doubled the server's CPU per entry).
* PUBLISH_KEYED: `publish_many` with keys: per entry, GET its key; if absent XADD the entry and
  SET the key to its id (with expiry); then HINCRBY the producer's credits by minus the entries
  appended. A crash never leaves an entry appended without its key, so a repeat under the same
  keys appends nothing twice. Only keyed publishes (the feeder's prompts, small) pass through Lua.
* ACK: XACK, then trim the acked prefix: XTRIM MINID below the first entry that any group still
  needs (its oldest pending entry, or the one after its last-delivered id). Unconsumed entries
  are never trimmed; entries acked out of order behind an older pending one stay until it goes.
* DEAD_LETTER: append an entry with its reason to `<stream>:dead`, ack it, trim.
  A dead letter keeps the entry's id, group, attempts, reason, size (`n`) and the first
  `dead_payload_bytes` of its payload (`d`), never the whole of a payload that may be huge.
* RECLAIM: XAUTOCLAIM entries idle longer than `claim_idle_ms`, read their delivery counters,
  move the ones delivered more than `max_deliveries` times to the dead-letter stream (and ack
  them), and return the rest with their counters and how many it moved.
* READ_OWN: re-read this consumer's own pending entries after a cursor (XREADGROUP from an id
  instead of '>'), with the same redelivery cap as RECLAIM (a restarted consumer gets back what
  it held, at once, and a poison entry that kills it every time still ends in the dead-letter stream).
* RELEASE: hand a consumer's pending entries back to its group: XCLAIM each to the same consumer with an
  idle time far above any `claim_idle_s` (the next XAUTOCLAIM of any consumer takes it) and its
  delivery counter one below what it was (that XAUTOCLAIM counts it again): a hand-back is no failed
  delivery.
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

RESERVE = """
-- KEYS[1] stream; KEYS[2] credits hash (producer token -> credits); KEYS[3] leases zset (token -> expiry ms)
-- ARGV: token, want, max_len, lease_ms. Returns the credits this producer now holds.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for _, token in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)) do
  redis.call('HDEL', KEYS[2], token)
  redis.call('ZREM', KEYS[3], token)
end
local outstanding = 0
for _, n in ipairs(redis.call('HVALS', KEYS[2])) do outstanding = outstanding + tonumber(n) end
local room = tonumber(ARGV[3]) - redis.call('XLEN', KEYS[1]) - outstanding
local mine = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if room > 0 and tonumber(ARGV[2]) > 0 then
  mine = redis.call('HINCRBY', KEYS[2], ARGV[1], math.min(room, tonumber(ARGV[2])))
end
if mine > 0 then redis.call('ZADD', KEYS[3], now + tonumber(ARGV[4]), ARGV[1]) end
return mine
"""

PUBLISH_KEYED = """
-- KEYS[1] stream; KEYS[2] credits hash; KEYS[3..] one key per entry.
-- ARGV: token, key ttl ms, then one payload per entry (ARGV[i] goes with KEYS[i]).
-- Returns {credits this producer holds now, {id, ...}}.
local ids, added = {}, 0
for i = 3, #KEYS do
  local id = redis.call('GET', KEYS[i])
  if not id then
    id = redis.call('XADD', KEYS[1], '*', 'd', ARGV[i])
    redis.call('SET', KEYS[i], id, 'PX', ARGV[2])
    added = added + 1
  end
  ids[#ids + 1] = id
end
local held = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if added > 0 then held = redis.call('HINCRBY', KEYS[2], ARGV[1], 0 - added) end
return {held, ids}
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
-- max_deliveries, dead_maxlen, cursor, dead_payload_bytes. Returns {next cursor,
-- {{id, payload, deliveries}, ...}, dead-lettered} with the reclaimed entries that are still live
-- and how many went to KEYS[2].
local group, consumer = ARGV[1], ARGV[2]
local reply = redis.call('XAUTOCLAIM', KEYS[1], group, consumer, ARGV[3], ARGV[7], 'COUNT', ARGV[4])
local claimed = reply[2]
local out = {}
for _, entry in ipairs(claimed) do
  local id, fields = entry[1], entry[2]
  local payload = ''
  for j = 1, #fields, 2 do if fields[j] == 'd' then payload = fields[j + 1] end end
  local deliveries = redis.call('XPENDING', KEYS[1], group, id, id, 1)[1][4]
  if deliveries > tonumber(ARGV[5]) then
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'd', string.sub(payload, 1, tonumber(ARGV[8])),
      'n', #payload, 'id', id, 'group', group, 'attempts', deliveries - 1,
      'reason', 'delivered ' .. (deliveries - 1) .. ' times without ack (max_deliveries ' .. ARGV[5] .. ')')
    redis.call('XACK', KEYS[1], group, id)
  else
    out[#out + 1] = {id, payload, deliveries}
  end
end
if #out < #claimed then trim_acked(KEYS[1]) end
return {reply[1], out, #claimed - #out}
"""
)

DEAD_LETTER = (
    _TRIM
    + """
-- KEYS[1] stream; KEYS[2] dead-letter stream; ARGV: group, id, payload prefix, attempts, reason,
-- dead_maxlen, payload bytes.
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'd', ARGV[3], 'n', ARGV[7], 'id', ARGV[2],
  'group', ARGV[1], 'attempts', ARGV[4], 'reason', ARGV[5])
local acked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
trim_acked(KEYS[1])
return acked
"""
)

_CAP = """
local function cap(stream, dead, group, id, payload, deliveries, max_deliveries, dead_maxlen, keep)
  if deliveries <= tonumber(max_deliveries) then return false end
  redis.call('XADD', dead, 'MAXLEN', '~', dead_maxlen, '*', 'd', string.sub(payload, 1, tonumber(keep)),
    'n', #payload, 'id', id, 'group', group, 'attempts', deliveries - 1,
    'reason', 'delivered ' .. (deliveries - 1) .. ' times without ack (max_deliveries '
      .. max_deliveries .. ')')
  redis.call('XACK', stream, group, id)
  return true
end
"""

READ_OWN = (
    _TRIM
    + _CAP
    + """
-- KEYS[1] stream; KEYS[2] dead-letter stream; ARGV: group, consumer, after, count, max_deliveries,
-- dead_maxlen, dead_payload_bytes. Returns {last id read (or ARGV[3]), {{id, payload, deliveries}, ...},
-- dead-lettered, entries read}.
local group, consumer = ARGV[1], ARGV[2]
local reply = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', ARGV[4], 'STREAMS', KEYS[1],
  ARGV[3])
local entries = {}
if reply and reply[1] then entries = reply[1][2] end
local out, last, capped = {}, ARGV[3], 0
for _, entry in ipairs(entries) do
  local id, fields = entry[1], entry[2]
  last = id
  if not fields then
    redis.call('XACK', KEYS[1], group, id)  -- deleted under us: nothing to hand back
  else
    local payload = ''
    for j = 1, #fields, 2 do if fields[j] == 'd' then payload = fields[j + 1] end end
    local deliveries = redis.call('XPENDING', KEYS[1], group, id, id, 1)[1][4]
    if cap(KEYS[1], KEYS[2], group, id, payload, deliveries, ARGV[5], ARGV[6], ARGV[7]) then
      capped = capped + 1
    else
      out[#out + 1] = {id, payload, deliveries}
    end
  end
end
if capped > 0 then trim_acked(KEYS[1]) end
return {last, out, capped, #entries}
"""
)

RELEASE = """
-- KEYS[1] stream; ARGV: group, consumer, idle ms. Returns how many entries were handed back.
local n, start = 0, '-'
while true do
  local rows = redis.call('XPENDING', KEYS[1], ARGV[1], start, '+', 100, ARGV[2])
  for _, row in ipairs(rows) do
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, row[1], 'IDLE', ARGV[3],
      'RETRYCOUNT', math.max(row[4] - 1, 0), 'JUSTID')
    start = '(' .. row[1]
  end
  n = n + #rows
  if #rows < 100 then return n end
end
"""
