"""TRL's GRPOTrainer on the shared workload (bench/peers/workload.py), one process on one GPU, vLLM colocated.

    python -m bench.peers.trl_grpo --model CKPT --data DATA_DIR --out trl.json            # GPU, the workload
    python -m bench.peers.trl_grpo --device cpu --model TINY --data DIR --prompts 2 --group 2 --response 8 \
        --micro-batch 2 --out /tmp/trl_cpu.json                                             # a CPU check

DATA_DIR is bench.peers.data's output (trl.parquet). TRL's settings for one GPU, as its documentation gives
them for speed and memory: vLLM in colocate mode (in this process, sharing the GPU) with sleep mode (its
weights and KV cache released while the trainer runs), gradient checkpointing, bf16 weights
(`model_init_kwargs.dtype`, or TRL loads float32). TRL's GRPO has no padding-free option (padding_free is an
SFT option): a micro-batch is padded to its longest sample, which costs nothing here, every sample being
prompt + 512 tokens. One optimizer step a workload step: `per_device_train_batch_size` x
`gradient_accumulation_steps` = 640 samples, generated in one vLLM call at the step's start
(steps_per_generation defaults to gradient_accumulation_steps). Responses are forced to 512 tokens by
vLLM's `min_tokens` (transformers' `min_new_tokens` on CPU). Everything else is TRL's default (loss "dapo",
importance-sampling correction against vLLM's logprobs, which recomputes the old logprobs).

Writes OUT: the exact settings, per-step end times and tokens (TRL's `num_tokens`), the measured row
(bench/peers/workload.py throughput) and the trainer's peak GPU memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench.peers.workload import add_workload_args, step_seconds, throughput


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.peers.trl_grpo", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory (python -m policy build)")
    p.add_argument("--data", type=Path, required=True, help="bench.peers.data output directory")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    add_workload_args(p)
    p.add_argument("--micro-batch", type=int, default=16, help="per_device_train_batch_size")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="vLLM's share of the GPU")
    p.add_argument("--work-dir", default="/tmp/trl-run")
    return p.parse_args(argv)


def grpo_config(args: argparse.Namespace):
    """The GRPOConfig of the run (the settings the module docstring names)."""
    from trl import GRPOConfig

    samples = args.prompts * args.group
    if samples % args.micro_batch:
        raise SystemExit(f"--micro-batch {args.micro_batch} must divide {samples} samples a step")
    cuda = args.device == "cuda"
    forced = {"min_tokens": args.response} if cuda else {"min_new_tokens": args.response}
    if cuda:  # a sampled image/video pad has no image behind it (Parallax and verl ban them too)
        forced["logit_bias"] = {i: -100.0 for i in vision_pad_ids(args.model)}
    return GRPOConfig(
        output_dir=args.work_dir,
        max_steps=args.warmup + args.steps,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=samples // args.micro_batch,
        num_generations=args.group,
        max_completion_length=args.response,
        generation_kwargs=forced,
        learning_rate=args.lr,
        beta=args.kl_coef,
        bf16=cuda,
        use_cpu=not cuda,
        model_init_kwargs={"dtype": "bfloat16" if cuda else "float32"},
        gradient_checkpointing=True,
        use_vllm=cuda,
        vllm_mode="colocate",
        vllm_enable_sleep_mode=cuda,
        vllm_gpu_memory_utilization=args.gpu_memory_utilization,
        vllm_max_model_length=1024 + args.response,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        lr_scheduler_type="constant",
        seed=0,
    )


def vision_pad_ids(model: str) -> list[int]:
    """The tokenizer's <|image_pad|> and <|video_pad|> ids (TRL's vLLM path leaves them samplable)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>")]


def reward(completions, solution, **_) -> list[float]:
    """The synthetic task's verifier (Parallax's reward): 1.0 for the right colour in the last box."""
    from tasks.synthetic import verify

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [verify(text, truth) for text, truth in zip(texts, solution)]


def step_clock(on_step=None):
    """A TrainerCallback that records each optimizer step's end time and TRL's logs (its token count), and
    calls `on_step(clock)` after each step's log (so that a run cut short still leaves its steps)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []
            self.logs: list[dict] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.time())

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append({"step": state.global_step, **(logs or {})})
            if on_step is not None and "num_tokens" in (logs or {}):
                on_step(self)

    return StepClock()


def tokens_per_step(logs: list[dict], warmup: int) -> float:
    """Tokens trained a measured step: TRL's cumulative `num_tokens` (prompt + completion tokens of every
    sample) differenced over the measured steps."""
    seen = [x["num_tokens"] for x in logs if "num_tokens" in x]
    if len(seen) <= warmup:
        raise RuntimeError(f"TRL logged num_tokens for {len(seen)} steps")
    return (seen[-1] - seen[warmup - 1]) / (len(seen) - warmup)


def result(args: argparse.Namespace, config, clock, started: float) -> dict:
    """The run's record so far: settings, step times, logs, and the measured row once there is one."""
    import torch
    import trl

    cuda = args.device == "cuda" and torch.cuda.is_available()
    out = {
        "system": "trl",
        "version": trl.__version__,
        "command": "python -m bench.peers.trl_grpo " + " ".join(sys.argv[1:]),
        "settings": {k: v for k, v in config.to_dict().items() if not k.startswith("_")},
        "step_end_times": clock.ends,
        "logs": clock.logs,
        "run_s": time.time() - started,
        "trainer_peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }
    try:
        seconds = step_seconds(clock.ends, args.warmup)
        return out | throughput(tokens_per_step(clock.logs, args.warmup), seconds)
    except (ValueError, RuntimeError) as exc:
        return out | {"error": f"not measured yet: {exc}"}


def write(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")


def run(args: argparse.Namespace) -> dict:
    import datasets
    from trl import GRPOTrainer

    data = datasets.load_dataset("parquet", data_files=str(args.data / "trl.parquet"), split="train")
    data = data.cast_column("image", datasets.Image())
    config = grpo_config(args)
    started = time.time()
    clock = step_clock(lambda c: write(args.out, result(args, config, c, started)))
    extra = {}
    if args.device == "cpu":  # this machine's CPU stack has no torchvision: the project's processor loader
        from policy.loading import load_processor

        extra["processing_class"] = load_processor(args.model)
    trainer = GRPOTrainer(
        model=args.model, reward_funcs=reward, args=config, train_dataset=data, callbacks=[clock], **extra
    )
    trainer.train()
    return result(args, config, clock, started)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # colocate: the engine in this process
    record = run(args)
    write(args.out, record)
    if "error" in record:
        print(f"trl: {record['error']} -> {args.out}")
        return 1
    rate = record["tokens_per_s_per_gpu"]
    print(f"trl: {record['step_s']:.1f} s/step, {rate:,.0f} tokens/s/GPU -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
