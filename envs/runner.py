"""Run environment calls on a thread pool, each bounded in time: a slow or crashing environment fails
its own episode, with the reason recorded, never the caller.

    runner = EnvRunner(threads=4, timeout_s=10.0)
    outcomes = runner.run([lambda: env.step(text) for env, text in ...])   # in order
    # each outcome is the call's return value or an EnvFailure("timeout" | "error", detail)

A call that runs longer than `timeout_s` (from the moment a thread starts it) is abandoned: its episode
fails with "timeout", and the pool is replaced so that calls still waiting get fresh threads (Python
cannot stop a thread: the stuck one keeps its thread until it returns, and its result is dropped;
`abandoned` counts them). An exception fails its episode with "error" and the exception in words.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

log = logging.getLogger(__name__)
POLL_S = 0.05


@dataclass
class EnvFailure:
    """Why an environment call failed its episode."""

    reason: str
    """"timeout" or "error"."""
    detail: str

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


class EnvRunner:
    """Environment calls on `threads` threads, each at most `timeout_s` seconds (module docstring)."""

    def __init__(self, threads: int, timeout_s: float):
        self.threads, self.timeout_s = threads, timeout_s
        self.pool = self._new_pool()
        self.abandoned = 0

    def _new_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(self.threads, thread_name_prefix="env")

    def run(self, calls: Sequence[Callable[[], object]]) -> list:
        """Each call's return value, or an EnvFailure, in order."""
        results: list = [None] * len(calls)
        started: dict[int, float] = {}
        pending = {i: self._submit(i, fn, started) for i, fn in enumerate(calls)}
        while pending:
            wait(list(pending.values()), timeout=POLL_S, return_when=FIRST_COMPLETED)
            now, stuck = time.monotonic(), False
            for i, future in list(pending.items()):
                if future.done():
                    results[i] = _outcome(future)
                    del pending[i]
                elif i in started and now - started[i] > self.timeout_s:
                    results[i] = EnvFailure("timeout", f"the environment took more than {self.timeout_s:g} s")
                    del pending[i]
                    stuck = True
            if stuck:
                pending = self._replace_pool(pending, calls, started)
        return results

    def _submit(self, i: int, fn: Callable[[], object], started: dict[int, float]) -> Future:
        def timed():
            started[i] = time.monotonic()
            return fn()

        return self.pool.submit(timed)

    def _replace_pool(self, pending: dict[int, Future], calls, started) -> dict[int, Future]:
        """A fresh pool for the calls no thread has started yet; the running ones stay where they are."""
        old, self.pool = self.pool, self._new_pool()
        self.abandoned += 1
        log.warning("an environment call timed out after %.1f s: its thread is abandoned", self.timeout_s)
        out = {}
        for i, future in pending.items():
            out[i] = self._submit(i, calls[i], started) if future.cancel() else future
        old.shutdown(wait=False)
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _outcome(future: Future):
    exc = future.exception()
    if exc is None:
        return future.result()
    log.warning("an environment call raised %s: %s", type(exc).__name__, exc)
    return EnvFailure("error", f"{type(exc).__name__}: {str(exc)[:200]}")
