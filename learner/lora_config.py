"""The learner's `[lora]` section: train a LoRA adapter instead of every weight (docs/lora.md).

    python -m learner --model PATH --lora.rank 16 --lora.alpha 32
    python -m deploy --config deploy/configs/demo.toml --learner.lora.rank 16

rank 0 (the default) trains every weight. With rank > 0 the base weights are frozen (bf16 on a GPU,
fp32 on CPU), only the adapter is trained, checkpointed and sent to the generators, and vLLM serves
each version's adapter on the base model it loaded once. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LM_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The language model's attention and MLP projections: the default targets."""
VISION_TARGETS = ("qkv", "proj", "gate_proj", "up_proj", "down_proj", "linear_fc1", "linear_fc2")
"""The vision blocks' attention and MLP linears of both families (Qwen2.5-VL: qkv, proj, gate/up/down_proj;
Qwen3-VL: qkv, proj, linear_fc1/2); with `vision` and no `vision_target_modules`, those the tower has."""
ADAPTER_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM's `max_lora_rank` accepts; an adapter of rank r needs the smallest one >= r."""


@dataclass
class LoraConfig:
    """LoRA: a low-rank adapter on the chosen linear layers, trained while the base model stays frozen."""

    rank: int = 0
    """Rank of the adapter; 0 = off (every weight is trained). 8-64 are usual; at most 512 (vLLM's limit)."""
    alpha: float = 32.0
    """LoRA alpha: the adapter's output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training (vLLM samples without it)."""
    target_modules: list[str] = field(default_factory=lambda: list(LM_TARGETS))
    """Linear layers of the language model that get an adapter, by their last name; every name must exist in
    the model. Default: its attention and MLP projections."""
    vision: bool = False
    """Adapt the vision tower too (`vision_target_modules`); off, the tower stays frozen as loaded."""
    vision_target_modules: list[str] = field(default_factory=list)
    """With `vision`: linear layers of the vision blocks by their last name ([] = the attention and MLP
    linears the tower has)."""
    export_merged: bool = False
    """The export also writes the base model with the adapter merged in (`hf-merged/`, loads without peft)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (the model's module names are checked at build)."""
        if self.rank < 0:
            raise ValueError(f"lora.rank must be >= 0 (0 = off), not {self.rank}")
        if self.rank > ADAPTER_RANKS[-1]:
            raise ValueError(f"lora.rank must be <= {ADAPTER_RANKS[-1]} (vLLM's largest), not {self.rank}")
        if not self.enabled:
            return
        if self.alpha <= 0:
            raise ValueError(f"lora.alpha must be > 0, not {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), not {self.dropout}")
        if not self.target_modules:
            raise ValueError("lora.target_modules is empty: name the linear layers that get an adapter")


def serving_rank(rank: int) -> int:
    """vLLM's `max_lora_rank` for an adapter of `rank`: the smallest rank it accepts that holds it."""
    for allowed in ADAPTER_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"no vLLM LoRA rank holds rank {rank} (largest {ADAPTER_RANKS[-1]})")
