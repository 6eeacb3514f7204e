"""Multi-turn episodes in the generator, with a scripted engine: each turn continues the exact ids of the
earlier ones, tool turns are environment tokens with their images stored, every limit ends an episode with
its reason, and a stuck or crashing environment fails its own episode only. Then the worker publishes the
episodes' fields over a real broker."""

from __future__ import annotations

import io
from types import SimpleNamespace

from PIL import Image

import broker
from broker.channel import Publisher, Subscriber
from broker.images import ImageStore
from broker.names import Names
from broker.schemas import ImageRef, PromptRecord, RolloutGroup
from envs.config import CropConfig, EnvConfig
from generator.episodes import EpisodeCompletion, EpisodeRunner, tool_turn_ids
from generator.inputs import Completion, Request, Result
from runtime.metrics import new_registry
from tasks.prompt import render_prompt_ids
from tests.support import scripted_env
from weights.config import WeightReceiverConfig

CALL = '<tool_call>{"name": "crop", "arguments": {"bbox": [0, 0, 50, 50]}}</tool_call>'
ANSWER = "<think>seen</think> \\boxed{3}"


class ScriptedEngine:
    """First turns: `n` samples of `first`; later turns: `later` (one text per call, the last repeated)."""

    on_cpu = True
    version = 7

    def __init__(self, processor, first, later, n=2, max_images=4):
        self.tokenizer = processor.tokenizer
        self.checker = SimpleNamespace(image_processor=processor.image_processor, max_images=max_images)
        self.first, self.later, self.n = first, list(later), n
        self.calls: list = []
        self.end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def completion(self, text, end=True):
        ids = self.tokenizer.encode(text, add_special_tokens=False) + ([self.end] if end else [])
        return Completion(ids, [-0.25] * len(ids), text, "stop" if end else "length")

    def generate(self, requests):
        return [
            Result(completions=[self.completion(t) for t in self.first[: self.n]], version=self.version)
            for _ in requests
        ]

    def sampling_params(self, split):
        return SimpleNamespace(n=self.n, max_tokens=999, min_tokens=0, split=split)

    def continue_turns(self, prompts, params):
        self.calls.append((prompts, params))
        text = self.later[min(len(self.calls) - 1, len(self.later) - 1)]
        return [self.completion(text) for _ in prompts], self.version

    def close(self):
        pass


def image(size=(200, 100)) -> Image.Image:
    return Image.effect_noise(size, 60).convert("RGB")


def record(env="crop", i=0) -> PromptRecord:
    return PromptRecord(
        prompt_id=f"z{i}",
        data_source="zoom",
        problem="<image>Which digit?",
        ground_truth="3",
        meta={"env": env},
    )


class Store:
    def __init__(self):
        self.images: dict[str, Image.Image] = {}

    def put(self, img) -> ImageRef:
        ref = ImageRef(sha256=f"{len(self.images):064x}", width=img.width, height=img.height)
        self.images[ref.sha256] = img
        return ref


def run(processor, engine, records, config=None, max_tokens=400):
    store = Store()
    runner = EpisodeRunner(engine, config or EnvConfig(), max_tokens, store.put, new_registry())
    requests = [
        Request(render_prompt_ids(processor, r.problem, 1), [image()], split=r.split) for r in records
    ]
    results = engine.generate(requests)
    runner.run(records, requests, results)
    runner.close()
    return results, requests, store, runner


def test_each_turn_continues_the_exact_ids_and_tool_turns_are_environment_tokens(tiny_processor):
    engine = ScriptedEngine(tiny_processor, first=["<think>zoom</think>" + CALL, ANSWER], later=[ANSWER])
    (result,), (request,), store, runner = run(tiny_processor, engine, [record()])
    crop_episode, answered = result.completions
    assert isinstance(crop_episode, EpisodeCompletion) and isinstance(answered, EpisodeCompletion)
    assert answered.turn_versions == [7] and answered.loss_mask == [1] * len(answered.token_ids)
    assert (
        crop_episode.turn_versions == [7, 7]
        and crop_episode.tool_calls == 1
        and crop_episode.tool_errors == 0
    )
    ((prompts, params),) = engine.calls  # one continuation call, for the one open episode
    first = engine.completion("<think>zoom</think>" + CALL).token_ids
    pad = tiny_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    tool = tool_turn_ids(tiny_processor.tokenizer, "", 1, pad)
    expected = request.prompt_token_ids + first
    assert prompts[0]["prompt_token_ids"][: len(expected)] == expected  # no re-tokenization
    rest = prompts[0]["prompt_token_ids"][len(expected) :]
    assert pad in rest and rest[-4:] == tiny_processor.tokenizer.encode("<|im_start|>assistant\n")
    assert prompts[0]["multi_modal_data"]["image"][0] is request.images[0]
    assert params[0].n == 1 and params[0].max_tokens == 400 - (
        len(first) + len(rest) - 1 + tool_tokens(crop_episode, tiny_processor)
    )
    ids, mask = crop_episode.token_ids, crop_episode.loss_mask
    assert ids[: len(first)] == first and ids[len(first) : len(first) + len(rest)] == rest
    assert mask == [1] * len(first) + [0] * len(rest) + [1] * (len(ids) - len(first) - len(rest))
    assert all(lp == 0.0 for lp, m in zip(crop_episode.logprobs, mask) if not m)
    (ref,) = crop_episode.images
    assert store.images[ref.sha256].size == (141, 141) and len(tool) < len(rest)  # zoomed, with its text
    assert crop_episode.text.count("\\boxed{3}") == 1 and "Crop of bbox" in crop_episode.text
    assert runner.metrics.tool_calls._value.get() == 1


