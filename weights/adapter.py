"""The adapter payload: a LoRA-trained policy version travels as its adapter alone (docs/lora.md).

A model that peft adapted (`model.peft_config`, trainable `lora_A` / `lora_B` weights) is sent by both
transports as `AdapterTensors` instead of `manifest.WireTensors`: the same buckets, checksums and versions,
but only the adapter's tensors, under the names PEFT saves them with
(`base_model.model.<module>.lora_A.weight`), and a manifest of kind "adapter" that carries the adapter's
`adapter_config.json`. A generator writes a received version as a PEFT adapter directory
(`write_peft_dir`: what vLLM's `LoRARequest`, `vllm serve --lora-modules` and peft load) and vLLM serves
it on the base model it loaded once (generator/lora.py).

`adapter_digest` names an adapter by its content (a checksum per tensor, hashed with the names, dtypes
and shapes): the learner records the digest of every version it publishes, each generator stamps every
sample with the digest of the adapter vLLM sampled it with, and the learner refuses a sample whose digest
is not the one it published for that version (learner/adapter_guard.py).

    wire = wire_tensors(model, send_dtype, layout, transport)    # AdapterTensors or WireTensors
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import torch

from weights.manifest import Layout, WireTensors, checksum, full, wire_dtype
from weights.protocol import Manifest, WeightSyncError, dtype_name

ADAPTER = "adapter"
"""`Manifest.kind` of an adapter version ("full": every weight)."""
ADAPTER_NAME = "default"
"""The adapter peft injected (the learner trains one)."""
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def is_adapted(model: torch.nn.Module) -> bool:
    """True when peft injected a LoRA adapter into `model` (its `peft_config`)."""
    return ADAPTER_NAME in (getattr(model, "peft_config", None) or {})


def peft_name(name: str) -> str:
    """The name PEFT saves an adapter tensor under, from its name in the model: `model.layers.0.q_proj.
    lora_A.default.weight` -> `base_model.model.model.layers.0.q_proj.lora_A.weight`."""
    return "base_model.model." + name.replace(f".{ADAPTER_NAME}.", ".")


def adapter_params(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name in the model, parameter) of every adapter tensor, in module order."""
    return [(n, p) for n, p in model.named_parameters() if ".lora_" in n and f".{ADAPTER_NAME}." in n]


def config_json(model: torch.nn.Module) -> str:
    """The adapter's adapter_config.json, as peft writes it (inference mode)."""
    config = model.peft_config[ADAPTER_NAME].to_dict()
    config["inference_mode"] = True
    return json.dumps(config, sort_keys=True, default=_json_default)


def _json_default(value):
    if isinstance(value, set | frozenset):
        return sorted(value)
    raise TypeError(f"adapter config value of type {type(value).__name__}")


class AdapterTensors(WireTensors):
    """The adapter of a peft-adapted model as it goes on the wire: checkpoint layout, PEFT names, each tensor
    in the wire dtype (FSDP2 shards gathered by `gather`, as for full weights)."""

    def __init__(self, model: torch.nn.Module, send_dtype: str):
        params = adapter_params(model)
        if not params:
            raise WeightSyncError(f"{type(model).__name__} has no trainable LoRA adapter to send")
        self.model = model
        self.layout = "checkpoint"
        self.parts = {}
        self._params = [p for _, p in params]
        cast = wire_dtype(send_dtype, self._params[0].device)
        self.entries = [(peft_name(n), cast or p.dtype, tuple(p.shape)) for n, p in params]
        self.members = [[i] for i in range(len(params))]
        self.slots = [(i, 0) for i in range(len(params))]
        self.config = config_json(model)

    def tensors(self) -> list[torch.Tensor]:
        return list(self._params)

    def gather(self, tensors: list[torch.Tensor], i: int) -> torch.Tensor:
        return full(tensors[i]).detach()

    def manifest(self, layout: Layout, version: int, step: int, checksums: bool) -> Manifest:
        manifest = super().manifest(layout, version, step, checksums)
        manifest.kind, manifest.adapter_config = ADAPTER, self.config
        return manifest

    def digest(self) -> str:
        """`adapter_digest` of what a sync sends now (collective over the ranks of an FSDP2 model)."""
        tensors = self.tensors()
        pairs = []
        for i, (name, dtype, _) in enumerate(self.entries):
            pairs.append((name, self.gather(tensors, i).to(dtype)))
        return adapter_digest(pairs)


def wire_tensors(model: torch.nn.Module, send_dtype: str, layout: str, transport: str) -> WireTensors:
    """What a sync of `model` sends: its adapter when peft adapted it, else every weight."""
    if is_adapted(model):
        return AdapterTensors(model, send_dtype)
    return WireTensors(model, send_dtype, layout, transport)


def adapter_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A short content name of an adapter: per tensor (by name) its dtype, shape and `checksum`, hashed."""
    h = hashlib.blake2b(digest_size=8)
    for name, tensor in sorted(named_tensors, key=lambda pair: pair[0]):
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        if raw.numel() % 8:
            raw = torch.cat([raw, raw.new_zeros(8 - raw.numel() % 8)])
        total = checksum(raw) if raw.numel() else 0
        h.update(f"{name}|{dtype_name(tensor.dtype)}|{list(tensor.shape)}|{total};".encode())
    return h.hexdigest()


def write_peft_dir(directory: str | Path, named_tensors, config: str) -> Path:
    """An adapter directory as peft saves one (adapter_config.json + adapter_model.safetensors), written
    under a temporary name and renamed into place."""
    from safetensors.torch import save_file

    out = Path(directory)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in named_tensors}
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / CONFIG_FILE).write_text(config)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def adapter_rank(config: str) -> int:
    """The rank `r` of an adapter_config.json."""
    return int(json.loads(config)["r"])
