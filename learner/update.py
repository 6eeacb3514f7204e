"""One step's policy updates over a planned step: the no-grad passes, loss, backward, clipping, AdamW.

    updater = Updater(cfg, info, model, ref, optimizer, scheduler, model_config=..., dummy=...)  # Learner's
    updater.apply_held_update(values, plans[:1])          # an update held back from the last step, if any
    updater.run(plans, values, version=7, step=12)       # fills `values` with the step's loss metrics

`run` on one step's plan (learner/batching.py: `MicroBatchPlanner.plan_step`, the same plan on every rank;
ranks with fewer micro-batches run zero-weighted dummies so FSDP's collectives line up):
  1. proximal = recompute: one no-grad pass gives π_prox over the mini-batches after the first (the
     first trains at π_prox's weights and takes it from its own forward); with a KL term, a no-grad pass
     of the reference model gives π_ref, for a later mini-batch beside the previous update's host AdamW
     (`overlap_ref`: the GPU computes while the CPU updates, learner/optim.py `step_beside`); both
     passes run over a mini-batch's no-grad packs (its consecutive micro-batches joined into packs of up to
     `batching.no_grad_tokens_per_microbatch` tokens: they keep no activations);
  2. per mini-batch: loss per micro-batch with the step's global denominator, gradient accumulation,
     clipping, AdamW; a non-finite gradient norm skips the update (counted in `nonfinite_steps`). With
     `hold_last` the last AdamW waits in `pending` for the next step's `apply_held_update`, which runs it
     beside that step's first KL pass (the Learner decides: `optim.defer_update`).
The Learner (learner/trainer.py) owns everything around it: data, versions, sync, checkpoints.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from learner.batching import MiniBatch, PackedMicroBatch
from learner.losses import TokenBatch, behaviour_kl, policy_loss
from learner.metrics import train_flops
from learner.optim import step_beside
from learner.parallel import all_reduce_sum, clip_grad_norm, distributed

log = logging.getLogger(__name__)

SUMMED = (
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
"""Per-token loss metrics: token-weighted sums over micro-batches and ranks, divided by the tokens."""


class Updater:
    """See the module docstring. `dummy` makes the zero-weighted micro-batch a rank runs where another has one
    more (`MicroBatchPlanner.dummy`); `before_write` is called before AdamW writes the parameters (the weight
    sender's `begin_write`); `overlap_ref` runs each later KL pass beside the host AdamW."""

    def __init__(
        self, cfg, info, model, ref, optimizer, scheduler, *,
        model_config, n_lm_params: int, dummy: Callable[[], PackedMicroBatch],
        before_write: Callable[[], float] = lambda: 0.0, overlap_ref: bool = False,
    ):  # fmt: skip
        self.cfg, self.info = cfg, info
        self.model, self.ref, self.optimizer, self.scheduler = model, ref, optimizer, scheduler
        self.text_config, self.n_lm_params = model_config.text_config, n_lm_params
        self.dummy, self.before_write = dummy, before_write
        self.overlap_ref = overlap_ref
        self.nonfinite_steps = 0
        self.version = 0  # of the weights the current step starts from (`run`)
        self.pending: tuple[float, int] | None = None
        """(gradient norm, step) of an update `run` held back (`hold_last`) for `apply_held_update`."""

    def run(
        self, plans: list[MiniBatch], values: dict[str, float], version: int, step: int, *,
        first_ref_done: bool = False, hold_last: bool = False,
    ) -> None:  # fmt: skip
        """Every mini-batch's update of `plans`; `version` is the weights' version (what `fresh` means).
        `first_ref_done`: the first mini-batch's KL pass ran already (`apply_held_update`); `hold_last`: the
        last mini-batch's AdamW waits in `pending` for `apply_held_update`."""
        self.version, cfg = version, self.cfg
        t0 = time.perf_counter()  # each no-grad pass ends synchronised with its stream
        if cfg.algo.proximal == "recompute":  # the first update runs at π_prox's weights: its own forward
            self.no_grad_pass(plans[1:], self.model, "proximal_logprobs")  # gives them (`micro_step`)
        t1 = time.perf_counter()
        beside = self.overlap_ref and self.ref is not None
        if self.ref is not None and not first_ref_done:
            self.no_grad_pass(plans[:1] if beside else plans, self.ref, "ref_logprobs")
        values["proximal_pass_s"] = t1 - t0
        values["ref_pass_s"] += time.perf_counter() - t1  # after a KL pass run beside a held AdamW
        values["micro_batches"] = float(sum(mini.n_micro for mini in plans))  # training forwards a rank runs
        values["no_grad_packs"] = float(sum(mini.n_no_grad for mini in plans))  # forwards of a no-grad pass
        weights = defaultdict(float)
        for update, mini in enumerate(plans):
            t2 = time.perf_counter()
            for i in range(mini.n_micro):
                real = mini.mine[i] if i < len(mini.mine) else None
                self.micro_step(real, mini.denom, weights, first_update=update == 0)
            # the norm is read on the host, so the training pass has ended when it returns
            values["grad_norm"] = norm = clip_grad_norm(self.model, cfg.optim.grad_clip)
            values["train_pass_s"] += time.perf_counter() - t2
            if hold_last and update == len(plans) - 1:
                self.pending = (norm, step)
                break
            later_ref = plans[update + 1 : update + 2] if beside else []
            self.apply_update(norm, later_ref, values, step)
        self.summarise(weights, values)

    def apply_held_update(self, values: dict[str, float], beside: list[MiniBatch]) -> bool:
        """The AdamW step that `run` held back (`hold_last`), if any, with the KL pass of `beside` (the next
        step's first mini-batch) running meanwhile; True if that KL pass ran."""
        if self.pending is None:
            return False
        (norm, step), self.pending = self.pending, None
        later_ref = beside if self.ref is not None else []
        self.apply_update(norm, later_ref, values, step)
        return bool(later_ref)

    def apply_update(self, norm: float, later_ref: list, values: dict[str, float], step: int) -> None:
        """AdamW (the KL pass of `later_ref` beside it) unless the gradient norm `norm` is not finite, then
        the scheduler. `optimizer_exposed_s`: the part of AdamW's time nothing ran beside;
        `optimizer_copy_wait_s`: the part a host-memory AdamW waited for its copies (the rest is CPU work);
        `write_lock_wait_s`: waiting for generators to finish reading parameters that live in their buffer."""
        work = None
        if later_ref:
            work = functools.partial(self.no_grad_pass, later_ref, self.ref, "ref_logprobs")
        if math.isfinite(norm):  # host time (torch's AdamW on CUDA returns before its kernels end)
            values["write_lock_wait_s"] += self.before_write()
            t0 = time.perf_counter()
            optimizer_s, ref_s = step_beside(self.optimizer, work)
            values["optimizer_s"] += optimizer_s
            values["optimizer_copy_wait_s"] += getattr(self.optimizer, "copy_wait_s", 0.0)  # host AdamW's
            values["optimizer_exposed_s"] += time.perf_counter() - t0 - ref_s
            values["ref_pass_s"] += ref_s
        else:
            self.nonfinite_steps += 1
            log.warning("step %d: non-finite gradient norm, update skipped", step)
            if work is not None:
                work()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def summarise(self, weights: dict, values: dict[str, float]) -> None:
        """The step's token-weighted loss metrics (`weights`: floats and device tensors), summed over the
        ranks."""
        head = ("n", "tokens", "flops", "fresh_tokens", "fresh_kl", "computed_tokens")
        totals = all_reduce_sum(read_once([weights[k] for k in (*head, *SUMMED)]))
        n = max(totals[0], 1.0)
        values["tokens"], values["flops"], values["computed_tokens"] = totals[1], totals[2], totals[5]
        values["fresh_tokens"] = totals[3]
        values["mismatch_kl_fresh"] = totals[4] / totals[3] if totals[3] > 0 else math.nan
        for key, total in zip(SUMMED, totals[len(head) :]):
            values[key] = total / n
        values["lr"] = self.scheduler.get_last_lr()[0]
        values["nonfinite_steps"] = float(self.nonfinite_steps)

    # ------------------------------------------------------------------ forward passes
    def forward(self, module, mb: PackedMicroBatch, with_entropy: bool = True):
        packed = mb.packed.to(self.info.device)
        return module(
            packed,
            temperature=self.cfg.algo.temperature,
            with_entropy=with_entropy,
            run_vision_always=distributed(),
        )

    def no_grad_pass(self, plans: list[MiniBatch], module, attr: str) -> None:
        """`attr` (proximal_logprobs / ref_logprobs) of every micro-batch of `plans` from `module`, computed
        over the mini-batches' no-grad packs (a pack's logprobs are its micro-batches', one after another)."""
        with torch.no_grad():
            for mini in plans:
                for i in range(mini.n_no_grad):
                    if i >= len(mini.no_grad):  # keeps the ranks' collectives in step
                        self.forward(module, self.dummy(), with_entropy=False)
                        continue
                    pack, parts = mini.no_grad[i]
                    logprobs, _ = self.forward(module, pack, with_entropy=False)  # only the loss uses it
                    sizes = [len(part.behaviour_logprobs) for part in parts]
                    for part, values in zip(parts, logprobs.float().split(sizes), strict=True):
                        setattr(part, attr, values)  # stays on the device: no sync between packs
            if self.info.device.type == "cuda":  # the pass's time is its GPU work (`proximal_pass_s`...)
                torch.cuda.current_stream(self.info.device).synchronize()

    def micro_step(
        self, mb: PackedMicroBatch | None, denom: float, weights: dict[str, float], first_update: bool
    ) -> None:
        """Forward, loss and backward of one micro-batch (None: a dummy); its metrics into `weights`."""
        real = mb is not None
        mb = mb if real else self.dummy()
        logprobs, entropy = self.forward(self.model, mb)
        dev = logprobs.device
        prox = mb.proximal_logprobs
        if self.cfg.algo.proximal == "detached" or (self.cfg.algo.proximal == "recompute" and first_update):
            prox = logprobs.detach()
        batch = TokenBatch(
            logprobs=logprobs,
            behaviour_logprobs=_to(mb.behaviour_logprobs, dev),
            advantages=_to(mb.advantages, dev),
            seq_index=_to(mb.seq_index, dev),
            num_seqs=len(mb.samples),
            proximal_logprobs=_to(prox, dev),
            ref_logprobs=_to(mb.ref_logprobs, dev),
            entropy=entropy,
        )
        loss, m = policy_loss(self.cfg.loss, batch, denom)
        scale = float(self.info.world_size) if real else 0.0
        (loss * scale).backward()
        if not real:
            return
        n = float(mb.behaviour_logprobs.numel())  # the loss's tokens (m["num_tokens"], read without a sync)
        weights["n"] += n
        weights["tokens"] += mb.packed.sequence_tokens  # the samples' own, whether prompts are shared or not
        weights["computed_tokens"] += mb.num_tokens  # what the row computed (the FLOPs count these)
        layers, hidden = self.text_config.num_hidden_layers, self.text_config.hidden_size
        weights["flops"] += train_flops(
            self.n_lm_params, layers, hidden, mb.num_tokens, mb.packed.causal_area()
        )
        for key in SUMMED:  # tensors on the device: summed there, read once a step (`summarise`)
            if key in m:
                weights[key] = weights[key] + m[key] * n
        if first_update:
            self.fresh_mismatch(mb, batch, weights)

    def fresh_mismatch(self, mb: PackedMicroBatch, batch: TokenBatch, weights: dict[str, float]) -> None:
        """k3 KL between the generator's and the learner's logprobs over the tokens of samples sampled by
        exactly the weights this forward runs (version_start == version_end == the current version): the
        engine mismatch alone, without the policy change that staleness adds to `mismatch_kl`."""
        now = self.version
        fresh = [s.version_start == now and s.version_end in (-1, now) for s in mb.samples]
        if not any(fresh):
            return
        with torch.no_grad():
            mask = torch.tensor(fresh).to(batch.seq_index.device, non_blocking=True)[batch.seq_index]
            kl = behaviour_kl(batch.logprobs.float(), batch.behaviour_logprobs.float())
            lengths = [s.loss_tokens for s in mb.samples]
            weights["fresh_tokens"] += float(sum(n for n, f in zip(lengths, fresh, strict=True) if f))
            weights["fresh_kl"] = weights["fresh_kl"] + torch.where(mask, kl, 0.0).sum()


def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """`t` on `device` without waiting: a blocking copy there would wait for the forward just launched."""
    return None if t is None else t.to(device, non_blocking=True)


def read_once(values: list) -> list[float]:
    """Floats of `values`, some of them device tensors (the step's metric sums), read in one transfer."""
    tensors = [v for v in values if torch.is_tensor(v)]
    if not tensors:
        return [float(v) for v in values]
    read = iter(torch.stack([t.detach().double().reshape(()) for t in tensors]).tolist())
    return [next(read) if torch.is_tensor(v) else float(v) for v in values]
