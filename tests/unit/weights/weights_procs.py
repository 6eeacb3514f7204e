"""What the weight-sync tests share: a small mixed-dtype model, digests, and the bodies of the
generator / learner processes that the tests start with multiprocessing (spawn).

Child processes report through files (one JSON line per delivered version), never pickle.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

import weights
from weights.broadcast_sender import BroadcastSender
from weights.config import BroadcastTransport, WeightReceiverConfig, WeightSenderConfig
from weights.manifest import checkpoint_names, module_loader, named_tensors
from weights.protocol import Announcement, decode, encode


class Net(nn.Module):
    """fp32 and bf16 parameters, a tied weight, an int64 buffer and a non-persistent buffer."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(64, 32)
        self.proj = nn.Linear(32, 48)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight
        self.scale = nn.Parameter(torch.randn(48).to(torch.bfloat16))
        self.register_buffer("steps", torch.tensor(seed, dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(4), persistent=False)


def perturb(model: nn.Module, amount: float) -> None:
    """Change every floating tensor (and bump integer buffers) so versions differ."""
    with torch.no_grad():
        for _, t in named_tensors(model):
            if t.is_floating_point():
                t.add_(amount)
            else:
                t.add_(1)


def digest(model: nn.Module) -> str:
    """sha256 over (checkpoint name, dtype, shape, raw bytes) of every transferred tensor."""
    names = checkpoint_names(model)
    h = hashlib.sha256()
    for name, t in sorted(named_tensors(model), key=lambda kv: names[kv[0]]):
        h.update(f"{names[name]}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def read_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_until(predicate, timeout_s: float = 120.0, what: str = "condition"):
    """The predicate's first truthy value; spawned processes start slowly on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _load_model(kind: str):
    if kind == "net":
        return Net(seed=123)
    from policy.loading import load_model

    return load_model(kind, dtype="float32", device="cpu")


def announced_config(announcement: bytes | Announcement, **kwargs) -> WeightReceiverConfig:
    """A generator's config joining the learner of `announcement` (its msgpack bytes, or itself)."""
    if isinstance(announcement, bytes):
        announcement = decode(announcement, Announcement)
    return WeightReceiverConfig(
        transport=announcement.transport, address=announcement.address, token=announcement.token, **kwargs
    )


def file_resolver(path: Path):
    """A `resolve` callback reading an announcement that a learner wrote to `path`."""
    return lambda: decode(path.read_bytes(), Announcement) if path.exists() else None


def generator_main(
    announcement: bytes, generator_id: str, out_dir: str, model: str = "net", timeout_s: float = 10.0
) -> None:
    """A generator: receive versions into its own model, append {version, digest} to <out_dir>/<id>.jsonl.

    `model` is "net" (weights_procs.Net) or a checkpoint directory. Stops when <out_dir>/stop exists.
    """
    target = _load_model(model)
    loader = module_loader(target)
    out = Path(out_dir) / f"{generator_id}.jsonl"

    def apply(tensors, version):
        loader(tensors, version)
        with out.open("a") as f:
            f.write(json.dumps({"version": version, "digest": digest(target)}) + "\n")

    config = announced_config(announcement, timeout_s=timeout_s, retry_s=0.2)
    receiver = weights.receiver(config, generator_id, apply=apply)
    receiver.start()
    while not (Path(out_dir) / "stop").exists():
        time.sleep(0.05)
    receiver.close()


class DyingSender(BroadcastSender):
    """Exits the process right after launching the first bucket of version `die_at`."""

    die_at = -1
    _version = -1

    def sync(self, model, version, step=0):
        self._version = version
        return super().sync(model, version, step)

    def _launch(self, members, buf):
        works = super()._launch(members, buf)
        if self._version == self.die_at:
            time.sleep(0.2)
            os._exit(3)
        return works


def dying_learner_main(address_file: str, out_dir: str, bucket_mb: float) -> None:
    """Learner that syncs version 1 to the first generator that joins, then dies inside version 2.

    Writes its announcement to `address_file` and the digests of versions 1 and 2 to <out_dir>/learner.json.
    """
    sender = DyingSender(
        WeightSenderConfig(transport=BroadcastTransport(bucket_mb=bucket_mb), timeout_s=10.0)
    )
    sender.die_at = 2
    model = Net(seed=0)
    model_v2 = copy.deepcopy(model)
    perturb(model_v2, 1.0)
    Path(out_dir, "learner.json").write_text(json.dumps({"1": digest(model), "2": digest(model_v2)}))
    Path(address_file).write_bytes(encode(sender.start()))
    wait_until(lambda: sender.members(), what="a generator to join")
    sender.sync(model, 1)
    wait_until(lambda: sender.members().get("gen") == 1, what="version 1 confirmed")
    sender.sync(model_v2, 2)  # exits after the first bucket


def fsdp_learner_main(rank: int, init_port: int, model_dir: str, address_file: str) -> None:
    """One of two FSDP2 (gloo) training ranks: shard the tiny model, sync version 1 to the generator."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from policy.loading import load_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{init_port}", rank=rank, world_size=2)
    model = load_model(model_dir)
    perturb(model, 0.25)
    for layer in model.model.language_model.layers:
        fully_shard(layer)
    fully_shard(model)
    sender = weights.sender(
        WeightSenderConfig(transport=BroadcastTransport(bucket_mb=0.5), timeout_s=20.0), rank=rank
    )
    if rank == 0:
        Path(address_file).write_bytes(encode(sender.start()))
        wait_until(lambda: sender.members(), what="a generator to join")
    dist.barrier()
    report = sender.sync(model, 1)
    if rank == 0:
        assert report.sent_to == ["gen"], report
        wait_until(lambda: sender.members().get("gen") == 1, what="version 1 confirmed")
    dist.barrier()
    sender.close()
    dist.destroy_process_group()


def gpu_generator_main(announcement: bytes, generator_id: str, out_dir: str, device: str) -> None:
    """A generator receiving onto `device` (poll mode); appends {version, digest} per version."""
    receiver = weights.receiver(announced_config(announcement, timeout_s=60.0), generator_id, device=device)
    receiver.start()
    out = Path(out_dir) / f"{generator_id}.jsonl"
    while not (Path(out_dir) / "stop").exists():
        received = receiver.poll()
        if received is None:
            time.sleep(0.01)
            continue
        h = hashlib.sha256()
        for name, t in sorted(received.named_tensors(), key=lambda kv: kv[0]):
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        with out.open("a") as f:
            f.write(
                json.dumps(
                    {
                        "version": received.version,
                        "digest": h.hexdigest(),
                        "device": str(received.buffers[0].device),
                    }
                )
                + "\n"
            )
        receiver.mark_served(received.version)
    receiver.close()
