"""Lua scripts of leases and fenced writes on Redis (broker/lease.py says what they are for).

A lease is a hash `<key>` {epoch, holder} with an expiry, and a counter `<key>:epoch` that outlives it:
  * LEASE_ACQUIRE: when the hash is absent (expired, released) or its holder is exactly the one the
    caller names as dead, INCR the counter and write the hash with that epoch; else return the holder.
  * LEASE_RENEW: PEXPIRE the hash while it carries the caller's epoch; when it expired and the counter
    still equals that epoch (nobody took the lease since), write it again; else 0 (the lease is lost).
  * LEASE_RELEASE: delete the hash if it carries the caller's epoch.
Fenced writes: `fenced(script)` prefixes a script with a check of the caller's epoch, atomic with the
script's writes. The fenced script takes the lease's two keys before its own and the epoch before its own
arguments; when the lease carries another epoch (or, expired, the counter moved on) it returns an error
starting with FENCED and writes nothing. SPEND (XADDs and the credits they used), SET (a latest value),
READ_NEW (XREADGROUP of new entries, without blocking) and CHECK (nothing) exist to be fenced.
"""

from __future__ import annotations

from broker.transport import LeaseState

LEASE_ACQUIRE = """
-- KEYS[1] lease hash, KEYS[2] epoch counter; ARGV: holder, ttl ms, replace ('' = none).
-- Returns {1 if taken else 0, epoch, holder}.
local cur = redis.call('HMGET', KEYS[1], 'epoch', 'holder')
if cur[1] and (ARGV[3] == '' or cur[2] ~= ARGV[3]) then
  return {0, tonumber(cur[1]), cur[2]}
end
local epoch = redis.call('INCR', KEYS[2])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'epoch', epoch, 'holder', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, epoch, ARGV[1]}
"""

LEASE_RENEW = """
-- KEYS[1] lease hash, KEYS[2] epoch counter; ARGV: epoch, ttl ms, holder. Returns 1 (held) or 0 (lost).
local cur = redis.call('HGET', KEYS[1], 'epoch')
if not cur then
  if tonumber(redis.call('GET', KEYS[2]) or '0') ~= tonumber(ARGV[1]) then return 0 end
  redis.call('HSET', KEYS[1], 'epoch', ARGV[1], 'holder', ARGV[3])
elseif tonumber(cur) ~= tonumber(ARGV[1]) then
  return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

LEASE_RELEASE = """
-- KEYS[1] lease hash; ARGV[1] epoch.
if tonumber(redis.call('HGET', KEYS[1], 'epoch') or '-1') == tonumber(ARGV[1]) then
  redis.call('DEL', KEYS[1])
end
return 1
"""

_FENCE = """
local fence_key = table.remove(KEYS, 1)
local fence_counter = table.remove(KEYS, 1)
local fence_epoch = tonumber(table.remove(ARGV, 1))
local held = redis.call('HGET', fence_key, 'epoch')
if not held then held = redis.call('GET', fence_counter) end
if tonumber(held or '0') ~= fence_epoch then
  return redis.error_reply('FENCED lease ' .. fence_key .. ' is at epoch ' .. tostring(held) ..
    ', this holder has epoch ' .. fence_epoch)
end
"""

SPEND = """
-- KEYS[1] stream; KEYS[2] credits hash; ARGV: token, then the payloads. Returns {credits left, {id, ...}}.
local ids = {}
for i = 2, #ARGV do ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', 'd', ARGV[i]) end
local held = redis.call('HINCRBY', KEYS[2], ARGV[1], 1 - #ARGV)
return {held, ids}
"""

SET = """
-- KEYS[1] key; ARGV[1] value.
return redis.call('SET', KEYS[1], ARGV[1])
"""

READ_NEW = """
-- KEYS[1] stream; ARGV: group, consumer, count.
return redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS', KEYS[1], '>')
"""

CHECK = """
return 1
"""


def fenced(script: str) -> str:
    """`script` behind the epoch check (see the module docstring)."""
    return _FENCE + script


class RedisLeases:
    """`RedisTransport`'s lease methods (broker.transport.Transport documents them); it provides `_call`,
    `_eval` (a fenced script) and `_lease_scripts` (`register_lease_scripts`)."""

    @staticmethod
    def register_lease_scripts(register) -> dict:
        """The lease scripts, registered with `register` (redis-py's `register_script`), by name."""
        return {name: register(globals()[f"LEASE_{name}"]) for name in ("ACQUIRE", "RENEW", "RELEASE")}

    def acquire_lease(
        self, key: str, holder: bytes, ttl_s: float, *, replace: bytes | None = None
    ) -> LeaseState:
        taken, epoch, current = self._call(
            "acquire_lease",
            self._lease_scripts["ACQUIRE"],
            keys=[key, f"{key}:epoch"],
            args=[holder, _ms(ttl_s), replace or b""],
        )
        return LeaseState(bool(taken), int(epoch), bytes(current))

    def renew_lease(self, key: str, epoch: int, holder: bytes, ttl_s: float) -> bool:
        script = self._lease_scripts["RENEW"]
        return bool(
            self._call("renew_lease", script, keys=[key, f"{key}:epoch"], args=[epoch, _ms(ttl_s), holder])
        )

    def release_lease(self, key: str, epoch: int) -> None:
        self._call("release_lease", self._lease_scripts["RELEASE"], keys=[key], args=[epoch])

    def check_fence(self) -> None:
        if self.fence is not None:
            self._eval("check_fence", "CHECK", [], [])


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))
