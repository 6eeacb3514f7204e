"""bench/peers on CPU: the peers' datasets hold Parallax's own prompts, the throughput and the table count
every system the same way, the flash-attn compatibility package agrees with SDPA, and (where the peers are
installed) TRL renders the same prompt tokens as Parallax and verl's config composes with the recipe.

TRL and verl are not the project's dependencies: their tests skip when the package is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

from bench.peers import data as peer_data
from bench.peers import report
from bench.peers.workload import WORKLOAD, step_seconds, throughput

COMPAT = Path(__file__).resolve().parents[3] / "bench" / "peers" / "flash_attn_compat"


@pytest.fixture(scope="module")
def datasets_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("peers-data")
    peer_data.build(out, prompts=6, image_side=112)
    return out


def test_both_peers_get_parallaxs_prompts_and_images(datasets_dir):
    import pyarrow.parquet as pq

    items = peer_data.records(6, 112)
    trl = pq.read_table(datasets_dir / "trl.parquet").to_pylist()
    verl = pq.read_table(datasets_dir / "verl.parquet").to_pylist()
    assert len(trl) == len(verl) == 6
    for (record, images), t, v in zip(items, trl, verl):
        assert v["prompt"][0]["content"] == record.problem and record.problem.startswith("<image>")
        assert t["prompt"][0]["content"] == record.problem.removeprefix("<image>")
        assert t["image"]["bytes"] == v["images"][0]["bytes"] == images[0]
        assert t["solution"] == v["reward_model"]["ground_truth"] == record.ground_truth
    assert json.loads((datasets_dir / "manifest.json").read_text())["prompts"] == 6


def test_the_launchers_task_options_are_used():
    config = peer_data.task_config(10, 448)
    assert (config.task, config.image_size, config.train, config.test) == ("colour", 448, 10, 0)
    assert config.n_colours == 4 and config.seed == 0  # deploy/plan.py TaskOptions' defaults


def test_step_seconds_start_at_the_last_warmup_steps_end():
    assert step_seconds([10.0, 40.0, 75.0, 105.0], warmup=1) == [30.0, 35.0, 30.0]
    assert step_seconds([10.0, 40.0, 75.0], warmup=2) == [35.0]
    with pytest.raises(ValueError):
        step_seconds([10.0], warmup=1)
    with pytest.raises(ValueError):
        step_seconds([10.0, 20.0], warmup=0)


def test_throughput_is_tokens_per_second_per_gpu():
    tokens = WORKLOAD.samples_per_step * (309 + WORKLOAD.response)
    row = throughput(tokens, [40.0, 50.0], gpus=1)
    assert row["step_s"] == 45.0 and row["tokens_per_s_per_gpu"] == pytest.approx(tokens / 45.0)
    assert throughput(tokens, [45.0], gpus=2)["tokens_per_s_per_gpu"] == pytest.approx(tokens / 90.0)


def _write(path: Path, payload: dict) -> Path:
    path.write_text(json.dumps(payload))
    return path


def test_report_rows_and_ratios(tmp_path):
    tokens = 525_440
    row = {"k": 1, "step_s": 36.0, "tokens_per_step": tokens, "tokens_per_s_per_gpu": 14_596.0, "steps": 2}
    k1 = _write(tmp_path / "k1.json", {"command": "python -m bench.e2e ...", "results": [row]})
    trl_row = {"system": "trl", "version": "1.16.0", "step_s": 120.0, "tokens_per_s_per_gpu": 4_378.7}
    trl = _write(tmp_path / "trl.json", trl_row | {"tokens_per_step": tokens})
    mem = tmp_path / "mem"
    mem.mkdir()
    _write(mem / "trl.json", {"peak_used_gib": 70.5, "gpu": "NVIDIA H100 80GB HBM3"})
    args = argparse.Namespace(
        parallax_k0=None, parallax_k1=k1, trl=trl, verl=tmp_path / "none.json", memory_dir=mem, commit="abc",
        date=None, note="", command=["python -m bench.e2e x"], error=["verl=no GPU time"], argv=[],
    )  # fmt: skip
    out = report.build(args)
    rows = {r["name"]: r for r in out["rows"]}
    assert rows["trl"]["peak_gpu_used_gib"] == 70.5 and out["gpu"] == "NVIDIA H100 80GB HBM3"
    assert rows["verl"]["error"] == "no GPU time" and "no result file" in rows["parallax_k0"]["error"]
    assert (
        list(out)[:4] == ["date", "commit", "gpu", "command"] and out["command"][0] == "python -m bench.e2e x"
    )
    assert out["ratios"] == {"parallax_k1/trl": pytest.approx(14_596.0 / 4_378.7)}
    table = report.format_table(out["rows"], out["ratios"])
    assert "parallax_k1/trl: 3.33x" in table


@pytest.fixture
def compat_flash_attn(monkeypatch):
    monkeypatch.syspath_prepend(str(COMPAT))
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    import flash_attn

    return flash_attn


@pytest.mark.parametrize("causal", [True, False])
def test_compat_varlen_matches_padded_sdpa(compat_flash_attn, causal):
    torch.manual_seed(0)
    lengths, heads, kv_heads, dim = [5, 3, 7], 4, 2, 8
    cu = torch.tensor([0, 5, 8, 15], dtype=torch.int32)
    q = torch.randn(sum(lengths), heads, dim)
    k, v = torch.randn(sum(lengths), kv_heads, dim), torch.randn(sum(lengths), kv_heads, dim)
    out = compat_flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=causal)
    for i in range(len(lengths)):
        s = slice(int(cu[i]), int(cu[i + 1]))
        ref = compat_flash_attn.flash_attn_func(q[s][None], k[s][None], v[s][None], causal=causal)[0]
        torch.testing.assert_close(out[s], ref)


def test_compat_padding_round_trip_and_refusals(compat_flash_attn):
    from flash_attn.bert_padding import pad_input, unpad_input

    x = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    packed, indices, cu, longest, _ = unpad_input(x, mask)
    assert packed.shape == (5, 3) and cu.tolist() == [0, 3, 5] and longest == 3
    back = pad_input(packed, indices, 2, 4)
    torch.testing.assert_close(back * mask[..., None], x * mask[..., None])
    q = torch.randn(3, 2, 4)
    cu1 = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(NotImplementedError):
        compat_flash_attn.flash_attn_varlen_func(q, q, q, cu1, cu1, 3, 3, dropout_p=0.1)


def test_trl_renders_the_prompt_tokens_parallax_trains(tiny_model_dir, tiny_processor):
    pytest.importorskip("trl")
    from trl.data_utils import prepare_multimodal_messages

    from tasks.prompt import expanded_length, render_prompt_ids
    from tasks.records import decode_image

    record, images = peer_data.records(1, 112)[0]
    row = peer_data.trl_rows([(record, images)])[0]
    image = decode_image(images[0])
    messages = prepare_multimodal_messages(row["prompt"], [image])
    trl_ids = tiny_processor.apply_chat_template(
        conversation=[messages], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"][0]
    ours = render_prompt_ids(tiny_processor, record.problem, 1)
    assert len(trl_ids) == expanded_length(len(ours), [image.size], tiny_processor.image_processor)


def test_verl_config_composes_with_the_recipe(tmp_path, tiny_model_dir):
    pytest.importorskip("verl")
    pytest.importorskip("hydra")
    from bench.peers import verl_grpo

    args = verl_grpo.parse(
        ["--model", str(tiny_model_dir), "--data", str(tmp_path), "--out", str(tmp_path / "o")]
    )
    config = verl_grpo.compose(args)
    a = config.actor_rollout_ref
    assert a.model.use_remove_padding and a.actor.use_dynamic_bsz and a.rollout.ignore_eos
    assert config.data.train_batch_size == WORKLOAD.prompts_per_step and a.rollout.n == WORKLOAD.group
    assert a.actor.kl_loss_coef == WORKLOAD.kl_coef and a.actor.optim.lr == WORKLOAD.lr
