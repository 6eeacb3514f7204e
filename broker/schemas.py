"""Versioned wire messages of Parallax.

Every message that crosses a process boundary is one of the msgspec Structs below, encoded
as msgpack (never pickle). Each struct carries a `kind` tag and a `schema_version`; the codec
(`broker.codec`) rejects unknown kinds and versions with a `MessageError`.

Images never travel inside these messages: they are stored once, content-addressed, in the
blob store (`broker.images`), and messages carry `ImageRef`s.

Flow:  PromptRecord --(generator)--> RolloutGroup --(reward_service)--> ScoredGroup --(learner)
       learner --> WeightVersion (announcement).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

SCHEMA_VERSION = 3
"""Bump when a field changes meaning or a field is added that a reader must not ignore.
2: `Rollout` carries its token ids and logprobs packed (int32 / float32 bytes) instead of as lists.
3: `Rollout` may be a multi-turn episode: a loss mask over its response, the tool turns' images, the
   policy version of every turn (all optional: a version 2 message reads as a one-turn sample)."""

READABLE_VERSIONS = (2, 3)
"""Schema versions this build decodes (the codec refuses others); it writes SCHEMA_VERSION."""


class ImageRef(msgspec.Struct, frozen=True):
    """A pointer to encoded image bytes stored once in the blob store under their sha256."""

    sha256: str
    """Hex sha256 of the encoded bytes (the blob key)."""
    format: str = "png"
    """Encoding of the bytes (png, jpeg, ...)."""
    width: int = 0
    height: int = 0
    nbytes: int = 0


class PromptRecord(msgspec.Struct, tag="prompt", kw_only=True):
    """One task prompt, as written by a task's preprocessor and read by generators."""

    prompt_id: str
    """Stable id, unique within a data source and split."""
    data_source: str
    """Which task (and so which reward function) this prompt belongs to, e.g. "geometry3k"."""
    problem: str
    """User text; each `<image>` placeholder marks where an image goes, in order."""
    images: list[ImageRef] = []
    ground_truth: str
    """Verifiable answer the reward function grades against."""
    split: str = "train"
    meta: dict[str, str] = {}
    min_version: int = 0
    """Staleness gate (admission control): a generator may start this prompt only once it serves a
    policy version >= min_version. The learner's feeder sets it to (index // groups_per_step) - K."""
    schema_version: int = SCHEMA_VERSION


