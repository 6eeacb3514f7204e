"""learner.optim.MasterAdamW: AdamW's math, fp32 state through checkpoints, and its loss curve on the tiny
model against fp32 master weights (with plain bf16 AdamW as the control the tolerance must reject)."""

import pytest
import torch

from learner.config import OptimConfig, ParallelConfig
from learner.optim import MasterAdamW
from learner.parallel import apply_parallelism, build_optimizer, clip_grad_norm


def _param(values, dtype=torch.float32):
    p = torch.nn.Parameter(values.clone().to(dtype))
    return p


def test_matches_torch_adamw_on_fp32_parameters():
    torch.manual_seed(0)
    init = torch.randn(300, 7)
    grads = [torch.randn(300, 7) for _ in range(5)]
    ours, ref = _param(init), _param(init)
    a = MasterAdamW([ours], lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99), chunk=256)
    b = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99))
    for g in grads:
        ours.grad, ref.grad = g.clone(), g.clone()
        a.step()
        b.step()
    torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(a.state[ours]["exp_avg_sq"], b.state[ref]["exp_avg_sq"])


def test_small_updates_survive_bf16_parameters():
    """lr 1e-4 on weights of 1 is below half of bf16's resolution there (2^-9): plain bf16 AdamW rounds every
    update away, the master copy accumulates them and the bf16 parameter follows."""
    init = torch.ones(1000)
    ours, plain = _param(init, torch.bfloat16), _param(init, torch.bfloat16)
    a = MasterAdamW([ours], lr=1e-4, weight_decay=0.0)
    b = torch.optim.AdamW([plain], lr=1e-4, weight_decay=0.0)
    for _ in range(30):
        ours.grad = torch.ones(1000, dtype=torch.bfloat16)
        plain.grad = torch.ones(1000, dtype=torch.bfloat16)
        a.step()
        b.step()
    assert torch.equal(plain.detach(), init.to(torch.bfloat16))  # every update rounded away
    master = a.state[ours]["master"]
    torch.testing.assert_close(master, torch.full((1000,), 1 - 30e-4), rtol=0, atol=1e-5)
    assert float(ours.detach()[0]) < 1.0  # the accumulated update reached the bf16 parameter


def test_state_dict_round_trip_keeps_fp32_master(tmp_path):
    torch.manual_seed(1)
    p = _param(torch.randn(64), torch.bfloat16)
    opt = MasterAdamW([p], lr=1e-3)
    for _ in range(3):
        p.grad = torch.randn(64).to(torch.bfloat16)
        opt.step()
    saved = opt.state_dict()
    torch.save(saved, tmp_path / "optim.pt")
    q = _param(p.detach().float(), torch.bfloat16)
    other = MasterAdamW([q], lr=1e-3)
    other.load_state_dict(torch.load(tmp_path / "optim.pt"))
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert other.state[q][key].dtype == torch.float32
        assert torch.equal(other.state[q][key], opt.state[p][key]), key
    assert float(other.state[q]["step"]) == 3.0
    g = torch.randn(64).to(torch.bfloat16)
    p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    other.step()
    assert torch.equal(p.detach(), q.detach())


