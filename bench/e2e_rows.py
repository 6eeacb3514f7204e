"""One end-to-end run's row and the table of rows (bench/e2e.py runs them; `python -m bench.e2e` prints it).

From each run's learner/metrics.jsonl, over the steps after the warm-up:
  learner    the learner's training packs and recomputation as it ran them (its resolved config: `8k sel` =
             8,192-token packs under selective recomputation, `32k full` = 32k under full);
  steps/s    steps / wall time between the first and last measured step;
  wait       learner blocked waiting for a step's scored groups (generation + reward not overlapped);
  train      the learner's step (forward, backward, AdamW; the no-grad passes), of which
  fwd+bwd    the training pass (the micro-batches' forwards and backwards up to the gradient norm),
  prox       the no-grad pass for pi_prox (proximal = recompute), ref the reference model's no-grad pass
             (with AdamW in host memory partly beside it), optim the optimizer's updates, and exposed the
             part of optim that nothing ran beside (train = fwd+bwd + prox + ref + exposed + a little);
  pass MFU   the learner's MFU (6·N_LM per computed token and its attention) over the training pass alone;
  tokens/s/GPU  prompt + response tokens trained per wall-clock second per GPU (steps/s x tokens/step / GPUs);
  sync       weight broadcast to the generator until it acknowledged;
  generate   generator seconds in the vLLM calls that produced the step's groups (on the
             generator's clock: with K >= 1 this overlaps the learner's train time);
  staleness  mean learner version minus the samples' starting version;
  peak GB    the learner's peak GPU memory allocated in a measured step (GPU runs; 0 on CPU);
  shared     (`sharing`) on the reference row: the bound on any K's speedup, its step over its train time
             (generation wholly hidden at no cost to the learner); on a K >= 1 row: the work the GPU did
             while both ran, in GPUs (the learner's progress over the generation window, 1 - its slowdown
             over the reference's train time / generate, plus the generator's, the reference's generate /
             this row's); 1.00 = no gain from sharing, 2.00 = neither slowed the other.
A failed run's row keeps its logs' tails and facts (`run_logs`, `log_tails`, `log_facts`), the exceptions its
processes raised in its error (`raised`) and whether it ran out of memory (`ran_out_of_memory`): the device
keeps no files after the call.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from deploy.gpus.mps import GeneratorShare


def run_logs(run_dir: Path) -> dict[str, str]:
    """The text of every log of a run, by file name: the launcher's own (`<run_dir>.log`) and each
    process's (`<run_dir>/logs/`). A run's JSON carries what the analysis needs of them (the device keeps
    no files after the call)."""
    paths = [run_dir.with_suffix(".log"), *sorted((run_dir / "logs").glob("*.log"))]
    return {p.name: p.read_text(errors="replace") for p in paths if p.is_file()}


def log_tails(logs: dict[str, str], lines: int = 40) -> dict[str, str]:
    """The last `lines` lines of each log of a run (`run_logs`): what a failed run's JSON carries."""
    return {name: "\n".join(text.splitlines()[-lines:]) for name, text in logs.items()}


FACTS = re.compile(
    r"KV cache|concurrency|Model loading took|memory profiling|Graph capturing|ready in|torch.compile|"
    r"joined|gpu_peak|took \d|serving policy version [0-3] |KL reference model in|cudaHostRegister|"
    r"groups here|generated \d+ prompts"
)
"""Log lines worth keeping from every run (vLLM's memory split and start-up, the learner's start, where its KL
reference lives and first versions, each generate call, a held AdamW that ran alone): an analysis needs them
(docs/benchmarks.md reads them)."""


def log_facts(logs: dict[str, str], per_log: int = 40) -> dict[str, list[str]]:
    """The first `per_log` FACTS lines of each log of a run (`run_logs`), each cut to 300 characters."""
    facts = {name: [x[:300] for x in text.splitlines() if FACTS.search(x)] for name, text in logs.items()}
    return {name: lines[:per_log] for name, lines in facts.items() if lines}


RAISED = re.compile(r"\b(\w*(?:Error|Exception)): (.+)")
"""The line a Python traceback ends with (`RuntimeError: ...`, `[rank0]: EngineOutputError: ...`)."""


def raised(logs: dict[str, str]) -> str:
    """The last exception each log of a run (`run_logs`) names, "log: Type: message" joined by " | ", each
    cut to 300 characters ("" when none): what a failed row's error adds to the harness's own."""
    found = []
    for name, text in logs.items():
        matches = RAISED.findall(text)
        if matches:
            kind, message = matches[-1]
            found.append(f"{name}: {kind}: {message}"[:300])
    return " | ".join(found)


OOM_MARKS = ("out of memory", "outofmemoryerror")
"""What torch's and vLLM's GPU memory errors say (lower case)."""