class Rollout(msgspec.Struct, kw_only=True):
    """One sampled response of a group.

    Token ids and logprobs travel packed, as little-endian int32 / float32 bytes (decoding them as msgpack
    number lists cost far more: bench/results/broker.json). Build with `Rollout.of(token_ids=...,
    logprobs=..., ...)` from lists or arrays; read with `num_tokens`, `token_ids()` and `logprobs()`
    (read-only numpy views).
    """

    response_token_ids_i32: bytes
    """Response token ids, packed little-endian int32."""
    behaviour_logprobs_f32: bytes
    """Per-token logprobs of the sampled tokens under the generator's policy (same temperature as the
    learner), packed little-endian float32 (vLLM's own precision); one per token."""
    response_text: str
    """Decoded response tokens only (never prompt + response)."""
    version_start: int
    """Policy version that was served when this sample started."""
    version_end: int
    """Policy version that was served when this sample finished."""
    finish_reason: str
    """"stop", "length" or "abort"."""
    loss_mask_u8: bytes = b""
    """Multi-turn episodes (docs/environments.md): per response token, 1 where the model sampled it and 0
    where the environment appended it (tool turns, their image pads), packed uint8; the logprob of an
    environment token is 0 and means nothing. Empty: every token is the model's (a one-turn sample)."""
    images: list[ImageRef] = []
    """The images the environment added in its turns, in the order of their pads in the response (one pad
    each, like the prompt's); the group's `images` stay the prompt's."""
    turn_versions: list[int] = []
    """The policy version serving each model turn, in order (empty for a one-turn sample)."""
    tool_calls: int = 0
    """Tool calls the model made in this episode."""
    tool_errors: int = 0
    """Of those, the ones the environment answered with an error (malformed, out of range, over a limit)."""
    env_reward: float = 0.0
    """The environment's own reward term, summed over the episode; the reward service adds it."""
    env_error: str = ""
    """Why the environment failed this episode (a timeout, an exception), "" when it did not."""

    def __post_init__(self) -> None:
        """Reject ids and logprobs that do not pair up (also when decoding: the codec says "malformed")."""
        ids, logprobs = self.response_token_ids_i32, self.behaviour_logprobs_f32
        if not isinstance(ids, bytes) or not isinstance(logprobs, bytes):
            raise TypeError("token ids and logprobs are packed bytes: build samples with Rollout.of(...)")
        if len(ids) % 4 or len(ids) != len(logprobs):
            raise ValueError(
                f"{len(ids)} bytes of int32 token ids and {len(logprobs)} bytes of float32 "
                "logprobs do not pair up"
            )
        if self.loss_mask_u8 and len(self.loss_mask_u8) * 4 != len(ids):
            raise ValueError(f"a loss mask of {len(self.loss_mask_u8)} for {len(ids) // 4} response tokens")

    @classmethod
    def of(
        cls,
        *,
        token_ids: Sequence[int] | np.ndarray,
        logprobs: Sequence[float] | np.ndarray,
        loss_mask: Sequence[int] | np.ndarray | None = None,
        **fields,
    ) -> Rollout:
        """A sample from token ids and logprobs (and a multi-turn episode's loss mask) as lists or arrays
        (packed here); `fields`: the rest."""
        return cls(
            response_token_ids_i32=np.asarray(token_ids, dtype="<i4").tobytes(),
            behaviour_logprobs_f32=np.asarray(logprobs, dtype="<f4").tobytes(),
            loss_mask_u8=b"" if loss_mask is None else np.asarray(loss_mask, dtype=np.uint8).tobytes(),
            **fields,
        )

    @property
    def num_tokens(self) -> int:
        """Response tokens of this sample."""
        return len(self.response_token_ids_i32) // 4

    def token_ids(self) -> np.ndarray:
        """Response token ids (a read-only int32 view of the packed bytes)."""
        return np.frombuffer(self.response_token_ids_i32, dtype="<i4")

    def logprobs(self) -> np.ndarray:
        """Behaviour logprobs, one per token (a read-only float32 view of the packed bytes)."""
        return np.frombuffer(self.behaviour_logprobs_f32, dtype="<f4")

    def loss_mask(self) -> np.ndarray:
        """1 per model token, 0 per environment token (all ones for a one-turn sample), uint8."""
        if not self.loss_mask_u8:
            return np.ones(self.num_tokens, dtype=np.uint8)
        return np.frombuffer(self.loss_mask_u8, dtype=np.uint8)

    @property
    def multi_turn(self) -> bool:
        """True for an episode with environment turns (a loss mask or images of its own)."""
        return bool(self.loss_mask_u8 or self.images)


class RolloutGroup(msgspec.Struct, tag="rollout_group", kw_only=True):
    """n samples of one prompt, as published by a generator."""

    group_id: str
    """Globally unique; the idempotency key of every downstream stage."""
    prompt_id: str
    data_source: str
    prompt_token_ids: list[int]
    """Chat-templated prompt ids with ONE image pad token per image (not processor-expanded)."""
    images: list[ImageRef]
    ground_truth: str
    samples: list[Rollout]
    temperature: float = 1.0
    generator_id: str = ""
    split: str = "train"
    timings: dict[str, float] = {}
    """Wall-clock seconds per stage, e.g. {"queue": .., "generate": ..}; stages add their own."""
    schema_version: int = SCHEMA_VERSION


class Score(msgspec.Struct, kw_only=True):
    """Reward of one sample and its parts."""

    reward: float
    accuracy: float
    format: float
    timed_out: bool = False


class ScoredGroup(msgspec.Struct, tag="scored_group", kw_only=True):
    """A rollout group with one Score per sample, as published by the reward service."""

    group: RolloutGroup
    scores: list[Score]
    scorer_id: str = ""
    schema_version: int = SCHEMA_VERSION


class WeightVersion(msgspec.Struct, tag="weight_version", kw_only=True):
    """Announcement of a policy version: by the learner (published) or a generator (now served)."""

    version: int
    step: int = 0
    source: str = ""
    """"learner" or a generator id."""
    num_bytes: int = 0
    seconds: float = 0.0
    """Time the sender/receiver spent on this version's transfer."""
    timestamp: float = 0.0
    schema_version: int = SCHEMA_VERSION


Message = PromptRecord | RolloutGroup | ScoredGroup | WeightVersion
"""Every top-level message type; the codec decodes this union."""
