"""The learner's metrics: Prometheus series (docs/metrics.md, rank 0) and a JSONL log per step.

`LearnerMetrics.log_step(values)` appends one JSON line to `<run_dir>/metrics.jsonl` (a NaN
value, e.g. mismatch_kl_fresh on a step without fresh samples, is left out: strict JSON has no NaN), hands
the same values to the experiment trackers `metrics.sinks` names (TensorBoard, W&B: trackers/sinks.py) and
sets the matching gauges; counters and the staleness histogram are fed where the events
happen. `flops_per_token` / `mfu` estimate model FLOPs utilisation for the language model
(6·N per token plus causal attention), given the device's peak FLOP/s. `track_gpu_peak` / `gpu_peak`
give a step's high-water mark of GPU memory (what the learner's share of a shared GPU must hold).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from trackers.sinks import Sinks

if TYPE_CHECKING:
    from runtime.metrics import MetricsConfig

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
SYNC_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

_GAUGES = {
    # JSONL key -> (metric name, help)
    "step": ("parallax_learner_step", "optimizer steps done"),
    "version": ("parallax_learner_version", "policy version last published to the generators"),
    "reward_mean": ("parallax_learner_reward_mean", "mean reward of the last step's samples"),
    "accuracy": ("parallax_learner_accuracy", "mean accuracy of the last step's samples"),
    "mismatch_kl": ("parallax_learner_mismatch_kl", "behaviour-vs-learner KL (k3), last step"),
    "clipped_frac": ("parallax_learner_clip_fraction", "fraction of response tokens clipped, last step"),
    "masked_frac": (
        "parallax_learner_masked_fraction",
        "fraction of response tokens masked by the correction",
    ),
    "entropy": ("parallax_learner_entropy", "mean token entropy, last step"),
    "grad_norm": ("parallax_learner_grad_norm", "global gradient norm before clipping, last step"),
    "mfu": ("parallax_learner_mfu", "model FLOPs utilisation of the last step (0 when unknown)"),
    "gpu_peak_gb": (
        "parallax_learner_gpu_peak_gb",
        "peak GPU memory allocated in the last step, GB (GPU only)",
    ),
}


class LearnerMetrics:
    """Prometheus series and the JSONL step log of one learner (only rank 0 writes)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        run_dir: str | Path | None,
        enabled: bool = True,
        cfg: MetricsConfig | None = None,
        config: dict | None = None,
    ):
        """`cfg`: the learner's metrics section (its `sinks`: the trackers to log to beside metrics.jsonl);
        `config`: the run's resolved config, secrets redacted (stored with a W&B run)."""
        self.registry = registry
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl" if run_dir else None
        self.gauges = {key: Gauge(name, doc, registry=registry) for key, (name, doc) in _GAUGES.items()}
        self.tokens = Counter(
            "parallax_learner_tokens", "tokens through the training forward", registry=registry
        )
        self.staleness = Histogram(
            "parallax_learner_staleness",
            "learner version minus sample version_start",
            buckets=STALENESS_BUCKETS,
            registry=registry,
        )
        self.sync_seconds = Histogram(
            "parallax_learner_weight_sync_seconds",
            "one weight broadcast",
            buckets=SYNC_BUCKETS,
            registry=registry,
        )
        self.eval_accuracy = Gauge(
            "parallax_learner_eval_accuracy",
            "accuracy of the last evaluation",
            ["data_source"],
            registry=registry,
        )
        self.skipped = Counter(
            "parallax_learner_skipped_groups", "groups not trained on", ["reason"], registry=registry
        )
        for reason in (
            "zero_variance",
            "stale",
            "duplicate",
            "redelivered",
            "unexpected",
            "empty",
            "malformed",
            "nonfinite",
        ):
            self.skipped.labels(reason=reason)
        self.sinks = None
        if self.path is not None and enabled:
            self.sinks = Sinks.open(self.path.parent, cfg, config)

    def log_step(self, values: dict[str, float]) -> None:
        """Set the gauges of `values`, append them as one JSON line (with a timestamp) and hand them to the
        trackers."""
        if not self.enabled:
            return
        for key, gauge in self.gauges.items():
            if key in values:
                gauge.set(values[key])
        for key, value in values.items():
            if key.startswith("eval/accuracy/"):
                self.eval_accuracy.labels(data_source=key.removeprefix("eval/accuracy/")).set(value)
        if self.sinks is not None:
            self.sinks.log(values)

    def log_trained(self, step: int, group_ids: list[str]) -> None:
        """Append the group ids one step trained on to trained.jsonl (next to metrics.jsonl): an
        audit trail of which groups went into which step (after a restart from a checkpoint the
        steps past it appear again, with what they trained this time)."""
        if self.enabled and self.path is not None:
            line = {"time": time.time(), "step": step, "groups": group_ids}
            with open(self.path.with_name("trained.jsonl"), "a") as f:
                f.write(json.dumps(line) + "\n")

    def close(self) -> None:
        """Flush and close the trackers (a W&B run is finished)."""
        if self.sinks is not None:
            self.sinks.close()


def lm_param_count(hf_model) -> int:
    """Parameters of the language model without the input embedding (the 6·N of MFU)."""
    inner = getattr(hf_model, "model", hf_model)
    lm = getattr(inner, "language_model", inner)
    total = sum(p.numel() for p in lm.parameters())
    embed = getattr(lm, "embed_tokens", None)
    head = getattr(hf_model, "lm_head", None)
    total -= embed.weight.numel() if embed is not None else 0
    total += head.weight.numel() if head is not None else 0
    return total


def train_flops(n_params: int, num_layers: int, hidden: int, tokens: int, causal_area: int) -> float:
    """Forward + backward model FLOPs of a packed row of `tokens`: 6·N·T plus attention over
    `causal_area` query-key pairs (policy.packing.PackedBatch.causal_area: s^2 per sequence of s tokens)."""
    return 6.0 * n_params * tokens + 6.0 * num_layers * hidden * causal_area


def mfu(flops: float, seconds: float, peak_flops: float, world_size: int = 1) -> float:
    """Model FLOPs utilisation (0 when the peak is unknown)."""
    if peak_flops <= 0 or seconds <= 0:
        return 0.0
    return flops / (seconds * peak_flops * max(world_size, 1))


def track_gpu_peak(device: torch.device) -> None:
    """Start a new high-water mark of the memory allocated on `device`, and a new count of the caching
    allocator's retries (nothing off CUDA)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)


def gpu_peak(device: torch.device) -> dict[str, float]:
    """On CUDA, since `track_gpu_peak`: {"gpu_peak_gb": GB allocated at most, "gpu_alloc_retries": times
    the caching allocator found no free block, emptied its cache and asked the driver again (each one
    synchronises the device: a learner squeezed beside vLLM shows it here)}; {} elsewhere."""
    if device.type != "cuda":
        return {}
    retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    return {"gpu_peak_gb": torch.cuda.max_memory_allocated(device) / 1e9, "gpu_alloc_retries": float(retries)}
