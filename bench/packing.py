"""Learner forward+backward throughput: padding-free packed batches vs padded batches.

    python -m bench.packing                              (CPU: `small` preset, lengths x0.25, ~1-2 min)
    python -m bench.packing --device cuda --dtype bfloat16 --scale 1 --model /path/to/Qwen2.5-VL-3B
    python -m bench.packing --device cuda --dtype bfloat16 --scale 1 --shapes 3b   (random weights)

Samples follow a Geo3k-like length mix: 96 text + 256-1024 image + 64-1024 response tokens
(times --scale), with random ids and random pixel patches (the image grid is chosen to give the
wanted token count, so the image processor's pixel limits do not apply). Both paths score the
same samples and take the same loss (sum of response-token logprobs) with a backward pass:
  padded  transformers' forward on right-padded micro-batches of --micro-batch samples
          (attention mask, full-vocabulary logits, log_softmax, gather): the usual baseline;
  packed  policy.packing.pack + policy.forward.PackedPolicy on micro-batches of about the same
          number of real tokens, varlen attention, chunked logprobs over response tokens only.
Tokens/s counts real tokens (text + image + response) over the time of the forward+backward
passes. The first step checks that both paths give the same logprobs. Prints a table and
writes bench/results/packing.json with the packed/padded ratio.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro

from policy.forward import VISION_ATTN_NAME, PackedPolicy, set_vision_attention
from policy.packing import PackSample, pack


@dataclass
class BenchConfig:
    """`python -m bench.packing`: padded vs packed learner throughput, side by side."""

    preset: str = "small"
    """Builder preset used when --model is not given."""
    model: Path | None = None
    """An HF Qwen2.5-VL checkpoint directory (real or built); overrides --preset."""
    shapes: str | None = None
    """"3b" or "7b": random weights with the published Qwen2.5-VL shapes (no checkpoint); overrides both."""
    samples: int = 8
    """Samples per step."""
    scale: float = 0.25
    """Multiplies every length of the mix (1.0 = Geo3k-like full lengths)."""
    text_tokens: int = 96
    image_tokens: tuple[int, int] = (256, 1024)
    response_tokens: tuple[int, int] = (64, 1024)
    micro_batch: int = 4
    """Padded path: samples per forward. Packed path: about as many real tokens per forward."""
    steps: int = 2
    """Timed steps per path (after one untimed warm-up step)."""
    device: str = "cpu"
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    seed: int = 0
    out: Path = Path("bench/results/packing.json")


SHAPES = {
    "3b": dict(
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
}
"""Text-model shapes of the published Qwen2.5-VL-3B/7B-Instruct configs (vision tower shared below)."""


def model_from_shapes(name: str, dtype: str, device: str):
    """A randomly initialised Qwen2.5-VL with published shapes, built directly on `device`."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from policy.loading import resolve_dtype

    text = dict(
        SHAPES[name],
        vocab_size=151936,
        rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6},
        max_position_embeddings=128000,
        rms_norm_eps=1e-6,
        pad_token_id=151643,
    )
    vision = dict(
        depth=32,
        hidden_size=1280,
        num_heads=16,
        intermediate_size=3420,
        out_hidden_size=text["hidden_size"],
        fullatt_block_indexes=[7, 15, 23, 31],
        window_size=112,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        tokens_per_second=2,
    )
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        tie_word_embeddings=text["tie_word_embeddings"],
    )
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration(config).to(resolve_dtype(dtype))
    return model


