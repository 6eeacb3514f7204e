"""runtime.config: defaults < TOML < CLI, GPU specs, resolved-config output."""

import dataclasses
import json
from typing import Literal

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


@dataclasses.dataclass
class Section:
    mode: Literal["fast", "exact"] = "fast"
    """A choice."""
    limit: int = 4
    """Must be below 10."""

    def validate(self) -> None:
        if self.limit >= 10:
            raise ValueError(f"limit must be < 10, got {self.limit}")


def _section_default() -> Section:
    return Section(limit=7)


@dataclasses.dataclass
class Role:
    section: Section = dataclasses.field(default_factory=_section_default)
    """A section whose default differs from the section class's own."""
    url: str = "redis://h:1/0"
    """A URL."""
    maybe: bool | None = None
    """Optional."""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[inner]\nlr = "fast"\n', "inner.lr = 'fast': expected float, got str"),
        ("betas = [0.5]\n", "betas = [0.5]: expected tuple[float, float] (2 items), got an array"),
        ("steps = 2.5\n", "steps = 2.5: expected int, got float"),
        ("steps = true\n", "steps = True: expected int, got bool"),  # bool is not an int here
        ("inner = 3\n", "inner: expected a table, got int"),
    ],
)
def test_a_wrong_type_in_toml_names_the_file_the_key_and_the_type(tmp_path, text, message):
    toml = tmp_path / "c.toml"
    toml.write_text(text)
    with pytest.raises(SystemExit) as info:
        load_config(Cfg, ["--config", str(toml)])
    assert str(info.value) == f"error: {toml}: {message}"


def test_a_choice_outside_its_literal_names_the_allowed_values(tmp_path):
    toml = tmp_path / "r.toml"
    toml.write_text('[section]\nmode = "quick"\n')
    with pytest.raises(SystemExit, match="section.mode = 'quick': expected one of 'fast', 'exact', got str"):
        load_config(Role, ["--config", str(toml)])
    with pytest.raises(SystemExit):  # tyro refuses it on the command line too
        load_config(Role, ["--section.mode", "quick"])


def test_validate_runs_once_toml_and_flags_are_merged(tmp_path):
    toml = tmp_path / "r.toml"
    toml.write_text("[section]\nlimit = 12\n")
    assert load_config(Role, ["--config", str(toml), "--section.limit", "3"]).section.limit == 3
    with pytest.raises(SystemExit, match="error: section: limit must be < 10, got 12"):
        load_config(Role, ["--config", str(toml)])
    with pytest.raises(ValueError, match="section: limit must be < 10"):
        from_dict(Role, {"section": {"limit": 11}})


def test_a_partial_toml_section_keeps_the_roles_defaults_for_it(tmp_path):
    toml = tmp_path / "r.toml"
    toml.write_text('[section]\nmode = "exact"\n')
    cfg = load_config(Role, ["--config", str(toml)])
    assert cfg.section == Section(mode="exact", limit=7)  # limit from Role's default, not Section's
    assert from_dict(Role, {"maybe": None, "url": "zmq://x:1"}).maybe is None


def test_write_resolved_redacts_passwords(tmp_path):
    path = write_resolved(Role(url="redis://user:hunter2@h:1/0"), tmp_path, "role")
    text = path.read_text()
    assert "hunter2" not in text
    assert json.loads(text)["url"] == "redis://user:***@h:1/0"


@dataclasses.dataclass
class Clip:
    """A variant with two parameters."""

    type: Literal["clip"] = "clip"
    low: float = 0.2
    high: float = 0.3

    def validate(self) -> None:
        if self.low < 0:
            raise ValueError(f"low must be >= 0, got {self.low}")


@dataclasses.dataclass
class Gate:
    """A variant with one parameter."""

    type: Literal["soft-gate"] = "soft-gate"
    tau: float = 1.0


@dataclasses.dataclass
class Loss:
    policy: Clip | Gate = dataclasses.field(default_factory=Clip)
    """A variant picked by `type`."""
    coef: float = 0.0


@dataclasses.dataclass
class Outer:
    loss: Loss = dataclasses.field(default_factory=Loss)
    steps: int = 1


def test_a_toml_table_picks_a_variant_tunes_the_chosen_one_or_names_it_in_short(tmp_path):
    toml = tmp_path / "v.toml"
    toml.write_text('[loss.policy]\ntype = "soft-gate"\ntau = 2.0\n')
    assert load_config(Outer, ["--config", str(toml)]).loss.policy == Gate(tau=2.0)
    toml.write_text("[loss.policy]\nhigh = 0.5\n")  # no type: the default variant, tuned
    assert load_config(Outer, ["--config", str(toml)]).loss.policy == Clip(high=0.5)
    toml.write_text('[loss]\npolicy = "soft-gate"\n')
    assert load_config(Outer, ["--config", str(toml)]).loss.policy == Gate()
    assert from_dict(Outer, dataclasses.asdict(Outer(Loss(Gate(tau=3.0))))) == Outer(Loss(Gate(tau=3.0)))


def test_a_wrong_variant_or_a_parameter_of_another_variant_is_one_clear_error(tmp_path):
    toml = tmp_path / "v.toml"
    toml.write_text('[loss.policy]\ntype = "hard"\n')
    with pytest.raises(SystemExit) as info:
        load_config(Outer, ["--config", str(toml)])
    assert str(info.value) == f"error: {toml}: loss.policy.type = 'hard': expected one of 'clip', 'soft-gate'"
    toml.write_text('[loss.policy]\ntype = "soft-gate"\nlow = 0.1\n')
    with pytest.raises(
        SystemExit, match=r"unknown config keys \[loss.policy\] \['low'\]; known: \['tau', 'type'\]"
    ):
        load_config(Outer, ["--config", str(toml)])
    with pytest.raises(SystemExit, match="error: loss.policy: low must be >= 0, got -1.0"):
        load_config(Outer, ["--loss.policy.low", "-1"])


def test_flags_pick_a_variant_and_then_set_its_parameters(tmp_path, capsys):
    cfg = load_config(Outer, ["--loss.policy.type", "soft-gate", "--loss.policy.tau", "4", "--steps", "2"])
    assert cfg == Outer(loss=Loss(policy=Gate(tau=4.0)), steps=2)
    assert load_config(Outer, ["--loss.policy=soft-gate"]).loss.policy == Gate()  # short for .type
    toml = tmp_path / "v.toml"
    toml.write_text('[loss.policy]\ntype = "soft-gate"\ntau = 2.0\n')
    assert load_config(Outer, ["--config", str(toml), "--loss.policy.type", "clip"]).loss.policy == Clip()
    assert load_config(Outer, ["--config", str(toml), "--loss.policy.tau", "5"]).loss.policy == Gate(tau=5.0)
    with pytest.raises(SystemExit) as info:
        load_config(Outer, ["--loss.policy.type", "hard"])
    assert str(info.value) == "error: --loss.policy.type = 'hard': expected one of 'clip', 'soft-gate'"
    with pytest.raises(SystemExit):  # a parameter of the variant not chosen is not a flag
        load_config(Outer, ["--loss.policy.tau", "4"])
    capsys.readouterr()
