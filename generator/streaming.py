"""Continuous batching: keep vLLM fed instead of one `generate` call per batch (GeneratorConfig.continuous).

    loop = ContinuousLoop(worker)     # worker.step() delegates here when config.continuous is set
    loop.step()                       # admit prompts, collect finished groups, publish them

It drives the worker through the same parts as its batch loop (generator/worker.py): `admit_prompts`,
`holding`, `wait_for_held`, `prepare`, `reject`, `make_group`, `publish_and_ack`, `sync_weights`.

The batch loop (worker.py) prepares a batch, runs `LLM.generate` on it and publishes when the
slowest sequence ends: the GPU idles while a batch is prepared and runs at low occupancy through the
long tail of each batch. Here prompts go into vLLM's engine (`LLMEngine.add_request`) as soon as they are
prepared, `batch_prompts` at a time, up to `max_inflight_prompts` in flight, and each group is published
(and its prompt acked) the step it finishes. Freed slots are refilled only once `batch_prompts` of them are
free: a prompt admitted alone costs a step that mixes its vision encoding and prefill with everyone's
decode, which runs outside vLLM's decode CUDA graphs (refilling each slot at once made a long-tailed run
slower than the batch loop: docs/benchmarks.md). With the engine core in its own
process (the default on CUDA) the GPU keeps generating while this loop prepares and publishes.

Versions (`GeneratorConfig.weight_update`):
  drain     a group never mixes policy versions. When the learner is ahead of the served version,
            admission pauses; once the prompts in flight have finished, the newest weights are applied
            (the same `sync_weights` as the batch loop) and admission resumes. If the new weights have
            not arrived by then, admission resumes on the current version (the learner's min_version
            gate still holds).
  inflight  new weights are applied between two engine steps as soon as they arrive, with the
            prompts in flight kept: vLLM preempts them and recomputes their KV cache under the new
            weights (AReaL's interruptible generation), so nothing waits for the longest response.
            A group then carries version_start (admission) < version_end (finish); every token's
            behaviour logprob is from the version that sampled it, which is what the learner's
            importance correction needs, and its staleness counts from version_start.
Bad prompts are rejected exactly as in the batch loop (same reasons, empty group, dead letter).
"""

from __future__ import annotations

import itertools
import time

from generator.inputs import Request, Result


class EngineStream:
    """Requests in, finished Results out, on a running vLLM engine (generator.engine.Engine)."""

    def __init__(self, engine):
        self.engine = engine
        self._ids = itertools.count()
        self._pending: dict[str, tuple[object, Result, float, object]] = {}

    @property
    def inflight(self) -> int:
        """Prompts submitted and not yet finished."""
        return len(self._pending)

    def submit(self, request: Request, tag) -> Result | None:
        """Add `request` to the engine (its groups come back from `poll` with `tag`); a refused prompt's
        Result (with its reason) is returned at once instead."""
        engine = self.engine
        result, prompt, params = engine.admit(request)
        if result.rejected is not None:
            return result
        request_id = f"px-{next(self._ids)}"
        result.version = engine.version
        adapter = engine.add_request(request_id, prompt, params)
        result.adapter = adapter.digest if adapter is not None else ""
        if adapter is not None:  # LoRA: the request keeps its adapter (and version) to the end
            result.version = adapter.version
        self._pending[request_id] = (tag, result, time.perf_counter(), adapter)
        return None

    def poll(self) -> list[tuple[object, Result]]:
        """Run one engine step; the (tag, Result) of every prompt that finished in it."""
        if not self._pending:
            return []
        engine = self.engine
        outputs = engine.step()
        done = []
        for output in outputs:
            if not output.finished or output.request_id not in self._pending:
                continue
            tag, result, t0, adapter = self._pending.pop(output.request_id)
            engine.finished(adapter)
            # > result.version after an in-flight update of full weights; an adapter stays the request's own
            result.version_end = result.version if adapter is not None else engine.version
            result.completions = [engine.completion(c) for c in output.outputs]
            result.seconds = time.perf_counter() - t0
            done.append((tag, result))
        return done


class ContinuousLoop:
    """The continuous step of one GeneratorWorker (see the module docstring)."""

    def __init__(self, worker):
        self.worker = worker
        self.stream = EngineStream(worker.engine)
        self.inflight_updates = worker.config.weight_update == "inflight"
        self._quiet_until = 0.0

    @property
    def inflight(self) -> int:
        return self.stream.inflight

    def step(self) -> int:
        """Apply weights when idle, admit prompts unless draining, publish what finished; groups published."""
        worker = self.worker
        if self.stream.inflight == 0:
            worker.sync_weights()
        elif self.inflight_updates:
            worker.sync_weights(running=True)
        if not self._draining() and self.stream.inflight < worker.config.max_inflight_prompts:
            self._admit()
        worker.metrics.queue_depth.set(self.stream.inflight)
        finished = self.stream.poll()
        groups, done = [], []
        for (delivery, record, ids, images_s), result in finished:
            groups.append(worker.make_group(delivery, record, ids, result, images_s))
            done.append(delivery)
        return worker.publish_and_ack(groups, done)

    def _draining(self) -> bool:
        """True while prompts are in flight and the learner is ahead of the served version (drain mode)."""
        if self.stream.inflight == 0 or self.inflight_updates:
            return False
        learner = self.worker.gate.learner()
        return learner is not None and learner > self.worker.engine.version

    def _admit(self) -> None:
        worker = self.worker
        if not worker.holding and self.stream.inflight and time.monotonic() < self._quiet_until:
            return  # the stream was empty a moment ago: no broker round trip per engine step
        room = worker.config.max_inflight_prompts - self.stream.inflight
        if self.stream.inflight and room < min(
            worker.config.batch_prompts, worker.config.max_inflight_prompts
        ):
            return  # refill a whole admission at once: its prefills run as one batch, not one per step
        block_s = 0.0 if self.stream.inflight else worker.config.block_s
        admitted = worker.admit_prompts(min(room, worker.config.batch_prompts), block_s)
        if not admitted:
            if not worker.holding:  # none came
                self._quiet_until = time.monotonic() + worker.config.block_s
            elif self.stream.inflight == 0:
                worker.wait_for_held()
            return
        prepared, images_s = worker.prepare(admitted)
        for delivery, record, request in prepared:
            refused = self.stream.submit(request, (delivery, record, request.prompt_token_ids, images_s))
            if refused is not None:
                worker.reject(delivery, record, refused.rejected, refused.detail)
