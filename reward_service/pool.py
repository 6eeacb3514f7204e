"""Parent side of the grader: hard per-answer timeouts, restarts, a warm spare, batches in flight.

`SafeGrader.grade(items)` grades a batch of (reward, response, ground truth) items in a grader
process (`reward_service.grader`). It is `finish(submit(items))`: `submit` sends the batch at once
and returns a `Ticket`, so a caller can queue the next batch while the grader works on this one
(the grader then never waits for the parent's broker round trips); `finish` reads the answers.
The grader answers one item at a time, in the order sent; each answer has its own deadline,
`timeout_s` from the moment the grader could start on it (the previous answer, or the send). When
an answer is late the grader is SIGKILLed, the item scores 0 with `timed_out=True`, a warm spare
takes over and every unanswered item of every ticket in flight is resent. A grader that dies
(segfault, memory cap) is handled the same way, with `crashed=True`. A ticket's `budget_s` bounds
the whole batch from the moment its grading starts (not while it waits behind another batch): each
item's timeout shrinks to what is left of it, and what the budget never reached scores as timed out.
Results of identical items are graded once per batch and cached (LRU), so a group of identical
pathological answers costs one timeout.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace

import msgspec

from reward_service.grader import GradeRequest, GradeResult, encode_batch
from reward_service.grader_process import GraderDied, GraderProcess

__all__ = ["GraderDied", "GraderProcess", "GraderUnavailable", "Outcome", "SafeGrader", "Ticket"]
_result_decoder = msgspec.msgpack.Decoder(GradeResult)


class GraderUnavailable(RuntimeError):
    """No grader process could be started (broken environment); the worker should stop."""


@dataclass(frozen=True)
class Outcome:
    """The graded parts of one item, or why there are none."""

    accuracy: float = 0.0
    format: float = 0.0
    timed_out: bool = False
    """The grading ran past the timeout and was killed."""
    crashed: bool = False
    """The grader process died while grading this item."""
    error: str = ""
    """The reward function raised (the item scores 0)."""
    seconds: float = 0.0
    cached: bool = False
    """Served from the cache of identical items (no grading ran now)."""

    @property
    def failed(self) -> bool:
        return self.timed_out or self.crashed


@dataclass(eq=False)
class Ticket:
    """A submitted batch: its items, the outcomes so far, and its budget."""

    items: list[tuple[str, str, str]]
    budget_s: float | None
    results: list[Outcome | None]
    first: dict[tuple[str, str, str], int]
    """Each distinct item -> the index that is graded (repeats copy its outcome)."""
    open: set[int] = field(default_factory=set)
    """Indices still without an outcome (sent or waiting to be resent)."""
    deadline: float | None = None
    """Set when the grader starts on the batch: then + budget_s."""


def _valid_utf8(text: str) -> str:
    return text.encode("utf-8", "replace").decode("utf-8")


def _encode(requests: list[GradeRequest]) -> bytes:
    """The batch; text that is not valid UTF-8 (lone surrogates) is repaired."""
    try:
        return encode_batch(requests)
    except UnicodeEncodeError:
        return encode_batch(
            [GradeRequest(r.id, *map(_valid_utf8, (r.reward, r.response, r.ground_truth))) for r in requests]
        )


def _digest(item: tuple[str, str, str]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in item:
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


class SafeGrader:
    """Grades batches under a hard per-item timeout; see the module docstring."""

    def __init__(
        self,
        timeout_s: float = 5.0,
        memory_mb: int = 1024,
        *,
        spare: bool = True,
        startup_timeout_s: float = 120.0,
        cache_size: int = 4096,
        preload: str = "math,synthetic",
    ) -> None:
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.spare = spare
        self.startup_timeout_s = startup_timeout_s
        self.cache_size = cache_size
        self.preload = preload
        self.timeouts = 0
        self.crashes = 0
        self.restarts = 0
        self._active: GraderProcess | None = None
        self._spare: GraderProcess | None = None
        self._cache: OrderedDict[bytes, Outcome] = OrderedDict()  # keyed by digest: bounded memory
        self._ids = itertools.count()
        self._sent: deque[tuple[int, Ticket, int, float]] = deque()
        """(request id, ticket, index, sent at) the active grader has not answered, in order."""
        self._idle_since = 0.0
        """When the active grader last answered (it starts on the next item then)."""

    def start(self) -> None:
        """Start (and wait for) the active grader and, if enabled, the spare."""
        self._ensure_active()

    def grade(self, items: list[tuple[str, str, str]], budget_s: float | None = None) -> list[Outcome]:
        """Outcomes of (reward, response, ground_truth) items, in order (`budget_s`: see `submit`)."""
        return self.finish(self.submit(items, budget_s))

    def submit(self, items: list[tuple[str, str, str]], budget_s: float | None = None) -> Ticket:
        """Send a batch to the grader now; `finish` the ticket for its outcomes. `budget_s` bounds the
        batch's grading from when the grader starts on it, so many different hanging answers still
        return in about `budget_s` seconds."""
        ticket = Ticket(list(items), budget_s, [self._cached(item) for item in items], {})
        for i, item in enumerate(ticket.items):
            if ticket.results[i] is None and ticket.first.setdefault(item, i) == i:
                ticket.open.add(i)
        self._send(ticket, sorted(ticket.open))
        return ticket

    def finish(self, ticket: Ticket) -> list[Outcome]:
        """Wait for the ticket's outcomes (answers of batches sent before it are read on the way)."""
        sends_failed = 0
        while ticket.open:
            if self._active is None or not self._sent:  # a send failed: everything open goes to a new grader
                sends_failed += 1
                if sends_failed > 3:
                    raise GraderUnavailable("grader processes die on every batch")
                self._resend_open(ticket)
                continue
            self._read_one()
        for i, item in enumerate(ticket.items):
            if ticket.results[i] is None:  # a repeat of an item graded in this batch
                ticket.results[i] = replace(ticket.results[ticket.first[item]], seconds=0.0, cached=True)
        return ticket.results  # type: ignore[return-value]

    # ---- sending and reading -------------------------------------------------------------------
    def _send(self, ticket: Ticket, indices: list[int]) -> None:
        if not indices:
            return
        requests, now = [], time.monotonic()
        for index in indices:
            rid = next(self._ids)
            requests.append(GradeRequest(rid, *ticket.items[index]))
            self._sent.append((rid, ticket, index, now))
        grader = self._ensure_active()
        try:
            grader.send(_encode(requests))
        except GraderDied:
            self._discard_active()  # nothing was answered: `finish` resends all that is open

    def _read_one(self) -> None:
        """Wait for the answer to the oldest request sent; on a timeout or death, restart and resend."""
        rid, ticket, index, sent_at = self._sent[0]
        started = max(sent_at, self._idle_since)
        if ticket.deadline is None and ticket.budget_s is not None:
            ticket.deadline = started + ticket.budget_s
        until = (
            started + self.timeout_s
            if ticket.deadline is None
            else min(started + self.timeout_s, ticket.deadline)
        )
        try:
            frame = self._active.recv(max(until - time.monotonic(), 0.0))
        except GraderDied:
            frame, crashed = None, True
        else:
            crashed = False
        now = time.monotonic()
        if frame is None:
            if crashed:
                self.crashes += 1
            else:
                self.timeouts += 1
            self._record_outcome(
                ticket, index, Outcome(timed_out=not crashed, crashed=crashed, seconds=now - started)
            )
            self._discard_active()
            self._resend_open(None)
            return
        result = _result_decoder.decode(frame)
        if result.id != rid:
            raise RuntimeError(f"grader answered request {result.id}, expected {rid}")
        self._sent.popleft()
        self._idle_since = now
        self._record_outcome(
            ticket, index, Outcome(result.accuracy, result.format, error=result.error, seconds=now - started)
        )

    def _resend_open(self, current: Ticket | None) -> None:
        """Send every open item again, in order, to a fresh grader; items whose ticket ran out of
        budget score as timed out instead (never sent)."""
        tickets = list(dict.fromkeys([t for _, t, _, _ in self._sent] + ([current] if current else [])))
        self._sent.clear()
        now = time.monotonic()
        for ticket in tickets:
            if ticket.deadline is not None and now >= ticket.deadline:
                for index in sorted(ticket.open):
                    self.timeouts += 1
                    self._record_outcome(ticket, index, Outcome(timed_out=True))
            else:
                self._send(ticket, sorted(ticket.open))

    def _record_outcome(self, ticket: Ticket, index: int, outcome: Outcome) -> None:
        """Item `index` of `ticket` is done with `outcome` (remembered in the cache where it may be)."""
        ticket.open.discard(index)
        ticket.results[index] = self._remember(ticket.items[index], outcome)

    # ---- cache ---------------------------------------------------------------------------------
    def _cached(self, item: tuple[str, str, str]) -> Outcome | None:
        if self.cache_size <= 0:
            return None
        key = _digest(item)
        outcome = self._cache.get(key)
        if outcome is None:
            return None
        self._cache.move_to_end(key)
        return replace(outcome, seconds=0.0, cached=True)

    def _remember(self, item: tuple[str, str, str], outcome: Outcome) -> Outcome:
        if self.cache_size > 0:
            self._cache[_digest(item)] = outcome
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return outcome

    # ---- processes -----------------------------------------------------------------------------
    def _ensure_active(self) -> GraderProcess:
        if self._active is None:
            candidates = [self._spare, None] if self._spare is not None else [None]
            self._spare = None
            for candidate in candidates:  # a spare that died while idle gets one fresh replacement
                self._active = candidate or self._spawn()
                try:
                    self._active.wait_ready(self.startup_timeout_s)
                    break
                except GraderDied as exc:
                    self._discard_active()
                    error = exc
            else:
                raise GraderUnavailable(str(error)) from error
            self._idle_since = time.monotonic()
        if self.spare and self._spare is None:
            self._spare = self._spawn()
        return self._active

    def _spawn(self) -> GraderProcess:
        return GraderProcess(self.memory_mb, self.preload)

    def _discard_active(self) -> None:
        if self._active is not None:
            self._active.kill()
            self._active = None
            self.restarts += 1

    def close(self) -> None:
        for grader in (self._active, self._spare):
            if grader is not None:
                grader.kill()
        self._active = self._spare = None
        self._sent.clear()

    def __enter__(self) -> SafeGrader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
