"""Checkpoints that make a restart exact, and Hugging Face exports that load without a merge step.

A checkpoint is a directory `<run_dir>/checkpoints/step-00000042/` holding
    model.safetensors      full (gathered) parameters, keyed by the training module's names
    optim.safetensors      AdamW tensors (exp_avg, exp_avg_sq, step) keyed "<param>/<field>"
    optim.json             AdamW param groups and non-tensor state, the LR scheduler's state
    trainer_state.json     step, policy version, the feeder's data cursor, consumed group ids
    manifest.json          every other file's size and sha256 (learner/manifest.py), written last
All ranks take part (FSDP gathers), rank 0 writes into `step-...tmp/`, fsyncs every file, writes the
manifest and renames the directory into place, so a checkpoint exists completely or not at all. Nothing
is pickled; safetensors and JSON only. Loading broadcasts rank 0's copy into every rank's shards.

`resume(model, optimizer, scheduler)` loads the newest checkpoint that verifies against its manifest:
rank 0 checks them newest first, logs each one it skips with the file and the reason (truncated, changed
on disk, unreadable), and every rank loads the one it chose. A checkpoint without a manifest (written
before manifests existed) is loaded unverified, with a log line that says so. With `keep` >= 2 the
learner acks a step's groups only once a second checkpoint holds them (learner/inbox.py), so falling
back to the previous checkpoint loses no group: what the skipped one held is still pending and comes
back. When no checkpoint is usable, `CorruptCheckpoint` lists every file at fault.

`export_hf` writes `save_pretrained` output (config, weights under checkpoint names, generation
config) plus the processor files, which transformers and vLLM load directly.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from learner.manifest import CorruptCheckpoint, verify, write_manifest
from learner.parallel import HF_PREFIX, broadcast_bytes, distributed
from policy.loading import save_processor

log = logging.getLogger(__name__)

PREFIX = "step-"


@dataclass
class TrainerState:
    """Everything besides tensors that a restart needs."""

    step: int = 0
    """Optimizer steps done."""
    version: int = 0
    """Policy version of the weights in this checkpoint."""
    cursor: dict = field(default_factory=dict)
    """The prompt feeder's data cursor (`PromptFeeder.state()`)."""
    consumed: list[str] = field(default_factory=list)
    """Ids of every rollout group whose training is contained in these weights (or that was skipped)."""
    extra: dict = field(default_factory=dict)
    """Counters and other small JSON values."""


