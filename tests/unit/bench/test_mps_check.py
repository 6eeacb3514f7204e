"""bench/mps_check.py and its GEMM sweep: each operation against its fp32 CPU reference; a non-finite or
unwritten output is not ok."""

import json

import pytest
import torch

from bench.mps_check import SHAPES, compare, main, model_config
from bench.mps_gemms import gemm_row, gemm_shapes, operands, settings
from bench.mps_gemms import main as gemm_main


def test_every_torch_operation_agrees_with_its_reference_on_cpu(tmp_path):
    out = tmp_path / "check.json"
    assert main(["--device", "cpu", "--shapes", "tiny", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["operation"]: r for r in result["results"]}
    torch_rows = [r for name, r in rows.items() if not name.startswith("vllm ")]
    assert len(torch_rows) == 6 and all(r["ok"] and r["finite"] for r in torch_rows)
    assert result["mps_cap"] == "" and result["sms_seen"] is None
    assert result["cap_check"] == [], "the launcher's GEMM check: every output written"


def test_a_nan_or_a_wrong_value_is_not_ok():
    ref = torch.tensor([1.0, -2.0, 3.0])
    assert compare(ref.clone(), ref, "float32") == {"finite": True, "rel_error": 0.0, "ok": True}
    bad = compare(torch.tensor([1.0, float("nan"), 3.0]), ref, "float32")
    assert bad["finite"] is False and bad["ok"] is False
    off = compare(torch.tensor([1.0, -2.0, 3.3]), ref, "bfloat16")
    assert off["finite"] and off["rel_error"] == pytest.approx(0.1) and off["ok"] is False


def test_the_gemm_sweep_covers_every_shape_under_every_cpu_setting(tmp_path):
    out = tmp_path / "check.json"
    assert main(["--device", "cpu", "--shapes", "tiny", "--out", str(out)]) == 0
    sweep = json.loads(out.read_text())["gemm_sweep"]
    assert len(sweep) == len(gemm_shapes(SHAPES["tiny"])) * len(settings("cpu")) == 20
    assert sweep[0]["operation"].startswith("gemm lm_head"), "the reverse of the first table's order"
    assert {r["setting"] for r in sweep} == {"default", "fp32 reductions", "fp16", "fp32 no tf32"}
    assert all(r["ok"] and r["repeat_ok"] and r["unwritten"] == 0 for r in sweep)
    qkv = next(r for r in sweep if "qkv+bias" in r["operation"])
    assert qkv["operation"].endswith("5x64x128"), "64 + 2 x 16-wide heads x 2 KV heads"


def test_a_gemm_that_never_writes_its_output_is_unwritten_and_not_ok(monkeypatch):
    inputs, ref = operands(((3, 8), (4, 8), False))
    monkeypatch.setattr(torch, "mm", lambda a, b, out: out)  # deploy.gpus.cap_check.gemm_into_nan
    row = gemm_row("skipped", inputs, ref, "default", "bfloat16", settings("cpu")["default"][1], "cpu")
    assert row["unwritten"] == 1.0 and row["finite"] is False and row["ok"] is False


def test_blas_library_and_green_context_choices_are_offered_only_on_cuda():
    on_cuda = {"cublas", "cublaslt", "green context 40 %"}
    assert on_cuda <= set(settings("cuda")) and not on_cuda & set(settings("cpu"))


def test_a_setting_holds_only_where_it_ran_every_gemm_right(tmp_path, capsys):
    rows = [
        {"setting": "cublaslt", "ok": True, "repeat_ok": True},
        {"setting": "cublaslt", "ok": True, "repeat_ok": False},
        {"setting": "default", "ok": True, "repeat_ok": True},
    ]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"gemm_sweep": rows}))
    assert gemm_main([str(path), "default"]) == 0
    assert gemm_main([str(path), "cublaslt"]) == 1, "a wrong repeat is not right"
    assert gemm_main([str(path), "cublas"]) == 1, "a setting that never ran does not hold"
    assert "not every GEMM right" in capsys.readouterr().out


def test_the_green_context_rows_run_after_every_other_setting(monkeypatch):
    from contextlib import nullcontext

    import bench.mps_gemms as mps_gemms

    fake = {"green context 40 %": ("float32", nullcontext), "default": ("float32", nullcontext)}
    monkeypatch.setattr(mps_gemms, "settings", lambda device: fake)
    rows = mps_gemms.gemm_sweep(SHAPES["tiny"], "cpu")
    order = [r["setting"] for r in rows]
    shapes = len(gemm_shapes(SHAPES["tiny"]))
    assert order == ["default"] * shapes + ["green context 40 %"] * shapes


def test_the_launchers_check_runs_on_the_same_shapes_and_gates_the_default(tmp_path, monkeypatch, capsys):
    """On an H100 (2026-12-07) at 45 % the sweep passed and the launcher's check (more row counts) did
    not; the check's verdict is in the result, fails the run, and keeps `default` from holding, as the
    launcher would."""
    import deploy.gpus.cap_check

    seen = []

    def refuse(config, device):
        seen.append(deploy.gpus.cap_check.projections(config))
        return ["down 256x128x64: 28.6 % of its output unwritten"]

    monkeypatch.setattr(deploy.gpus.cap_check, "check", refuse)
    out = tmp_path / "check.json"
    assert main(["--device", "cpu", "--shapes", "tiny", "--out", str(out)]) == 1
    assert seen == [deploy.gpus.cap_check.projections(model_config(SHAPES["tiny"]))]
    assert seen[0]["down"] == (128, 64, False) and seen[0]["qkv+bias"] == (64, 128, True)
    result = json.loads(out.read_text())
    assert result["cap_check"] == ["down 256x128x64: 28.6 % of its output unwritten"]
    assert all(r["ok"] for r in result["gemm_sweep"]), "the sweep alone would have passed"
    assert "down 256x128x64" in capsys.readouterr().out
    assert gemm_main([str(out), "default"]) == 1
    assert gemm_main([str(out), "fp16"]) == 0, "the launcher's check runs the default setting only"
