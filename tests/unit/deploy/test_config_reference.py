"""docs/configuration.md is what `python -m deploy.reference` prints: the page never drifts from the code."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from deploy import reference

PAGE = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def test_the_committed_reference_is_current():
    assert PAGE.read_text() == reference.render(), (
        "docs/configuration.md is out of date: run `python -m deploy.reference docs/configuration.md`"
    )


def test_every_field_of_every_role_is_documented():
    page = reference.render()
    for command, cls in reference.roles():
        assert f"## `{command}`" in page
        for f in dataclasses.fields(cls):
            assert f"--{f.name.replace('_', '-')}" in page or f"[{f.name}]" in page, (command, f.name)


def test_field_docs_read_the_docstring_under_each_field():
    @dataclasses.dataclass
    class Example:
        alpha: int = 1
        """What alpha does."""
        beta: str = ""

    assert reference.field_docs(Example) == {"alpha": "What alpha does."}


def test_a_union_of_sections_gets_one_table_per_variant():
    page = reference.render()
    for variant in ("ppo-clip", "gspo", "cispo", "sapo"):
        assert f'`[loss.policy]` `type = "{variant}"`' in page


def test_help_prints_usage_and_writes_no_file(tmp_path, capsys):
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(SystemExit) as exit_:
            reference.main(["--help"])
    finally:
        os.chdir(cwd)
    assert exit_.value.code == 0 and "python -m deploy.reference" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_the_page_goes_to_the_named_file(tmp_path):
    assert reference.main([str(tmp_path / "page.md")]) == 0
    assert (tmp_path / "page.md").read_text() == reference.render()
