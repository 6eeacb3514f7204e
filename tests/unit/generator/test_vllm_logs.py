"""The skipped-set_num_threads warning of vLLM's CPU worker is shown once; its other lines all pass."""

import importlib.util
import logging
import re
from pathlib import Path

import pytest

from generator.vllm_logs import CPU_WORKER_LOGGER, SKIPPED_SET_NUM_THREADS, show_once

WARNING = "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it."


class Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_warning_passes_once_and_other_lines_always(request):
    logger = logging.getLogger(f"test.{request.node.name}")
    collect = Collect()
    logger.addHandler(collect)
    logger.propagate = False
    once = show_once(logger.name)
    assert show_once(logger.name) is once and len(logger.filters) == 1  # installed once per process
    for _ in range(3):
        logger.warning(WARNING)
        logger.warning("another warning %d", 7)
    assert collect.lines[0].startswith(WARNING) and "shown once" in collect.lines[0]
    assert collect.lines[1:] == ["another warning 7"] * 3


def test_the_filter_matches_what_vllm_logs_and_where():
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    source = (Path(spec.origin).parent / "v1" / "worker" / "cpu_worker.py").read_text()
    assert "init_logger(__name__)" in source and CPU_WORKER_LOGGER == "vllm.v1.worker.cpu_worker"
    assert SKIPPED_SET_NUM_THREADS in re.sub(r'"\s+"', "", source)  # its string literal, pieces joined
    assert WARNING.startswith(SKIPPED_SET_NUM_THREADS)
