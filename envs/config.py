"""Settings of multi-turn episodes (the generator's `env` section: `--env.routes`, `--env.max-turns`, ...).

Which prompts run as episodes: those whose record names an environment (`meta["env"]`, written by the
task) and those whose data source `routes` maps to one. Every other prompt is sampled in one turn, as
before. Environments run in the generator's process on `threads` threads, each call bounded by `timeout_s`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CropConfig:
    """The crop/zoom tool (envs/crop.py)."""

    max_calls: int = 3
    """Tool calls per episode; later ones are answered with an error and not run."""
    max_images: int = 3
    """Crops per episode (each is an image the engine must take: keep the engine's max_images above the
    prompt's images plus this)."""
    min_side: int = 4
    """The smallest box side in pixels of the image; smaller boxes are refused."""
    crop_pixels: int = 0
    """Pixels of a returned crop: the region is resized to about this many (keeping its aspect ratio);
    0 = as many as the image it was cut from, so a crop is a zoom by (image side / box side)."""
    min_pixels: int = 0
    """Least pixels of a returned crop; 0 = the model's image processor's min_pixels."""
    max_pixels: int = 0
    """Most pixels of a returned crop; 0 = the model's image processor's max_pixels."""


@dataclass
class EnvConfig:
    """Multi-turn episodes with an environment (docs/environments.md)."""

    routes: dict[str, str] = field(default_factory=dict)
    """Data source -> environment name (envs.ENVIRONMENTS), for prompts whose record names none."""
    max_turns: int = 4
    """Model turns per episode; the episode ends after the last even if the environment is not done."""
    timeout_s: float = 10.0
    """Longest call into an environment (reset or step); a slower one fails its episode ("timeout")."""
    threads: int = 4
    """Threads the environments run on."""
    crop: CropConfig = field(default_factory=CropConfig)
    """The crop/zoom tool."""

    def validate(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"env.max_turns must be >= 1, not {self.max_turns}")
        if self.timeout_s <= 0 or self.threads < 1:
            raise ValueError("env.timeout_s must be > 0 and env.threads >= 1")
        if self.crop.max_calls < 0 or self.crop.max_images < 0 or self.crop.min_side < 1:
            raise ValueError("env.crop: max_calls and max_images must be >= 0, min_side >= 1")

    def environment_of(self, record) -> str:
        """The environment name of a prompt record ("" for a one-turn prompt)."""
        return record.meta.get("env", "") or self.routes.get(record.data_source, "")
