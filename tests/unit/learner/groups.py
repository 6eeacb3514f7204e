"""Hand-made scored rollout groups for the tiny model (shared by the learner's tests)."""

import io
import random
import uuid

from PIL import Image

from broker.images import ImageStore
from broker.schemas import Rollout, RolloutGroup, Score, ScoredGroup
from tasks.prompt import render_prompt_ids


def png(colour, size=(56, 56)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def make_group(
    processor,
    store: ImageStore,
    rewards,
    *,
    image=True,
    version=0,
    seed=0,
    group_id=None,
    resp_len=(3, 9),
    temperature=1.0,
    n_images=1,
) -> ScoredGroup:
    """A scored group: one prompt (with `n_images` images, or none), len(rewards) random responses."""
    rng = random.Random(seed)
    refs = [store.put(png((rng.randrange(256), 40, 40 + 80 * k))) for k in range(n_images)] if image else []
    problem = "<image>" * len(refs) + " what colour?" if image else "count to three"
    prompt = render_prompt_ids(processor, problem, len(refs))
    vocab = min(len(processor.tokenizer), 1500)
    samples = []
    for _ in rewards:
        n = rng.randint(*resp_len)
        samples.append(
            Rollout.of(
                token_ids=[rng.randrange(30, vocab) for _ in range(n)],
                logprobs=[-rng.uniform(5.0, 9.0) for _ in range(n)],
                response_text="",
                version_start=version,
                version_end=version,
                finish_reason="stop",
            )
        )
    group = RolloutGroup(
        group_id=group_id or uuid.uuid4().hex,
        prompt_id=f"p{seed}",
        data_source="synthetic",
        prompt_token_ids=prompt,
        images=refs,
        ground_truth="red",
        samples=samples,
        temperature=temperature,
    )
    return ScoredGroup(
        group=group, scores=[Score(reward=r, accuracy=float(r > 0.5), format=1.0) for r in rewards]
    )


def set_token(scored: ScoredGroup, *, sample: int, index: int, token: int) -> None:
    """Overwrite one response token id of one sample in place (to make a bad group)."""
    s = scored.group.samples[sample]
    ids = s.token_ids().copy()
    ids[index] = token
    s.response_token_ids_i32 = ids.tobytes()
