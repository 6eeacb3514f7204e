"""Builders of the learner's parts that talk to the outside: the inbox (with its data, the task directories),
the weight sender, the device's peak FLOP/s.

Each takes the config and the finished parts it needs (transport, names, metrics...), never the `Learner`:
`Learner.__init__` (learner/trainer.py) builds the parts, then assembles them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from broker.schemas import ImageRef
from learner.batching import warm_pixels
from learner.config import LearnerConfig
from learner.evaluation import Evaluator
from learner.feeder import PromptFeeder
from learner.inbox import Inbox
from learner.parallel import DistInfo
from policy.packing import PixelCache

log = logging.getLogger(__name__)

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H20": 148.0, "A100": 312.0, "L40S": 362.0, "L20": 119.5}
"""Dense bf16 peak per GPU, by a substring of the device name (for MFU)."""


def build_inbox(
    cfg: LearnerConfig, transport, names, *, model_config, images, pixels: PixelCache, metrics
) -> Inbox:
    """Rank 0's inbox with the feeder (when training data is configured) and the evaluator. `model_config`
    (the Hugging Face config) gives the vocabulary and the image pad id that groups are checked against;
    `images` (broker.images.ImageStore) and `pixels` check that a group's images load (warming rank 0's
    cache); `metrics` (learner.metrics.LearnerMetrics) counts the skipped groups."""
    feeder = evaluator = None
    if cfg.feeder.train_data:
        records, tests, image_bytes = read_task(cfg.feeder.train_data, cfg.feeder.test_data)
        feeder = PromptFeeder(
            transport,
            names,
            records,
            image_bytes,
            groups_per_step=cfg.algo.groups_per_step,
            max_staleness=cfg.algo.max_staleness,
            ahead=cfg.feeder.prompts_ahead,
            epochs=cfg.feeder.epochs,
            shuffle=cfg.feeder.shuffle,
            seed=cfg.seed,
        )
        if cfg.eval.every > 0 and tests:
            evaluator = Evaluator(feeder, tests, cfg.eval)
    return Inbox(
        transport,
        names,
        cfg,
        feeder=feeder,
        evaluator=evaluator,
        registry=metrics.registry,
        vocab_size=model_config.text_config.vocab_size,
        image_token_id=model_config.image_token_id,
        check_image=lambda ref: warm_pixels(pixels, ref, images.get),
        on_skip=lambda reason: metrics.skipped.labels(reason=reason).inc(),
    )


def read_task(train_dir: str, test_dir: str = "") -> tuple[list, list, Callable[[ImageRef], bytes]]:
    """A task directory's training records, the test records of `test_dir` (default: the same directory; []
    without a test split) and the reader of their images (`ref -> bytes`: train and test images may live
    apart)."""
    test_dir = test_dir or train_dir
    records = task_records(train_dir, "train")
    tests = task_records(test_dir, "test") if (Path(test_dir) / "test.jsonl").is_file() else []
    image_bytes = task_images(train_dir)
    if test_dir != train_dir:
        image_bytes = _either(image_bytes, task_images(test_dir))
    return records, tests, image_bytes


def task_records(task_dir: str, split: str) -> list:
    """The PromptRecords of one split of a task directory ([] when the directory is not given)."""
    if not task_dir:
        return []
    from tasks.records import read_records

    path = Path(task_dir) / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: write the task with `python -m tasks ...` first")
    return list(read_records(task_dir, split))


def task_images(task_dir: str):
    """`ref -> bytes` reading a task directory's images (sha256-checked)."""
    from tasks.records import read_image_bytes

    return lambda ref: read_image_bytes(task_dir, ref)


def _either(first, second):
    """An image reader that tries `first`, then `second` (train and test images may live apart)."""

    def read(ref: ImageRef) -> bytes:
        try:
            return first(ref)
        except FileNotFoundError:
            return second(ref)

    return read


def build_sender(cfg, info: DistInfo, transport, names):
    """The weight sender of this rank (`info`) for the learner's `weight_sync` config `cfg`: started on rank
    0, its versions announced on the broker (`transport`, `names`); a NullSender when weight sync is off."""
    if not cfg.enabled:
        return NullSender()
    import weights
    from weights.follow import broker_publisher

    if cfg.transport.type == "cuda-ipc" and info.world_size != 1:
        raise ValueError(
            f"weight_sync.transport = cuda-ipc needs a one-rank learner (this one has "
            f"{info.world_size} ranks); use broadcast"
        )
    sender = weights.sender(
        cfg,
        publish=broker_publisher(transport, names),
        rank=info.rank,
        device=info.device,
    )
    sender.start()
    return sender


class NullSender:
    """Weight sender used when no generators listen (tests, offline training)."""

    def begin_write(self) -> float:
        return 0.0

    def sync(self, model, version: int, step: int = 0):
        return None

    def close(self) -> None:
        return None


def guess_peak_flops(device: torch.device) -> float:
    """Peak FLOP/s of one device from its name; 0 when unknown (CPU)."""
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return 0.0
