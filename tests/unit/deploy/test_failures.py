"""The failure classifier on the errors' real texts: each kind recognised precisely, with the action and
the fix it names; supervision stops at once on a disk full and restarts on a broker out of memory."""

import sys

import pytest

from deploy.failures import classify
from deploy.processes import ChildDied, ProcessGroup
from tests.unit.deploy.test_processes import _wait_exit

BROKER_OOM = """Traceback (most recent call last):
  File "/app/broker/redis_transport.py", line 104, in _call
    result = fn(*args, **kwargs)
redis.exceptions.OutOfMemoryError: OOM command not allowed when used memory > 'maxmemory'.

The above exception was the direct cause of the following exception:

broker.transport.TransportError: redis publish failed (redis://127.0.0.1:40123/0): OOM command not allowed \
when used memory > 'maxmemory'."""
GPU_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
    "79.10 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.03 GiB memory "
    "in use."
)
DISK_FULL = {
    "python": "OSError: [Errno 28] No space left on device: '/runs/x/learner/checkpoints/step-00000004.tmp'",
    "safetensors": "safetensors_rust.SafetensorError: Error while serializing: IoError(Os { code: 28, kind: "
    'StorageFull, message: "No space left on device" })',
    "redis": "broker.transport.TransportError: redis ack failed (redis://127.0.0.1:40123/0): MISCONF Errors "
    "writing to the AOF file: No space left on device",
}
CORRUPT = {
    "manifest": "learner.manifest.CorruptCheckpoint: no usable checkpoint in /runs/x/learner/checkpoints: "
    "/runs/x/learner/checkpoints/step-00000004/model.safetensors: 1024 bytes, the manifest says 90112",
    "unverified": "safetensors_rust.SafetensorError: Error while deserializing header: "
    "MetadataIncompleteBuffer",
}


def test_a_broker_out_of_memory_is_not_a_gpu_one():
    failure = classify(BROKER_OOM)
    assert failure.kind == "broker out of memory" and failure.action == "retry"
    assert "maxmemory" in failure.fix and "backlog" in failure.fix and "GPU" not in failure.fix


def test_a_gpu_out_of_memory_restarts_once():
    failure = classify(GPU_OOM)
    assert failure.kind == "GPU out of memory" and failure.action == "repeat"
    assert "gpu-memory-utilization" in failure.fix


@pytest.mark.parametrize("source", sorted(DISK_FULL))
def test_a_full_disk_stops_the_run_and_names_resume(source):
    failure = classify(DISK_FULL[source])
    assert failure.kind == "disk full" and failure.action == "stop"
    assert "free space" in failure.fix and "--resume RUN_DIR" in failure.fix


@pytest.mark.parametrize("source", sorted(CORRUPT))
def test_a_damaged_checkpoint_stops_the_run(source):
    failure = classify(CORRUPT[source])
    assert failure.kind == "damaged checkpoint" and failure.action == "stop"
    assert "checkpoints" in failure.fix


def test_a_second_learner_of_the_run_stops_it_naming_the_holder():
    from learner.fencing import Holder, lost_message, refusal

    for text in (refusal(Holder(run_dir="/runs/x/learner"), 3, "run-1"), lost_message(3, "FENCED lease")):
        failure = classify(text)
        assert failure is not None and failure.kind == "run held by another learner", text
        assert failure.action == "stop" and "--broker.namespace" in failure.fix


def test_unknown_errors_are_not_classified():
    assert classify("ValueError: something else\nKeyError: 'x'") is None
    assert classify("") is None


def test_supervision_stops_at_once_on_a_full_disk_and_restarts_a_broker_out_of_memory(tmp_path):
    group = ProcessGroup(tmp_path, classify=classify)
    full = group.start(
        "learner", [sys.executable, "-c", f"print({DISK_FULL['python']!r}); exit(1)"], restarts=3
    )
    _wait_exit(full)
    with pytest.raises(ChildDied, match=r"\(disk full\): not restarted"):
        group.check()
    assert full.restarts == 0
    group.stop()
    group = ProcessGroup(tmp_path, classify=classify)
    oom = group.start("generator", [sys.executable, "-c", f"print({BROKER_OOM!r}); exit(1)"], restarts=3)
    _wait_exit(oom)
    group.check()
    assert oom.restarts == 1 and oom.failure.kind == "broker out of memory"
    _wait_exit(oom)
    group.check()  # the same failure again: still restarted (the backlog may drain), after its back-off
    assert not oom.repeated and not oom.final
    group.stop()
