"""The learner entry point: flags resolve before torch is imported; multi-rank re-launch command."""

import subprocess
import sys
from pathlib import Path

from learner.__main__ import relaunch_command, world_size_wanted

ROOT = Path(__file__).resolve().parents[3]


def test_world_size_from_gpus_or_nproc():
    assert world_size_wanted([0, 1, 2], 1) == 3
    assert world_size_wanted([], 4) == 4
    assert world_size_wanted([], 0) == 1


def test_relaunch_runs_this_module_under_torch_distributed():
    cmd = relaunch_command(2)
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert "--nproc-per-node=2" in cmd
    assert cmd[-2:] == ["-m", "learner"]  # flags travel in a JSON file, not through torchrun's parser


def test_relaunched_rank_reads_the_resolved_config(tmp_path, monkeypatch):
    from learner.__main__ import CONFIG_ENV, resolve
    from learner.config import LearnerConfig
    from learner.loss_config import CispoLoss, IcepopCorrection
    from runtime.config import write_resolved

    cfg = LearnerConfig(model="/m", nproc=2)
    cfg.loss.policy, cfg.loss.correction = CispoLoss(clip_high=2.0), IcepopCorrection(low=0.4)
    cfg.optim.betas = (0.8, 0.9)
    monkeypatch.setenv(CONFIG_ENV, str(write_resolved(cfg, tmp_path, "learner")))
    monkeypatch.setenv("RANK", "1")
    got = resolve(["--model", "ignored"])
    assert got.model == "/m" and tuple(got.optim.betas) == (0.8, 0.9)
    assert (got.loss.policy, got.loss.correction) == (CispoLoss(clip_high=2.0), IcepopCorrection(low=0.4))


def test_config_resolves_without_importing_torch(tmp_path):
    toml = tmp_path / "learner.toml"
    toml.write_text('model = "/x"\n[loss.correction]\ntype = "tis"\n')
    code = (
        "import sys\n"
        "from learner.config import LearnerConfig\n"
        "from runtime.config import apply_gpus, load_config\n"
        f"cfg = load_config(LearnerConfig, ['--config', {str(toml)!r}, '--algo.groups-per-step', '3'])\n"
        "apply_gpus('2-3')\n"
        "assert 'torch' not in sys.modules, 'torch imported before CUDA_VISIBLE_DEVICES was set'\n"
        "import os\n"
        "print(cfg.model, cfg.loss.correction.type, cfg.algo.groups_per_step,"
        " os.environ['CUDA_VISIBLE_DEVICES'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["/x", "tis", "3", "2,3"]


def test_a_rank_gets_the_redacted_password_from_the_environment(tmp_path, monkeypatch):
    from broker.config import PASSWORD_ENV, BrokerConfig
    from learner.__main__ import CONFIG_ENV, resolve
    from learner.config import LearnerConfig
    from runtime.config import write_resolved

    cfg = LearnerConfig(model="/m", broker=BrokerConfig(url="redis://:pw-123@h:6379/0"))
    path = write_resolved(cfg, tmp_path, "learner")
    assert "pw-123" not in path.read_text() and "redis://:***@h:6379/0" in path.read_text()
    monkeypatch.setenv(CONFIG_ENV, str(path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv(PASSWORD_ENV, cfg.broker.password())  # what main() does before re-launching
    assert resolve([]).broker.connect_url() == "redis://:pw-123@h:6379/0"


def test_a_missing_model_directory_is_named_before_anything_starts(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "learner", "--model", str(tmp_path / "no-such-model")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert f"error: model {tmp_path / 'no-such-model'}: no such directory" in out.stderr
    assert "Traceback" not in out.stderr