def ran_out_of_memory(logs: dict[str, str]) -> bool:
    """Whether any log of a run (`run_logs`) says a process ran out of GPU memory (the row's `oom`): a script
    can then retry with smaller packs, which would not help a run that failed otherwise."""
    return any(mark in text.lower() for text in logs.values() for mark in OOM_MARKS)


def measure(lines: list[dict], k: int, warmup: int, gpus: int = 0) -> dict:
    """The row of one run from its per-step metrics (steps after `warmup`); `gpus` = 0 on CPU."""
    steps = [x for x in lines if x.get("groups")]
    measured = steps[warmup:]
    if len(measured) < 2 and not (warmup > 0 and measured):
        raise RuntimeError(f"K={k}: only {len(measured)} measured steps")
    wall = (
        measured[-1]["time"] - steps[warmup - 1]["time"]
        if warmup > 0
        else measured[-1]["time"] - measured[0]["time"]
    )
    n = len(measured) if warmup > 0 else len(measured) - 1

    def mean(key: str) -> float:
        return statistics.fmean(x.get(key, 0.0) for x in measured)

    tokens = mean("tokens")
    return {
        "k": k,
        "steps": n,
        "wall_s": wall,
        "steps_per_s": n / wall,
        "step_s": wall / n,
        "tokens_per_step": tokens,
        "computed_tokens_per_step": mean("computed_tokens") or tokens,  # fewer with shared prompts
        "tokens_per_s_per_gpu": tokens * n / wall / max(gpus, 1),
        "gpus": gpus,
        "wait_s": mean("wait_s"),
        "train_s": mean("train_s"),
        "ref_pass_s": mean("ref_pass_s"),
        "proximal_pass_s": mean("proximal_pass_s"),
        "optimizer_s": mean("optimizer_s"),
        "optimizer_exposed_s": mean("optimizer_exposed_s"),
        "optimizer_copy_wait_s": mean("optimizer_copy_wait_s"),  # host AdamW: the rest of optimizer_s is CPU
        "write_lock_wait_s": mean("write_lock_wait_s"),  # cuda-ipc, parameters in the buffer: readers
        "train_pass_s": mean("train_pass_s"),
        "train_pass_mfu": mean("train_pass_mfu"),
        "sync_s": mean("sync_s"),
        "generate_s": mean("generate_s"),  # the seconds of every generate call the step's groups came from
        "generate_calls": mean("generate_calls"),  # how many: above 1, generate_s adds calls up
        "mfu": mean("mfu"),
        "learner_gpu_peak_gb": max((x.get("gpu_peak_gb", 0.0) for x in measured), default=0.0),
        "learner_alloc_retries": max((x.get("gpu_alloc_retries", 0.0) for x in measured), default=0.0),
        "staleness": mean("staleness_mean"),
        "response_len": mean("response_len"),
        "samples_per_step": mean("samples"),
        # vLLM's logprobs against the learner's on the same tokens: a generator computing wrong numbers (a
        # GEMM under an MPS cap that skips tiles, docs/benchmarks.md) shows here first
        "mismatch_kl": max((x.get("mismatch_kl", 0.0) for x in measured), default=0.0),
        "mismatch_abs_logprob_diff": max(
            (x.get("mismatch_abs_logprob_diff", 0.0) for x in measured), default=0.0
        ),
        # `optim.defer_update`: steps that held their AdamW for the next step's KL pass, and steps whose
        # held AdamW ran alone as the next step's groups were not all there yet (learner/trainer.py)
        "update_held": mean("update_held"),
        "update_settled_alone": mean("update_settled_alone"),
        "step_lines": [{key: x[key] for key in STEP_KEYS if key in x} for x in steps],  # warmup steps too
    }


STEP_KEYS = (
    "step", "time", "wait_s", "train_s", "ref_pass_s", "optimizer_s", "optimizer_exposed_s", "sync_s",
    "generate_s", "update_held", "update_settled_alone", "staleness_mean",
)  # fmt: skip
"""What a row keeps of every step, warmup included (`step_lines`): where a step's time went."""


def learner_facts(run_dir: Path) -> dict:
    """What the run's learner trained with, from the resolved config it wrote (`learner/config.learner.json`,
    after the launcher's layout capped its packs): pack size, recomputation, compilation, the host AdamW's
    CPU threads (0: every CPU), whether it held a step's AdamW for the next step's KL pass (False before
    `optim.defer_update`); {} without it."""
    path = run_dir / "learner" / "config.learner.json"
    if not path.is_file():
        return {}
    cfg = json.loads(path.read_text())
    return {
        "learner_pack_tokens": cfg["batching"]["max_tokens_per_microbatch"],
        "learner_checkpoint_mode": cfg["parallel"]["checkpoint_mode"]
        if cfg["parallel"]["activation_checkpointing"]
        else "none",
        "learner_compile": cfg["parallel"]["compile"],
        "learner_host_threads": cfg.get("optim", {}).get("host_threads", 0),
        "learner_reference_location": cfg["parallel"].get("reference_location", "device"),
        "learner_defer_update": cfg.get("optim", {}).get("defer_update", False),
    }


