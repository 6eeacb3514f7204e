"""The learner's activation-checkpointing modes change memory and recompute, never the gradients."""

import pytest
import torch

from learner.config import ParallelConfig
from learner.parallel import apply_parallelism
from policy.loading import load_model
from runtime.config import from_dict


def _grads(model_dir, **cfg):
    torch.manual_seed(0)
    hf = load_model(model_dir).train()
    root = apply_parallelism(hf, ParallelConfig(**cfg), torch.device("cpu"))
    ids = torch.arange(3, 40).unsqueeze(0)
    root.model(input_ids=ids).logits.float().pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in root.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("blocks", [0, 1])
def test_selective_checkpointing_gives_the_gradients_of_no_checkpointing(tiny_model_dir, blocks):
    reference = _grads(tiny_model_dir, activation_checkpointing=False)
    ours = _grads(
        tiny_model_dir, activation_checkpointing=True, checkpoint_mode="selective", selective_blocks=blocks
    )
    assert ours.keys() == reference.keys() and len(ours) > 10
    for name, grad in reference.items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_auto_outside_a_launcher_layout_runs_selective_and_a_bad_mode_is_named():
    from learner.parallel import text_checkpoint_mode

    cfg = ParallelConfig(checkpoint_mode="auto")
    cfg.validate()
    assert text_checkpoint_mode(cfg) == "selective"
    assert text_checkpoint_mode(ParallelConfig(checkpoint_mode="full")) == "full"
    assert (
        text_checkpoint_mode(ParallelConfig(checkpoint_mode="selective", selective_blocks=2)) == "selective:2"
    )
    with pytest.raises(ValueError, match="checkpoint_mode = 'partial': expected one of 'full', 'selective'"):
        from_dict(ParallelConfig, {"checkpoint_mode": "partial"})
    with pytest.raises(ValueError, match="selective_blocks needs checkpoint_mode selective, not full"):
        from_dict(ParallelConfig, {"selective_blocks": 2})
