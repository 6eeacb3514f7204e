"""The learner-step bench's workload and measurements: synthetic scored groups, the padded baseline, timers.

Used by bench/learner_step.py (run that). `GroupMaker` writes fresh random 448x448 PNGs to the
broker's image store and builds ScoredGroups in the reference workload's shapes (one image and
~96 text tokens per prompt, forced-length random responses, behaviour logprobs near a random
model's, rewards with variance in every group), versioned at the learner's current step so none
is stale. `run_padded` trains the same kind of groups with transformers' padded forward.
"""

from __future__ import annotations

import gc
import io
import random
import statistics
import time
import uuid

import numpy as np
import torch

from bench.common import param_counts, preset_name
from learner.metrics import mfu

HOLD: dict[str, int] = {"bytes": 0}
"""Bytes of GPU memory held back for a co-located generator (subtracted from the peaks)."""


class GroupMaker:
    """Fresh ScoredGroups for one learner (see the module docstring)."""

    def __init__(self, images, processor, cfg, seed: int = 0):
        self.images, self.processor, self.cfg = images, processor, cfg
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        tok = processor.tokenizer
        self.pad = tok.convert_tokens_to_ids("<|image_pad|>")
        self.start = tok.convert_tokens_to_ids("<|vision_start|>")
        self.end = tok.convert_tokens_to_ids("<|vision_end|>")
        # below every added token (Qwen's specials from 151643; a local tokenizer's image pad among them):
        # a random id that is the image pad would make a prompt with more pads than images
        self.vocab = min([len(tok), 151643, *tok.get_added_vocab().values()])

    def _png(self) -> bytes:
        from PIL import Image

        side = self.cfg.image_side
        pixels = self.np_rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)
        return buf.getvalue()

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(30, self.vocab) for _ in range(n)]

    def groups(self, n: int, version: int) -> list:
        from broker.schemas import Rollout, RolloutGroup, Score, ScoredGroup

        out = []
        cfg = self.cfg
        for _ in range(n):
            ref = self.images.put(self._png())
            before = self.rng.randint(4, max(cfg.text - 7, 4))
            prompt = self._ids(before) + [self.start, self.pad, self.end] + self._ids(cfg.text - before - 3)
            rewards = [float(self.rng.random() < 0.5) for _ in range(cfg.group_size)]
            rewards[0], rewards[-1] = 1.0, 0.0  # never zero variance
            samples = [
                Rollout.of(
                    token_ids=self._ids(cfg.response),
                    logprobs=(-12.0 + self.np_rng.standard_normal(cfg.response)).astype("f4"),
                    response_text="",
                    version_start=version,
                    version_end=version,
                    finish_reason="length",
                )
                for _ in rewards
            ]
            group = RolloutGroup(
                group_id=uuid.uuid4().hex,
                prompt_id=uuid.uuid4().hex[:8],
                data_source="synthetic",
                prompt_token_ids=prompt,
                images=[ref],
                ground_truth="",
                samples=samples,
                temperature=1.0,
            )
            scores = [Score(reward=r, accuracy=r, format=1.0) for r in rewards]
            out.append(ScoredGroup(group=group, scores=scores))
        return out


class Timers:
    """Seconds spent in the wrapped learner methods during one step (GPU work synchronised)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, {}

    def wrap(self, key: str, fn):
        def timed(*args, **kwargs):
            sync(self.device)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync(self.device)
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0

        return timed

    def clear(self) -> None:
        self.seconds = {}

    def totals(self) -> dict[str, float]:
        return {f"{k}_s": v for k, v in self.seconds.items()}


def attach_timers(learner) -> Timers:
    """Time the learner's optimizer steps and no-grad passes (instance attributes; the code is its own)."""
    timers = Timers(learner.info.device)
    learner.optimizer.step = timers.wrap("optimizer", learner.optimizer.step)
    learner.updater.no_grad_pass = timers.wrap("no_grad", learner.updater.no_grad_pass)
    return timers


def summarise(rows: list[dict], n_lm: int, peak_tflops: float) -> dict:
    step = statistics.median(r["train_s"] for r in rows)
    tokens = statistics.median(r["tokens"] for r in rows)
    computed = statistics.median(r.get("computed_tokens", r["tokens"]) for r in rows)  # fewer: shared prompts
    tps = tokens / step
    train_pass = statistics.median(r.get("train_pass_s", 0.0) for r in rows)  # the learner's; 0 elsewhere

    def lm_mfu(seconds: float) -> float:  # 6 x N_LM x computed tokens over `seconds` (0 when not timed)
        return round(mfu(6 * n_lm * computed, seconds, peak_tflops * 1e12), 4)

    return {
        "n_lm": n_lm,
        "tokens_per_step": int(tokens),
        "computed_tokens_per_step": int(computed),
        "step_s": round(step, 3),
        "seconds": [round(r["train_s"], 3) for r in rows],
        "tokens_per_s": round(tps, 1),
        "lm_mfu": lm_mfu(step),
        "train_pass_s": round(train_pass, 3),
        "pass_lm_mfu": lm_mfu(train_pass),
        "optimizer_s": round(statistics.median(r.get("optimizer_s", 0.0) for r in rows), 3),
        "no_grad_s": round(statistics.median(r.get("no_grad_s", 0.0) for r in rows), 3),
    }


