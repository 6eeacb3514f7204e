"""The launcher's stage runners, one function a stage, each on the run's `Supervisor` (deploy/supervisor.py).

    build_model    build      `python -m policy build` (or the user's checkpoint, inspected)
    write_task     task       `python -m tasks synthetic`, or `python -m tasks geometry3k` once per split
    start_broker   broker     a local redis-server (AOF in the run directory) or `python -m broker zmq-broker`
    warm_start     warm-start `python -m learner.warmstart` (kept from before on a resumed run)
    start_rl       rl         the GEMM check under a generator cap (`python -m deploy.gpus.cap_check`), then
                              `python -m generator` and `python -m learner`
    train          rl         watch the learner until max_steps, the time limit or the target accuracy

deploy/launcher.py runs them in that order (after the reward service starts); each raises ChildDied when
a process it needs died, with the process's last log lines.
"""

from __future__ import annotations

import time
from pathlib import Path

from broker.redis_server import write_redis_config
from deploy.credentials import RunCredentials
from deploy.gpus.layout import GpuPlan
from deploy.gpus.mps import GeneratorShare, time_slice_notice
from deploy.plan import LaunchConfig
from deploy.preflight import PreflightError, inspect_model
from deploy.processes import Child, ChildDied, free_port, port_open, tail
from deploy.progress import JsonlTail, scrape
from deploy.supervisor import Supervisor
from runtime.private import private_dir


def build_model(sv: Supervisor, cfg: LaunchConfig) -> Path:
    """The model this run trains: the user's checkpoint, or the preset built locally (cached)."""
    if cfg.model:
        sv.stage("build", f"using {cfg.model}")
        return inspect_model(cfg.model).path
    sv.stage("build", cfg.preset)
    args = ["build", "--preset", cfg.preset, "--seed", str(cfg.model_seed)]
    child = sv.start(sv.infra, "build", "policy", args, critical=False)
    sv.wait(child)
    return Path(child.log_path.read_text().strip().splitlines()[-1])


def write_task(sv: Supervisor, cfg: LaunchConfig, model_dir: Path) -> tuple[Path, Path]:
    """(training task directory, held-out task directory) of this run."""
    if cfg.task.task == "geometry3k":
        return _geometry3k(sv, cfg, model_dir)
    t = cfg.task
    sv.stage(
        "task",
        f"{t.task}, {t.train} train / {t.test} test" + (", SHUFFLED images" if t.shuffle_images else ""),
    )
    out = sv.run_dir / "data"
    sv.wait(sv.start(sv.infra, "task", "tasks", t.synthetic_args(out), critical=False))
    return out, out


def _geometry3k(sv: Supervisor, cfg: LaunchConfig, model_dir: Path) -> tuple[Path, Path]:
    """Preprocess the train and test parquet files into two task directories (one child each)."""
    from tasks.geometry3k import find_splits

    t, g = cfg.task, cfg.generator
    try:
        splits = find_splits(t.data_dir)
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    sv.stage("task", f"geometry3k from {t.data_dir}: " + ", ".join(p.name for p in splits.values()))
    max_prompt_len = g.engine.max_model_len - g.sampling.max_tokens
    dirs = {}
    for split, parquet in splits.items():
        out = sv.run_dir / "data" / split
        args = ["geometry3k", "--input", str(parquet), "--out", str(out), "--split", split]
        args += ["--model", str(model_dir), "--max-prompt-len", str(max_prompt_len)]
        sv.wait(sv.start(sv.infra, f"task-{split}", "tasks", args, critical=False))
        dirs[split] = out
    return dirs["train"], dirs["test"]


def start_broker(sv: Supervisor, cfg: LaunchConfig, creds: RunCredentials) -> str:
    """Start the broker on a free port, with the run's password, and wait until it listens; returns its
    URL (without the password: the roles read `creds.password_file`)."""
    sv.stage("broker", cfg.broker)
    port = free_port()
    if cfg.broker == "redis":  # AOF in the run directory: restarts and --resume lose nothing
        data_dir = private_dir(sv.run_dir / "redis")  # its settings hold the password: a 0600 file
        argv = write_redis_config(data_dir / "redis.conf", port, creds.password, data_dir=str(data_dir))
        sv.infra.start("redis", argv, restarts=cfg.max_restarts)
        url = f"redis://127.0.0.1:{port}/0"
    else:
        args = [
            "zmq-broker",
            "--bind",
            f"tcp://127.0.0.1:{port}",
            "--password-file",
            str(creds.password_file),
        ]
        sv.start(sv.infra, "zmq-broker", "broker", args)
        url = f"zmq://127.0.0.1:{port}"
    sv.write_pids()
    deadline = time.monotonic() + 30
    while not port_open(port):
        sv.infra.check()
        if time.monotonic() > deadline:
            raise ChildDied(f"the {cfg.broker} broker did not open port {port} within 30 s")
        time.sleep(0.1)
    return url


def warm_start(
    sv: Supervisor, cfg: LaunchConfig, model_dir: Path, task_dir: Path, gpus: GpuPlan, resume: bool
) -> Path:
    """The format warm start of `model_dir` on the learner's first GPU; returns the checkpoint it wrote
    (a resumed run keeps the one it wrote before)."""
    ws = cfg.warm_start
    out = sv.run_dir / "warmstart" / "model"
    if resume and (out / "config.json").is_file():
        sv.stage("warm-start", "done before (resumed run)")
        return out
    sv.stage("warm-start", f"{ws.steps} supervised steps on random answers")
    args = warm_start_args(cfg, model_dir, task_dir, out, "cpu" if gpus.kind == "cpu" else "cuda")
    child = sv.start(
        sv.roles,
        "warmstart",
        "learner.warmstart",
        args,
        critical=False,
        env={"CUDA_VISIBLE_DEVICES": gpus.learner_gpus.split(",")[0]} if gpus.kind != "cpu" else None,
    )
    tail_ = JsonlTail(out.with_name(out.name + ".metrics.jsonl"))
    sv.wait(child, on_tick=lambda: sv.status.warm(tail_.read()))
    return out


