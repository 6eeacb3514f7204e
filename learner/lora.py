"""LoRA on the learner: the adapter peft injects, checks of a resumed checkpoint, the PEFT-format export.

    model = load_model(path, dtype=base_dtype(device), ...)     # the base: frozen, bf16 on a GPU
    add_adapter(model, cfg.lora)                                  # before parallelism (FSDP2 shards it too)
    ...
    export_adapter(root, model, out_dir, rank)     # adapter_config.json + adapter_model.safetensors

peft injects the adapter in place (`get_peft_model`), so the Hugging Face model keeps its module tree and
the packed forward (policy/forward.py), recomputation and FSDP2 run on it unchanged; its `peft_config`
marks it for weight sync, which then sends the adapter alone (weights/adapter.py). The adapter's
parameters are fp32 (peft upcasts them from a bf16 base), the only ones with `requires_grad`: the optimizer
and checkpoints hold them alone. A checkpoint records the adapter's settings (`CHECKPOINT_KEY` in the
trainer state), so resuming a LoRA checkpoint without LoRA (or the reverse, or at another rank) is refused
before anything is loaded.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import torch

from learner.lora_config import VISION_TARGETS, LoraConfig
from weights.adapter import ADAPTER_NAME, config_json, peft_name, write_peft_dir

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "lora"
"""Key of the adapter's settings in a checkpoint's trainer_state.json `extra`."""
LM_PATH = r"(.*\.)?language_model\.layers\.\d+\.(.*\.)?"
VISION_PATH = r"(.*\.)?visual\.blocks\.\d+\.(.*\.)?"


def base_dtype(device: torch.device) -> torch.dtype:
    """The frozen base weights' dtype: bf16 on a GPU, fp32 on CPU (exact numerics in the CPU tests)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def linear_names(model: torch.nn.Module, path: str) -> set[str]:
    """Last names of the nn.Linear modules whose full name matches `path` + a name."""
    pattern = re.compile(path + r"[^.]+")
    return {
        name.rpartition(".")[2]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and pattern.fullmatch(name)
    }


def target_regex(model: torch.nn.Module, cfg: LoraConfig) -> str:
    """peft's `target_modules` (a regex matched against full module names) for the configured layers;
    raises ValueError for a name the model lacks."""
    have = linear_names(model, LM_PATH)
    if not have:
        raise ValueError(f"{type(model).__name__} has no language_model.layers: LoRA targets its decoder")
    missing = sorted(set(cfg.target_modules) - have)
    if missing:
        raise ValueError(
            f"lora.target_modules: the language model has no linear layer {missing} (it has {sorted(have)})"
        )
    parts = [LM_PATH + "(" + "|".join(map(re.escape, cfg.target_modules)) + ")"]
    if cfg.vision:
        tower = linear_names(model, VISION_PATH)
        wanted = cfg.vision_target_modules or [n for n in VISION_TARGETS if n in tower]
        missing = sorted(set(wanted) - tower)
        if missing or not wanted:
            raise ValueError(
                f"lora.vision_target_modules: the vision tower has no linear layer {missing or wanted} "
                f"(it has {sorted(tower)})"
            )
        parts.append(VISION_PATH + "(" + "|".join(map(re.escape, wanted)) + ")")
    return "|".join(f"(?:{p})" for p in parts)


def add_adapter(model: torch.nn.Module, cfg: LoraConfig, base_path: str = ""):
    """Inject a fresh adapter into `model` in place (A random, B zero: the model's outputs are unchanged),
    freeze every other weight; returns the peft config. `base_path`: the base checkpoint, recorded in the
    adapter's config (what `vllm serve` and peft load it onto)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_config = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=target_regex(model, cfg),
        base_model_name_or_path=base_path or None,
    )
    get_peft_model(model, peft_config, adapter_name=ADAPTER_NAME, autocast_adapter_dtype=True)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info(
        "LoRA rank %d alpha %g on %s: %d trainable parameters (%.3f%% of %d)",
        cfg.rank, cfg.alpha, "language model and vision tower" if cfg.vision else "the language model",
        trainable, 100.0 * trainable / max(total, 1), total,
    )  # fmt: skip
    return peft_config


def checkpoint_settings(cfg: LoraConfig) -> dict:
    """What a checkpoint records of the adapter (empty without LoRA)."""
    if not cfg.enabled:
        return {}
    return {"rank": cfg.rank, "alpha": cfg.alpha, "targets": sorted(cfg.target_modules), "vision": cfg.vision}


def check_resume(checkpoint: Path, cfg: LoraConfig) -> None:
    """Refuse to resume a checkpoint whose adapter settings differ from this run's (LoRA or not, rank,
    targets), before anything is loaded."""
    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    saved = state.get("extra", {}).get(CHECKPOINT_KEY, {})
    wanted = checkpoint_settings(cfg)
    if saved == wanted:
        return
    if not saved:
        raise ValueError(
            f"{checkpoint} holds full weights, not a LoRA adapter: resume it without --lora.rank "
            "(or start a LoRA run in another run_dir)"
        )
    if not wanted:
        raise ValueError(
            f"{checkpoint} holds a LoRA adapter (rank {saved['rank']}): resume it with --lora.rank "
            f"{saved['rank']} (or start a full fine-tune in another run_dir)"
        )
    raise ValueError(f"{checkpoint} holds a LoRA adapter {saved}, this run asks for {wanted}")


def export_adapter(
    root, hf_model, out_dir: str | Path, rank: int = 0, merged_dir: str | Path = "", processor=None
):
    """Collective: write the adapter in PEFT format into `out_dir` (what peft's `PeftModel.from_pretrained`
    and `vllm serve --lora-modules name=DIR` load); with `merged_dir`, also the base with the adapter merged
    in (`save_pretrained` output). `root` is the training root, `hf_model` the adapted model inside it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from learner.parallel import HF_PREFIX, distributed

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state = get_model_state_dict(root, options=opts)
    out = Path(out_dir)
    if rank == 0:
        tensors = [(peft_name(k.removeprefix(HF_PREFIX)), v) for k, v in state.items() if ".lora_" in k]
        write_peft_dir(out, tensors, config_json(hf_model))
        log.info("exported the LoRA adapter (%d tensors) -> %s", len(tensors), out)
        if merged_dir:
            export_merged(hf_model, out, Path(merged_dir), processor)
    if distributed():
        torch.distributed.barrier()
    return out if rank == 0 else None


def export_merged(hf_model, adapter_dir: Path, out: Path, processor=None) -> Path:
    """The base checkpoint with the adapter of `adapter_dir` merged in, written by `save_pretrained`."""
    from peft import PeftModel

    from policy.loading import load_model, save_processor

    base_path = hf_model.peft_config[ADAPTER_NAME].base_model_name_or_path
    dtype = next((p.dtype for p in hf_model.parameters() if not p.requires_grad), torch.float32)
    base = load_model(base_path, dtype=dtype, device="cpu")
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp)
    if processor is not None:
        save_processor(processor, tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log.info("exported the base model with the adapter merged in -> %s", out)
    return out
