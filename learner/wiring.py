"""Wiring of one learner run: its data (task directories), the inbox, the weight sender, the device peak.

Kept apart from the trainer so that `Learner` reads as the training loop only.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from broker.schemas import ImageRef
from learner.batching import warm_pixels
from learner.evaluation import Evaluator
from learner.feeder import PromptFeeder
from learner.inbox import Inbox

log = logging.getLogger(__name__)

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H20": 148.0, "A100": 312.0, "L40S": 362.0, "L20": 119.5}
"""Dense bf16 peak per GPU, by a substring of the device name (for MFU)."""


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


def task_images(task_dir: str):
    """`ref -> bytes` reading a task directory's images (sha256-checked)."""
    from tasks.records import read_image_bytes

    return lambda ref: read_image_bytes(task_dir, ref)


def task_records(task_dir: str, split: str) -> list:
    """The PromptRecords of one split of a task directory ([] when the directory is not given)."""
    if not task_dir:
        return []
    from tasks.records import read_records

    path = Path(task_dir) / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: write the task with `python -m tasks ...` first")
    return list(read_records(task_dir, split))


def build_inbox(learner) -> Inbox:
    """Rank 0's inbox with the feeder (when training data is configured) and the evaluator."""
    cfg = learner.cfg
    feeder = evaluator = None
    if cfg.feeder.train_data:
        test_dir = cfg.feeder.test_data or cfg.feeder.train_data
        images = task_images(cfg.feeder.train_data)
        if test_dir != cfg.feeder.train_data:
            images = _either(images, task_images(test_dir))
        feeder = PromptFeeder(
            learner.transport,
            learner.names,
            task_records(cfg.feeder.train_data, "train"),
            images,
            groups_per_step=cfg.algo.groups_per_step,
            max_staleness=cfg.algo.max_staleness,
            ahead=cfg.feeder.prompts_ahead,
            epochs=cfg.feeder.epochs,
            shuffle=cfg.feeder.shuffle,
            seed=cfg.seed,
        )
        tests = task_records(test_dir, "test") if (Path(test_dir) / "test.jsonl").is_file() else []
        if cfg.eval.every > 0 and tests:
            evaluator = Evaluator(feeder, tests, cfg.eval)
    return Inbox(
        learner.transport,
        learner.names,
        cfg,
        feeder=feeder,
        evaluator=evaluator,
        registry=learner.registry,
        vocab_size=learner.hf.config.text_config.vocab_size,
        image_token_id=learner.image_token_id,
        check_image=lambda ref: warm_pixels(learner.pixels, ref, learner.images.get),
        on_skip=lambda reason: learner.metrics.skipped.labels(reason=reason).inc(),
    )


def _either(first, second):
    """An image reader that tries `first`, then `second` (train and test images may live apart)."""

    def read(ref: ImageRef) -> bytes:
        try:
            return first(ref)
        except FileNotFoundError:
            return second(ref)

    return read


def build_sender(learner):
    """The weight sender of `learner` (started on rank 0, announced on the broker), or a NullSender
    when weight sync is off."""
    cfg = learner.cfg.weight_sync
    if not cfg.enabled:
        return NullSender()
    import weights
    from weights.follow import broker_publisher

    if cfg.transport.type == "cuda-ipc" and learner.info.world_size != 1:
        raise ValueError(
            f"weight_sync.transport cuda-ipc needs a one-rank learner (this one has "
            f"{learner.info.world_size} ranks); use broadcast"
        )
    sender = weights.sender(
        cfg,
        publish=broker_publisher(learner.transport, learner.names),
        rank=learner.info.rank,
        device=learner.info.device,
    )
    sender.start()
    return sender