def synth_samples(config: BenchConfig, model, rng: random.Random) -> list[PackSample]:
    """Random samples with the configured length mix; one image per sample."""
    cfg = model.config
    vocab = cfg.text_config.vocab_size
    special = {cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id}
    vision = cfg.vision_config
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    merge = vision.spatial_merge_size

    def ids(n):
        return [t for t in (rng.randrange(min(vocab, 150_000)) for _ in range(n * 2)) if t not in special][:n]

    def scaled(lo_hi):
        return rng.randint(max(1, int(lo_hi[0] * config.scale)), max(1, int(lo_hi[1] * config.scale)))

    samples = []
    for _ in range(config.samples):
        want = scaled(config.image_tokens)
        a = max(1, round(math.sqrt(want)))
        b = max(1, want // a)
        text = ids(max(4, int(config.text_tokens * config.scale)))
        prompt = (
            text[:2]
            + [cfg.vision_start_token_id]
            + [cfg.image_token_id] * (a * b)
            + [cfg.vision_end_token_id]
            + text[2:]
        )
        grid = (1, a * merge, b * merge)
        pixels = torch.randn(a * b * merge * merge, patch_dim)
        samples.append(
            PackSample(
                prompt_ids=prompt,
                response_ids=ids(scaled(config.response_tokens)),
                image_grid_thw=[grid],
                pixel_values=pixels,
            )
        )
    return samples


def padded_step(
    model, samples: list[PackSample], micro_batch: int, pad_id: int, backward: bool
) -> list[torch.Tensor]:
    """The baseline: right-padded micro-batches through the HF forward; returns per-sample logprobs."""
    device, out = model.device, []
    image_id = model.config.image_token_id
    for i in range(0, len(samples), micro_batch):
        mb = samples[i : i + micro_batch]
        length = max(len(s.prompt_ids) + len(s.response_ids) for s in mb)
        ids = torch.full((len(mb), length), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, s in enumerate(mb):
            seq = s.prompt_ids + s.response_ids
            ids[j, : len(seq)] = torch.tensor(seq)
            mask[j, : len(seq)] = 1
        ids, mask = ids.to(device), mask.to(device)
        logits = model(
            input_ids=ids,
            attention_mask=mask,
            mm_token_type_ids=(ids == image_id).long(),
            pixel_values=torch.cat([s.pixel_values for s in mb]).to(device, model.dtype),
            image_grid_thw=torch.tensor([g for s in mb for g in s.image_grid_thw], device=device),
            use_cache=False,
        ).logits
        logp = logits.float().log_softmax(-1)
        per = []
        for j, s in enumerate(mb):
            p, r = len(s.prompt_ids), len(s.response_ids)
            target = torch.tensor(s.response_ids, device=device).unsqueeze(-1)
            per.append(logp[j, p - 1 : p + r - 1].gather(-1, target).squeeze(-1))
        if backward:
            (-torch.cat(per).sum()).backward()
        out.extend(x.detach() for x in per)
        del logits, logp
    return out


def token_bins(samples: list[PackSample], budget: int) -> list[list[PackSample]]:
    """Greedy bins of consecutive samples holding at most `budget` real tokens (at least one sample each)."""
    bins, current, used = [], [], 0
    for s in samples:
        n = len(s.prompt_ids) + len(s.response_ids)
        if current and used + n > budget:
            bins.append(current)
            current, used = [], 0
        current.append(s)
        used += n
    if current:
        bins.append(current)
    return bins


def packed_step(
    policy: PackedPolicy, samples: list[PackSample], budget: int, backward: bool
) -> list[torch.Tensor]:
    """Packed micro-batches through PackedPolicy; returns per-sample logprobs."""
    out = []
    image_id = policy.image_token_id
    merge = policy.model.config.vision_config.spatial_merge_size
    for mb in token_bins(samples, budget):
        batch = pack(mb, image_id, merge).to(policy.model.device)
        batch.pixel_values = batch.pixel_values.to(policy.model.dtype)
        logprobs, _ = policy(batch, with_entropy=False)
        if backward:
            (-logprobs.sum()).backward()
        out.extend(x.detach() for x in batch.split(logprobs))
    return out


def _timed(fn, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run(config: BenchConfig) -> dict:
    from policy.builder import build_checkpoint
    from policy.loading import load_model

    if config.shapes:
        path = f"random Qwen2.5-VL-{config.shapes} shapes"
        model = model_from_shapes(config.shapes, config.dtype, config.device).train()
    else:
        path = config.model or build_checkpoint(config.preset)
        model = load_model(path, dtype=config.dtype, device=config.device).train()
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    policy = PackedPolicy(model)
    samples = synth_samples(config, model, random.Random(config.seed))
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    real_tokens = sum(lengths)
    padded_tokens = sum(
        max(lengths[i : i + config.micro_batch]) * len(lengths[i : i + config.micro_batch])
        for i in range(0, len(lengths), config.micro_batch)
    )
    budget = max(max(lengths), config.micro_batch * real_tokens // len(lengths))
    pad_id = model.config.text_config.pad_token_id or 0

    with torch.no_grad():  # correctness first: both paths give the same logprobs
        set_vision_attention(model, "sdpa")
        ref = torch.cat(padded_step(model, samples, config.micro_batch, pad_id, backward=False))
        set_vision_attention(model, VISION_ATTN_NAME)
        ours = torch.cat(packed_step(policy, samples, budget, backward=False))
    max_diff = (ref - ours).abs().max().item()

    def padded():
        set_vision_attention(model, "sdpa")  # the stock path: transformers' SDPA, one call per vision window
        return padded_step(model, samples, config.micro_batch, pad_id, backward=True)

    def packed():
        set_vision_attention(model, VISION_ATTN_NAME)
        return packed_step(policy, samples, budget, backward=True)

    paths = {"padded": padded, "packed": packed}
    times: dict[str, list[float]] = {name: [] for name in paths}
    peak: dict[str, float | None] = {}
    for name, fn in paths.items():
        fn()  # warm-up
        model.zero_grad(set_to_none=True)
        if config.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
    for _ in range(config.steps):  # interleaved, so both paths see the same machine load
        for name, fn in paths.items():
            if config.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            times[name].append(_timed(fn, config.device))
            model.zero_grad(set_to_none=True)
            peak[name] = (
                torch.cuda.max_memory_allocated() / 2**30 if config.device.startswith("cuda") else None
            )
    rows = {}
    for name in paths:
        best = min(times[name])
        rows[name] = {
            "tokens_per_s": real_tokens / best,
            "step_s": best,
            "steps_s": times[name],
            "peak_gib": peak[name],
            "forwards": len(token_bins(samples, budget))
            if name == "packed"
            else math.ceil(len(samples) / config.micro_batch),
            "computed_tokens": real_tokens if name == "packed" else padded_tokens,
        }
    result = {
        "bench": "packing",
        "config": {k: str(v) for k, v in dataclasses.asdict(config).items()},
        "model": str(path),
        "params": sum(p.numel() for p in model.parameters()),
        "device": config.device,
        "host": platform.node(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "samples": len(samples),
        "real_tokens": real_tokens,
        "padded_tokens": padded_tokens,
        "pad_fraction": 1 - real_tokens / padded_tokens,
        "packed_token_budget": budget,
        "logprob_max_abs_diff": max_diff,
        "paths": rows,
        "ratio_packed_over_padded": rows["packed"]["tokens_per_s"] / rows["padded"]["tokens_per_s"],
    }
    return result


def format_table(result: dict) -> str:
    lines = [
        f"{'path':<8} {'tokens/s':>10} {'step s':>8} {'forwards':>9} {'computed tok':>13} {'peak GiB':>9}"
    ]
    for name, row in result["paths"].items():
        peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.2f}"
        lines.append(
            f"{name:<8} {row['tokens_per_s']:>10.0f} {row['step_s']:>8.3f} {row['forwards']:>9} "
            f"{row['computed_tokens']:>13} {peak:>9}"
        )
    lines.append(
        f"packed/padded = {result['ratio_packed_over_padded']:.2f}x   pad fraction "
        f"{result['pad_fraction']:.1%}   {result['samples']} samples, {result['real_tokens']} real tokens, "
        f"{result['params'] / 1e6:.1f} M params on {result['device']}   logprob max |diff| "
        f"{result['logprob_max_abs_diff']:.1e}"
    )
    return "\n".join(lines)


def main() -> None:
    config = tyro.cli(BenchConfig)
    result = run(config)
    print(format_table(result))
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {config.out}")


if __name__ == "__main__":
    main()
