"""verl's GRPO trainer on the shared workload (bench/peers/workload.py), one GPU, its documented recipe.

    python -m bench.peers.verl_grpo --model CKPT --data DATA_DIR --out verl.json [--site DIR]   # GPU
    python -m bench.peers.verl_grpo --model CKPT --data DATA_DIR --out x.json --dry-run      # compose only

The recipe is verl's examples/grpo_trainer/run_qwen2_5_vl_7b_fsdp.sh (Qwen2.5-VL GRPO on Geometry3k) with
the workload's numbers: FSDP2 actor with sequence packing (`use_remove_padding`), dynamic batch size
(24,576 tokens a GPU), gradient checkpointing, fused log-prob kernels, the KL loss (low_var_kl), the
reference policy's parameters offloaded to the CPU between its passes, vLLM as an async server colocated on
the same GPU (the hybrid engine: it sleeps while FSDP trains, and wakes with the new weights). For one GPU
(the recipe spreads over eight): rollout tensor parallel 1, the actor's AdamW state in host memory
(`optimizer_offload`, as verl advises when the GPU is short; Parallax keeps AdamW in host memory on one GPU
too), vLLM at 0.5 of the GPU (the recipe's 0.6 sits beside an eighth of the actor), up to all 640 samples
of a step in flight (`max_num_seqs`), responses forced to 512 tokens (`ignore_eos`). Step time: verl's own
`timing_s/step`; tokens: `perf/total_num_tokens` (prompt + response tokens of the step's samples).

verl 0.9.1 needs transformers < 5.11: `--site` names a directory holding verl and its own transformers
(put first on the path, before the environment's). Its packing path calls the flash-attn package, which
this runs over PyTorch's built-in flash attention (bench/peers/flash_attn_compat).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.peers.workload import add_workload_args, throughput

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
FLASH_ATTN_VERSION = "2.8.3"
"""The flash-attn version verl 0.9.1 pins (its fsdp extra), which the compatibility package reports."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.peers.verl_grpo", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", type=Path, required=True, help="bench.peers.data output directory")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--site", default="", help="directory with verl and transformers < 5.11 (first on the path)"
    )
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/verl-run"))
    add_workload_args(p)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="vLLM's share of the GPU")
    p.add_argument("--max-token-len", type=int, default=24576, help="dynamic batch size: tokens a GPU")
    p.add_argument("--timeout-s", type=float, default=0, help="stop the run after this long (0: never)")
    p.add_argument("--dry-run", action="store_true", help="compose and print the config, run nothing")
    return p.parse_args(argv)


def overrides(args: argparse.Namespace) -> list[str]:
    """The hydra overrides of verl's ppo_trainer config: the recipe, the workload, one GPU."""
    a = "actor_rollout_ref"
    data = args.data.resolve() / "verl.parquet"
    tokens = args.max_token_len
    return [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={data}",
        f"data.val_files={data}",
        "data.image_key=images",
        f"data.train_batch_size={args.prompts}",
        "data.max_prompt_length=1024",
        f"data.max_response_length={args.response}",
        "data.filter_overlong_prompts=True",
        "data.truncation=error",
        f"{a}.model.path={args.model}",
        f"{a}.model.use_remove_padding=True",
        f"{a}.model.use_fused_kernels=True",
        f"{a}.model.enable_gradient_checkpointing=True",
        f"{a}.actor.strategy=fsdp2",
        f"{a}.actor.optim.lr={args.lr}",
        f"{a}.actor.ppo_mini_batch_size={args.prompts}",
        f"{a}.actor.use_dynamic_bsz=True",
        f"{a}.actor.ppo_max_token_len_per_gpu={tokens}",
        f"{a}.actor.use_kl_loss=True",
        f"{a}.actor.kl_loss_coef={args.kl_coef}",
        f"{a}.actor.kl_loss_type=low_var_kl",
        f"{a}.actor.entropy_coeff=0",
        f"{a}.actor.fsdp_config.param_offload=False",
        f"{a}.actor.fsdp_config.optimizer_offload=True",
        f"{a}.rollout.name=vllm",
        f"{a}.rollout.mode=async",
        f"{a}.rollout.tensor_model_parallel_size=1",
        f"{a}.rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
        f"{a}.rollout.n={args.group}",
        f"{a}.rollout.max_num_seqs={args.prompts * args.group}",
        f"{a}.rollout.ignore_eos=True",
        f"{a}.rollout.enable_chunked_prefill=False",
        f"{a}.rollout.enforce_eager=False",
        f"{a}.rollout.free_cache_engine=True",
        f"{a}.rollout.multi_stage_wake_up=True",
        f"+{a}.rollout.engine_kwargs.vllm.mm_processor_cache_gb=0",
        f"{a}.rollout.log_prob_use_dynamic_bsz=True",
        f"{a}.rollout.log_prob_max_token_len_per_gpu={tokens}",
        f"{a}.ref.log_prob_use_dynamic_bsz=True",
        f"{a}.ref.log_prob_max_token_len_per_gpu={tokens}",
        f"{a}.ref.fsdp_config.param_offload=True",
        f"reward.custom_reward_function.path={HERE / 'verl_reward.py'}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.balance_batch=True",
        "trainer.logger=[console,file]",
        "trainer.project_name=peers",
        "trainer.experiment_name=verl",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=False",
        "trainer.total_epochs=1",
        f"trainer.total_training_steps={args.warmup + args.steps}",
        "ray_kwargs.ray_init.num_cpus=64",  # logical CPUs: room for every actor verl starts on one host
        "+ray_kwargs.ray_init.include_dashboard=False",
    ]