class Checkpointer:
    """Save, find and load checkpoints under `directory`; keep the newest `keep`."""

    def __init__(self, directory: str | os.PathLike, keep: int = 2, rank: int = 0, guard=None):
        self.directory = Path(directory)
        self.keep = max(keep, 1)
        self.rank = rank
        self.guard = guard or (lambda: None)
        """Called by rank 0 before a written checkpoint is renamed into place; raising keeps it out (a
        learner that lost the run: learner/fencing.py)."""

    def latest(self) -> Path | None:
        """The newest complete checkpoint directory (unverified), or None."""
        return next(iter(self.complete()), None)

    def complete(self) -> list[Path]:
        """The complete checkpoint directories, newest first (unverified)."""
        if not self.directory.is_dir():
            return []
        done = [
            p
            for p in self.directory.glob(f"{PREFIX}*")
            if p.is_dir() and (p / "trainer_state.json").is_file() and not p.name.endswith(".tmp")
        ]
        return sorted(done, key=lambda p: int(p.name[len(PREFIX) :]), reverse=True)

    def resume(self, model, optimizer=None, scheduler=None) -> TrainerState | None:
        """Collective: load the newest usable checkpoint (see the module docstring); None when there is
        none at all; CorruptCheckpoint when there are some and none is usable."""
        chosen = self._choose() if self.rank == 0 else None
        raw = broadcast_bytes(None if chosen is None else chosen.encode())  # as it is without a group
        chosen = None if raw is None else raw.decode()
        if chosen is None:
            return None
        if chosen.startswith("!"):
            raise CorruptCheckpoint(chosen[1:])
        return self.load(chosen, model, optimizer, scheduler)

    def _choose(self) -> str | None:
        """Rank 0: the path of the newest checkpoint that verifies (None: no checkpoint; "!why": none
        usable), logging each one skipped with its reason."""
        found, problems = self.complete(), []
        for path in found:
            try:
                verified = verify(path)
            except CorruptCheckpoint as exc:
                problems.append(str(exc))
                log.warning("skipping checkpoint %s: %s", path.name, exc)
                continue
            if not verified:
                log.warning(
                    "checkpoint %s has no manifest (written before checkpoints had one): loading it "
                    "unverified",
                    path.name,
                )
            if problems:
                log.warning("resuming from the previous checkpoint %s instead", path.name)
            return str(path)
        if not found:
            return None
        return "!" + (
            f"no usable checkpoint in {self.directory}: "
            + "; ".join(problems)
            + ". Move the damaged checkpoint directories away (with none left, the learner starts again from "
            "its initial weights)"
        )

    def save(self, model, optimizer, scheduler, state: TrainerState) -> Path:
        """Collective: write a checkpoint of `state.step`; returns its directory once durable."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = get_model_state_dict(model, options=opts)
        optim_sd = get_optimizer_state_dict(model, optimizer, options=opts)
        final = self.directory / f"{PREFIX}{state.step:08d}"
        if self.rank == 0:
            tmp = final.with_name(final.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            save_file(_contiguous(model_sd), str(tmp / "model.safetensors"))
            tensors, meta = _split_optimizer(optim_sd)
            save_file(tensors, str(tmp / "optim.safetensors"))
            meta["scheduler"] = scheduler.state_dict() if scheduler is not None else None
            _write_json(tmp / "optim.json", meta)
            _write_json(tmp / "trainer_state.json", asdict(state))
            for f in tmp.iterdir():
                _fsync(f)
            write_manifest(tmp)  # last: a manifest lists only files that are durable
            self.guard()
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            _fsync(self.directory)
            self._prune()
            log.info(
                "checkpoint step %d (version %d, %d consumed groups) -> %s",
                state.step,
                state.version,
                len(state.consumed),
                final,
            )
        if distributed():
            dist.barrier()
        return final

    def load(self, path: str | os.PathLike, model, optimizer=None, scheduler=None) -> TrainerState:
        """Collective: restore model (and optimizer, scheduler) from `path`; returns its state."""
        path = Path(path)
        state = TrainerState(**json.loads((path / "trainer_state.json").read_text()))
        meta = json.loads((path / "optim.json").read_text())
        # one rank has nothing to broadcast (and a broadcast load would stage host-resident optimizer states,
        # ~100 GB for 7B with master_weights = host, on the GPU first)
        multi = distributed() and dist.get_world_size() > 1
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=multi)
        model_sd = load_file(str(path / "model.safetensors")) if self.rank == 0 or not multi else {}
        set_model_state_dict(model, model_sd, options=opts)
        if optimizer is not None:
            optim_sd = {}
            if self.rank == 0 or not multi:
                optim_sd = _join_optimizer(load_file(str(path / "optim.safetensors")), meta)
            # Parameters that never had a gradient have no AdamW state yet: not an error.
            optim_opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=multi, strict=False)
            set_optimizer_state_dict(model, optimizer, optim_sd, options=optim_opts)
        if scheduler is not None and meta.get("scheduler") is not None:
            scheduler.load_state_dict(meta["scheduler"])
        log.info("resumed from %s: step %d, version %d", path, state.step, state.version)
        return state

    def _prune(self) -> None:
        done = sorted(
            (p for p in self.directory.glob(f"{PREFIX}*") if not p.name.endswith(".tmp")),
            key=lambda p: int(p.name[len(PREFIX) :]),
        )
        for old in done[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)


def export_hf(model, hf_model, processor, out_dir: str | os.PathLike, rank: int = 0) -> Path | None:
    """Collective: write a Hugging Face checkpoint of the current weights into `out_dir`.

    `model` is the training root (`PackedPolicy`), `hf_model` the Hugging Face model inside it
    (for its class and config). Rank 0 rebuilds the model on the meta device, assigns the
    gathered tensors and calls `save_pretrained`, so the names and files are exactly what
    transformers writes; the processor files go next to them.
    """
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = Path(out_dir)
    if rank == 0:
        inner = {k.removeprefix(HF_PREFIX): v for k, v in full.items()}
        with torch.device("meta"):  # plain SDPA: the training model's attention hook is not for export
            fresh = type(hf_model)._from_config(copy.deepcopy(hf_model.config), attn_implementation="sdpa")
        fresh.load_state_dict(inner, assign=True, strict=True)
        if getattr(hf_model.config, "tie_word_embeddings", False):
            fresh.tie_weights()
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        fresh.save_pretrained(tmp)
        if hf_model.generation_config is not None:
            hf_model.generation_config.save_pretrained(tmp)
        if processor is not None:
            save_processor(processor, tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
        log.info("exported Hugging Face checkpoint -> %s", out)
    if distributed():
        dist.barrier()
    return out if rank == 0 else None


def _split_optimizer(optim_sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors of the optimizer state into a flat dict; the rest into JSON-able metadata."""
    tensors, scalars = {}, {}
    for param, fields in optim_sd.get("state", {}).items():
        for key, value in fields.items():
            if torch.is_tensor(value):
                tensors[f"{param}/{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(param, {})[key] = value
    return tensors, {"param_groups": optim_sd.get("param_groups", []), "scalars": scalars}


def _join_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[str, dict] = {}
    for key, value in tensors.items():
        param, field_name = key.rsplit("/", 1)
        state.setdefault(param, {})[field_name] = value
    for param, fields in meta.get("scalars", {}).items():
        state.setdefault(param, {}).update(fields)
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def _contiguous(sd: dict) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in sd.items()}


def _write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=1, default=_json_default))


def _json_default(value):
    if torch.is_tensor(value):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    raise TypeError(f"cannot store {type(value).__name__} in a checkpoint's JSON")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