def warm_start_args(cfg: LaunchConfig, model_dir: Path, task_dir: Path, out: Path, device: str) -> list[str]:
    """The arguments of `python -m learner.warmstart` for this launch (deploy/docker-compose.yml's
    `warmstart` service runs the same)."""
    ws = cfg.warm_start
    args = ["--model", str(model_dir), "--task-dir", str(task_dir), "--out", str(out)]
    args += ["--steps", str(ws.steps), "--batch", str(ws.batch), "--lr", str(ws.lr)]
    return args + ["--seed", str(cfg.learner.seed), "--thought", ws.thought, "--device", device]


def check_cap(sv: Supervisor, model_dir: Path, gpus: GpuPlan, share: GeneratorShare) -> None:
    """Under a generator cap, before vLLM starts: the model's GEMMs on the generator's GPU under its MPS
    environment (deploy/gpus/cap_check.py); a cap that leaves GEMM outputs unwritten ends the run here."""
    env = {"CUDA_VISIBLE_DEVICES": gpus.generator_gpus, **share.env()}
    args = ["--model", str(model_dir)]
    sv.wait(sv.start(sv.roles, "cap-check", "deploy.gpus.cap_check", args, critical=False, env=env))


def start_rl(
    sv: Supervisor, cfg: LaunchConfig, gpus: GpuPlan, model_dir: Path, paths: dict[str, Path], port: int
) -> Child:
    """The rl stage: the generator (from `paths["generator"]`, metrics on `port`), then the learner;
    returns the learner. On a shared GPU the learner starts once vLLM serves, and a failed vLLM start is
    final."""
    sv.stage("rl", "" if gpus.kind == "cpu" else gpus.describe())
    shared = gpus.kind == "shared"
    sv.notice(time_slice_notice(cfg.mps, gpus, cfg.learner.algo.max_staleness))
    share = GeneratorShare.of(cfg)
    if cfg.mps and share.sms < 100:
        check_cap(sv, model_dir, gpus, share)
    generator = sv.start(
        sv.roles,
        "generator",
        "generator",
        ["--config", str(paths["generator"])],
        env=share.env(),  # {}: no --mps settings
        restart=not shared,
    )
    if shared:  # vLLM checks the GPU's free memory at start: let it go first, and a failed start is final
        wait_ready(sv, generator, port, cfg.generator_start_s)
        generator.max_restarts = cfg.max_restarts
    args = ["--config", str(paths["learner"])]
    return sv.start(sv.roles, "learner", "learner", args, critical=False, restart=True)


def wait_ready(sv: Supervisor, generator: Child, port: int, timeout_s: float) -> None:
    """Wait until the generator serves (its metrics port is open, or its log says so)."""
    sv.progress.message("[launcher] waiting for the generator's vLLM engine before starting the learner")
    deadline = time.monotonic() + timeout_s
    while not (port_open(port) if port else "serving version" in tail(generator.log_path, 200)):
        sv.check()
        if time.monotonic() > deadline:
            raise ChildDied(
                f"the generator's vLLM engine did not start within {timeout_s:.0f} s "
                f"(--generator-start-s); last log lines:\n{tail(generator.log_path)}"
            )
        sv.progress.show(sv.status)
        time.sleep(0.5)


def train(
    sv: Supervisor, cfg: LaunchConfig, learner: Child, generator_port: int, metrics: JsonlTail, on_tick=None
) -> str:
    """Watch the run until it ends; returns its outcome: max_steps (the learner finished), time_limit
    (--max-minutes) or target_reached (--stop-accuracy). `on_tick()` runs once a second (deploy/scale.py)."""
    deadline = sv.status.started + cfg.max_minutes * 60 if cfg.max_minutes > 0 else float("inf")
    url = f"http://127.0.0.1:{generator_port}/metrics" if generator_port else ""
    while True:
        sv.check()
        if on_tick is not None:
            on_tick()
        _observe(sv, metrics, url)
        code = learner.popen.poll()
        if code is not None and (code == 0 or learner.max_restarts == 0):  # else: restarted by check()
            _observe(sv, metrics, url)
            if code != 0:
                raise ChildDied(f"learner exited with code {code}; last log lines:\n{tail(learner.log_path)}")
            return "max_steps"
        if time.time() >= deadline:
            return "time_limit"
        target = cfg.stop_accuracy
        if target > 0 and sv.status.eval_accuracy is not None and sv.status.eval_accuracy >= target:
            return "target_reached"
        time.sleep(1.0)


def _observe(sv: Supervisor, metrics: JsonlTail, url: str) -> None:
    """Fold the learner's new metrics lines and the generator's token counter into the live status."""
    sv.status.learner(metrics.read())
    if url:
        tokens = scrape(url, ("parallax_generator_tokens_total",)).get("parallax_generator_tokens_total")
        if tokens is not None:
            sv.status.generator_tokens.add(tokens, time.time())
    sv.progress.show(sv.status)
