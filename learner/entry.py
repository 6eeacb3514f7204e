"""The learner process on every rank: `run(cfg)` builds the Learner, trains, and closes it.

`python -m learner` (learner/__main__.py) parses the config, claims the run on rank 0
(learner/fencing.py) and calls `run` on each rank; tests call it the same way.
"""

from __future__ import annotations

import logging

from broker.transport import FencedError
from learner.config import LearnerConfig
from learner.fencing import lost_message
from learner.trainer import Learner
from runtime.config import write_resolved
from runtime.metrics import start_metrics_server
from runtime.redact import setup_logging

log = logging.getLogger("learner.trainer")


def run(cfg: LearnerConfig, claim=None) -> None:
    """Entry point of every rank (`python -m learner`); `claim`: rank 0's hold on the run
    (learner.fencing.claim_run), released at the end. A learner whose lease another learner took exits
    with SystemExit saying so, without writing anything more."""
    setup_logging("INFO", "%(asctime)s %(name)s %(levelname)s %(message)s")
    fence = claim.lease.fence if claim is not None else None
    learner = None
    try:
        learner = Learner(cfg, fence=fence)
        if learner.info.is_main:
            write_resolved(cfg, cfg.run_dir, "learner")
            start_metrics_server(cfg.metrics, learner.registry)
        learner.train()
    except KeyboardInterrupt:
        if learner is None:
            raise
        log.info("interrupted at step %d: saving and exporting", learner.state.step)
    except FencedError as exc:
        if learner is not None:
            learner.fenced = True
        raise SystemExit(lost_message(fence.epoch if fence else 0, str(exc))) from None
    finally:
        try:
            if learner is not None:
                learner.close()
        finally:
            if claim is not None:
                claim.release()
