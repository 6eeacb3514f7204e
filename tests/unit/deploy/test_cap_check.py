"""deploy/gpus/cap_check.py: the model's GEMM shapes, an output a GEMM left unwritten is named, and the
launcher runs the check under the generator's cap and GPU before vLLM, ending the run when it fails."""

from __future__ import annotations

import json

import pytest
import torch

from deploy.gpus import cap_check
from deploy.gpus.layout import GpuPlan
from deploy.gpus.mps import GeneratorShare
from deploy.plan import LaunchConfig
from deploy.processes import ChildDied
from deploy.progress import Progress

QWEN25_VL_7B = {  # the published config's sizes, at the top level as in Qwen2.5-VL
    "model_type": "qwen2_5_vl",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
}
TINY = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "vocab_size": 300}


def test_the_shapes_are_the_decoders_projections():
    shapes = cap_check.projections(QWEN25_VL_7B)
    assert shapes["qkv+bias"] == (3584, 4608, True)  # 28 query heads and 2 x 4 key/value heads of 128
    assert shapes["gate+up"] == (3584, 2 * 18944, False) and shapes["down"] == (18944, 3584, False)
    assert shapes["lm_head"] == (3584, 152064, False)
    nested = {"model_type": "qwen3_vl", "text_config": {**TINY, "num_key_value_heads": 2, "head_dim": 32}}
    assert cap_check.projections(nested)["qkv+bias"] == (64, (4 + 2 * 2) * 32, True)  # Qwen3-VL: text_config
    with pytest.raises(ValueError, match="vocab_size"):
        cap_check.projections({k: v for k, v in TINY.items() if k != "vocab_size"})


def test_every_output_written_passes_and_a_skipped_tile_is_named(monkeypatch):
    assert cap_check.check(TINY, "cpu") == []

    real_mm = torch.mm

    def skips_a_tile(x, w, *, out):  # as cuBLAS under a 40 % MPS cap: part of the output never written
        full = real_mm(x, w)
        out[:, : out.shape[1] // 2] = full[:, : out.shape[1] // 2]
        return out

    monkeypatch.setattr(torch, "mm", skips_a_tile)
    failed = cap_check.check(TINY, "cpu")
    assert len(failed) == 4 * len(cap_check.ROWS)  # every projection but the QKV (addmm, untouched)
    assert failed[0] == "attention out 1x64x64: 50.0 % of its output unwritten"
    assert not any(line.startswith("qkv") for line in failed)


def test_the_command_exits_by_what_it_found(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert cap_check.main(["--model", str(tmp_path), "--device", "cpu"]) == 0
    monkeypatch.setattr(cap_check, "check", lambda config, device: ["lm_head 1x64x300: 3.0 % ..."])
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "40")
    assert cap_check.main(["--model", str(tmp_path), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "(40 % of the SMs)" in err and "lm_head 1x64x300" in err and "Raise --mps-generator-sms" in err
    assert cap_check.main(["--model", str(tmp_path / "missing"), "--device", "cpu"]) == 2


def test_the_launcher_runs_it_on_the_generators_gpu_under_its_cap(tmp_path):
    """On this CPU machine the child finds no GPU and fails: the run ends there, before any generator,
    with the child's own line, which names the GPU and the cap it was given."""
    from deploy.launcher import Launcher
    from deploy.stages import check_cap

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY))
    launcher = Launcher(LaunchConfig(run_dir=str(tmp_path / "run")))
    shared = GpuPlan("shared", "3", "3", ((3,),), "cuda-ipc")
    with Progress("off") as launcher.sv.progress:
        with pytest.raises(ChildDied, match="cap-check exited with code 2") as failure:
            check_cap(launcher.sv, tmp_path / "model", shared, GeneratorShare(40))
    launcher.sv.roles.stop()
    assert "CUDA_VISIBLE_DEVICES=3, MPS cap 40 %" in str(failure.value)


def test_a_launcher_with_its_display_off_still_says_why_it_failed(tmp_path, monkeypatch, capsys):
    """bench.e2e runs the launcher with --progress off: a refused cap (any dead child) must reach its log."""
    from deploy.launcher import Launcher

    launcher = Launcher(LaunchConfig(run_dir=str(tmp_path / "run"), progress="off"))

    def refused():
        raise ChildDied("cap-check exited with code 1; last log lines:\nqkv+bias 256x3584x4608: 27.1 %")

    monkeypatch.setattr(launcher, "_pipeline", refused)
    assert launcher.run() == 1
    captured = capsys.readouterr()
    assert (
        "[launcher] cap-check exited with code 1" in captured.err and "qkv+bias 256x3584x4608" in captured.err
    )
    assert captured.out == ""
