"""The Learner: scored groups in, GRPO updates, weights out to the generators, checkpoints.

    learner = Learner(cfg)          # builds its parts (process group, model, broker...), then assembles them
    learner.train()                 # until max_steps or the data runs out
    learner.close()                 # final checkpoint, acks, HF export, sockets

One `train_step(groups)` (every rank, same groups):
  1. advantages per group (GRPO / Dr.GRPO / RLOO), flattened into samples (learner/samples.py); samples
     older than the staleness bound (counted from version_start) are dropped (counted); staleness observed
     per sample, and samples whose policy changed mid-response (in-flight updates) counted;
  2. the samples are planned into PPO mini-batches of packed micro-batches spread over the ranks
     (learner/batching.py), and the policy updates over that plan (learner/update.py): the no-grad passes
     for π_prox and π_ref, loss, backward, clipping, AdamW;
  3. every `sync_every` steps the weights go to the generators and the new version is announced;
     every `checkpoint.every` steps a checkpoint, then the consumed groups are acked.
With `optim.defer_update` a step's last AdamW may wait for the next step (`_may_hold`): when that step's
groups are already waiting, its first KL pass runs beside the AdamW and the weights go out before it trains
(`_finish_held_update`); else, or before a checkpoint, export or evaluation, the AdamW and its sync run at
once (`_finish_held_update_alone`, or `_finish_held_update` without a KL pass beside it).
Rank 0 alone talks to the scored stream and the feeder (learner/inbox.py) and broadcasts each
step's groups to the other ranks. It holds the run (learner/fencing.py): every write of its transport and
every checkpoint is checked against its lease's epoch, and a learner whose lease another took stops.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from pathlib import Path

import msgspec
import torch

from broker import codec
from broker.images import ImageStore
from broker.metrics import watch_pipeline
from broker.names import Names
from broker.schemas import ScoredGroup, WeightVersion
from learner import lora
from learner.adapter_guard import STATE_KEY as GUARD_KEY
from learner.adapter_guard import AdapterGuard
from learner.advantages import batch_advantages
from learner.batching import MicroBatchPlanner
from learner.checkpoint import Checkpointer, TrainerState, export_hf
from learner.config import LearnerConfig
from learner.inbox import NOT_READY, ROUTINE_SKIPS, NotReady, ack_generations
from learner.metrics import LearnerMetrics, gpu_peak, lm_param_count, mfu, track_gpu_peak
from learner.parallel import (
    apply_parallelism,
    broadcast_bytes,
    build_optimizer,
    distributed,
    init_distributed,
    param_dtype,
    resolve_master_weights,
)
from learner.reference import build_reference
from learner.samples import (
    filter_env_failed,
    filter_stale,
    filter_truncated,
    rollout_stats,
    spans_versions,
    staleness,
    to_samples,
)
from learner.update import Updater
from learner.wiring import build_inbox, build_sender, guess_peak_flops
from policy.loading import load_model, load_processor
from policy.packing import PixelCache
from runtime.config import to_dict
from runtime.metrics import new_registry
from weights.adapter import AdapterTensors

log = logging.getLogger(__name__)


class Learner:
    """See the module docstring."""

    def __init__(self, cfg: LearnerConfig, *, transport=None, sender=None, registry=None, fence=None):
        """Build the parts, then assemble them; `transport`, `sender` and `registry` stand in for the ones
        the config would build (tests, benchmarks); `fence` (rank 0's lease, learner/fencing.py) guards
        every write of the transport and every checkpoint."""
        self.cfg = cfg
        clock = [("start", time.perf_counter())]  # the start-up's phases, logged once ready
        # this rank, the policy and its reference, the optimizer
        self.info = init_distributed(cfg.parallel.backend)
        torch.manual_seed(cfg.seed)
        self.run_dir = Path(cfg.run_dir)
        self.processor = load_processor(cfg.model)
        self.master_weights = resolve_master_weights(
            cfg.optim.master_weights, self.info.world_size, self.info.device
        )
        self.param_dtype = param_dtype(self.master_weights)
        if cfg.lora.enabled:  # a frozen base (bf16 on a GPU) and an fp32 adapter that AdamW updates in place
            self.master_weights, self.param_dtype = "params", lora.base_dtype(self.info.device)
        self.hf = load_model(cfg.model, dtype=self.param_dtype, device=self.info.device).train()
        if cfg.lora.enabled:
            lora.add_adapter(self.hf, cfg.lora, base_path=cfg.model)
        # LoRA: every trained sample must come from the adapter published for its version (adapter_guard.py)
        self.guard = AdapterGuard(0) if cfg.lora.enabled and cfg.weight_sync.enabled else None
        self.n_lm_params = lm_param_count(self.hf)
        clock.append(("model", time.perf_counter()))
        self.model = apply_parallelism(self.hf, cfg.parallel, self.info.device)
        self.ref = build_reference(cfg, self.info, self.param_dtype) if cfg.loss.kl_coef > 0 else None
        clock.append(("parallelism and reference", time.perf_counter()))
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg.optim, self.master_weights)
        clock.append(("optimizer", time.perf_counter()))
        # the broker and what goes through it: images, metrics, checkpoints, the weight sender, the inbox
        self.names = Names(cfg.broker.namespace)
        self.transport = transport or cfg.broker.connect()
        if fence is not None:
            self.transport.fence = fence
        self.fenced = False
        """Set when the broker refused a write (the lease moved on): `close` then writes nothing."""
        self.images = ImageStore(self.transport, self.names)
        self.pixels = PixelCache(self.processor.image_processor)
        self.registry = registry if registry is not None else new_registry()
        self.metrics = LearnerMetrics(
            self.registry, self.run_dir, enabled=self.info.is_main, cfg=cfg.metrics, config=to_dict(cfg)
        )
        self.checkpointer = Checkpointer(
            self.run_dir / "checkpoints", cfg.checkpoint.keep, self.info.rank, trainable_only=cfg.lora.enabled
        )
        if sender is None:
            sender = build_sender(cfg.weight_sync, self.info, self.transport, self.names)
        self.sender = sender
        self.checkpointer.guard = self.transport.check_fence  # a learner that lost the run writes none
        self.inbox = None
        if self.info.is_main:
            watch_pipeline(self.registry, self.transport, self.names)  # what autoscalers size the roles by
            self.inbox = build_inbox(
                cfg, self.transport, self.names, model_config=self.hf.config, images=self.images,
                pixels=self.pixels, metrics=self.metrics,
            )  # fmt: skip
        # assembled: the step's planner and updater
        self.planner = MicroBatchPlanner(
            cfg, self.info, self.processor, self.images, self.pixels, self.hf.config.image_token_id
        )
        # AdamW in host memory is CPU work: the next mini-batch's KL reference pass runs on the GPU meanwhile
        self.updater = Updater(
            cfg, self.info, self.model, self.ref, self.optimizer, self.scheduler, model_config=self.hf.config,
            n_lm_params=self.n_lm_params, dummy=self.planner.dummy, before_write=self.sender.begin_write,
            overlap_ref=self.master_weights == "host" and self.info.device.type == "cuda",
        )  # fmt: skip
        self.peak_flops = cfg.peak_tflops * 1e12 or guess_peak_flops(self.info.device)
        self.state = TrainerState()
        self._last_ckpt_step = 0
        self._held_groups = 0  # trained since the last checkpoint: their acks wait for the next one
        self._carried: dict[str, float] = defaultdict(float)  # a held update's times, for the next step
        self._target_reached = 0.0  # the held-out accuracy that reached eval.stop_accuracy (0: not yet)
        clock.append(("broker and sender", time.perf_counter()))
        self._resume()
        clock.append(("resume", time.perf_counter()))
        phases = ", ".join(f"{name} {t - t0:.1f} s" for (_, t0), (name, t) in zip(clock, clock[1:]))
        log.info("learner ready in %.1f s (%s)", clock[-1][1] - clock[0][1], phases)

    # ------------------------------------------------------------------ lifecycle
    def _resume(self) -> None:
        resume = self.cfg.checkpoint.resume
        check = lambda path: lora.check_resume(path, self.cfg.lora)  # noqa: E731
        loaded = (
            self.checkpointer.resume(self.model, self.optimizer, self.scheduler, check=check)
            if resume
            else None
        )
        if loaded is not None:
            self.state = loaded
            self._last_ckpt_step = self.state.step
        if self.inbox is not None:
            self.inbox.restore(self.state.consumed)
            if self.inbox.feeder is not None:
                self.inbox.feeder.load_state(self.state.cursor or None, consumed=self.inbox.consumed)
        self._skip_lost_versions()
        if self.guard is not None:
            self.guard = AdapterGuard(0, self.state.extra.get(GUARD_KEY))
        if self.state.version > 0:
            self.sender.sync(self.model.model, version=self.state.version, step=self.state.step)
            self._record_adapter()
        self._announce()

    def _skip_lost_versions(self) -> None:
        """After a crash the broker may announce versions newer than the checkpoint: their weights
        are gone. Their numbers are never reused (the restored weights become the next version
        after them) and samples of them count as stale (`lost_versions`), never as fresh."""
        raw = self.transport.get_value(self.names.learner_version) if self.info.is_main else None
        raw = broadcast_bytes(raw if raw is not None else b"")
        announced = codec.decode(raw).version if raw else -1
        if announced <= self.state.version:
            return
        lost = [self.state.version + 1, announced]
        self.state.extra["lost_versions"] = [*self.state.extra.get("lost_versions", []), lost]
        self.state.extra["version_offset"] = announced + 1 - self.state.step
        log.warning(
            "versions %d-%d were announced but not checkpointed: their samples count as stale; "
            "the restored weights (step %d) are version %d",
            *lost,
            self.state.step,
            announced + 1,
        )
        self.state.version = announced + 1

    @property
    def version_now(self) -> int:
        """The version number the current weights would be published as (step + the offset that
        skips versions lost to crashes)."""
        return self.state.step + int(self.state.extra.get("version_offset", 0))

    def train(self) -> None:
        """Train until `max_steps` optimizer steps, the data runs out or `eval.stop_accuracy` is reached."""
        evaluator = self.inbox.evaluator if self.inbox is not None else None
        if evaluator is not None and self.cfg.eval.at_start and self.state.step == 0:
            evaluator.start(0, self.state.version)
        first = self.state.step
        while self.state.step < self.cfg.max_steps:
            t0 = time.perf_counter()
            groups = self._next_groups(wait=self.updater.pending is None)
            if groups is NOT_READY:  # the learner does not bound the pipeline now: the held update goes out
                t1 = time.perf_counter()
                self._finish_held_update_alone()
                t0 += time.perf_counter() - t1  # not waiting
                groups = self._next_groups()
            if groups is None:
                self._finish_held_update(self._carried)
                self._data_ended(trained=self.state.step - first)
                return
            wait_s = time.perf_counter() - t0
            self.train_step(groups, wait_s=wait_s)
        self._finish_held_update(self._carried)
        log.info("stopping at step %d: max_steps reached", self.state.step)

    def _data_ended(self, trained: int) -> None:
        """The data ran out (or nothing came for `idle_exit_s`, or an evaluation reached
        `eval.stop_accuracy`) after `trained` steps of this run: say so, and fail when none was trained and
        groups were rejected as broken (malformed, non-finite, empty...: a generator or reward service at
        fault, not a finished run)."""
        if self.inbox is None:
            return
        if self._target_reached:
            target = self.cfg.eval.stop_accuracy
            log.info(
                "stopping at step %d: held-out accuracy %.3f reached eval.stop_accuracy %.3f",
                *(self.state.step, self._target_reached, target),
            )
            return
        skips = self.inbox.skip_summary()
        if trained == 0 and set(self.inbox.skipped) - set(ROUTINE_SKIPS):
            raise RuntimeError(f"the learner trained no step: the groups it received were skipped ({skips})")
        log.log(
            logging.WARNING if trained == 0 else logging.INFO,
            "stopping at step %d: the data ran out after %d steps of this run (%s)",
            self.state.step,
            trained,
            skips,
        )

    def close(self) -> None:
        """The held update, final checkpoint and acks, Hugging Face export, release sockets and the process
        group."""
        if self.fenced:  # another learner holds the run: nothing more is written
            self.sender.close()
            self.transport.close()
            return
        self._finish_held_update(self._carried)
        if self.cfg.checkpoint.every >= 0:
            if self.state.step > self._last_ckpt_step:
                self._checkpoint()
            self._export()
        self.metrics.close()
        self.sender.close()
        self.transport.close()
        if distributed():
            torch.distributed.destroy_process_group()

    # ------------------------------------------------------------------ one step
    def train_step(self, groups: list[ScoredGroup], wait_s: float = 0.0) -> dict[str, float]:
        """One optimizer step (or `mini_batches` of them) on these groups; returns the step's metrics."""
        t0 = time.perf_counter()
        cfg = self.cfg
        track_gpu_peak(self.info.device)
        trained, refused = self.guard.check(groups) if self.guard is not None else (groups, 0)
        advantages = batch_advantages(
            [[s.reward for s in g.scores] for g in trained], cfg.algo.estimator, cfg.algo.adv_eps
        )
        samples = all_samples = to_samples(trained, advantages)
        lost = self.state.extra.get("lost_versions", [])
        ages = [staleness(self.version_now, s, lost) for s in samples]
        for age in ages:
            self.metrics.staleness.observe(age)
        samples, n_stale = filter_stale(samples, self.version_now, cfg.algo.max_staleness, lost)
        values: dict[str, float] = defaultdict(float, self._carried)
        self._carried.clear()
        if self.guard is not None:
            values["adapter_mismatch"] = float(refused)
        if cfg.algo.mask_truncated:
            samples, n_truncated = filter_truncated(samples)
            values["truncated_masked"] = float(n_truncated)
        samples, n_env_failed = filter_env_failed(samples)
        if n_env_failed:
            values["env_failed_masked"] = float(n_env_failed)
        if ages:
            values["staleness_mean"], values["staleness_max"] = sum(ages) / len(ages), float(max(ages))
            values["version_spanning"] = float(sum(map(spans_versions, all_samples)))
        plans = self.planner.plan_step(samples) if samples else []
        ref_done = self._finish_held_update(values, beside=plans[:1])  # the last step's held AdamW, its sync
        if plans:
            hold = self._may_hold()
            values["update_held"] = float(hold)  # the next step's groups may still finish it at once
            version, step = self.version_now, self.state.step
            self.updater.run(plans, values, version, step, first_ref_done=ref_done, hold_last=hold)
        self._record_consumed(groups)
        self._held_groups += len(groups)
        self.state.step += 1
        self.metrics.log_trained(self.state.step, [g.group.group_id for g in groups])
        skipped = self.inbox.skipped if self.inbox is not None else {}
        values.update(rollout_stats(groups, samples, n_stale, skipped))
        every, export_every = cfg.checkpoint.every, cfg.checkpoint.export_hf_every
        checkpoint_due = every >= 0 and ((every > 0 and self.state.step % every == 0) or self._acks_due())
        export_due = export_every > 0 and self.state.step % export_every == 0
        if self.updater.pending is None:
            values["sync_s"] += self._maybe_sync()
        elif checkpoint_due or export_due or self._eval_due():  # they need this step's weights
            self._finish_held_update(values)
        values["train_s"] = time.perf_counter() - t0
        values["wait_s"] = wait_s
        values["step"], values["version"] = float(self.state.step), float(self.state.version)
        values["tokens_per_s"] = values["tokens"] / max(values["train_s"], 1e-9)
        flops = values.pop("flops", 0.0)
        values["mfu"] = mfu(flops, values["train_s"], self.peak_flops, self.info.world_size)
        values["train_pass_mfu"] = mfu(flops, values["train_pass_s"], self.peak_flops, self.info.world_size)
        values.update(gpu_peak(self.info.device))  # the step's high-water mark on this rank's GPU
        self._evaluate(values)
        if checkpoint_due:
            values["checkpoint_s"] = self._checkpoint()
        elif every < 0 and self.inbox is not None:
            self.inbox.ack_durable()  # nothing is ever saved: nothing to redeliver after a crash either
        if export_due:
            self._export()
        self.metrics.tokens.inc(values["tokens"])
        self.metrics.log_step(dict(values))
        return dict(values)

    # ------------------------------------------------------------------ groups, sync, checkpoints
    def _next_groups(self, wait: bool = True) -> list[ScoredGroup] | None | NotReady:
        """Rank 0 collects one step's groups and broadcasts them; None means stop. `wait=False`: NOT_READY
        (on every rank) unless they are all here now."""
        payload = None
        if self.inbox is not None:
            groups = (
                None  # eval.stop_accuracy reached: every rank stops here
                if self._target_reached
                else self.inbox.collect(self._collect_version(), self.cfg.idle_exit_s, wait=wait)
            )
            payload = (
                b"" if groups is NOT_READY else None if groups is None else msgspec.msgpack.encode(groups)
            )
        payload = broadcast_bytes(payload)
        if payload == b"":
            return NOT_READY
        return None if payload is None else msgspec.msgpack.decode(payload, type=list[ScoredGroup])

    def _collect_version(self) -> int:
        """The published version the collected step trains beside (the feeder's admission counts from it):
        with an update held back whose sync is due, the version that sync publishes."""
        if self.updater.pending is not None and self._sync_due():
            return self.version_now
        return self.state.version

    def _may_hold(self) -> bool:
        """Hold this step's last AdamW back for the next step's first KL pass (`optim.defer_update`): one
        rank (a one-GPU learner has a one-rank process group: the world size counts, not the group), where
        that pass runs beside the host AdamW anyway (`Updater.overlap_ref`), and K > 0 (at K = 0 the next
        step's groups come from this step's weights: they are never waiting, the update would run alone)."""
        hold = self.cfg.optim.defer_update and self.updater.overlap_ref and self.ref is not None
        return hold and self.info.world_size == 1 and self.cfg.algo.max_staleness > 0

    def _finish_held_update_alone(self) -> None:
        """The held update and its weight sync, now and with nothing beside it: the next step's groups were
        not all here when it ended (said in the log, and in the next step's metrics as
        `update_settled_alone`)."""
        taken = self.inbox.taken if self.inbox is not None else 0
        want = self.cfg.algo.groups_per_step
        log.info("step %d: %d of %d groups here, its held AdamW runs now", self.state.step, taken, want)
        self._carried["update_settled_alone"] = 1.0
        self._finish_held_update(self._carried)

    def _eval_due(self) -> bool:
        """An evaluation round starts after this step (`_evaluate`)."""
        evaluator = self.inbox.evaluator if self.inbox is not None else None
        return evaluator is not None and evaluator.due(self.state.step)

    def _finish_held_update(self, values: dict[str, float], beside: list | None = None) -> bool:
        """The AdamW step the last step held back (`Updater.apply_held_update`, the KL pass of `beside`
        meanwhile), then the weight sync it was due; True if that KL pass ran. Nothing held: nothing to do."""
        if self.updater.pending is None:
            return False
        ref_done = self.updater.apply_held_update(values, beside or [])
        values["sync_s"] += self._maybe_sync()
        return ref_done

    def _evaluate(self, values: dict[str, float]) -> None:
        """Start an evaluation round when one is due; report the rounds that finished."""
        if self.inbox is None:
            return
        if self._eval_due():
            self.inbox.evaluator.start(self.state.step, self.state.version)
        target = self.cfg.eval.stop_accuracy
        for metrics in self.inbox.eval_metrics:
            values.update(metrics)
            if target > 0 and metrics.get("eval/accuracy", 0.0) >= target:
                self._target_reached = metrics["eval/accuracy"]
        self.inbox.eval_metrics.clear()

    def _record_consumed(self, groups: list[ScoredGroup]) -> None:
        if self.inbox is not None:
            self.inbox.commit()
            self.state.consumed = sorted(self.inbox.consumed)
            if self.inbox.feeder is not None:
                self.state.cursor = self.inbox.feeder.cursor()

    def _sync_due(self) -> bool:
        """The weights after `state.step` updates go to the generators (every `sync_every` steps)."""
        return self.state.step % max(self.cfg.sync_every, 1) == 0

    def _maybe_sync(self) -> float:
        if not self._sync_due():
            return 0.0
        t0 = time.perf_counter()
        self.state.version = self.version_now
        self.sender.sync(self.model.model, version=self.state.version, step=self.state.step)
        self._record_adapter()
        seconds = time.perf_counter() - t0
        self.metrics.sync_seconds.observe(seconds)
        self._announce(seconds)
        return seconds

    def _announce(self, seconds: float = 0.0) -> None:
        if self.info.is_main:
            msg = WeightVersion(
                version=self.state.version,
                step=self.state.step,
                source="learner",
                seconds=seconds,
                timestamp=time.time(),
            )
            self.transport.set_value(self.names.learner_version, codec.encode(msg))

    def _acks_due(self) -> bool:
        """The groups held unacked since the last checkpoint fill half the scored stream's `max_len` (a
        quarter when acks lag one checkpoint, learner/inbox.py: two checkpoints' groups are held then).

        The broker counts unacked entries against `max_len` (a publish blocks while a stream holds that
        many), so a learner holding its acks for `checkpoint.every` steps of more groups than that would
        block the reward service that feeds it and then wait for data forever: it checkpoints early.
        """
        share = 2 * ack_generations(self.cfg)  # every rank counts the same groups
        if self._held_groups < self.transport.options.max_len // share:
            return False
        log.info("checkpoint at step %d: %d groups await their ack", self.state.step, self._held_groups)
        return True

    def _record_adapter(self) -> None:
        """LoRA: remember the digest of the adapter just published as `state.version` (the guard's)."""
        if self.guard is not None:
            digest = AdapterTensors(self.model.model, self.cfg.weight_sync.send_dtype).digest()
            self.guard.publish(self.state.version, digest)

    def _export(self) -> None:
        """The Hugging Face export: the model, or with LoRA its adapter in PEFT format (and the merge)."""
        out = self.run_dir / "hf"
        if not self.cfg.lora.enabled:
            export_hf(self.model, self.hf, self.processor, out, rank=self.info.rank)
            return
        merged = self.run_dir / "hf-merged" if self.cfg.lora.export_merged else ""
        lora.export_adapter(self.model, self.hf, out, self.info.rank, merged, self.processor)

    def _checkpoint(self) -> float:
        t0 = time.perf_counter()
        if self.cfg.lora.enabled:
            self.state.extra[lora.CHECKPOINT_KEY] = lora.checkpoint_settings(self.cfg.lora)
        if self.guard is not None:
            self.state.extra[GUARD_KEY] = self.guard.state()
        self.checkpointer.save(self.model, self.optimizer, self.scheduler, self.state)
        self._last_ckpt_step = self.state.step
        self._held_groups = 0
        if self.inbox is not None:
            self.inbox.ack_durable()
        return time.perf_counter() - t0