def test_checkpointer_round_trip(tiny_model_dir, tmp_path):
    """learner.checkpoint saves the fp32 states and a resumed learner continues bit for bit."""
    from learner.checkpoint import Checkpointer, TrainerState
    from policy.loading import load_model

    def build():
        hf = load_model(tiny_model_dir, dtype="bfloat16").train()
        root = apply_parallelism(hf, ParallelConfig(activation_checkpointing=False), torch.device("cpu"))
        opt, sched = build_optimizer(root, OptimConfig(lr=1e-3), "host")
        return root, opt, sched

    root, opt, sched = build()
    params = [p for p in root.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.full_like(p, 0.01)
    opt.step()
    ckpt = Checkpointer(tmp_path)
    path = ckpt.save(root, opt, sched, TrainerState(step=1))
    root2, opt2, sched2 = build()
    ckpt.load(path, root2, opt2, sched2)
    params2 = [p for p in root2.parameters() if p.requires_grad]
    for p, q in zip(params, params2):
        assert torch.equal(opt.state[p]["master"], opt2.state[q]["master"])
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"])


STEPS = 200
LR = 1e-5
TOLERANCE = 0.05
"""Largest |loss - fp32 reference loss| over the curve, as a share of the reference's loss drop."""


def _curve(model_dir, mode: str) -> list[float]:
    """Mean response-token NLL per step: 2 packed micro-batches per optimizer step (gradient accumulation),
    the learner's PackedPolicy, clipping and optimizer factory."""
    from policy.loading import load_model, load_processor
    from policy.packing import pack
    from tests.fixtures.models import make_samples

    processor = load_processor(model_dir)
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    samples = make_samples(processor, image_counts=(0, 0), seed=0)
    batches = [pack(samples[:1], pad), pack(samples[1:], pad)]
    n = sum(int(b.target_index.numel()) for b in batches)
    torch.manual_seed(0)
    hf = load_model(model_dir, dtype="float32" if mode == "params" else "bfloat16").train()
    root = apply_parallelism(hf, ParallelConfig(activation_checkpointing=False), torch.device("cpu"))
    if mode == "plain-bf16":
        opt = torch.optim.AdamW(root.parameters(), lr=LR, weight_decay=1e-2)
    else:
        opt, _ = build_optimizer(root, OptimConfig(lr=LR), mode)
    curve = []
    for _ in range(STEPS):
        total = 0.0
        for batch in batches:
            logprobs, _ = root(batch, with_entropy=False)
            loss = -logprobs.sum() / n
            loss.backward()
            total += float(loss.detach())
        clip_grad_norm(root, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        curve.append(total)
    return curve


@pytest.mark.slow
def test_loss_curve_matches_fp32_master_weights(tiny_model_dir):
    """200 steps at lr 1e-5 (updates ~1e-5 on weights of ~0.02: below bf16's resolution). bf16 parameters
    with fp32 master weights in host memory follow the fp32 curve within 5% of its drop; plain bf16 AdamW
    (no master copy) is the control: it must miss by far more, or the tolerance could not fail."""
    torch.set_num_threads(1)
    ref = _curve(tiny_model_dir, "params")
    host = _curve(tiny_model_dir, "host")
    plain = _curve(tiny_model_dir, "plain-bf16")
    drop = ref[0] - ref[-1]
    assert drop > 1.0, f"the reference barely learned ({ref[0]:.3f} -> {ref[-1]:.3f})"

    def deviation(curve):
        return max(abs(a - b) for a, b in zip(curve, ref)) / drop

    assert deviation(host) <= TOLERANCE, (deviation(host), host[-1], ref[-1])
    assert deviation(plain) > 5 * TOLERANCE, (deviation(plain), plain[-1], ref[-1])


def test_step_beside_runs_the_work_and_the_same_update():
    """step_beside: the update equals a plain step; the work runs in the calling thread; both are timed."""
    import threading

    from learner.optim import step_beside

    torch.manual_seed(0)
    init, grad = torch.randn(500), torch.randn(500)
    plain, beside = _param(init), _param(init)
    a, b = MasterAdamW([plain], lr=1e-2, location="host"), MasterAdamW([beside], lr=1e-2, location="host")
    plain.grad, beside.grad = grad.clone(), grad.clone()
    a.step()
    ran = []
    step_s, work_s = step_beside(b, lambda: ran.append(threading.current_thread() is threading.main_thread()))
    assert ran == [True] and step_s >= 0 and work_s >= 0
    torch.testing.assert_close(beside.detach(), plain.detach(), rtol=0, atol=0)


def test_step_beside_raises_either_sides_error_after_both_ended():
    from learner.optim import step_beside

    p = _param(torch.randn(10))
    p.grad = torch.randn(10)
    opt = MasterAdamW([p], lr=1e-2, location="host")

    def broken_work():
        raise RuntimeError("work failed")

    with pytest.raises(RuntimeError, match="work failed"):
        step_beside(opt, broken_work)
    assert int(opt.state[p]["step"]) == 1  # the update still ran to its end

    def broken_step():
        raise ValueError("update failed")

    opt.step = broken_step  # fails in its thread: raised here
    with pytest.raises(ValueError, match="update failed"):
        step_beside(opt, lambda: None)
