"""`python -m reward_service`: score rollout groups with N worker processes on this host.

    python -m reward_service --workers 4 --broker.url redis://host:6379/0 --broker.namespace run1
    python -m reward_service --config deploy/configs/reward.toml --burst      # drain, then exit

With `--workers 1` the worker runs in this process. With more, this process supervises N children
(`python -m reward_service.worker`, config as JSON on stdin): worker i serves metrics on
metrics.port + i, a worker that dies is restarted with backoff (its pending groups are reclaimed
by the others meanwhile), and SIGTERM/SIGINT stop them all (SIGKILL after `GRACE_S`).
The Redis password: `--broker.password-file FILE` or $PARALLAX_BROKER_PASSWORD (broker/config.py).
The resolved config goes to `<run_dir>/config.reward.json`, the password shown as ***.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from reward_service.config import RewardConfig

log = logging.getLogger("reward_service")
GRACE_S = 30.0
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])


class Supervisor:
    """Starts, restarts and stops the worker processes of one host."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self.procs: dict[int, subprocess.Popen] = {}
        self.exit_codes: dict[int, int] = {}
        self.backoff_s = {i: 1.0 for i in range(cfg.workers)}
        self.stopping = False

    def start(self, index: int) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        proc = subprocess.Popen(
            [sys.executable, "-m", "reward_service.worker"], stdin=subprocess.PIPE, env=env
        )
        spec = {"config": dataclasses.asdict(self.cfg), "index": index}
        proc.stdin.write(json.dumps(spec).encode())
        proc.stdin.close()
        self.procs[index] = proc
        log.info("started reward worker %d (pid %d)", index, proc.pid)

    def stop(self, *_signal_args) -> None:
        self.stopping = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        for index in range(self.cfg.workers):
            self.start(index)
        while self.procs and not self.stopping:
            time.sleep(0.2)
            self._reap()
        self._terminate()
        return 0 if all(code == 0 for code in self.exit_codes.values()) else 1

    def _reap(self) -> None:
        for index, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None or self.stopping:
                continue
            del self.procs[index]
            self.exit_codes[index] = code
            if self.cfg.burst or code == 0:
                continue  # drained (burst) or asked to stop
            delay = self.backoff_s[index]
            self.backoff_s[index] = min(delay * 2, 60.0)
            log.error("reward worker %d exited with %d; restarting in %.0f s", index, code, delay)
            time.sleep(delay)
            self.start(index)

    def _terminate(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for index, proc in self.procs.items():
            try:
                self.exit_codes[index] = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                self.exit_codes[index] = proc.wait()
        self.procs.clear()


def main(argv: list[str] | None = None) -> int:
    from runtime.config import load_config, write_resolved
    from runtime.private import private_umask
    from runtime.redact import setup_logging

    private_umask()
    cfg = load_config(RewardConfig, argv, description="Parallax reward service: score rollout groups.")
    setup_logging(cfg.log_level, "%(asctime)s reward %(levelname)s %(message)s")
    write_resolved(cfg, cfg.run_dir, "reward")
    if cfg.workers == 1:
        from reward_service.worker import run_worker

        run_worker(cfg, 0)
        return 0
    return Supervisor(cfg).run()


if __name__ == "__main__":
    sys.exit(main())
