"""The Learner: scored groups in, GRPO updates, weights out to the generators, checkpoints.

    learner = Learner(cfg)          # joins the torch.distributed group, shards the model, resumes
    learner.train()                 # until max_steps or the data runs out
    learner.close()                 # final checkpoint, acks, HF export, sockets

One `train_step(groups)` (every rank, same groups):
  1. advantages per group (GRPO / Dr.GRPO / RLOO), flattened into samples; samples older than
     the staleness bound (counted from version_start) are dropped (counted); staleness observed
     per sample, and samples whose policy changed mid-response (in-flight updates) counted;
  2. per PPO mini-batch: token-budget packed micro-batches spread over the ranks (the same
     plan on every rank; ranks with fewer micro-batches run zero-weighted dummies so FSDP's
     collectives line up);
  3. optionally a no-grad pass for π_prox (proximal = recompute; over the mini-batches after the first,
     which trains at π_prox's weights and takes it from its own forward) and for π_ref (KL; with AdamW in
     host memory, each later mini-batch's π_ref pass runs on the GPU during the previous update);
  4. loss per micro-batch with the step's global denominator, gradient accumulation, clipping,
     AdamW; a non-finite gradient norm skips the update (counted);
  5. every `sync_every` steps the weights go to the generators and the new version is announced;
     every `checkpoint.every` steps a checkpoint, then the consumed groups are acked.
Rank 0 alone talks to the scored stream and the feeder (learner/inbox.py) and broadcasts each
step's groups to the other ranks.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections import defaultdict
from pathlib import Path

import msgspec
import torch

from broker import codec
from broker.images import ImageStore
from broker.names import Names
from broker.schemas import ScoredGroup, WeightVersion
from learner.advantages import batch_advantages
from learner.batching import (
    PackedMicroBatch,
    TrainSample,
    assign_to_ranks,
    filter_stale,
    filter_truncated,
    plan_microbatches,
    sample_length,
    spans_versions,
    staleness,
    to_samples,
)
from learner.checkpoint import Checkpointer, TrainerState, export_hf
from learner.config import LearnerConfig
from learner.losses import TokenBatch, behaviour_kl, loss_denominator, policy_loss
from learner.metrics import LearnerMetrics, gpu_peak, lm_param_count, mfu, track_gpu_peak, train_flops
from learner.optim import step_beside
from learner.parallel import (
    all_reduce_sum,
    apply_parallelism,
    broadcast_bytes,
    build_optimizer,
    clip_grad_norm,
    distributed,
    init_distributed,
    param_dtype,
    resolve_master_weights,
)
from learner.wiring import build_inbox, build_reference, build_sender, guess_peak_flops
from policy.loading import load_model, load_processor
from policy.packing import PixelCache
from runtime.config import write_resolved
from runtime.metrics import new_registry, start_metrics_server
from runtime.redact import setup_logging
from tasks.prompt import num_image_tokens

log = logging.getLogger(__name__)

_SUMMED = (
    "mismatch_kl",
    "mismatch_kl_k1",
    "mismatch_abs_logprob_diff",
    "clipped_frac",
    "dual_clipped_frac",
    "masked_frac",
    "is_weight_mean",
    "ratio_mean",
    "entropy",
    "kl_ref",
)


class Learner:
    """See the module docstring."""

    def __init__(self, cfg: LearnerConfig, *, transport=None, sender=None, registry=None):
        self.cfg = cfg
        self.info = init_distributed(cfg.parallel.backend)
        torch.manual_seed(cfg.seed)
        self.run_dir = Path(cfg.run_dir)
        self.processor = load_processor(cfg.model)
        self.master_weights = resolve_master_weights(
            cfg.optim.master_weights, self.info.world_size, self.info.device
        )
        self.param_dtype = param_dtype(self.master_weights)
        self.hf = load_model(cfg.model, dtype=self.param_dtype, device=self.info.device).train()
        self.image_token_id = self.hf.config.image_token_id
        self.n_lm_params = lm_param_count(self.hf)
        self.model = apply_parallelism(self.hf, cfg.parallel, self.info.device)
        self.ref = build_reference(self) if cfg.loss.kl_coef > 0 else None
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg.optim, self.master_weights)
        # AdamW in host memory is CPU work: the next mini-batch's KL reference pass runs on the GPU meanwhile
        self.overlap_ref = self.master_weights == "host" and self.info.device.type == "cuda"
        self.names = Names(cfg.broker.namespace)
        self.transport = transport or cfg.broker.connect()
        self.images = ImageStore(self.transport, self.names)
        self.pixels = PixelCache(self.processor.image_processor)
        self.registry = registry if registry is not None else new_registry()
        self.metrics = LearnerMetrics(self.registry, self.run_dir, enabled=self.info.is_main)
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", cfg.checkpoint.keep, self.info.rank)
        self.sender = sender if sender is not None else build_sender(self)
        self.state = TrainerState()
        self.inbox = build_inbox(self) if self.info.is_main else None
        self.peak_flops = cfg.peak_tflops * 1e12 or guess_peak_flops(self.info.device)
        self.nonfinite_steps = 0
        self._last_ckpt_step = 0
        self._held_groups = 0  # trained since the last checkpoint: their acks wait for the next one
        self._resume()

    # ------------------------------------------------------------------ lifecycle
    def _resume(self) -> None:
        latest = self.checkpointer.latest() if self.cfg.checkpoint.resume else None
        if latest is not None:
            self.state = self.checkpointer.load(latest, self.model, self.optimizer, self.scheduler)
            self._last_ckpt_step = self.state.step
        if self.inbox is not None:
            self.inbox.restore(self.state.consumed)
            if self.inbox.feeder is not None:
                self.inbox.feeder.load_state(self.state.cursor or None, consumed=self.inbox.consumed)
        self._skip_lost_versions()
        if self.state.version > 0:
            self.sender.sync(self.model.model, version=self.state.version, step=self.state.step)
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
        """Train until `max_steps` optimizer steps or until the data runs out."""
        evaluator = self.inbox.evaluator if self.inbox is not None else None
        if evaluator is not None and self.cfg.eval.at_start and self.state.step == 0:
            evaluator.start(0, self.state.version)
        while self.state.step < self.cfg.max_steps:
            t0 = time.perf_counter()
            groups = self._next_groups()
            if groups is None:
                break
            wait_s = time.perf_counter() - t0
            self.train_step(groups, wait_s=wait_s)

    def close(self) -> None:
        """Final checkpoint and acks, Hugging Face export, release sockets and the process group."""
        if self.cfg.checkpoint.every >= 0:
            if self.state.step > self._last_ckpt_step:
                self._checkpoint()
            export_hf(self.model, self.hf, self.processor, self.run_dir / "hf", rank=self.info.rank)
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
        advantages = batch_advantages(
            [[s.reward for s in g.scores] for g in groups], cfg.algo.estimator, cfg.algo.adv_eps
        )
        samples = all_samples = to_samples(groups, advantages)
        lost = self.state.extra.get("lost_versions", [])
        ages = [staleness(self.version_now, s, lost) for s in samples]
        for age in ages:
            self.metrics.staleness.observe(age)
        samples, n_stale = filter_stale(samples, self.version_now, cfg.algo.max_staleness, lost)
        values: dict[str, float] = defaultdict(float)
        if cfg.algo.mask_truncated:
            samples, n_truncated = filter_truncated(samples)
            values["truncated_masked"] = float(n_truncated)
        if ages:
            values["staleness_mean"], values["staleness_max"] = sum(ages) / len(ages), float(max(ages))
            values["version_spanning"] = float(sum(map(spans_versions, all_samples)))
        if samples:
            self._optimize(samples, values)
        self._record_consumed(groups)
        self._held_groups += len(groups)
        self.state.step += 1
        self.metrics.log_trained(self.state.step, [g.group.group_id for g in groups])
        values.update(self._rollout_stats(groups, samples, n_stale))
        values["train_s"] = time.perf_counter() - t0
        values["sync_s"] = self._maybe_sync()
        values["wait_s"] = wait_s
        values["step"], values["version"] = float(self.state.step), float(self.state.version)
        values["tokens_per_s"] = values["tokens"] / max(values["train_s"], 1e-9)
        flops = values.pop("flops", 0.0)
        values["mfu"] = mfu(flops, values["train_s"], self.peak_flops, self.info.world_size)
        values.update(gpu_peak(self.info.device))  # the step's high-water mark on this rank's GPU
        self._evaluate(values)
        every = cfg.checkpoint.every
        if every >= 0 and ((every > 0 and self.state.step % every == 0) or self._acks_due()):
            values["checkpoint_s"] = self._checkpoint()
        elif every < 0 and self.inbox is not None:
            self.inbox.ack_durable()  # nothing is ever saved: nothing to redeliver after a crash either
        if cfg.checkpoint.export_hf_every > 0 and self.state.step % cfg.checkpoint.export_hf_every == 0:
            export_hf(self.model, self.hf, self.processor, self.run_dir / "hf", rank=self.info.rank)
        self.metrics.tokens.inc(values["tokens"])
        self.metrics.log_step(dict(values))
        return dict(values)

    def _optimize(self, samples: list[TrainSample], values: dict[str, float]) -> None:
        cfg = self.cfg
        lengths = [sample_length(s, self._image_tokens) for s in samples]
        chunks = _split(len(samples), cfg.algo.mini_batches)
        plans = [self._plan([samples[i] for i in c], [lengths[i] for i in c]) for c in chunks]
        t0 = time.perf_counter()  # the no-grad passes end in host copies of their logprobs: synchronised
        if cfg.algo.proximal == "recompute":  # the first update runs at π_prox's weights: its own forward
            self._no_grad_pass(plans[1:], self.model, "proximal_logprobs")  # gives them (`_micro_step`)
        t1 = time.perf_counter()
        # overlap_ref: the KL pass of update u + 1 runs beside update u's AdamW (also counted in ref_pass_s)
        beside = self.overlap_ref and self.ref is not None
        if self.ref is not None:
            self._no_grad_pass(plans[:1] if beside else plans, self.ref, "ref_logprobs")
        values["proximal_pass_s"], values["ref_pass_s"] = t1 - t0, time.perf_counter() - t1
        weights = defaultdict(float)
        for update, (mine, n_micro, denom) in enumerate(plans):
            for i in range(n_micro):
                mb = mine[i] if i < len(mine) else None
                self._micro_step(mb, denom, weights, first_update=update == 0)
            norm = clip_grad_norm(self.model, cfg.optim.grad_clip)
            later = plans[update + 1 : update + 2] if beside else []
            work = functools.partial(self._no_grad_pass, later, self.ref, "ref_logprobs") if later else None
            if math.isfinite(norm):  # host time (torch's AdamW on CUDA returns before its kernels end)
                optimizer_s, ref_s = step_beside(self.optimizer, work)
                values["optimizer_s"] += optimizer_s
                values["ref_pass_s"] += ref_s
            else:
                self.nonfinite_steps += 1
                log.warning("step %d: non-finite gradient norm, update skipped", self.state.step)
                if work is not None:
                    work()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            values["grad_norm"] = norm
        head = ("n", "tokens", "flops", "fresh_tokens", "fresh_kl")
        totals = all_reduce_sum([weights[k] for k in (*head, *_SUMMED)])
        n = max(totals[0], 1.0)
        values["tokens"], values["flops"] = totals[1], totals[2]
        values["fresh_tokens"] = totals[3]
        values["mismatch_kl_fresh"] = totals[4] / totals[3] if totals[3] > 0 else math.nan
        for key, total in zip(_SUMMED, totals[len(head) :]):
            values[key] = total / n
        values["lr"] = self.scheduler.get_last_lr()[0]
        values["nonfinite_steps"] = float(self.nonfinite_steps)

    def _plan(self, samples: list[TrainSample], lengths: list[int]):
        """(this rank's micro-batches, micro-batches every rank runs, the loss denominator)."""
        bins = plan_microbatches(
            lengths, self.cfg.batching.max_tokens_per_microbatch, [s.group_id for s in samples]
        )
        per_rank = assign_to_ranks(bins, lengths, self.info.world_size)
        mine = [self._build([samples[i] for i in b]) for b in per_rank[self.info.rank]]
        n_resp = sum(len(s.response_ids) for s in samples)
        denom = loss_denominator(self.cfg.loss, n_resp, len(samples))
        return mine, max(len(r) for r in per_rank), denom

    def _build(self, samples: list[TrainSample]) -> PackedMicroBatch:
        return PackedMicroBatch.build(samples, self.images.get, self.pixels, self.image_token_id)

    def _forward(self, module, mb: PackedMicroBatch):
        packed = mb.packed.to(self.info.device)
        return module(
            packed, temperature=self.cfg.algo.temperature, with_entropy=True, run_vision_always=distributed()
        )

    def _no_grad_pass(self, plans, module, attr: str) -> None:
        with torch.no_grad():
            for mine, n_micro, _ in plans:
                for i in range(n_micro):
                    mb = mine[i] if i < len(mine) else self._dummy()
                    logprobs, _ = self._forward(module, mb)
                    setattr(mb, attr, logprobs.float().cpu())

    def _micro_step(
        self, mb: PackedMicroBatch | None, denom: float, weights: dict[str, float], first_update: bool
    ) -> None:
        real = mb is not None
        mb = mb if real else self._dummy()
        logprobs, entropy = self._forward(self.model, mb)
        dev = logprobs.device
        prox = mb.proximal_logprobs
        if self.cfg.algo.proximal == "detached" or (self.cfg.algo.proximal == "recompute" and first_update):
            prox = logprobs.detach()
        batch = TokenBatch(
            logprobs=logprobs,
            behaviour_logprobs=mb.behaviour_logprobs.to(dev),
            advantages=mb.advantages.to(dev),
            seq_index=mb.seq_index.to(dev),
            num_seqs=len(mb.samples),
            proximal_logprobs=None if prox is None else prox.to(dev),
            ref_logprobs=None if mb.ref_logprobs is None else mb.ref_logprobs.to(dev),
            entropy=entropy,
        )
        loss, m = policy_loss(self.cfg.loss, batch, denom)
        scale = float(self.info.world_size) if real else 0.0
        (loss * scale).backward()
        if real:
            n = m["num_tokens"]
            weights["n"] += n
            weights["tokens"] += mb.num_tokens
            seq_lens = (mb.packed.cu_seqlens[1:] - mb.packed.cu_seqlens[:-1]).tolist()
            text = self.hf.config.text_config
            layers, hidden = text.num_hidden_layers, text.hidden_size
            weights["flops"] += train_flops(self.n_lm_params, layers, hidden, seq_lens)
            for key in _SUMMED:
                weights[key] += m.get(key, 0.0) * n
            if first_update:
                self._fresh_mismatch(mb, batch, weights)

    def _fresh_mismatch(self, mb: PackedMicroBatch, batch: TokenBatch, weights: dict[str, float]) -> None:
        """k3 KL between the generator's and the learner's logprobs over the tokens of samples sampled by
        exactly the weights this forward runs (version_start == version_end == the current version): the
        engine mismatch alone, without the policy change that staleness adds to `mismatch_kl`."""
        now = self.version_now
        fresh = [s.version_start == now and s.version_end in (-1, now) for s in mb.samples]
        if not any(fresh):
            return
        with torch.no_grad():
            mask = torch.tensor(fresh, device=batch.seq_index.device)[batch.seq_index]
            kl = behaviour_kl(batch.logprobs.float(), batch.behaviour_logprobs)[mask]
            weights["fresh_tokens"] += float(kl.numel())
            weights["fresh_kl"] += kl.sum().item()

    def _dummy(self) -> PackedMicroBatch:
        """A one-token micro-batch whose loss is multiplied by zero (keeps FSDP collectives aligned)."""
        tok = int(self.processor.tokenizer.pad_token_id or 0)
        sample = TrainSample(
            group_id="",
            prompt_ids=[tok],
            response_ids=[tok],
            behaviour_logprobs=[0.0],
            advantage=0.0,
            version_start=0,
        )
        return self._build([sample])

    def _image_tokens(self, ref) -> int:
        if ref.width and ref.height:
            return num_image_tokens(self.processor.image_processor, ref.width, ref.height)
        pixels, grid = self.pixels.get(ref.sha256, self.images.get(ref))
        return grid[0] * grid[1] * grid[2] // self.processor.image_processor.merge_size**2

    # ------------------------------------------------------------------ groups, sync, checkpoints
    def _next_groups(self) -> list[ScoredGroup] | None:
        """Rank 0 collects one step's groups and broadcasts them; None means stop."""
        payload = None
        if self.inbox is not None:
            groups = self.inbox.collect(self.state.version, self.cfg.idle_exit_s)
            payload = None if groups is None else msgspec.msgpack.encode(groups)
        payload = broadcast_bytes(payload)
        return None if payload is None else msgspec.msgpack.decode(payload, type=list[ScoredGroup])

    def _evaluate(self, values: dict[str, float]) -> None:
        """Start an evaluation round when one is due; report the rounds that finished."""
        if self.inbox is None:
            return
        evaluator = self.inbox.evaluator
        if evaluator is not None and evaluator.due(self.state.step):
            evaluator.start(self.state.step, self.state.version)
        for metrics in self.inbox.eval_metrics:
            values.update(metrics)
        self.inbox.eval_metrics.clear()

    def _record_consumed(self, groups: list[ScoredGroup]) -> None:
        if self.inbox is not None:
            self.inbox.commit()
            self.state.consumed = sorted(self.inbox.consumed)
            if self.inbox.feeder is not None:
                self.state.cursor = self.inbox.feeder.cursor()

    def _maybe_sync(self) -> float:
        if self.state.step % max(self.cfg.sync_every, 1) != 0:
            return 0.0
        t0 = time.perf_counter()
        self.state.version = self.version_now
        self.sender.sync(self.model.model, version=self.state.version, step=self.state.step)
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
        """The groups held unacked for the next checkpoint fill half the scored stream's `max_len`.

        The broker counts unacked entries against `max_len` (a publish blocks while a stream holds that
        many), so a learner holding its acks for `checkpoint.every` steps of more groups than that would
        block the reward service that feeds it and then wait for data forever: it checkpoints early.
        """
        if self._held_groups < self.transport.options.max_len // 2:  # every rank counts the same groups
            return False
        log.info("checkpoint at step %d: %d groups await their ack", self.state.step, self._held_groups)
        return True

    def _checkpoint(self) -> float:
        t0 = time.perf_counter()
        self.checkpointer.save(self.model, self.optimizer, self.scheduler, self.state)
        self._last_ckpt_step = self.state.step
        self._held_groups = 0
        if self.inbox is not None:
            self.inbox.ack_durable()
        return time.perf_counter() - t0

    def _rollout_stats(self, groups, samples, n_stale) -> dict[str, float]:
        scores = [s for g in groups for s in g.scores]
        out = {
            "groups": float(len(groups)),
            "samples": float(len(samples)),
            "stale_samples": float(n_stale),
            "reward_mean": sum(s.reward for s in scores) / max(len(scores), 1),
            "accuracy": sum(s.accuracy for s in scores) / max(len(scores), 1),
            "response_len": sum(len(s.response_ids) for s in samples) / max(len(samples), 1),
        }
        # Generator seconds behind this step: each generate call that produced some of its groups, once.
        calls = {(g.group.generator_id, g.group.timings.get("generate", 0.0)) for g in groups}
        out["generate_s"] = sum(seconds for _, seconds in calls)
        out["generate_calls"] = float(len(calls))
        if self.inbox is not None:
            for reason, count in self.inbox.skipped.items():
                out[f"skipped/{reason}"] = float(count)
        return out


def _split(n: int, parts: int) -> list[list[int]]:
    """0..n-1 in `parts` contiguous, nearly equal chunks (empty chunks dropped)."""
    size = math.ceil(n / max(parts, 1))
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)] if n else []


def run(cfg: LearnerConfig) -> None:
    """Entry point of every rank (`python -m learner`)."""
    setup_logging("INFO", "%(asctime)s %(name)s %(levelname)s %(message)s")
    learner = Learner(cfg)
    if learner.info.is_main:
        write_resolved(cfg, cfg.run_dir, "learner")
        start_metrics_server(cfg.metrics, learner.registry)
    try:
        learner.train()
    except KeyboardInterrupt:
        log.info("interrupted at step %d: saving and exporting", learner.state.step)
    finally:
        learner.close()