def memory(device: torch.device, optimizer=None) -> dict:
    out = {}
    if device.type == "cuda":
        out["peak_gb"] = round((torch.cuda.max_memory_allocated(device) - HOLD["bytes"]) / 1e9, 1)
        out["peak_reserved_gb"] = round((torch.cuda.max_memory_reserved(device) - HOLD["bytes"]) / 1e9, 1)
    state = getattr(optimizer, "state_bytes", None)
    if state is not None:
        out["host_state_gb"] = round(state().get("cpu", 0) / 1e9, 1)
        out["device_state_gb"] = round(state().get("cuda", 0) / 1e9, 1)
    return out


def reserve(device: str, frac: float):
    """Hold `frac` of the GPU's memory (a co-located generator's share) until the tensor is dropped."""
    if device != "cuda" or frac <= 0:
        return None
    total = torch.cuda.get_device_properties(0).total_memory
    hold = torch.empty(int(total * frac), dtype=torch.uint8, device="cuda")
    HOLD["bytes"] = hold.numel()
    return hold


def gpu_memory_gb(device: str) -> float:
    return round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1) if device == "cuda" else 0.0


def checkpoint(model: str, out, device: str):
    """A random-weight checkpoint directory of the bench model (policy/presets.py shapes)."""
    from policy.builder import build_checkpoint

    return build_checkpoint(preset_name(model), seed=0, out=out, device=device)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def reset_peak(device) -> None:
    sync(device)
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def cleanup() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def speedups(variants: dict) -> None:
    base = variants.get("padded", {}).get("tokens_per_s")
    for r in variants.values():
        if base and "tokens_per_s" in r:
            r["speedup_vs_padded"] = round(r["tokens_per_s"] / base, 2)


# ---------------------------------------------------------------------------------------------- padded
def run_padded(cfg, model_dir, transport, peak_tflops: float, micro: int = 8) -> dict:
    """transformers' padded forward (SDPA + mask, full recomputation, full-vocabulary fp32 log-softmax),
    bf16 weights and fused bf16 AdamW, the learner's PPO loss; micro-batches of `micro` samples."""
    from broker.images import ImageStore
    from broker.names import Names
    from policy.loading import load_model, load_processor
    from policy.packing import PixelCache, make_sample
    from policy.synthetic import padded_batch, padded_logprobs

    device = torch.device(cfg.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    model = load_model(model_dir, dtype=dtype, device=device).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    processor = load_processor(model_dir)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-6, fused=device.type == "cuda", foreach=device.type != "cuda"
    )
    images = ImageStore(transport, Names("bench-learner-step"))
    make = GroupMaker(images, processor, cfg, seed=1)
    cache = PixelCache(processor.image_processor)
    image_token = model.config.image_token_id

    def batches(groups):
        samples = [
            make_sample(
                g.group.prompt_token_ids,
                s.token_ids().tolist(),
                [(r.sha256, images.get(r)) for r in g.group.images],
                cache,
                image_token,
            )
            for g in groups
            for s in g.group.samples
        ]
        return [
            padded_batch(samples[i : i + micro], model.config, device) for i in range(0, len(samples), micro)
        ]

    def step(groups) -> tuple[float, int]:
        sync(device)
        t0 = time.perf_counter()
        parts = batches(groups)
        n_resp = sum(int(b["response_mask"].sum()) for b in parts)
        for b in parts:
            logprobs = padded_logprobs(model, b)
            _ppo_loss(logprobs, b["response_mask"][:, 1:], n_resp).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        return time.perf_counter() - t0, sum(b["tokens"] for b in parts)

    step(make.groups(min(cfg.warmup_groups, 2), 0))
    reset_peak(device)
    rows = []
    for _ in range(cfg.steps):
        seconds, tokens = step(make.groups(cfg.padded_groups, 0))
        rows.append({"train_s": seconds, "tokens": tokens})
    out = summarise(rows, param_counts(model)["n_lm"], peak_tflops) | memory(device)
    out["micro_batch_samples"] = micro
    return out  # the caller's cleanup() frees the model once this frame is gone


def _ppo_loss(logprobs: torch.Tensor, resp: torch.Tensor, denom: int) -> torch.Tensor:
    """The learner's PPO-clip loss on these tokens (behaviour = detached + 0.01, random advantages)."""
    from learner.config import LossConfig
    from learner.losses import TokenBatch, policy_loss

    seq_index = torch.arange(resp.shape[0], device=resp.device).unsqueeze(1).expand_as(resp)[resp]
    gen = torch.Generator().manual_seed(0)
    adv = torch.randn(resp.shape[0], generator=gen).to(logprobs.device)[seq_index]
    batch = TokenBatch(
        logprobs=logprobs,
        behaviour_logprobs=logprobs.detach() + 0.01,
        advantages=adv,
        seq_index=seq_index,
        num_seqs=resp.shape[0],
    )
    loss, _ = policy_loss(LossConfig(), batch, float(denom))
    return loss