def learner_label(row: dict) -> str:
    """A row's packs and recomputation for its table line, e.g. "8k sel" or "32k full", with " ref@host" where
    the KL reference model lived in host memory ("" if unknown)."""
    tokens, mode = row.get("learner_pack_tokens"), row.get("learner_checkpoint_mode")
    if not tokens:
        return ""
    host = " ref@host" if row.get("learner_reference_location") == "host" else ""
    return f"{tokens // 1024}k {(mode or '?').replace('selective', 'sel')}{host}"


def mps_label(mps: bool, share: GeneratorShare) -> str:
    """How a run shared the GPU, for its run directory and its table line: "" (time slices), "mps",
    "mps40" (MPS with the generator capped at 40 % of the multiprocessors), "mps-low" (the generator at
    below-normal MPS client priority)."""
    return "mps" + share.label() if mps else ""


def reference(rows: list[dict]) -> dict:
    """The row every speedup is against: K = 0 with the batch loop if it ran, else the first row."""
    timed = [r for r in rows if r.get("steps_per_s")] or rows
    first = (r for r in timed if r["k"] == 0 and r.get("mode", "batch") == "batch" and not r.get("mps"))
    return next(first, timed[0])


def sharing(row: dict, base: dict) -> dict:
    """What sharing the hardware gave `row` against the reference row `base` (see `shared` above):
    {"overlap_bound": ...} for the reference row, {"learner_slowdown_s", "shared_gpus"} for a K >= 1 row,
    {} where either is untimed or the generation window is empty."""
    timed = row.get("steps_per_s") and base.get("steps_per_s") and base.get("train_s")
    if not timed:
        return {}
    if row is base:
        return {"overlap_bound": base["step_s"] / base["train_s"]}
    if row["k"] == 0 or not row.get("generate_s"):
        return {}
    slowdown = row["train_s"] - base["train_s"]
    shared = 1 - slowdown / row["generate_s"] + base["generate_s"] / row["generate_s"]
    return {"learner_slowdown_s": slowdown, "shared_gpus": shared}


def format_table(rows: list[dict]) -> str:
    base = reference(rows)
    head = (
        f"{'K':>2} {'mode':>8} {'learner':>9} {'tok/s/GPU':>9} {'steps/s':>8} {'speedup':>8} {'s/step':>7} "
        f"{'wait':>6} "
        f"{'train':>6} {'fwd+bwd':>7} {'prox':>6} {'ref':>6} {'optim':>6} {'exposed':>7} {'sync':>6} "
        f"{'generate':>8} {'staleness':>9} {'peak GB':>7} {'pass MFU':>8} {'shared':>6} {'|dlogp|':>7} extra"
    )
    out = [head, "-" * len(head)]
    for r in rows:
        label = mps_label(r.get("mps", False), GeneratorShare.of_row(r))
        mode = r.get("mode", "batch") + (f"+{label}" if label else "")
        if not r.get("steps_per_s"):
            out.append(f"{r['k']:>2} {mode:>8} {learner_label(r):>9} not timed: {r.get('error')}")
            continue
        speedup = r["steps_per_s"] / base["steps_per_s"] if base.get("steps_per_s") else 0.0
        share = sharing(r, base)
        shared = share.get("overlap_bound") or share.get("shared_gpus")
        shared = f"{shared:.2f}" + ("<" if "overlap_bound" in share else "") if shared else ""
        out.append(
            f"{r['k']:>2} {mode:>8} {learner_label(r):>9} {r.get('tokens_per_s_per_gpu', 0):>9.0f} "
            f"{r['steps_per_s']:>8.3f} {speedup:>7.2f}x {r['step_s']:>7.2f} "
            f"{r['wait_s']:>6.2f} {r['train_s']:>6.2f} {r.get('train_pass_s', 0):>7.2f} "
            f"{r.get('proximal_pass_s', 0):>6.2f} {r.get('ref_pass_s', 0):>6.2f} "
            f"{r.get('optimizer_s', 0):>6.2f} {r.get('optimizer_exposed_s', 0):>7.2f} {r['sync_s']:>6.3f} "
            f"{r['generate_s']:>8.2f} {r['staleness']:>9.2f} {r.get('learner_gpu_peak_gb', 0):>7.1f} "
            f"{100 * r.get('train_pass_mfu', 0):>7.1f}% {shared:>6} "
            f"{r.get('mismatch_abs_logprob_diff', 0):>7.4f} "
            f"{r.get('extra') or ''}".rstrip()
        )
    return "\n".join(out)
