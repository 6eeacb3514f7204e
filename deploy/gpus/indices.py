"""Which GPUs a launch names for each role, checked: the first step of every GPU layout decision.

`assign_gpus(learner_gpus, generator_gpus, visible, tp)` reads the two `--learner.gpus` /
`--generator.gpus` lists (CUDA_VISIBLE_DEVICES-style indices among the GPUs the launcher sees) and
returns the `Sides` of the layout: no GPU (CPU), one GPU shared by both roles, or disjoint sets. Anything
else (one side only, a partial overlap, a missing or repeated index, a generator tensor-parallel size
that does not divide its GPUs) raises a `LayoutError` that names the fix; every other layout check
(deploy/gpus/estimate.py, deploy/gpus/packs.py) raises it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


class LayoutError(ValueError):
    """A GPU layout that cannot run; the message names the fix."""


@dataclass(frozen=True)
class GpuInfo:
    """One GPU this launcher can see, by its CUDA_VISIBLE_DEVICES-style index."""

    index: int
    """Index as the user writes it (position among the GPUs visible to the launcher)."""
    physical: int
    """Index as the driver numbers it (what a child's CUDA_VISIBLE_DEVICES gets)."""
    memory_gib: float
    """Total memory."""
    name: str = ""


@dataclass(frozen=True)
class Sides:
    """The GPUs each role of a layout gets, in the order the user named them (what `assign_gpus` returns)."""

    kind: Literal["cpu", "shared", "split"]
    """cpu: no GPU; shared: learner and one generator on the same GPU; split: disjoint GPU sets."""
    learner: tuple[GpuInfo, ...] = ()
    generator: tuple[GpuInfo, ...] = ()

    def memory_gib(self) -> float:
        """The smallest total memory among the layout's GPUs (what every estimate is held against)."""
        return min(g.memory_gib for g in (*self.learner, *self.generator))


def assign_gpus(learner_gpus: str, generator_gpus: str, visible: list[GpuInfo], tp: int = 1) -> Sides:
    """The checked `Sides` of the two GPU lists among `visible`, or a LayoutError that says what to change.

    Both empty: CPU. The same single GPU for both (and `tp` 1): shared. Disjoint sets whose generator
    GPUs `tp` divides: split. Anything else is an error."""
    learner, generator = _indices(learner_gpus, "learner"), _indices(generator_gpus, "generator")
    if not learner and not generator:
        return Sides("cpu")
    if not learner or not generator:
        side, other = ("learner", "generator") if learner else ("generator", "learner")
        raise LayoutError(
            f"--{side}.gpus is set but --{other}.gpus is not: give both (e.g. --learner.gpus 0 "
            f"--generator.gpus 0 to share one GPU), or neither to run on CPU"
        )
    by_index = {g.index: g for g in visible}
    missing = sorted(i for i in {*learner, *generator} if i not in by_index)
    if missing:
        seen = f"GPUs {', '.join(str(g.index) for g in visible)}" if visible else "no GPU"
        raise LayoutError(
            f"GPU index {', '.join(map(str, missing))} does not exist: this machine shows {seen} "
            f"(indices count from 0 among CUDA_VISIBLE_DEVICES); pick indices from that list"
        )
    if tp < 1 or len(generator) % tp:
        raise LayoutError(
            f"--generator.tp {tp} does not divide the {len(generator)} generator GPUs: give a multiple of "
            f"{tp} GPUs or change --generator.tp"
        )
    overlap = sorted(set(learner) & set(generator))
    if overlap and not (learner == generator and len(learner) == 1 and tp == 1):
        raise LayoutError(
            f"GPU {', '.join(map(str, overlap))} is in both --learner.gpus and --generator.gpus: "
            "share exactly one GPU (--learner.gpus 0 --generator.gpus 0) or give disjoint sets "
            "(--learner.gpus 0-5 --generator.gpus 6-7)"
        )
    return Sides(
        "shared" if overlap else "split",
        tuple(by_index[i] for i in learner),
        tuple(by_index[i] for i in generator),
    )


def _indices(spec: str, role: str) -> list[int]:
    """The indices of one `--<role>.gpus` list (0, 0-5, 6,7), each at most once and none negative."""
    from runtime.config import parse_gpus

    try:
        gpus = parse_gpus(spec)
    except ValueError:
        raise LayoutError(
            f"--{role}.gpus {spec!r} is not a GPU list: write indices like 0, 0-5 or 6,7"
        ) from None
    if len(set(gpus)) != len(gpus) or any(g < 0 for g in gpus):
        raise LayoutError(f"--{role}.gpus {spec!r} names a GPU twice or a negative index")
    return gpus
