"""Parallax weight sync: the only code that moves policy versions from the learner to the generators.

`weights.sender(cfg, ...)` and `weights.receiver(cfg, ...)` return the `WeightSender` /
`WeightReceiver` (weights/interface.py) of the configured transport (the learner's
`weights.config.WeightSenderConfig.transport`, a generator's `WeightReceiverConfig`):
    broadcast   bucketed collectives on a 2-rank group per generator: NCCL between GPUs, gloo on CPU
                (weights/broadcast_sender.py, weights/broadcast_receiver.py);
    cuda-ipc    one packed buffer on the learner's GPU, read in place by generators on this host
                (weights/ipc_sender.py, weights/ipc_receiver.py).
A LoRA-adapted model travels as its adapter alone (weights/adapter.py: same transports, a manifest of kind
"adapter"). Shared by both: the wire (weights/protocol.py), packed layouts and views
(weights/manifest.py), copies in place (weights/inplace.py), the token-checked rendezvous
(weights/rendezvous.py, weights/membership.py), the broker announcement (weights/follow.py) and applying a
version to vLLM (weights/vllm_apply.py, in vLLM's worker weights/vllm_worker.py). Nothing is imported
until a factory is called. The factories take a checked config: each process validates
its config once, where it loads it (runtime.config.load_config / from_dict). How this compares with
vLLM's own weight-transfer engines (`vllm.distributed.weight_transfer`), and why both transports are
ours: docs/weights.md.

    sender = weights.sender(cfg.weight_sync, publish=broker_publisher(transport, names), device=device)
    sender.start()
    sender.sync(model, version=step, step=step)            # after each optimizer step

    receiver = weights.receiver(cfg.weight_sync, "gen-0", resolve=broker_resolver(transport, names)).start()
    if (received := receiver.poll()) is not None:           # between engine steps
        engine.apply_weights(received, received.version)
        receiver.mark_served(received.version)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weights.config import TRANSPORTS, WeightReceiverConfig, WeightSenderConfig

if TYPE_CHECKING:
    from weights.interface import ApplyFn, Resolve, WeightReceiver, WeightSender
    from weights.membership import Publish

__all__ = ["TRANSPORTS", "WeightReceiverConfig", "WeightSenderConfig", "sender", "receiver"]


def sender(
    cfg: WeightSenderConfig, *, publish: Publish | None = None, rank: int = 0, device="cpu"
) -> WeightSender:
    """The learner's sender of `cfg.transport` (not started). `rank`: this training rank (0 sends);
    `device`: the learner's device (cuda -> NCCL / cuda-ipc; cpu -> gloo). `cfg` is checked where it is
    loaded (runtime.config)."""
    if cfg.transport.type == "broadcast":
        from weights.broadcast_sender import BroadcastSender

        return BroadcastSender(cfg, publish=publish, rank=rank, device=device)
    import torch

    if torch.device(device).type != "cuda":
        raise ValueError("weight_sync.transport cuda-ipc needs the learner on a CUDA GPU")
    from weights.ipc_sender import IpcSender

    return IpcSender(cfg, publish=publish, rank=rank, device=device)


def receiver(
    cfg: WeightReceiverConfig,
    generator_id: str,
    *,
    resolve: Resolve | None = None,
    apply: ApplyFn | None = None,
    version: int = -1,
    device: str = "cpu",
) -> WeightReceiver:
    """A generator's receiver (not started): of `cfg.transport` with an explicit `cfg.address`, else one
    that follows the transport the learner announces through `resolve`. `cfg` is checked where it is
    loaded (runtime.config); an unknown transport name is refused when the receiver is made."""

    def make(transport: str, resolve_inner: Resolve | None, served: int, apply_fn=None) -> WeightReceiver:
        kwargs = dict(resolve=resolve_inner, apply=apply_fn, version=served, device=device)
        if transport == "broadcast":
            from weights.broadcast_receiver import BroadcastReceiver

            return BroadcastReceiver(cfg, generator_id, **kwargs)
        if transport == "cuda-ipc":
            from weights.ipc_receiver import IpcReceiver

            return IpcReceiver(cfg, generator_id, **kwargs)
        raise ValueError(f"unknown weight-sync transport {transport!r} (known: {TRANSPORTS})")

    if cfg.address:
        return make(cfg.transport, resolve, version, apply)
    if resolve is None:
        raise ValueError("weight_sync.address is empty and no resolve callback was given")
    from weights.follow import FollowingReceiver

    def make_started(transport: str, resolve_inner: Resolve, served: int) -> WeightReceiver:
        return make(transport, resolve_inner, served).start()  # the following receiver runs any apply loop

    return FollowingReceiver(
        cfg, generator_id, resolve=resolve, make=make_started, version=version, apply=apply
    )
