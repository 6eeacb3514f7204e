"""The format warm start (the launcher's warm-start stage, run before RL): teach a random model the answer
FORMAT, and nothing about images.

A freshly built model emits random tokens, so no sampled response ever earns a reward and GRPO
has no signal. This stage runs a few supervised steps on responses of the form

    <think> look </think> \\boxed{W}<|im_end|>

where W is drawn uniformly at random from the task's answer vocabulary (the distinct answers of
the record's question type), independently of the image. The prompts are the real training
prompts (image included), so the model also meets the image tokens it will see later; but since
W is independent of the image, the data carries no information about what the image shows: the
model learns the format and a uniform prior over answers, held-out accuracy stays at chance,
and everything it later learns about the images comes from RL.

    python -m learner.warmstart --model BASE_DIR --task-dir DATA --out OUT_DIR [--steps 40] [--device cuda]

On a GPU (`--device cuda`, what the launcher passes on a GPU layout) the model keeps fp32 weights
and runs its forward under bf16 autocast; `--thought` sets the text of the think block (a longer
one makes every later response that much longer).

Writes a Hugging Face checkpoint (what the generator and learner load) into OUT_DIR and one JSON
line per step into OUT_DIR.metrics.jsonl (`{"stage": "warm-start", "step", "loss", ...}`).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

from runtime import jsonl

log = logging.getLogger("learner.warmstart")

THOUGHT = "look"
"""The fixed content of the <think> block the warm start teaches."""


@dataclasses.dataclass
class WarmStartConfig:
    """Supervised format warm start (see the module docstring)."""

    model: str = ""
    """Checkpoint to start from (the freshly built model)."""
    task_dir: str = ""
    """Task directory (train.jsonl + images) whose prompts are used."""
    out: str = ""
    """Where the warm-started checkpoint goes."""
    steps: int = 40
    """Supervised steps (0 copies the model unchanged)."""
    batch: int = 16
    """Prompts per step."""
    lr: float = 1e-3
    """AdamW learning rate (constant)."""
    seed: int = 0
    """Seed of the prompt order and of the random answers."""
    threads: int = 0
    """torch threads (0 = torch's default)."""
    device: str = "cpu"
    """cpu, or cuda (fp32 weights, bf16 autocast)."""
    thought: str = THOUGHT
    """The fixed content of the <think> block."""

    def validate(self) -> None:
        if not (self.model and self.task_dir and self.out):
            raise ValueError("--model, --task-dir and --out are required")


def response_text(answer: str, thought: str = THOUGHT) -> str:
    """The response the warm start teaches for one (random) answer."""
    return f"<think> {thought} </think> \\boxed{{{answer}}}"


def answer_vocabulary(records) -> dict[str, list[str]]:
    """Distinct answers per question type (`meta["task"]`, else the data source), sorted."""
    vocab: dict[str, set[str]] = defaultdict(set)
    for r in records:
        vocab[r.meta.get("task", r.data_source)].add(r.ground_truth)
    return {k: sorted(v) for k, v in vocab.items()}


def random_targets(records, seed: int) -> list[str]:
    """One answer per record, uniform over its question type's vocabulary, independent of the image."""
    vocab = answer_vocabulary(records)
    rng = random.Random(f"warmstart/{seed}")
    return [rng.choice(vocab[r.meta.get("task", r.data_source)]) for r in records]


def run(cfg: WarmStartConfig) -> Path:
    """Train and write the warm-started checkpoint; returns its directory."""
    import torch

    from policy.forward import PackedPolicy
    from policy.loading import load_model, load_processor
    from policy.packing import PixelCache, make_sample, pack
    from tasks.prompt import render_prompt_ids
    from tasks.records import read_image_bytes, read_records

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    metrics_path = out.with_name(out.name + ".metrics.jsonl")
    metrics_path.parent.mkdir(parents=True, exist_ok=True)
    records = list(read_records(cfg.task_dir, "train"))
    targets = random_targets(records, cfg.seed)
    processor = load_processor(cfg.model)
    tok = processor.tokenizer
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    device = torch.device(cfg.device)
    model = load_model(cfg.model, dtype="float32", device=device).train()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    policy = PackedPolicy(model)
    image_token_id = model.config.image_token_id
    cache = PixelCache(processor.image_processor)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    order = list(range(len(records)))
    random.Random(cfg.seed).shuffle(order)
    t_start = time.time()
    with open(metrics_path, "w") as mfile:
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            batch = [order[(step * cfg.batch + i) % len(order)] for i in range(cfg.batch)]
            samples = []
            for i in batch:
                r = records[i]
                prompt = render_prompt_ids(processor, r.problem, len(r.images))
                text = response_text(targets[i], cfg.thought)
                response = tok.encode(text, add_special_tokens=False) + [end_id]
                images = [(ref.sha256, read_image_bytes(cfg.task_dir, ref)) for ref in r.images]
                samples.append(make_sample(prompt, response, images, cache, image_token_id))
            packed = pack(samples, image_token_id, processor.image_processor.merge_size).to(device)
            with autocast:
                logprobs, _ = policy(packed, with_entropy=False)
            loss = -logprobs.mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            line = {
                "stage": "warm-start",
                "step": step + 1,
                "steps": cfg.steps,
                "loss": float(loss),
                "seconds": time.perf_counter() - t0,
                "time": time.time(),
            }
            mfile.write(jsonl.dumps(line) + "\n")  # a NaN loss: the key is left out
            mfile.flush()
            log.info("warm-start step %d/%d loss %.4f", step + 1, cfg.steps, float(loss))
    _save(model, cfg.model, processor, out)
    log.info("warm start done in %.1f s -> %s", time.time() - t_start, out)
    return out


def _save(trained, base_dir: str, processor, out: Path) -> None:
    """Write `trained`'s weights as a plain (SDPA) Hugging Face checkpoint, atomically."""
    from policy.loading import load_model

    fresh = load_model(base_dir, dtype="float32")
    fresh.load_state_dict({k: v.cpu() for k, v in trained.state_dict().items()}, strict=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    fresh.save_pretrained(tmp)
    if fresh.generation_config is not None:
        fresh.generation_config.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main(argv: list[str] | None = None) -> int:
    from runtime.config import load_config
    from runtime.redact import setup_logging

    cfg = load_config(WarmStartConfig, list(sys.argv[1:] if argv is None else argv), description=__doc__)
    setup_logging("INFO", "%(asctime)s %(name)s %(levelname)s %(message)s")
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
