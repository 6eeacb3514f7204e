"""The `[weight_sync]` sections: `WeightSenderConfig` (learner) and `WeightReceiverConfig` (generator).

Each side has only its own settings, and the learner's transport is a variant holding only that
transport's settings (runtime/variants.py), so one TOML table and one set of flags configure it:

    [weight_sync.transport]            # learner.toml; deploy's files: [learner.weight_sync.transport]
    type = "cuda-ipc"
    params_in_buffer = false

    python -m learner --weight-sync.transport.type cuda-ipc --weight-sync.transport.no-params-in-buffer
    python -m learner --weight-sync.transport.type broadcast --weight-sync.transport.bucket-mb 64

A generator follows the transport the learner announces on the broker; its own `transport` (a name)
counts only with an explicit `address`. Nothing here imports torch: entry points parse their config
before torch is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal, get_args

from runtime.variants import choices_shown

WeightTransport = Literal["broadcast", "cuda-ipc"]
"""The two ways weights travel; the same names in config, code, bench flags, docs and metrics labels."""
TRANSPORTS: tuple[str, ...] = get_args(WeightTransport)
TRANSPORT_TYPES = choices_shown(*TRANSPORTS)
RPC_BYTES_LIMIT = 2**32 - 2**24
"""Largest safetensors blob one collective_rpc to vLLM's worker may carry: msgpack refuses a bytes object
of 2**32 bytes or more; 16 MiB are left for the safetensors header (`EngineConfig.rpc_chunk_bytes`)."""


@dataclass
class BroadcastTransport:
    """broadcast: bucketed collectives on a weights-only process group per generator (NCCL between GPUs, gloo
    on CPU or on a shared GPU); any number of generators on any hosts."""

    type: Annotated[Literal["broadcast"], TRANSPORT_TYPES] = "broadcast"
    """The weight transport; each has its own settings (`--help` after the type lists the chosen one's)."""
    bucket_mb: float = 256.0
    """Size of one packed bucket in MiB; each bucket is one collective per generator."""
    checksums: bool = True
    """Send a checksum per bucket; a generator rejects a version that does not match."""
    keep_last: bool = True
    """Keep the last version packed on the learner, so that a (re)joining generator gets it at once."""

    def validate(self) -> None:
        if self.bucket_mb * 2**20 < 16:
            raise ValueError(f"bucket_mb must hold at least 16 bytes, not {self.bucket_mb}")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)


@dataclass
class CudaIpcTransport:
    """cuda-ipc: one packed buffer on the learner's GPU that generators on the same host read in place; needs
    a one-rank learner on CUDA."""

    type: Annotated[Literal["cuda-ipc"], TRANSPORT_TYPES] = "cuda-ipc"
    """The weight transport; each has its own settings (`--help` after the type lists the chosen one's)."""
    params_in_buffer: bool = True
    """The learner's bf16 parameters live in the shared buffer: the GPU holds the weights once and a sync
    copies nothing, but AdamW's writes wait for a generator still reading (docs/memory.md)."""
    lock_timeout_s: float = 30.0
    """A generator holding the buffer's lock longer than this is dropped (it rejoins by itself)."""
    poll_s: float = 0.002
    """How often the learner looks again while a generator holds the buffer's lock."""

    def validate(self) -> None:
        for name in ("lock_timeout_s", "poll_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, not {getattr(self, name)}")


SenderTransport = BroadcastTransport | CudaIpcTransport
SENDER_TRANSPORTS: dict[str, type] = {"broadcast": BroadcastTransport, "cuda-ipc": CudaIpcTransport}
"""Transport name -> the learner's variant of it, at its defaults."""


@dataclass
class WeightSenderConfig:
    """The learner's side: how a policy version travels to the generators (see weights/__init__.py)."""

    enabled: bool = True
    """Send weights after optimizer steps; False trains offline."""
    transport: SenderTransport = field(default_factory=BroadcastTransport)
    """How weights travel, and that transport's settings: `[weight_sync.transport] type = "cuda-ipc"`,
    `--weight-sync.transport.type cuda-ipc`. The learner announces it on the broker, and generators join
    whichever it announces."""
    host: str = "127.0.0.1"
    """The address the rendezvous binds to and announces (gloo binds its side there too). Loopback by
    default; set the learner's address on the network when generators run on other hosts."""
    port: int = 0
    """TCP port of the rendezvous; 0 picks a free one."""
    token: str = ""
    """The run's secret that a generator must present to join; peers without it are refused. "" draws a
    random one at start (announced through the broker)."""
    send_dtype: Literal["auto", "keep", "float32", "bfloat16", "float16"] = "auto"
    """dtype of floating-point tensors on the wire: "auto" (bfloat16 from a CUDA learner, each tensor's
    own dtype on CPU), "keep" (each tensor's own), or a dtype name."""
    layout: Literal["auto", "checkpoint", "vllm"] = "auto"
    """How tensors are named and packed: "checkpoint" as `save_pretrained` writes them (any engine), "vllm"
    as vLLM's Qwen2.5-VL holds them (stacked qkv_proj, gate_up_proj: one copy per parameter when applied),
    "auto": vllm for a Qwen2.5-VL model over cuda-ipc, checkpoint otherwise."""
    timeout_s: float = 60.0
    """Bound on every rendezvous step and every transfer; a generator that misses it is dropped."""

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (runtime.config checks the Literal choices)."""
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, not {self.port}")
        if not self.host:
            raise ValueError("host must name an address (127.0.0.1 for this host only)")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, not {self.timeout_s}")


@dataclass
class WeightReceiverConfig:
    """A generator's side: where it gets the learner's weights from (see weights/__init__.py)."""

    enabled: bool = True
    """Receive the learner's weights; False serves the model as loaded."""
    address: str = ""
    """The learner's rendezvous "host:port"; "" follows the learner's announcement on the broker
    (address, transport and token), read again every time the generator joins."""
    transport: WeightTransport = "broadcast"
    """With an explicit `address`: the transport the learner serves (broadcast or cuda-ipc)."""
    token: str = ""
    """With an explicit `address`: the run's secret the learner was given."""
    timeout_s: float = 60.0
    """Bound on every rendezvous step and every transfer."""
    connect_timeout_s: float = 2.0
    """Bound on one attempt to reach the rendezvous (a learner that is down is retried)."""
    retry_s: float = 1.0
    """Pause before joining again after a failure or a dropped session."""
    poll_s: float = 0.002
    """How often a waiting receiver looks for a new version."""

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (runtime.config checks the Literal choices)."""
        if self.address and self.address.rpartition(":")[0] == "":
            raise ValueError(f'address must be "host:port" or "", not {self.address!r}')
        if self.address and not self.address.rpartition(":")[2].isdigit():
            raise ValueError(f"address has no port number: {self.address!r}")
        for name in ("timeout_s", "connect_timeout_s", "retry_s", "poll_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, not {getattr(self, name)}")
