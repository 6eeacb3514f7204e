"""The learner's `[loss]` section: the policy loss and the off-policy correction, each a variant chosen
by its `type` that holds only its own parameters (runtime/variants.py), and the pairs that fit.

    [loss.policy]          # python -m learner --loss.policy.type gspo --loss.policy.clip-high 5e-4
    type = "gspo"
    [loss.correction]
    type = "geo_mask"

The formulas are in learner/losses.py and docs/algorithms.md. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal, get_args

from runtime.variants import choices_shown, name_of

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
POLICY_TYPES = choices_shown("ppo-clip", "gspo", "cispo", "sapo")
CORRECTION_TYPES = choices_shown("none", "decoupled", "tis", "icepop", "geo_mask")


@dataclass
class PpoClipLoss:
    """ppo-clip: max(-A·u, -A·clip(u, 1 - clip_low, 1 + clip_high)) on the token ratio u = π_θ/π_prox."""

    type: Annotated[Literal["ppo-clip"], POLICY_TYPES] = "ppo-clip"
    """The policy loss; each has its own parameters (`--help` after the type lists the chosen one's)."""
    clip_low: float = 0.2
    """The ratio is clipped below at 1 - clip_low."""
    clip_high: float = 0.3
    """The ratio is clipped above at 1 + clip_high (above clip_low: clip-higher)."""
    dual_clip: float = 3.0
    """For negative advantages the loss is capped at -A·dual_clip; <= 1 disables the cap."""

    def validate(self) -> None:
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError("clip_low and clip_high must be >= 0")


@dataclass
class GspoLoss:
    """gspo: PPO-clip on one ratio per sequence, exp of its mean token log-ratio; a whole sequence is
    clipped or not."""

    type: Annotated[Literal["gspo"], POLICY_TYPES] = "gspo"
    """The policy loss; each has its own parameters (`--help` after the type lists the chosen one's)."""
    clip_low: float = 3e-4
    """The sequence ratio is clipped below at 1 - clip_low."""
    clip_high: float = 4e-4
    """The sequence ratio is clipped above at 1 + clip_high."""
    dual_clip: float = 3.0
    """For negative advantages the loss is capped at -A·dual_clip; <= 1 disables the cap."""

    def validate(self) -> None:
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError("clip_low and clip_high must be >= 0")


@dataclass
class CispoLoss:
    """cispo: -A · sg(clip(u)) · log π_θ; the clip bounds each token's weight and drops no gradient."""

    type: Annotated[Literal["cispo"], POLICY_TYPES] = "cispo"
    """The policy loss; each has its own parameters (`--help` after the type lists the chosen one's)."""
    clip_low: float = 1.0
    """The stop-gradient weight is clipped below at 1 - clip_low (>= 1: no lower bound)."""
    clip_high: float = 3.0
    """The stop-gradient weight is clipped above at 1 + clip_high."""

    def validate(self) -> None:
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError("clip_low and clip_high must be >= 0")


@dataclass
class SapoLoss:
    """sapo: -A · (4/τ)·σ(τ(u-1)), a soft gate instead of a clip."""

    type: Annotated[Literal["sapo"], POLICY_TYPES] = "sapo"
    """The policy loss; each has its own parameters (`--help` after the type lists the chosen one's)."""
    tau_pos: float = 1.0
    """Temperature τ of the gate for tokens with a positive advantage."""
    tau_neg: float = 1.05
    """Temperature τ for the other tokens; larger shuts the gate faster as u moves away from 1."""

    def validate(self) -> None:
        if self.tau_pos <= 0 or self.tau_neg <= 0:
            raise ValueError("tau_pos and tau_neg must be > 0")


PolicyLoss = PpoClipLoss | GspoLoss | CispoLoss | SapoLoss


@dataclass
class NoCorrection:
    """none: every token has weight 1 (plain PPO on π_prox)."""

    type: Annotated[Literal["none"], CORRECTION_TYPES] = "none"
    """The off-policy correction of k = π_prox/μ; each has its own parameters (`--help` after the type lists
    the chosen one's)."""


@dataclass
class DecoupledCorrection:
    """decoupled: each token is weighted by k (decoupled PPO)."""

    type: Annotated[Literal["decoupled"], CORRECTION_TYPES] = "decoupled"
    """The off-policy correction of k = π_prox/μ; each has its own parameters (`--help` after the type lists
    the chosen one's)."""
    weight_cap: float = 0.0
    """Tokens whose k exceeds this get no loss; 0 keeps every token."""


@dataclass
class TisCorrection:
    """tis: each token is weighted by min(k, cap) (truncated importance sampling)."""

    type: Annotated[Literal["tis"], CORRECTION_TYPES] = "tis"
    """The off-policy correction of k = π_prox/μ; each has its own parameters (`--help` after the type lists
    the chosen one's)."""
    cap: float = 2.0
    """The largest weight a token gets."""


@dataclass
class IcepopCorrection:
    """icepop: each token is weighted by k, and tokens with k outside [low, high] get no loss."""

    type: Annotated[Literal["icepop"], CORRECTION_TYPES] = "icepop"
    """The off-policy correction of k = π_prox/μ; each has its own parameters (`--help` after the type lists
    the chosen one's)."""
    low: float = 0.5
    """Tokens with k below this get no loss."""
    high: float = 2.0
    """Tokens with k above this get no loss."""


@dataclass
class GeoMaskCorrection:
    """geo_mask: a sequence whose geometric-mean k is outside [low, high] gets no loss, the others
    weight 1."""

    type: Annotated[Literal["geo_mask"], CORRECTION_TYPES] = "geo_mask"
    """The off-policy correction of k = π_prox/μ; each has its own parameters (`--help` after the type lists
    the chosen one's)."""
    low: float = 0.99
    """Sequences whose geometric-mean k is below this get no loss."""
    high: float = 1.01
    """Sequences whose geometric-mean k is above this get no loss."""


Correction = NoCorrection | DecoupledCorrection | TisCorrection | IcepopCorrection | GeoMaskCorrection
POLICY_LOSSES: tuple[str, ...] = tuple(name_of(cls) for cls in get_args(PolicyLoss))
CORRECTIONS: tuple[str, ...] = tuple(name_of(cls) for cls in get_args(Correction))
POLICY_CORRECTIONS: dict[str, tuple[str, ...]] = {
    "ppo-clip": CORRECTIONS,
    "gspo": ("none", "geo_mask"),
    "cispo": ("none", "tis", "icepop", "geo_mask"),
    "sapo": CORRECTIONS,
}
"""The off-policy corrections each policy loss can be combined with (docs/algorithms.md, "Policy losses"):
GSPO's ratio is one per sequence, so only sequence-level rejection fits it (a per-token weight brings back the
token-level variance GSPO removes); CISPO's weight is a truncated importance weight, so decoupled's unbounded
k on top of it would undo the truncation (tis and icepop keep it bounded)."""


@dataclass
class LossConfig:
    """Policy loss, off-policy correction and regularisers (learner/losses.py)."""

    policy: PolicyLoss = field(default_factory=PpoClipLoss)
    """The policy-gradient surrogate on u = π_θ/π_prox and its parameters: `[loss.policy] type = "gspo"`,
    `--loss.policy.type gspo`."""
    correction: Correction = field(default_factory=DecoupledCorrection)
    """The off-policy correction of k = π_prox/μ and its parameters: `[loss.correction] type = "tis"`,
    `--loss.correction.type tis`. Which ones each policy loss takes: docs/algorithms.md."""
    aggregation: Aggregation = "token-mean"
    """How token losses become the batch loss: token-mean (each token weighs the same), seq-mean-token-mean
    (each sequence), seq-mean-token-sum-norm (token sums over the constant norm_length: Dr.GRPO)."""
    norm_length: int = 1024
    """The constant length of seq-mean-token-sum-norm (Dr.GRPO: the maximum response length)."""
    kl_coef: float = 0.0
    """Weight of low_var_kl to the frozen reference policy (0 = no reference model is loaded)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""

    def validate(self) -> None:
        """The one place where a policy loss refuses a correction."""
        takes = POLICY_CORRECTIONS[self.policy.type]
        if self.correction.type not in takes:
            raise ValueError(
                f"policy={self.policy.type} cannot take correction={self.correction.type}; "
                f"it takes one of {takes} (why: docs/algorithms.md, Policy losses)"
            )
