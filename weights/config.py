"""`WeightSyncConfig`: the `[weight_sync]` section that the learner and every generator share.

Both `LearnerConfig.weight_sync` and `GeneratorConfig.weight_sync` are this dataclass, so one TOML
table (`[weight_sync]`) and one set of flags (`--weight-sync.transport cuda-ipc`,
`--weight-sync.bucket-mb 64`, ...) configure either side. Each field says which side reads it.
Nothing here imports torch: entry points parse their config before torch is loaded.

    python -m learner --weight-sync.transport cuda-ipc --weight-sync.host 127.0.0.1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

WeightTransport = Literal["broadcast", "cuda-ipc"]
"""The two ways weights travel; the same names in config, code, bench flags, docs and metrics labels."""
TRANSPORTS: tuple[str, ...] = get_args(WeightTransport)
RPC_BYTES_LIMIT = 2**32 - 2**24
"""Largest safetensors blob one collective_rpc to vLLM's worker may carry: msgpack refuses a bytes object
of 2**32 bytes or more; 16 MiB are left for the safetensors header (`EngineConfig.rpc_chunk_bytes`)."""


@dataclass
class WeightSyncConfig:
    """How a policy version travels from the learner to the generators (see weights/__init__.py)."""

    enabled: bool = True
    """Learner: send weights after optimizer steps (False trains offline). Generator: receive them."""
    transport: WeightTransport = "broadcast"
    """"broadcast": bucketed collectives on a weights-only process group per generator (NCCL between
    GPUs, gloo on CPU or on a shared GPU), any number of generators on any hosts. "cuda-ipc": the
    learner shares one packed buffer that generators on its GPU's host read in place (needs a one-rank
    learner on CUDA). The learner serves this transport and announces it on the broker; a generator
    that follows the broker (`address = ""`) joins whatever the learner announces, and reads this
    field only with an explicit `address`."""
    host: str = "127.0.0.1"
    """Learner: the address the rendezvous binds to and announces (gloo binds its side there too).
    Loopback by default; set the learner's address on the network when generators run on other hosts."""
    port: int = 0
    """Learner: TCP port of the rendezvous; 0 picks a free one."""
    address: str = ""
    """Generator: the learner's rendezvous "host:port"; "" reads the learner's announcement from the
    broker (address, transport and token) every time it joins."""
    token: str = ""
    """The run's secret that a generator must present to join; peers without it are refused. Learner:
    "" draws a random one at start (announced through the broker). Generator: needed only with an
    explicit `address` ("" takes the announced one)."""
    bucket_mb: float = 256.0
    """broadcast: size of one packed bucket in MiB; each bucket is one collective per generator."""
    send_dtype: Literal["auto", "keep", "float32", "bfloat16", "float16"] = "auto"
    """dtype of floating-point tensors on the wire: "auto" (bfloat16 from a CUDA learner, each tensor's
    own dtype on CPU), "keep" (each tensor's own), or a dtype name ("bfloat16", "float32", "float16")."""
    layout: Literal["auto", "checkpoint", "vllm"] = "auto"
    """Learner: "checkpoint" sends the tensors under the names `save_pretrained` writes (any engine);
    "vllm" packs them as vLLM's Qwen2.5-VL holds them (stacked qkv_proj, gate_up_proj), so that applying
    a version inside vLLM's worker is one copy per parameter (weights/vllm_layout.py); "auto" is "vllm"
    for a Qwen2.5-VL model over cuda-ipc (where it halves the sync) and "checkpoint" otherwise."""
    params_in_buffer: bool = True
    """cuda-ipc learner: the model's parameters live in the shared buffer (weights/ipc_sender.py), so the
    GPU holds the weights once (2 bytes a parameter less at bf16: 15.4 GiB at 7B) and a sync copies nothing;
    the optimizer's writes then wait for a generator that is copying the previous version. Applies to plain
    parameters of the wire's dtype (bf16 parameters: master weights in host memory); others are copied."""
    checksums: bool = True
    """broadcast: a checksum per bucket; a receiver rejects a version that does not match."""
    keep_last: bool = True
    """broadcast: keep the last version packed on the learner, so a (re)joining generator gets it at once."""
    timeout_s: float = 60.0
    """Bound on every rendezvous step and every bucket transfer; a generator that misses it is dropped."""
    lock_timeout_s: float = 30.0
    """cuda-ipc: a generator holding the buffer's lock longer than this is dropped (it rejoins by itself)."""
    connect_timeout_s: float = 2.0
    """Generator: bound on one attempt to reach the rendezvous (a learner that is down is retried)."""
    retry_s: float = 1.0
    """Generator: pause before joining again after a failure or a dropped session."""
    poll_s: float = 0.002
    """How often a waiting side looks again (the learner for a lock, a generator for a new version)."""

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (runtime.config checks the Literal choices)."""
        if not 0 <= self.port < 65536:
            raise ValueError(f"weight_sync.port must be in 0..65535, not {self.port}")
        if not self.host:
            raise ValueError("weight_sync.host must name an address (127.0.0.1 for this host only)")
        if self.address and self.address.rpartition(":")[0] == "":
            raise ValueError(f'weight_sync.address must be "host:port" or "", not {self.address!r}')
        if self.address and not self.address.rpartition(":")[2].isdigit():
            raise ValueError(f"weight_sync.address has no port number: {self.address!r}")
        if self.bucket_mb * 2**20 < 16:
            raise ValueError(f"weight_sync.bucket_mb must hold at least 16 bytes, not {self.bucket_mb}")
        for name in ("timeout_s", "lock_timeout_s", "connect_timeout_s", "retry_s", "poll_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"weight_sync.{name} must be > 0, not {getattr(self, name)}")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)
