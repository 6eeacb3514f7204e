"""The launcher's shipped configs (deploy/configs/*.toml read by `python -m deploy --config`).

Each parses into LaunchConfig and yields valid role configs; the Qwen2.5-VL-7B Geometry3k reference
config carries exactly the values of the deployment's role files (learner.toml, generator.toml,
reward.toml), apart from what the launcher sets per run.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from deploy.gpus.layout import plan_gpus
from deploy.plan import LaunchConfig, role_configs
from generator.config import GeneratorConfig
from learner.config import LearnerConfig
from reward_service.config import RewardConfig
from runtime.config import load_config, validate
from tests.unit.deploy.test_gpu_plan import h200s

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "deploy" / "configs"
LAUNCH_CONFIGS = [
    "demo.toml",
    "qwen2_5_vl_7b_geometry3k.toml",
    "qwen2_5_vl_7b_geometry3k_crop.toml",
    "gpu_learn.toml",
]
PER_RUN = {"broker.namespace", "broker.url", "run_dir", "feeder.train_data", "feeder.test_data"}
"""Role settings the launcher fills in for each run."""


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and key != "routes":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.mark.parametrize("name", LAUNCH_CONFIGS)
def test_launch_config_parses_and_plans(name, tmp_path):
    path = CONFIGS / name
    if not path.is_file():
        pytest.skip(f"{name} not written yet")
    cfg = load_config(LaunchConfig, ["--config", str(path)])
    gpus = None
    if cfg.learner.gpus:
        gpus = plan_gpus(cfg.learner.gpus, cfg.generator.gpus, h200s(8), tp=cfg.generator.tp)
    configs = role_configs(cfg, tmp_path, Path("/m"), Path("/d"), "zmq://127.0.0.1:1", "ns", gpus=gpus)
    validate(configs["learner"])
    validate(configs["generator"])


@pytest.mark.parametrize(
    ("role", "cls"), [("learner", LearnerConfig), ("generator", GeneratorConfig), ("reward", RewardConfig)]
)
def test_reference_config_holds_the_role_files_values(role, cls):
    launch = load_config(LaunchConfig, ["--config", str(CONFIGS / "qwen2_5_vl_7b_geometry3k.toml")])
    shipped = load_config(cls, ["--config", str(CONFIGS / f"{role}.toml")])
    with open(CONFIGS / f"{role}.toml", "rb") as f:
        keys = set(_flat(tomllib.load(f))) - PER_RUN
    ours, theirs = _flat(dataclasses.asdict(getattr(launch, role))), _flat(dataclasses.asdict(shipped))
    differ = {k: (ours[k], theirs[k]) for k in sorted(keys) if ours[k] != theirs[k]}
    assert not differ, f"{role}: reference config differs from {role}.toml (ours, theirs): {differ}"


ROLE_CLASSES = {"learner": LearnerConfig, "generator": GeneratorConfig, "reward": RewardConfig}


@pytest.mark.parametrize("name", ["qwen2_5_vl_7b_geometry3k.toml", "gpu_learn.toml"])
def test_gpu_configs_set_every_value_the_cpu_demo_changes(name):
    """A launch config starts from the CPU demo's embedded default (LaunchConfig()), so a setting the demo
    changes from the role's own default and a GPU config leaves out runs the demo's CPU value on the GPU
    (a 0.25 GiB KV cache did once). Each such setting is written in the GPU config."""
    with open(CONFIGS / name, "rb") as f:
        written = _flat(tomllib.load(f))
    demo = LaunchConfig()
    leaked = []
    for role, cls in ROLE_CLASSES.items():
        ours, own = _flat(dataclasses.asdict(getattr(demo, role))), _flat(dataclasses.asdict(cls()))
        changed = {k for k in ours if ours[k] != own[k]} - PER_RUN
        leaked += [f"{role}.{k} = {ours[k]!r}" for k in sorted(changed) if f"{role}.{k}" not in written]
    assert not leaked, f"{name} inherits the CPU demo's values: {leaked}"
