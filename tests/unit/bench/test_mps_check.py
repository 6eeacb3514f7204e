"""bench/mps_check.py: each operation against its fp32 CPU reference; a non-finite output is not ok."""

import json

import pytest
import torch

from bench.mps_check import compare, main


def test_every_torch_operation_agrees_with_its_reference_on_cpu(tmp_path):
    out = tmp_path / "check.json"
    assert main(["--device", "cpu", "--shapes", "tiny", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["operation"]: r for r in result["results"]}
    torch_rows = [r for name, r in rows.items() if not name.startswith("vllm ")]
    assert len(torch_rows) == 6 and all(r["ok"] and r["finite"] for r in torch_rows)
    assert result["mps_cap"] == "" and result["sms_seen"] is None


def test_a_nan_or_a_wrong_value_is_not_ok():
    ref = torch.tensor([1.0, -2.0, 3.0])
    assert compare(ref.clone(), ref, "float32") == {"finite": True, "rel_error": 0.0, "ok": True}
    bad = compare(torch.tensor([1.0, float("nan"), 3.0]), ref, "float32")
    assert bad["finite"] is False and bad["ok"] is False
    off = compare(torch.tensor([1.0, -2.0, 3.3]), ref, "bfloat16")
    assert off["finite"] and off["rel_error"] == pytest.approx(0.1) and off["ok"] is False
