"""The generator loop: prompt records in, rollout groups out, new weights in between.

    worker = GeneratorWorker(config)        # builds the engine, joins the broker and the weight sync
    worker.run()                            # until stop(), max_groups or idle_exit_s
    worker.close()

One step:
  1. apply the newest verified weights the receiver holds (between generate calls only, so a batch
     never mixes versions; a cuda-ipc receiver holds the learner's buffer from poll() until
     mark_served()), then announce the served version (`names.generator_version(id)`);
  2. take up to `batch_prompts` PromptRecords from `names.prompts` as a member of the consumer group
     `Names.GENERATORS`: several generators shard the stream, each prompt goes to one of them;
  3. the staleness gate (gate.py) splits them into admitted and held; with nothing admitted it waits
     (applying weights as they arrive) for the first held one; held records stay unacked, in order;
  4. prepare the batch (prepare.py): fetch each image blob once, verify and decode the images on
     `prepare_threads` threads while the chat-templated prompt ids (one pad per image) are rendered;
     generate, and publish one RolloutGroup per prompt; ack the records only after their groups
     are published (a crash before that redelivers them). A prompt that cannot be generated
     (missing/undecodable image, too long after image expansion, ...) is dead-lettered with its
     reason and counted; it never takes the batch down.
With `continuous` (streaming.py) the same pieces run as continuous batching: prompts enter the
running engine as they are prepared and each group is published the step it finishes; weights
apply once the prompts in flight have drained, or between two engine steps with the prompts kept
running (weight_update = "inflight").
Joining and leaving a running run: `run` starts with `catch_up`, which waits (up to `weight_sync.timeout_s`)
for the weights of the version the learner announced before taking any prompt, so a generator added to a
run serves the current weights from its first group. Stopped (`stop()`, SIGTERM), it finishes the batch it
is generating and `close` hands every prompt it still holds (held by the gate, in flight, unacked) back to
the other generators (`Transport.release`): they take them at their next read, not after `claim_idle_s`.
A crash hands nothing back (its restart re-reads them, and a prompt that kills it still meets the cap).
The group id is `<prompt_id>@<stream entry id>`: stable across redeliveries, so a prompt reclaimed
and generated twice yields one group id and downstream idempotency drops the copy.

A dead learner does not wedge the loop: the weight receiver retries in its own thread, the engine
keeps serving its last version, and only prompts that need a newer version wait. A broken engine does stop
it: once `NONFINITE_RUN` groups in a row come back with a non-finite logprob in every sample (the learner
rejects each of them), the worker raises `EngineOutputError` before publishing them, their prompts unacked.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time

from broker import codec
from broker.channel import Publisher, Subscriber
from broker.images import ImageStore
from broker.names import Names, group_id
from broker.schemas import PromptRecord, Rollout, RolloutGroup, WeightVersion
from broker.transport import BackpressureTimeout, Delivery, TransportError
from generator.config import GeneratorConfig, default_generator_id
from generator.episodes import EpisodeRunner, episode_fields
from generator.gate import StalenessGate, VersionReader
from generator.inputs import Result
from generator.metrics import GeneratorMetrics
from generator.prepare import make_pool, prepare_batch
from runtime.heartbeat import Heartbeat
from weights.vllm_apply import WeightLoadError

log = logging.getLogger(__name__)

NONFINITE_RUN = 16
"""Groups in a row with a non-finite logprob in every sample after which the engine counts as broken."""


class EngineOutputError(RuntimeError):
    """The engine returns unusable output (module docstring); the message says what and the likely cause."""


class GeneratorWorker:
    """One engine's consume-generate-publish loop; see the module docstring."""

    def __init__(
        self, config: GeneratorConfig, *, engine=None, transport=None, metrics: GeneratorMetrics | None = None
    ):
        self.config = config
        self.heartbeat = Heartbeat.from_env()  # the launcher's watchdog restarts a stuck generator
        self.generator_id = config.generator_id or default_generator_id()
        self.names = Names(config.broker.namespace)
        self.metrics = metrics or GeneratorMetrics()
        if transport is None:
            transport = config.broker.connect()
        self.transport = transport
        self.prompts = Subscriber(
            transport,
            self.names.prompts,
            Names.GENERATORS,
            self.generator_id,
            expect=PromptRecord,
            registry=self.metrics.registry,
        )
        self.rollouts = Publisher(transport, self.names.rollouts)
        self.images = ImageStore(transport, self.names)
        self.engine = engine if engine is not None else self._build_engine()
        self.gate = StalenessGate(
            served=lambda: self.engine.version,
            learner=VersionReader(transport, self.names.learner_version, ttl_s=config.gate_poll_s),
            max_staleness=config.max_staleness,
            poll_s=config.gate_poll_s,
            on_blocked=self.metrics.blocked.inc,
        )
        self.receiver = self._start_receiver()
        self.pool = make_pool(config.prepare_threads)
        self.continuous = None
        if config.continuous:
            from generator.streaming import ContinuousLoop

            self.continuous = ContinuousLoop(self)
        self.episodes: EpisodeRunner | None = None  # built at the first prompt with an environment
        self.published = 0
        # groups with a non-finite logprob in a sample; in a row with one in every sample (`_check_finite`)
        self.nonfinite_groups = self.nonfinite_run = 0
        self._held: list[tuple[Delivery, PromptRecord]] = []
        self._stop = threading.Event()
        self.metrics.served_version.set(self.engine.version)

    def _build_engine(self):
        from generator.engine import Engine

        if not self.config.model:
            raise ValueError("--model is required (a Hugging Face checkpoint directory)")
        return Engine(
            self.config.model,
            self.config.engine,
            self.config.sampling,
            self.config.run_dir,
            tp=self.config.tp,
            initial_version=self.config.initial_version,
        )

    def _start_receiver(self):
        """The started weight receiver (weights/), or None when weight sync is off."""
        import weights
        from weights.follow import broker_resolver

        cfg = self.config.weight_sync
        if not cfg.enabled:
            return None
        receiver = weights.receiver(
            cfg,
            self.generator_id,
            resolve=broker_resolver(self.transport, self.names),
            version=self.engine.version,
            device="cpu" if getattr(self.engine, "on_cpu", True) else "cuda",
        )
        return receiver.start()

    # ------------------------------------------------------------------ loop
    def stop(self) -> None:
        """Ask `run` (and any gate wait) to return after the current step."""
        self._stop.set()

    def run(self) -> int:
        """Loop until stopped, `max_groups` published or `idle_exit_s` idle; returns groups published."""
        self.catch_up()
        self.announce()
        last_work = time.monotonic()
        while not self._stop.is_set():
            if self.step():
                last_work = time.monotonic()
            elif self.holding or (self.continuous is not None and self.continuous.inflight):
                last_work = time.monotonic()
            if self.config.max_groups and self.published >= self.config.max_groups:
                break
            if self.config.idle_exit_s and time.monotonic() - last_work > self.config.idle_exit_s:
                log.info("no prompts for %.1f s: exiting", self.config.idle_exit_s)
                break
        return self.published

    def step(self) -> int:
        """Apply weights, take prompts, gate, generate, publish; returns the number of groups published.
        With `continuous`, one step of the continuous loop (streaming.py) instead."""
        if self.continuous is not None:
            return self.continuous.step()
        self.sync_weights()
        admitted = self.admit_prompts(self.config.batch_prompts, self.config.block_s)
        if not admitted:
            if self.holding:
                self.wait_for_held()
            return 0
        return self._generate(admitted)

    def _generate(self, items: list[tuple[Delivery, PromptRecord]]) -> int:
        """The batch loop's generate call on the admitted `items`: prepare, generate, publish; returns the
        groups published."""
        prepared, images_s = self.prepare(items)
        if not prepared:
            return 0
        requests = [request for _, _, request in prepared]
        kept = [(delivery, record, request.prompt_token_ids) for delivery, record, request in prepared]
        self.metrics.queue_depth.set(len(requests))
        t0 = time.perf_counter()
        try:
            results = self.engine.generate(requests)
            self.run_episodes([record for _, record, _ in prepared], requests, results)
        finally:
            self.metrics.queue_depth.set(0)
        log.info(
            "generated %d prompts at version %d in %.1f s", len(requests), self.engine.version,
            time.perf_counter() - t0,
        )  # fmt: skip
        groups, done = [], []
        for (delivery, record, ids), result in zip(kept, results):
            if not result.ok:
                self.reject(delivery, record, result.rejected, result.detail)
                continue
            groups.append(self.make_group(delivery, record, ids, result, images_s))
            done.append(delivery)
        return self.publish_and_ack(groups, done)

    def run_episodes(self, records: list[PromptRecord], requests: list, results: list[Result]) -> None:
        """Continue the first turns of the prompts that name an environment into whole episodes."""
        if not any(self.config.env.environment_of(record) for record in records):
            return
        if self.episodes is None:
            self.episodes = EpisodeRunner(
                self.engine, self.config.env, self.config.sampling.max_tokens, self.images.put_image,
                self.metrics.registry,
            )  # fmt: skip
        self.episodes.run(records, requests, results)

    def catch_up(self) -> None:
        """Before serving: wait until the weights of the learner's announced version are applied (a generator
        joining a running run), for at most `weight_sync.timeout_s`; then the staleness gate alone decides."""
        learner = self.gate.learner()
        if self.receiver is None or learner is None or self.engine.version >= learner:
            return
        log.info(
            "joining at learner version %d (serving %d): waiting for its weights",
            learner,
            self.engine.version,
        )
        deadline = time.monotonic() + self.config.weight_sync.timeout_s
        while self.engine.version < learner and not self._stop.is_set() and time.monotonic() < deadline:
            if not self.sync_weights():
                self._stop.wait(0.05)
        if self.engine.version < learner:
            log.warning(
                "learner version %d not received within %.0f s: serving version %d meanwhile (the staleness "
                "gate holds the prompts that need newer weights)",
                learner, self.config.weight_sync.timeout_s, self.engine.version,
            )  # fmt: skip

    # ------------------------------------------------------------------ parts of a step (streaming.py's too)
    @property
    def holding(self) -> bool:
        """True while the staleness gate holds prompts back (unacked, in order, for `admit_prompts`)."""
        return bool(self._held)

    def admit_prompts(self, count: int, block_s: float) -> list[tuple[Delivery, PromptRecord]]:
        """The prompts that may start now: of those the staleness gate holds back, else of up to `count` new
        ones (polled for up to `block_s`); the gate holds the others ([] and not `holding`: none came)."""
        items = self._held or self.prompts.poll(count=count, block_s=block_s)
        if not items:
            return []
        admitted, self._held = self.gate.split(items)
        return admitted

    def wait_for_held(self) -> None:
        """Wait until the first held prompt may start (applying new weights meanwhile), or until `stop()`."""
        self.gate.wait(self._held[0][1], while_waiting=self.sync_weights, stop=self._stop)

    def prepare(self, items: list[tuple[Delivery, PromptRecord]]) -> tuple[list, float]:
        """([(delivery, record, request)] of the records that could be prepared, seconds spent); the others
        are rejected here with their reason (prepare.py)."""
        t0 = time.perf_counter()
        prepared = prepare_batch(
            [record for _, record in items], self.images, self.engine.tokenizer, self.pool
        )
        seconds = time.perf_counter() - t0
        kept = []
        for (delivery, record), p in zip(items, prepared):
            if p.request is None:
                self.reject(delivery, record, p.reason, p.detail)
            else:
                kept.append((delivery, record, p.request))
        return kept, seconds

    def publish_and_ack(self, groups: list[RolloutGroup], done: list[Delivery]) -> int:
        """Publish the groups, then ack their prompts; the number published (0 if stopped first: no ack)."""
        if groups and self._publish(groups):
            self.prompts.ack(done)
            self.published += len(groups)
            self.metrics.groups.inc(len(groups))
            self.metrics.tokens.inc(sum(s.num_tokens for g in groups for s in g.samples))
            return len(groups)
        return 0

    def reject(self, delivery: Delivery, record: PromptRecord, reason: str, detail: str = "") -> None:
        """Dead-letter the prompt with its reason and publish an EMPTY group for it, so that the learner's
        feeder sees the prompt come back (counted as consumed) instead of waiting for it forever."""
        log.warning("prompt %s rejected (%s): %s", record.prompt_id, reason, detail)
        empty = RolloutGroup(
            group_id=group_id(record.prompt_id, delivery.id),
            prompt_id=record.prompt_id,
            data_source=record.data_source,
            prompt_token_ids=[],
            images=list(record.images),
            ground_truth=record.ground_truth,
            samples=[],
            generator_id=self.generator_id,
            split=record.split,
            timings={"rejected": 1.0},
        )
        if not self._publish([empty]):
            return None  # stopping: leave the prompt unacked so that it is redelivered
        self.transport.dead_letter(delivery, Names.GENERATORS, f"{reason}: {detail}" if detail else reason)
        self.metrics.rejected.labels(reason).inc()
        return None

    def make_group(
        self, delivery: Delivery, record: PromptRecord, ids: list[int], result: Result, images_s: float
    ) -> RolloutGroup:
        """The RolloutGroup of one generated prompt (its Result); raises EngineOutputError where the engine's
        output is broken (`_check_finite`)."""
        self._check_finite(record.prompt_id, result)
        samples = [
            Rollout.of(
                token_ids=c.token_ids,
                logprobs=c.logprobs,
                response_text=c.text,
                version_start=result.version,
                version_end=max(result.version, result.version_end),
                finish_reason=c.finish_reason,
                **episode_fields(c),
            )
            for c in result.completions
        ]
        return RolloutGroup(
            group_id=group_id(record.prompt_id, delivery.id),
            prompt_id=record.prompt_id,
            data_source=record.data_source,
            prompt_token_ids=ids,
            images=list(record.images),
            ground_truth=record.ground_truth,
            samples=samples,
            temperature=result.temperature,
            generator_id=self.generator_id,
            split=record.split,
            timings={"images": images_s, "generate": result.seconds},
        )

    def _check_finite(self, prompt_id: str, result: Result) -> None:
        """Count the samples of one group with a non-finite logprob: warn at the first such group (later
        ones are counted), raise EngineOutputError at the NONFINITE_RUN-th group in a row where every
        sample has one."""
        bad = sum(not all(map(math.isfinite, c.logprobs)) for c in result.completions)
        if not bad:
            self.nonfinite_run = 0
            return
        self.nonfinite_groups += 1
        if self.nonfinite_groups == 1:
            log.warning(
                "prompt %s: %d of %d samples have a non-finite logprob (the learner rejects their group); "
                "later such groups are counted in nonfinite_groups",
                prompt_id, bad, len(result.completions),
            )  # fmt: skip
        self.nonfinite_run = self.nonfinite_run + 1 if bad == len(result.completions) else 0
        if self.nonfinite_run >= NONFINITE_RUN:
            raise EngineOutputError(
                f"vLLM returned a non-finite logprob in every sample of {self.nonfinite_run} groups in a row "
                f"(the last for prompt {prompt_id}): its output is unusable, so this generator stops before "
                f"publishing them (their prompts stay unacked).{_nonfinite_hint(os.environ)}"
            )

    def _publish(self, groups: list[RolloutGroup]) -> bool:
        """Publish, retrying while the rollouts stream is full; False if stopped first (nothing acked)."""
        while True:
            try:
                self.rollouts.publish_many(groups, timeout=self.config.publish_timeout_s)
                return True
            except BackpressureTimeout:
                log.warning(
                    "rollouts stream full for %.0f s; still holding %d groups",
                    self.config.publish_timeout_s,
                    len(groups),
                )
                if self._stop.is_set():
                    return False

    # ------------------------------------------------------------------ weights
    def sync_weights(self, running: bool = False) -> bool:
        """Apply the newest received version, if any; True when a new version is now served. `running`:
        requests are in flight in the engine and stay there (continuous loop, weight_update = inflight)."""
        self.heartbeat()  # before every batch and while the gate holds one: the loop turns
        if self.receiver is None:
            return False
        received = self.receiver.poll()
        if received is None:
            return False
        try:  # a cuda-ipc version goes to the engine as its reference (read inside vLLM's worker)
            seconds = self.engine.apply_weights(received, received.version, running=running)
        except WeightLoadError as exc:
            log.error(
                "version %d not applied, still serving %d: %s", received.version, self.engine.version, exc
            )
            self.receiver.mark_served(self.engine.version)
            return False
        self.receiver.mark_served(received.version)
        if running:
            self.metrics.inflight_updates.inc()
        self.metrics.weight_load.observe(received.seconds + seconds)
        self.metrics.served_version.set(received.version)
        self.announce(seconds=received.seconds + seconds, num_bytes=received.num_bytes)
        return True

    def announce(self, seconds: float = 0.0, num_bytes: int = 0) -> None:
        """Publish the served version under `names.generator_version(id)`."""
        msg = WeightVersion(
            version=self.engine.version,
            source=self.generator_id,
            num_bytes=num_bytes,
            seconds=seconds,
            timestamp=time.time(),
        )
        self.transport.set_value(self.names.generator_version(self.generator_id), codec.encode(msg))

    def hand_back(self) -> int:
        """Give the prompts this generator holds and has not acked back to the other generators; how many."""
        self._held = []
        try:
            n = self.transport.release(self.names.prompts, Names.GENERATORS, self.generator_id)
        except TransportError as exc:  # they still come back after claim_idle_s
            log.warning("could not hand the prompts this generator holds back: %s", exc)
            return 0
        if n:
            log.info("stopping: handed %d prompts back to the other generators", n)
        return n

    def close(self) -> None:
        """Stop the receiver and the preparation threads, release the engine and the broker connection. After
        a `stop()` the prompts still held go back to the other generators at once (`hand_back`); otherwise
        (a crash) they stay with this consumer name, for its restart."""
        if self._stop.is_set():
            self.hand_back()
        self.stop()
        if self.receiver is not None:
            self.receiver.close()
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self.episodes is not None:
            self.episodes.close()
        self.engine.close()
        self.transport.close()


def _nonfinite_hint(environ) -> str:
    """The likely cause of non-finite logprobs in this process's environment ("" when none is known)."""
    cap = environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "")
    if not cap:
        return ""
    return (
        f" This process runs under MPS capped at {cap} % of the GPU's SMs (--mps-generator-sms): with the"
        " cap at 40 every behaviour logprob was NaN on an H100, with or without the learner beside it and"
        " under every attention backend tried, because bf16 cuBLAS GEMMs leave tiles of their output"
        " unwritten under it (docs/benchmarks.md); at 50 every GEMM checked was right."
        " Check a cap with `python -m deploy.gpus.mps --mps-generator-sms P -- python -m bench.mps_check`,"
        " or run without it."
    )