def tool_tokens(completion, processor) -> int:
    from tasks.prompt import num_image_tokens

    return sum(
        num_image_tokens(processor.image_processor, ref.width, ref.height) for ref in completion.images
    )


def test_limits_end_episodes_with_their_reason(tiny_processor):
    calls = ["<think>z</think>" + CALL]
    turns = run(
        tiny_processor, ScriptedEngine(tiny_processor, calls * 2, calls), [record()], EnvConfig(max_turns=3)
    )
    for c in turns[0][0].completions:
        assert len(c.turn_versions) == 3 and c.finish_reason == "length" and c.tool_calls == 3
    budget = run(tiny_processor, ScriptedEngine(tiny_processor, calls * 2, calls), [record()], max_tokens=60)
    for c in budget[0][0].completions:
        assert c.finish_reason == "length" and len(c.token_ids) <= 60 and c.images == []
    limited = EnvConfig(crop=CropConfig(max_images=1))
    one = run(
        tiny_processor, ScriptedEngine(tiny_processor, calls * 2, calls + [ANSWER]), [record()], limited
    )
    for c in one[0][0].completions:
        assert len(c.images) == 1 and c.tool_errors == 1 and c.finish_reason == "stop"
    cut = ScriptedEngine(tiny_processor, calls * 2, calls)
    cut.completion = lambda text, end=False, inner=cut.completion: inner(text, end=False)
    for c in run(tiny_processor, cut, [record()])[0][0].completions:  # a turn cut at its token limit
        assert len(c.turn_versions) == 1 and c.finish_reason == "length" and c.tool_calls == 0


def test_a_stuck_or_crashing_environment_fails_its_own_episode(tiny_processor):
    engine = ScriptedEngine(tiny_processor, ["<think>z</think>" + CALL] * 2, [ANSWER])
    records = [
        record("tests.support.scripted_env:stuck", 0),
        record("crop", 1),
        record("tests.support.scripted_env:crash", 2),
        record("nope", 3),
    ]
    try:
        results, _, _, runner = run(tiny_processor, engine, records, EnvConfig(timeout_s=0.3))
    finally:
        scripted_env.RELEASE.set()
    stuck, fine, crashed, unknown = (r.completions[0] for r in results)
    assert stuck.env_error.startswith("timeout") and stuck.finish_reason == "abort"
    assert fine.env_error == "" and fine.finish_reason == "stop" and len(fine.turn_versions) == 2
    assert "cannot start" in crashed.env_error and "unknown environment 'nope'" in unknown.env_error
    assert runner.metrics.env_failures.labels("timeout")._value.get() == 2


def test_the_worker_publishes_episodes_with_their_fields(broker_url, names, tiny_processor):
    from broker.config import BrokerConfig
    from generator.config import GeneratorConfig
    from generator.worker import GeneratorWorker

    transport = broker.connect(broker_url)
    store = ImageStore(transport, names)
    buf = io.BytesIO()
    image().save(buf, format="PNG")
    ref = store.put(buf.getvalue())
    plain = PromptRecord(
        prompt_id="p", data_source="synthetic", problem="<image>?", images=[ref], ground_truth="1"
    )
    zoom = PromptRecord(prompt_id="z", data_source="zoom", problem="<image>?", images=[ref], ground_truth="3")
    Publisher(transport, names.prompts).publish_many([plain, zoom])
    engine = ScriptedEngine(tiny_processor, ["<think>z</think>" + CALL, ANSWER], [ANSWER])
    config = GeneratorConfig(
        broker=BrokerConfig(namespace=names.namespace), generator_id="gen-episodes",
        weight_sync=WeightReceiverConfig(enabled=False), block_s=0.05, batch_prompts=2, idle_exit_s=0.3,
        env=EnvConfig(routes={"zoom": "crop"}),
    )  # fmt: skip
    worker = GeneratorWorker(config, engine=engine, transport=transport)
    try:
        assert worker.run() == 2
        sub = Subscriber(transport, names.rollouts, Names.REWARD, "test", expect=RolloutGroup)
        groups = {g.prompt_id: g for _, g in sub.poll(count=10, block_s=0.1)}
        crop = store.open(groups["z"].samples[0].images[0])
    finally:
        worker.close()
    assert not any(s.multi_turn or s.turn_versions for s in groups["p"].samples)
    episode, answered = groups["z"].samples
    assert episode.multi_turn and episode.turn_versions == [7, 7] and episode.tool_calls == 1
    assert episode.loss_mask().sum() < episode.num_tokens and crop.size == (141, 141)
    assert answered.turn_versions == [7] and not answered.images
    assert worker.metrics.value("parallax_generator_tool_calls_total") == 1
