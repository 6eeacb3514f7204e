"""What an environment is: `reset` with the prompt, `step` with each model turn, observations back.

    class Echo(Environment):
        def reset(self, record, images):
            self.images = images
        def step(self, turn):
            return Step(Observation(text="you said: " + turn), done=len(turn) > 100)

`step` gets the text of the model's last turn (special tokens removed) and returns a `Step`: the
observation the environment appends as its own turn (text and PIL images; rendered as a tool turn of
the chat template, never trained on), `done` (no observation is appended then; the episode ends), an
optional `reward` term (summed over the episode and added to the reward service's reward), and what
happened in words for the metrics (`tool_calls`, `errors`: each error a short kind such as
"malformed" or "out_of_range"). An environment must not raise for anything the model writes: a bad
call is an observation that says what was wrong. It may be slow or raise for its own reasons: the
generator then fails that episode alone, with the reason recorded (envs.runner).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field


@dataclass
class Observation:
    """What the environment shows the model in its turn."""

    text: str = ""
    images: list = field(default_factory=list)
    """PIL images (RGB), shown before the text, in order."""


@dataclass
class Step:
    """The outcome of one `Environment.step`."""

    observation: Observation | None = None
    """Appended as the environment's turn unless `done`."""
    done: bool = False
    """The episode ends here (the model's last turn was its answer)."""
    reward: float = 0.0
    """A reward term of this step (summed over the episode)."""
    tool_calls: int = 0
    """Tool calls the model made in the turn."""
    errors: list[str] = field(default_factory=list)
    """One short kind per call the environment refused ("malformed", "out_of_range", ...)."""


class Environment(abc.ABC):
    """One episode's environment (a fresh instance per episode, `envs.make`)."""

    @abc.abstractmethod
    def reset(self, record, images: list) -> None:
        """Start an episode on `record` (a broker.schemas.PromptRecord) with its decoded PIL `images`."""

    @abc.abstractmethod
    def step(self, turn: str) -> Step:
        """Answer the model's turn (its text); never raises for what the model wrote."""
