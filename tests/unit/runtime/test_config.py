"""runtime.config: defaults < TOML < CLI, GPU specs, resolved-config output."""

import dataclasses
import json

import pytest

from runtime.config import apply_gpus, from_dict, load_config, parse_gpus, write_resolved


@dataclasses.dataclass
class Inner:
    lr: float = 1e-6
    """Learning rate."""


@dataclasses.dataclass
class Cfg:
    name: str = "x"
    """A name."""
    steps: int = 3
    """Steps."""
    inner: Inner = dataclasses.field(default_factory=Inner)
    """Nested."""
    betas: tuple[float, float] = (0.9, 0.999)
    """A tuple (TOML writes it as an array)."""


def test_precedence(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('name = "from-toml"\nsteps = 7\nbetas = [0.5, 0.6]\n[inner]\nlr = 0.5\n')
    cfg = load_config(Cfg, ["--config", str(toml), "--steps", "9"])
    assert cfg == Cfg(name="from-toml", steps=9, inner=Inner(lr=0.5), betas=(0.5, 0.6))


def test_unknown_key_is_an_error():
    with pytest.raises(ValueError, match="unknown config keys"):
        from_dict(Cfg, {"nme": "typo"})


def test_gpus(monkeypatch):
    assert parse_gpus("0-2,5") == [0, 1, 2, 5]
    assert parse_gpus("") == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert apply_gpus("6-7") == [6, 7]
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"


def test_write_resolved(tmp_path):
    path = write_resolved(Cfg(), tmp_path, "test")
    assert json.loads(path.read_text())["inner"]["lr"] == 1e-6
