"""The all-in-one launcher: the whole Parallax pipeline on one machine, as separate processes.

    python -m deploy                         # the CPU demo (what `./run demo` runs)
    python -m deploy --broker zmq            # the same over the ZeroMQ broker
    python -m deploy --task.shuffle-images   # control: images unrelated to the questions
    python -m deploy --config deploy/configs/demo.toml --learner.optim.lr 1e-4
    python -m deploy --learner.gpus 0 --generator.gpus 0 ...          # one GPU shared (CUDA-IPC weights)
    python -m deploy --learner.gpus 0 --generator.gpus 0 --mps ...    # the same, under CUDA MPS (gpus/mps.py)
    python -m deploy --learner.gpus 0-5 --generator.gpus 6-7 ...      # split GPUs (NCCL broadcast)
    python -m deploy --config deploy/configs/qwen2_5_vl_7b_geometry3k.toml --model DIR \\
        --task geometry3k --task.data-dir GEO3K_DIR                   # a real checkpoint on real data

GPU indices count among CUDA_VISIBLE_DEVICES; deploy.gpus.layout.plan_gpus decides which process gets
which GPU and how the weights travel (docs/gpu-layouts.md). Before anything starts, the launcher checks
the checkpoint, the GPU indices, the memory estimate and that vLLM is importable (deploy/preflight.py).

Stages (deploy/stages.py), each shown in the live progress and logged in events.jsonl:
  build      the model preset, built locally (`python -m policy build`, cached by config hash);
  task       the task's splits (`python -m tasks synthetic`, or `python -m tasks geometry3k`);
  broker     a local redis-server (or `python -m broker zmq-broker`) on a free port;
  reward     `python -m reward_service`;
  warm-start the format warm start (`python -m learner.warmstart`), skipped with `--warm-start.steps 0`;
  rl         `python -m generator` and `python -m learner`, until the learner's max_steps,
             `--max-minutes`, `--stop-accuracy` or Ctrl-C.

A crashed role is started again up to `--max-restarts` times (the budget refills after
`--restart-refill-s` up), a role whose heartbeat went silent for `--watchdog-s` is restarted too, and
`--resume RUN_DIR` continues a stopped run (deploy/supervisor.py, deploy/resume.py;
docs/fault-tolerance.md). `python -m deploy scale RUN_DIR --generators N` adds or removes generators while
it runs (deploy/scale.py, docs/scaling.md). The run directory, runs/<timestamp>/ (private to the user: mode
0700), holds each role's config and log, the metrics, events.jsonl, summary.json and curve.png
(docs/demo.md).
Ctrl-C stops every process the launcher started, the roles newest first, then the broker.
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

from deploy import stages
from deploy.credentials import RunCredentials
from deploy.gpus.indices import LayoutError
from deploy.gpus.layout import GpuPlan, gpu_env
from deploy.gpus.mps import GeneratorShare, check_layout
from deploy.plan import LaunchConfig, gpu_plan, role_configs, write_role_configs
from deploy.preflight import ModelInfo, PreflightError, inspect_model, require_vllm, visible_gpus
from deploy.processes import ChildDied, child_env
from deploy.progress import JsonlTail, Progress
from deploy.resume import read_namespace, resumed_config, split_resume, write_identity
from deploy.scale import Scaler
from deploy.supervisor import Supervisor
from runtime.config import write_resolved
from runtime.private import private_dir, private_umask

ROOT = Path(__file__).resolve().parents[1]


class Launcher:
    """One run of the pipeline; `run()` returns the process exit code."""

    def __init__(self, cfg: LaunchConfig, resume: bool = False):
        self.cfg = cfg
        self.resume = resume
        self.run_id = uuid.uuid4().hex[:12]
        stamp = time.strftime("%Y%m%d-%H%M%S")
        private_umask()  # the run directory and everything the run writes: this user's only
        self.run_dir = private_dir(Path(cfg.run_dir or ROOT / "runs" / stamp).resolve())
        self.credentials = RunCredentials.prepare(self.run_dir, cfg.broker_password_file)
        self.namespace = read_namespace(self.run_dir) if resume else f"run-{stamp}-{self.run_id[:4]}"
        write_identity(self.run_dir, self.run_id, self.namespace)
        env = child_env(cfg.threads, self.run_id)
        self.sv = Supervisor(self.run_dir, env, cfg.max_restarts, cfg.restart_refill_s, cfg.watchdog_s)
        self.metrics = JsonlTail(self.run_dir / "learner" / "metrics.jsonl")
        self.outcome = "running"

    def run(self) -> int:
        sv = self.sv
        sv.event("resume" if self.resume else "launch", chance=self.cfg.chance(), run_id=self.run_id)
        write_resolved(self.cfg, self.run_dir, "launcher")
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        # Ctrl-C must stop the run even when this process was started with SIGINT ignored (a shell's
        # background job, nohup): Python installs its KeyboardInterrupt handler only if SIGINT was at default.
        previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
        code = 0
        try:
            with Progress(self.cfg.progress, title=f"Parallax demo  {self.run_dir}") as sv.progress:
                try:
                    self._pipeline()
                except KeyboardInterrupt:
                    self.outcome, code = "interrupted", 130
                except ChildDied as exc:
                    self.outcome, code = "failed", 1
                    sv.progress.error(f"[launcher] {exc}{sv.explain()}")
                except (PreflightError, LayoutError) as exc:
                    self.outcome, code = "failed", 2
                    sv.progress.error(f"[launcher] cannot start: {exc} (run dir {self.run_dir})")
                    sv.event("error", error=str(exc))
                finally:
                    sv.stop_all(self.outcome)
                self._finish()
        finally:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, previous_int)
        return code

    def _pipeline(self) -> None:
        """The stages in order (deploy/stages.py): build, task, broker, reward, warm-start, rl."""
        cfg, sv = self.cfg, self.sv
        self._plan(None)  # indices and overlaps, before anything is built
        model_dir = stages.build_model(sv, cfg)
        gpus = self._plan(inspect_model(model_dir))
        if cfg.mps:
            sv.start_mps()
        task_dir, test_dir = stages.write_task(sv, cfg, model_dir)
        broker_url = stages.start_broker(sv, cfg, self.credentials)
        sv.stage("reward")
        creds = self.credentials

        def configs_for(model: Path):
            configs = role_configs(
                cfg,
                self.run_dir,
                model,
                task_dir,
                broker_url,
                self.namespace,
                test_dir=test_dir,
                gpus=gpus,
                password_file=str(creds.password_file),
                auth_key_file=str(creds.key_file),
            )
            return configs, write_role_configs(configs, self.run_dir)

        configs, paths = configs_for(model_dir)
        sv.start(sv.roles, "reward", "reward_service", ["--config", str(paths["reward"])], restart=True)
        if cfg.warm_start.steps > 0:
            model_dir = stages.warm_start(sv, cfg, model_dir, task_dir, gpus, self.resume)
            configs, paths = configs_for(model_dir)
        port = configs["generator"].metrics.port
        learner = stages.start_rl(sv, cfg, gpus, model_dir, paths, port)
        scaler = Scaler(sv, paths["generator"], configs["generator"], on_gpus=gpus.kind != "cpu")
        try:
            self.outcome = stages.train(sv, cfg, learner, port, self.metrics, on_tick=scaler.poll)
        finally:
            scaler.close()

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
            for group in (self.sv.infra, self.sv.roles):
                group.env.update(gpu_env(os.environ))
        if n_params:
            self.sv.event("plan", **dataclasses.asdict(gpus), n_params=n_params)
        return gpus

    def _finish(self) -> None:
        """summary.json and curve.png of the run, and its last line."""
        from deploy.plot import plot_runs, run_curve, summarize

        sv = self.sv
        sv.status.learner(self.metrics.read())
        curve = run_curve(self.run_dir, label="demo" if not self.cfg.task.shuffle_images else "control")
        if not (curve.reward or curve.eval_acc):  # an empty plot and a summary of nothing would mislead
            if self.outcome != "failed":  # a failure has said why (and a refused start where the run dir is)
                sv.progress.message(
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
        sv.progress.show(sv.status, force=True)
        accuracy = (
            f"held-out accuracy {summary['first_eval_accuracy']} -> {summary['final_eval_accuracy']} "
            f"(best {summary['best_eval_accuracy']}); "
            if summary["evals"]
            else ""
        )
        sv.progress.message(
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
