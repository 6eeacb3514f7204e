"""Multi-turn episodes in the generator: the model's turns and an environment's turns, token in, token out.

    runner = EpisodeRunner(engine, config.env, config.sampling.max_tokens, images.put_image, registry)
    runner.run(records, requests, results)    # after engine.generate: first turns become whole episodes

A prompt whose record names an environment (envs/config.py `environment_of`) is sampled as usual for its
first turn, `n` samples at once; each sample then becomes an episode with its own environment
(`envs.make`, `reset` with the record and its images). Each round steps every open episode's
environment with its model's last turn (on `envs.runner.EnvRunner`'s threads, each call time-bounded),
appends the observation as a tool turn (`tool_turn_ids`: Qwen's `<|im_start|>user\\n<tool_response>...`,
each image one `<|image_pad|>` in a vision block, the image stored content-addressed like the prompt's),
and samples every open episode's next turn in one engine call. A turn continues from the exact token ids of
the earlier ones (never re-tokenized): the prompt ids, then every model and tool token so far, with the
prompt's and the tool turns' images in the order of their pads.

An episode ends when its environment says done (the model answered), when a model turn was cut at the
token limit (finish "length"), after `max_turns` model turns ("length" if the
environment wanted more), when the next observation would not fit the response budget (`max_tokens`,
image tokens counted expanded) or the engine's image limit ("length"), or when its environment fails
(timeout, exception: finish "abort" with `env_error`; the learner gives such an episode no loss).

The sample carries the whole response (model and tool tokens), a loss mask (model 1, tool 0), the
behaviour logprobs of the model's tokens (0 for tool tokens), the policy version of every model turn, and
the tool turns' images by reference. A turn that stopped at another stop token than `<|im_end|>` (say a
`stop_token_ids` entry) is closed by an `<|im_end|>` of the environment's. Only the batch loop runs
episodes (not `continuous`).
"""

from __future__ import annotations

import copy
import functools
import logging

import envs
from envs.base import Observation, Step
from envs.config import EnvConfig
from envs.runner import EnvFailure, EnvRunner
from generator.episode_metrics import EpisodeMetrics
from generator.inputs import Completion, Request, Result
from tasks.prompt import num_image_tokens

log = logging.getLogger(__name__)

VISION = "<|vision_start|><|image_pad|><|vision_end|>"


class EpisodeCompletion(Completion):
    """A Completion that is a whole episode: `token_ids` and `logprobs` cover every turn."""

    def __init__(self, episode: Episode, text: str):
        super().__init__(episode.ids, episode.logprobs, text, episode.finish)
        self.loss_mask = episode.mask
        self.images = episode.refs
        self.turn_versions = episode.versions
        self.tool_calls, self.tool_errors = episode.calls, len(episode.error_kinds)
        self.env_reward = episode.reward
        self.env_error = str(episode.failure) if episode.failure is not None else ""


def episode_fields(completion: Completion) -> dict:
    """The Rollout fields of an episode (`broker.schemas.Rollout.of`); {} for a one-turn completion."""
    if not isinstance(completion, EpisodeCompletion):
        return {}
    return dict(
        loss_mask=completion.loss_mask,
        images=list(completion.images),
        turn_versions=list(completion.turn_versions),
        tool_calls=completion.tool_calls,
        tool_errors=completion.tool_errors,
        env_reward=completion.env_reward,
        env_error=completion.env_error,
    )


class Episode:
    """One sample's episode as it grows (module docstring)."""

    def __init__(self, record, request: Request, env_name: str):
        self.record, self.request, self.env_name = record, request, env_name
        self.env = None
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[int] = []
        self.crops: list = []  # PIL images of the tool turns
        self.refs: list = []  # their ImageRefs
        self.versions: list[int] = []
        self.length = 0  # response tokens, images expanded
        self.calls, self.reward = 0, 0.0
        self.error_kinds: list[str] = []
        self.failure: EnvFailure | None = None
        self.finish, self.done, self.last_text = "stop", False, ""

    def add_model_turn(self, completion: Completion, version: int) -> None:
        self.ids += completion.token_ids
        self.logprobs += completion.logprobs
        self.mask += [1] * len(completion.token_ids)
        self.versions.append(version)
        self.length += len(completion.token_ids)
        self.last_text, self.finish = completion.text, completion.finish_reason

    def add_tool_turn(self, ids: list[int], images: list, refs: list, image_tokens: int) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.crops += images
        self.refs += refs
        self.length += len(ids) + image_tokens - len(images)

    def fail(self, failure: EnvFailure) -> None:
        self.failure, self.finish, self.done = failure, "abort", True
        log.warning("prompt %s: episode failed (%s)", self.record.prompt_id, failure)