def compose(args: argparse.Namespace):
    """verl's config with the overrides, composed offline from its installed package (hydra)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from omegaconf import OmegaConf

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        config = hydra_compose(config_name="ppo_trainer", overrides=overrides(args))
    OmegaConf.resolve(config)
    return config


def flash_attn_site(work: Path) -> Path:
    """A directory holding the flash_attn compatibility package and its distribution metadata (transformers
    checks the installed distribution's name and version before it uses flash-attn)."""
    site = work / "flash_attn_site"
    shutil.rmtree(site, ignore_errors=True)
    shutil.copytree(HERE / "flash_attn_compat" / "flash_attn", site / "flash_attn")
    info = site / f"flash_attn-{FLASH_ATTN_VERSION}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: flash_attn\nVersion: {FLASH_ATTN_VERSION}\n"
        "Summary: FlashAttention-2's Python API over PyTorch's flash attention (bench/peers)\n"
    )
    (info / "top_level.txt").write_text("flash_attn\n")
    return site


def environment(args: argparse.Namespace) -> dict[str, str]:
    """The run's environment: verl's site and the flash-attn package first on the path, then the project
    (the reward function imports tasks/), then what was there; verl's metrics into a JSONL file."""
    paths = [str(flash_attn_site(args.work_dir)), args.site, str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "VERL_FILE_LOGGER_PATH": str(args.work_dir / "metrics.jsonl"),
        "TOKENIZERS_PARALLELISM": "false",
    }


def launch(args: argparse.Namespace) -> tuple[int, list[float]]:
    """Run verl's trainer; returns its exit status and the arrival times of its per-step console lines."""
    command = [
        sys.executable,
        "-m",
        "verl.trainer.main_ppo",
        *overrides(args),
        f"hydra.run.dir={args.work_dir}/hydra",
    ]
    log = args.work_dir / "verl.log"
    ends, deadline = [], time.time() + args.timeout_s if args.timeout_s else None
    with open(log, "w") as f:
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment(args),
            cwd=args.work_dir,
        )  # fmt: skip
        for line in proc.stdout:
            f.write(line)
            if "timing_s/step:" in line:
                ends.append(time.time())
            if deadline and time.time() > deadline:
                proc.kill()
                break
        code = proc.wait()
    return code, ends


def steps_from_metrics(path: Path) -> list[dict]:
    """verl's per-step metrics (its file logger's JSONL: {"step": n, "data": {...}})."""
    if not path.is_file():
        return []
    return [
        json.loads(line)["data"] | {"step": json.loads(line)["step"]}
        for line in path.read_text().splitlines()
    ]


def row(steps: list[dict], warmup: int) -> dict:
    """The measured row: verl's own step seconds and token counts over the steps after the warm-up."""
    measured = steps[warmup:]
    if not measured:
        raise RuntimeError(f"verl finished {len(steps)} steps, none after {warmup} warm-up")
    seconds = [s["timing_s/step"] for s in measured]
    tokens = sum(s["perf/total_num_tokens"] for s in measured) / len(measured)
    return throughput(tokens, seconds)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(compose(args)))
        return 0
    started = time.time()
    code, ends = launch(args)
    steps = steps_from_metrics(args.work_dir / "metrics.jsonl")
    import verl

    result = {
        "system": "verl",
        "version": getattr(verl, "__version__", "?"),
        "command": "python -m bench.peers.verl_grpo " + " ".join(sys.argv[1:]),
        "overrides": overrides(args),
        "exit_status": code,
        "run_s": time.time() - started,
        "step_line_times": ends,
        "per_step_metrics": steps,
    }
    try:
        result |= row(steps, args.warmup)
    except RuntimeError as exc:
        result["error"] = str(exc)
        result["log_tail"] = (args.work_dir / "verl.log").read_text(errors="replace")[-6000:]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"verl: exit {code}, {result.get('step_s', 0):.1f} s/step -> {args.out}")
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    raise SystemExit(main())
