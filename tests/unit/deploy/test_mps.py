"""deploy/gpus/mps.py: the launcher's CUDA MPS daemon for a shared GPU, with a stand-in control program.

CPU only: the stand-in `nvidia-cuda-mps-control` opens the control socket path the real one would,
records its environment and the commands it is sent, and stays up until it is stopped.
"""

from __future__ import annotations

import os
import stat
import time

import pytest

from deploy.gpus.indices import LayoutError
from deploy.gpus.layout import GpuPlan
from deploy.gpus.mps import GeneratorShare, MpsDaemon, check_layout, time_slice_notice
from deploy.plan import LaunchConfig
from deploy.processes import ChildDied, ProcessGroup
from runtime.config import load_config

SHARED = GpuPlan("shared", "3", "3", ((3,),), "cuda-ipc")

FAKE = """#!/bin/sh
if [ "$1" = "-f" ]; then
  echo "visible=$CUDA_VISIBLE_DEVICES log=$CUDA_MPS_LOG_DIRECTORY" > "$RECORD/started"
  [ -n "$FAKE_EXIT" ] && exit 7
  : > "$CUDA_MPS_PIPE_DIRECTORY/control"
  exec sleep 60
fi
cat > "$RECORD/command"
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    script = bin_dir / "nvidia-cuda-mps-control"
    script.write_text(FAKE)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("RECORD", str(record))
    return record


def test_the_daemon_starts_on_the_shared_gpu_and_quits_at_the_end(fake_control, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")  # the launcher's own restriction does not reach it
    run_dir = tmp_path / "run"
    with ProcessGroup(run_dir) as group:
        mps = MpsDaemon(run_dir)
        env = mps.start(group)
        # no CUDA_VISIBLE_DEVICES: clients number GPUs among the server's, so the server sees them all
        assert (fake_control / "started").read_text().split() == ["visible=", f"log={run_dir / 'mps'}"]
        assert env["CUDA_MPS_LOG_DIRECTORY"] == str(run_dir / "mps")
        pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
        assert len(os.path.join(pipe, "control")) < 108  # a Unix socket path
        mps.stop()
        assert (fake_control / "command").read_text() == "quit\n"
        assert not os.path.exists(pipe)
        daemon = group.children[0]
    assert daemon.popen.poll() is not None  # the group stopped what the quit left


def test_a_daemon_that_exits_at_start_is_a_clear_error(fake_control, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_EXIT", "1")
    with ProcessGroup(tmp_path) as group, pytest.raises(ChildDied, match="MPS control daemon exited"):
        MpsDaemon(tmp_path).start(group, timeout_s=5)


def test_no_control_program_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with ProcessGroup(tmp_path) as group, pytest.raises(LayoutError, match="drop --mps"):
        MpsDaemon(tmp_path).start(group)
    assert not group.children


def test_mps_is_for_a_shared_gpu_only():
    check_layout(True, SHARED)
    check_layout(False, GpuPlan("split", "0", "1", ((1,),), "broadcast"))
    for kind in ("split", "cpu"):
        with pytest.raises(LayoutError, match="--learner.gpus 0 --generator.gpus 0"):
            check_layout(True, GpuPlan(kind, "", "", (), "broadcast"))


def test_a_shared_gpu_at_k_1_without_mps_says_its_roles_take_turns():
    assert "without --mps" in time_slice_notice(False, SHARED, max_staleness=1)
    assert time_slice_notice(True, SHARED, max_staleness=1) == ""  # under MPS
    assert time_slice_notice(False, SHARED, max_staleness=0) == ""  # K = 0 takes turns by design
    assert time_slice_notice(False, GpuPlan("split", "0", "1", ((1,),), "broadcast"), max_staleness=1) == ""


def test_the_flag_parses():
    assert load_config(LaunchConfig, ["--mps"]).mps and not LaunchConfig().mps


def test_the_group_env_reaches_a_role(fake_control, tmp_path):
    """What the launcher does with the returned env: every role started afterwards sees the pipe."""
    roles = ProcessGroup(tmp_path)
    with ProcessGroup(tmp_path) as infra:
        mps = MpsDaemon(tmp_path)
        roles.env.update(mps.start(infra))
        child = roles.start("probe", ["sh", "-c", 'echo "$CUDA_MPS_PIPE_DIRECTORY" > "$RECORD/probe"'])
        child.popen.wait(timeout=10)
        deadline = time.monotonic() + 5
        while not (fake_control / "probe").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (fake_control / "probe").read_text().strip() == str(mps.pipe_dir)
        mps.stop()


def test_the_generator_cap_is_checked_and_reaches_only_the_generator():
    cfg = load_config(LaunchConfig, ["--mps", "--mps-generator-sms", "40"])
    assert cfg.mps_generator_sms == 40 and LaunchConfig().mps_generator_sms == 100
    check_layout(True, SHARED, GeneratorShare(40))
    assert GeneratorShare(40).env() == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40"}
    assert GeneratorShare(100).env() == {}  # no cap: the driver's default, nothing set
    for bad in (0, 101, -5):
        with pytest.raises(LayoutError, match="1-100"):
            check_layout(True, SHARED, GeneratorShare(bad))
    with pytest.raises(LayoutError, match="add --mps"):
        check_layout(False, SHARED, GeneratorShare(40))


def test_the_generator_priority_is_checked_and_reaches_only_the_generator():
    cfg = load_config(LaunchConfig, ["--mps", "--mps-generator-priority", "below-normal"])
    assert cfg.mps_generator_priority == "below-normal" and LaunchConfig().mps_generator_priority == "normal"
    check_layout(True, SHARED, GeneratorShare(100, "below-normal"))
    assert GeneratorShare(100, "below-normal").env() == {"CUDA_MPS_CLIENT_PRIORITY": "1"}
    assert GeneratorShare(40, "below-normal").env() == {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40",
        "CUDA_MPS_CLIENT_PRIORITY": "1",
    }
    assert GeneratorShare(100, "normal").env() == {}  # the driver's default: nothing set
    with pytest.raises(LayoutError, match="add --mps"):
        check_layout(False, SHARED, GeneratorShare(100, "below-normal"))
    with pytest.raises(LayoutError, match="one of normal, below-normal"):
        check_layout(True, SHARED, GeneratorShare(100, "high"))
    with pytest.raises(SystemExit):  # tyro: not one of the choices
        load_config(LaunchConfig, ["--mps", "--mps-generator-priority", "high"])


def test_the_generator_settings_come_from_the_config_and_label_its_runs():
    cfg = load_config(
        LaunchConfig,
        [
            "--mps",
            "--mps-generator-sms",
            "40",
            "--mps-generator-priority",
            "below-normal",
        ],
    )
    share = GeneratorShare.of(cfg)
    assert share == GeneratorShare(40, "below-normal")
    assert share.label() == "40-low" and GeneratorShare().label() == ""
    assert GeneratorShare.of(LaunchConfig()) == GeneratorShare()
    row = {
        "mps_generator_sms": 50,
        "mps_generator_blas": "default",
    }  # an older row: no priority, a BLAS setting since dropped
    assert GeneratorShare.of_row(row) == GeneratorShare(50) and GeneratorShare.of_row({}) == GeneratorShare()


def test_one_command_runs_alone_under_the_daemon_with_the_generator_settings(fake_control, tmp_path):
    """`python -m deploy.gpus.mps`: the launcher's daemon and the generator's env around one command, which
    quits the daemon whether the command exits, fails or runs past its timeout."""
    from deploy.gpus.mps import main

    probe = (
        'echo "$CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE $CUDA_MPS_CLIENT_PRIORITY"'
        ' > "$RECORD/probe"; exit 5'
    )
    low = ["--mps-generator-priority", "below-normal"]
    argv = ["--mps-generator-sms", "40", *low, "--run-dir", str(tmp_path / "run"), "--", "sh", "-c", probe]
    assert main(argv) == 5  # the command's own exit code
    pipe, cap, priority = (fake_control / "probe").read_text().split()
    assert cap == "40" and priority == "1" and pipe.startswith("/tmp/") and not os.path.exists(pipe)
    assert (fake_control / "command").read_text() == "quit\n"

    (fake_control / "command").unlink()
    started = time.monotonic()
    assert main(["--timeout-s", "0.5", "--run-dir", str(tmp_path / "run"), "--", "sleep", "30"]) == 124
    assert time.monotonic() - started < 20
    assert (fake_control / "command").read_text() == "quit\n"

    assert main(["--mps-generator-sms", "0", "--", "true"]) == 2  # checked as the launcher checks it
    with pytest.raises(SystemExit):
        main(["--mps-generator-sms", "40"])  # no command
