"""The launcher's preflight checks (deploy/preflight.py): nvidia-smi parsing, the checkpoint's
inspection (parameter counts from the safetensors headers, the decoder shape, refusals with the fix)
and the explanations of known vLLM failures.

CPU only: the GPUs are described, never used.
"""

from __future__ import annotations

import json
import struct

import pytest

from deploy.gpus.estimate import DecoderShape
from deploy.preflight import (
    PreflightError,
    decoder_shape,
    explain_failure,
    inspect_model,
    parse_nvidia_smi,
    restrict_visible,
)

QWEN_7B, QWEN_3B = DecoderShape(28, 3584, 18944), DecoderShape(36, 2048, 11008)


def test_nvidia_smi_lines_parse():
    gpus = parse_nvidia_smi("0, 143771, NVIDIA H200\n1, 143771, NVIDIA H200\n")
    assert [(g.index, round(g.memory_gib, 1), g.name) for g in gpus] == [
        (0, 140.4, "NVIDIA H200"),
        (1, 140.4, "NVIDIA H200"),
    ]
    with pytest.raises(PreflightError, match="use numeric indices"):
        restrict_visible(gpus, "GPU-1234")


def _checkpoint(tmp_path, model_type="qwen2_5_vl", shapes=((4, 8), (3,))):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["X"]}))
    header = {
        f"t{i}": {"dtype": "F32", "shape": list(s), "data_offsets": [0, 0]} for i, s in enumerate(shapes)
    }
    raw = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    (d / "tokenizer.json").write_text("{}")
    (d / "preprocessor_config.json").write_text("{}")
    return d


def test_inspect_model_counts_parameters_from_the_headers(tmp_path):
    info = inspect_model(_checkpoint(tmp_path))
    assert info.n_params == 4 * 8 + 3


def test_the_decoder_shape_comes_from_config_json():
    assert (
        decoder_shape({"num_hidden_layers": 28, "hidden_size": 3584, "intermediate_size": 18944}) == QWEN_7B
    )
    nested = {"text_config": {"num_hidden_layers": 36, "hidden_size": 2048, "intermediate_size": 11008}}
    assert decoder_shape(nested) == QWEN_3B
    assert decoder_shape({"hidden_size": 3584}) is None and decoder_shape({"text_config": None}) is None


def test_a_checkpoint_that_is_not_qwen2_5_vl_is_refused_with_the_fix(tmp_path):
    with pytest.raises(
        PreflightError, match=r"is a llama checkpoint .*not Qwen2.5-VL .*python -m policy build"
    ):
        inspect_model(_checkpoint(tmp_path, model_type="llama"))
    with pytest.raises(PreflightError, match="is not a directory"):
        inspect_model(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PreflightError, match="has no config.json"):
        inspect_model(tmp_path / "empty")


def test_a_checkpoint_without_weights_or_processor_is_refused(tmp_path):
    d = _checkpoint(tmp_path)
    (d / "preprocessor_config.json").unlink()
    with pytest.raises(PreflightError, match="no image processor"):
        inspect_model(d)
    (d / "model.safetensors").unlink()
    with pytest.raises(PreflightError, match=r"no \*.safetensors"):
        inspect_model(d)


def test_known_vllm_failures_are_explained():
    log = (
        "ValueError: Free memory on device (10.0/139.8 GiB) on startup is less than desired GPU memory "
        "utilization (0.9, 125.8 GiB)."
    )
    assert "lower --generator.engine.gpu-memory-utilization" in explain_failure(log)
    assert "requirements-gpu.txt" in explain_failure("ModuleNotFoundError: No module named 'vllm'")
    assert "max-model-len" in explain_failure(
        "ValueError: User-specified max_model_len (9000) is greater than the derived max_model_len"
    )
    assert explain_failure("all good") == ""