class EpisodeRunner:
    """Runs the episodes of a generate call's prompts that name an environment (module docstring)."""

    def __init__(self, engine, config: EnvConfig, max_tokens: int, store_image, registry):
        self.engine, self.config, self.max_tokens = engine, config, max_tokens
        self.store_image = store_image
        self.metrics = EpisodeMetrics(registry)
        self.tokenizer = engine.tokenizer
        self.end_id = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.image_token_id = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.image_processor = engine.checker.image_processor
        self.max_images = engine.checker.max_images
        self.env_config = resolve_pixels(config, self.image_processor)
        self.runner = EnvRunner(config.threads, config.timeout_s)

    def run(self, records, requests: list[Request], results: list[Result]) -> int:
        """Replace the completions of every prompt with an environment by whole episodes (in place); returns
        the number of episodes run."""
        episodes, owners = [], []
        for record, request, result in zip(records, requests, results, strict=True):
            name = self.config.environment_of(record)
            if not name or not result.ok:
                continue
            for j, completion in enumerate(result.completions):
                episode = Episode(record, request, name)
                episode.add_model_turn(completion, result.version)
                episodes.append(episode)
                owners.append((result, j))
        if not episodes:
            return 0
        self._reset(episodes)
        turn = 1
        while True:
            self._step([e for e in episodes if not e.done], last=turn >= self.config.max_turns)
            active = [e for e in episodes if not e.done]
            if not active:
                break
            self._next_turn(active)
            turn += 1
        for episode, (result, j) in zip(episodes, owners):
            text = self.tokenizer.decode(episode.ids, skip_special_tokens=True)
            result.completions[j] = EpisodeCompletion(episode, text)
            result.version_end = max(result.version_end, *episode.versions)
            self.metrics.observe(episode)
        return len(episodes)

    def _reset(self, episodes: list[Episode]) -> None:
        def reset(episode: Episode):
            env = envs.make(episode.env_name, self.env_config)
            env.reset(episode.record, list(episode.request.images))
            return env

        for episode, env in zip(episodes, self.runner.run([functools.partial(reset, e) for e in episodes])):
            if isinstance(env, EnvFailure):
                episode.fail(env)
            else:
                episode.env = env

    def _step(self, episodes: list[Episode], last: bool) -> None:
        """Each episode's environment answers its model's last turn; observations become tool turns."""
        for episode in episodes:  # a turn cut at the token limit: no turn can follow
            episode.done = episode.finish != "stop"
        episodes = [e for e in episodes if not e.done]
        steps = self.runner.run([functools.partial(e.env.step, e.last_text) for e in episodes])
        for episode, step in zip(episodes, steps):
            if isinstance(step, EnvFailure):
                episode.fail(step)
                continue
            if not isinstance(step, Step):
                episode.fail(EnvFailure("error", f"step returned {type(step).__name__}, not a Step"))
                continue
            episode.calls += step.tool_calls
            episode.error_kinds += step.errors
            episode.reward += step.reward
            if step.done or step.observation is None:
                episode.done = True
            elif last:
                episode.done, episode.finish = True, "length"
            else:
                self._observe(episode, step.observation)

    def _observe(self, episode: Episode, observation: Observation) -> None:
        """Append the observation as a tool turn, or end the episode where it does not fit."""
        images = [image.convert("RGB") for image in observation.images]
        close = not episode.ids or episode.ids[-1] != self.end_id
        ids = tool_turn_ids(self.tokenizer, observation.text, len(images), self.image_token_id, close)
        tokens = sum(num_image_tokens(self.image_processor, *image.size) for image in images)
        images_after = len(episode.request.images) + len(episode.crops) + len(images)
        if (
            episode.length + len(ids) + tokens - len(images) + 1 > self.max_tokens
            or images_after > self.max_images
        ):
            episode.done, episode.finish = True, "length"
            return
        refs = [self.store_image(image) for image in images]  # this thread: transports are not thread-safe
        episode.add_tool_turn(ids, images, refs, tokens)

    def _next_turn(self, episodes: list[Episode]) -> None:
        """Every open episode's next model turn, in one engine call."""
        prompts, params = [], []
        for e in episodes:
            prompt = {"prompt_token_ids": list(e.request.prompt_token_ids) + e.ids}
            images = list(e.request.images) + e.crops
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
            params.append(
                turn_params(self.engine.sampling_params(e.record.split), self.max_tokens - e.length)
            )
        completions, version = self.engine.continue_turns(prompts, params)
        for episode, completion in zip(episodes, completions, strict=True):
            episode.add_model_turn(completion, version)

    def close(self) -> None:
        self.runner.close()


def tool_turn_ids(tokenizer, text: str, n_images: int, image_token_id: int, close: bool = False) -> list[int]:
    """Token ids of one tool turn after a model turn's `<|im_end|>` (`close`: the turn ended otherwise, so
    the tool turn starts with one): Qwen's rendering of a tool response (the images' vision blocks first,
    then the text), then the header of the model's next turn. Special-token text in `text` (which may echo
    the model's) is broken up, so it cannot become a pad or an end of turn."""
    text = text.replace("<|", "< |")
    rendered = ("<|im_end|>" if close else "") + (
        f"\n<|im_start|>user\n<tool_response>\n{VISION * n_images}{text}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    if sum(1 for t in ids if t == image_token_id) != n_images:
        raise ValueError("the tokenizer did not keep <|image_pad|> as one token per image")
    return ids


def turn_params(params, max_tokens: int):
    """A copy of a split's sampling parameters for one more turn of one episode: n = 1, at most
    `max_tokens` tokens."""
    out = params.clone() if hasattr(params, "clone") else copy.copy(params)
    out.n = 1
    out.max_tokens = max_tokens
    if getattr(out, "min_tokens", 0) > max_tokens:
        out.min_tokens = max_tokens
    return out


def resolve_pixels(config: EnvConfig, image_processor) -> EnvConfig:
    """`config` with the crop tool's pixel limits that are 0 set to the image processor's."""
    out = copy.deepcopy(config)
    size = getattr(image_processor, "size", {}) or {}
    if not out.crop.min_pixels:
        out.crop.min_pixels = int(size.get("shortest_edge", size.get("min_pixels", 0)) or 0)
    if not out.crop.max_pixels:
        out.crop.max_pixels = int(size.get("longest_edge", size.get("max_pixels", 0)) or 0)
    return out
