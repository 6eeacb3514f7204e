"""Every loss variant against a plain, loop-based re-derivation on hand-made tokens."""

import math

import pytest
import torch

from learner.config import LearnerConfig
from learner.loss_config import (
    POLICY_CORRECTIONS,
    POLICY_LOSSES,
    CispoLoss,
    Correction,
    DecoupledCorrection,
    GeoMaskCorrection,
    GspoLoss,
    IcepopCorrection,
    LossConfig,
    NoCorrection,
    PolicyLoss,
    PpoClipLoss,
    SapoLoss,
    TisCorrection,
)
from learner.losses import TokenBatch, loss_denominator, low_var_kl, policy_loss
from runtime.config import from_dict, validate
from runtime.variants import variants

# Two sequences: seq 0 has 4 tokens (A > 0), seq 1 has 3 tokens (A < 0).
# log π_θ - log π_prox chosen to land inside, on and beyond the clip range [0.8, 1.3] and the
# dual clip c = 3; log π_prox - log μ chosen around the IcePop bounds [0.5, 2].
SEQ = [0, 0, 0, 0, 1, 1, 1]
ADV = [1.5, 1.5, 1.5, 1.5, -2.0, -2.0, -2.0]
RATIO = [1.0, 1.2, 1.31, 0.5, 0.7, 1.5, 4.0]  # π_θ / π_prox
K = [1.0, 1.9, 2.1, 0.45, 0.55, 1.0, 1.05]  # π_prox / μ
PROX = [-1.0, -0.5, -2.0, -0.3, -1.2, -0.8, -3.0]


def _loss(policy="ppo-clip", correction="decoupled", **kwargs) -> LossConfig:
    """A LossConfig of the named policy loss and correction, each at its defaults."""
    return LossConfig(
        policy=variants(PolicyLoss)[policy](), correction=variants(Correction)[correction](), **kwargs
    )


def _inputs(ratio=RATIO, k=K):
    logp = [p + math.log(r) for p, r in zip(PROX, ratio)]
    behav = [p - math.log(x) for p, x in zip(PROX, k)]
    return logp, behav


def _reference(cfg, logp, behav, prox, adv, seq, ref=None, ent=None, denom=None):
    """Per-token loop over the formulas of the module docstring, with torch scalars for autograd."""
    num_seqs = max(seq) + 1
    prox = prox if prox is not None else [b for b in behav]
    seq_logk = {}
    for t, s in enumerate(seq):
        seq_logk.setdefault(s, []).append(prox[t] - behav[t])
    token_losses = []
    for t in range(len(seq)):
        a = adv[t]
        pg = _reference_surrogate(cfg, logp, prox, seq, t, a)
        k = math.exp(prox[t] - behav[t])
        corr = cfg.correction
        if corr.type == "none":
            w = 1.0
        elif corr.type == "decoupled":
            w = 0.0 if (corr.weight_cap > 0 and k > corr.weight_cap) else k
        elif corr.type == "tis":
            w = min(k, corr.cap)
        elif corr.type == "icepop":
            w = k if corr.low <= k <= corr.high else 0.0
        else:
            lks = seq_logk[seq[t]]
            g = math.exp(sum(lks) / len(lks))
            w = 1.0 if corr.low <= g <= corr.high else 0.0
        loss_t = w * pg
        if cfg.kl_coef > 0:
            d = ref[t] - logp[t]
            loss_t = loss_t + cfg.kl_coef * (torch.exp(d) - d - 1)
        if cfg.entropy_coef > 0:
            loss_t = loss_t - cfg.entropy_coef * ent[t]
        token_losses.append(loss_t)
    if cfg.aggregation == "token-mean":
        return sum(token_losses) / (denom or len(seq))
    if cfg.aggregation == "seq-mean-token-mean":
        total = 0.0
        for s in range(num_seqs):
            mine = [token_losses[t] for t in range(len(seq)) if seq[t] == s]
            total = total + sum(mine) / len(mine)
        return total / (denom or num_seqs)
    return sum(token_losses) / (denom or num_seqs * cfg.norm_length)


def _reference_surrogate(cfg, logp, prox, seq, t, a):
    """pg of token t for `cfg.policy`; GSPO with the sequence ratio's full gradient (the paper's form)."""
    u = torch.exp(logp[t] - prox[t])
    pol = cfg.policy
    if pol.type == "cispo":
        w = min(max(u.item(), 1 - pol.clip_low), 1 + pol.clip_high)  # a constant
        return -a * w * logp[t]
    if pol.type == "sapo":
        tau = pol.tau_pos if a > 0 else pol.tau_neg
        return -a * (4 / tau) / (1 + torch.exp(-tau * (u - 1)))
    low, high = pol.clip_low, pol.clip_high
    if pol.type == "gspo":
        mine = [j for j in range(len(seq)) if seq[j] == seq[t]]
        u = torch.exp(sum(logp[j] - prox[j] for j in mine) / len(mine))
    pg = max(-a * u, -a * min(max(u, 1 - low), 1 + high))
    if pol.dual_clip > 1 and a < 0:
        pg = min(pg, torch.tensor(-a * pol.dual_clip, dtype=torch.float64))
    return pg


def _run_both(cfg, with_prox=True, ratio=RATIO, k=K, denom=None):
    logp, behav = _inputs(ratio, k)
    prox = PROX if with_prox else None
    ref = [x - 0.1 * i for i, x in enumerate(logp)]
    ent = [0.5 + 0.1 * i for i in range(len(logp))]
    logp_t = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    ent_t = torch.tensor(ent, dtype=torch.float64, requires_grad=True)
    batch = TokenBatch(
        logprobs=logp_t,
        behaviour_logprobs=torch.tensor(behav, dtype=torch.float64),
        proximal_logprobs=torch.tensor(prox, dtype=torch.float64) if prox else None,
        advantages=torch.tensor(ADV, dtype=torch.float64),
        seq_index=torch.tensor(SEQ),
        num_seqs=2,
        ref_logprobs=torch.tensor(ref, dtype=torch.float64),
        entropy=ent_t,
    )
    loss, metrics = policy_loss(cfg, batch, denom)
    assert all(torch.is_tensor(v) and v.dim() == 0 and not v.requires_grad for v in metrics.values())
    metrics = {key: float(value) for key, value in metrics.items()}
    loss.backward()

    logp_r = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in logp]
    ent_r = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in ent]
    ref_loss = _reference(cfg, logp_r, behav, prox, ADV, SEQ, ref, ent_r, denom)
    ref_loss.backward()
    grad_ref = [x.grad.item() if x.grad is not None else 0.0 for x in logp_r]
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-12)
    assert logp_t.grad.tolist() == pytest.approx(grad_ref, abs=1e-12)
    return loss, metrics, logp_t.grad


CORRECTION_CASES = ["none", "decoupled", "tis", "icepop", "geo_mask"]
AGG_CASES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
POLICY_CASES = [(p, c) for p in POLICY_LOSSES for c in POLICY_CORRECTIONS[p] if p != "ppo-clip"]


@pytest.mark.parametrize("correction", CORRECTION_CASES)
@pytest.mark.parametrize("aggregation", AGG_CASES)
def test_policy_loss_matches_loop_reference(correction, aggregation):
    cfg = _loss(correction=correction, aggregation=aggregation, norm_length=16)
    _run_both(cfg)


def test_kl_and_entropy_terms_match_reference():
    cfg = _loss(correction="tis", kl_coef=0.1, entropy_coef=0.01)
    _, metrics, _ = _run_both(cfg)
    assert "kl_ref" in metrics and metrics["entropy"] == pytest.approx(0.8)


def test_without_proximal_ratio_is_against_behaviour():
    cfg = _loss(correction="none")
    _run_both(cfg, with_prox=False)


def test_external_denominator_scales_loss():
    cfg = _loss(correction="none")
    loss_local, _, _ = _run_both(cfg)
    loss_global, _, _ = _run_both(cfg, denom=70.0)
    assert loss_global.item() == pytest.approx(loss_local.item() * 7 / 70.0)


def test_clip_edges_zero_gradient_where_clipped():
    # Positive advantage beyond 1 + ε_high (token 2: 1.31 > 1.3) and negative advantage
    # below 1 - ε_low are clipped (no gradient); A < 0 above 1 + ε is not clipped.
    cfg = LossConfig(policy=PpoClipLoss(dual_clip=0.0), correction=NoCorrection())
    _, metrics, grad = _run_both(cfg)
    assert grad[2].item() == 0.0  # A>0, u = 1.31 above 1.3
    assert grad[3].item() != 0.0  # A>0, u = 0.5 below the range: not clipped (max picks unclipped)
    assert grad[4].item() == 0.0  # A<0, u = 0.7 below 0.8
    assert grad[5].item() != 0.0  # A<0, u = 1.5: unclipped (pessimistic)
    assert metrics["clipped_frac"] == pytest.approx(2 / 7)


def test_clip_boundary_inside_keeps_gradient():
    ratio = [1.0, 1.2999, 1.3001, 0.8001, 0.7999, 1.0, 1.0]
    cfg = LossConfig(policy=PpoClipLoss(dual_clip=0.0), correction=NoCorrection())
    _, _, grad = _run_both(cfg, ratio=ratio)
    assert grad[1].item() != 0.0 and grad[2].item() == 0.0
    assert grad[3].item() != 0.0  # A>0 below the range: unclipped
    assert grad[4].item() == 0.0  # A<0, 0.7999 < 0.8: clipped


def test_dual_clip_caps_negative_advantage_loss():
    cfg = LossConfig(policy=PpoClipLoss(dual_clip=3.0), correction=NoCorrection(), aggregation="token-mean")
    loss, metrics, grad = _run_both(cfg)
    assert grad[6].item() == 0.0  # u = 4 > c = 3 with A < 0: loss is the constant -A·c
    assert metrics["dual_clipped_frac"] == pytest.approx(1 / 7)
    cfg_off = LossConfig(policy=PpoClipLoss(dual_clip=0.0), correction=NoCorrection())
    _, _, grad_off = _run_both(cfg_off)
    assert grad_off[6].item() != 0.0


def test_icepop_masks_outside_and_weights_inside():
    cfg = LossConfig(policy=PpoClipLoss(dual_clip=0.0), correction=IcepopCorrection(low=0.5, high=2.0))
    _, metrics, grad = _run_both(cfg)
    # K = [1.0, 1.9, 2.1, 0.45, 0.55, 1.0, 1.05]: tokens 2 and 3 are outside [0.5, 2].
    assert grad[3].item() == 0.0
    assert metrics["masked_frac"] == pytest.approx(2 / 7)
    assert metrics["is_weight_mean"] == pytest.approx((1.0 + 1.9 + 0.55 + 1.0 + 1.05) / 7)


def test_geo_mask_rejects_whole_sequences():
    # seq 1 log-ratios: log .55, log 1, log 1.05 -> geo mean ~0.834 -> rejected
    # seq 0 made exactly on-policy -> kept
    k = [1.0, 1.0, 1.0, 1.0, 0.55, 1.0, 1.05]
    cfg = LossConfig(correction=GeoMaskCorrection(low=0.99, high=1.01))
    _, metrics, grad = _run_both(cfg, k=k)
    assert all(g == 0.0 for g in grad[4:].tolist())
    assert any(g != 0.0 for g in grad[:4].tolist())
    assert metrics["masked_frac"] == pytest.approx(3 / 7)
    # Inside the band near its edge: 1.009 per token keeps the sequence.
    k_edge = [1.0, 1.0, 1.0, 1.0, 1.009, 1.009, 1.009]
    _, metrics, _ = _run_both(cfg, k=k_edge)
    assert metrics["masked_frac"] == 0.0


def test_decoupled_cap_masks_large_weights():
    cfg = LossConfig(correction=DecoupledCorrection(weight_cap=2.0))
    _, metrics, grad = _run_both(cfg)
    assert grad[2].item() == 0.0  # k = 2.1 > cap
    assert metrics["masked_frac"] == pytest.approx(1 / 7)


def test_tis_truncates_weight():
    cfg = LossConfig(policy=PpoClipLoss(dual_clip=0.0), correction=TisCorrection(cap=1.5))
    _, metrics, _ = _run_both(cfg)
    assert metrics["is_weight_mean"] == pytest.approx((1.0 + 1.5 + 1.5 + 0.45 + 0.55 + 1.0 + 1.05) / 7)


def test_mismatch_kl_is_zero_on_policy_and_positive_off_policy():
    cfg = _loss(correction="none")
    ones = [1.0] * 7
    _, m_on, _ = _run_both(cfg, ratio=ones, k=ones)
    assert m_on["mismatch_kl"] == pytest.approx(0.0, abs=1e-12)
    _, m_off, _ = _run_both(cfg)
    assert m_off["mismatch_kl"] > 0.0


def test_low_var_kl_is_k3():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -2.0])
    d = ref - logp
    assert torch.allclose(low_var_kl(logp, ref), d.exp() - d - 1)


def test_denominators_and_errors():
    assert loss_denominator(LossConfig(aggregation="token-mean"), 10, 3) == 10.0
    assert loss_denominator(LossConfig(aggregation="seq-mean-token-mean"), 10, 3) == 3.0
    assert loss_denominator(LossConfig(aggregation="seq-mean-token-sum-norm", norm_length=8), 10, 3) == 24.0
    with pytest.raises(ValueError, match="aggregation"):
        loss_denominator(LossConfig(aggregation="bogus"), 1, 1)
    batch = TokenBatch(torch.zeros(2), torch.zeros(2), torch.ones(2), torch.tensor([0, 0]), 1)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(LossConfig(kl_coef=0.1), batch)
    with pytest.raises(ValueError, match="correction"):
        policy_loss(LossConfig(correction=NoCorrection(type="bogus")), batch)


@pytest.mark.parametrize("policy,correction", POLICY_CASES)
@pytest.mark.parametrize("aggregation", AGG_CASES)
def test_other_policy_losses_match_loop_reference(policy, correction, aggregation):
    cfg = _loss(policy, correction, aggregation=aggregation, norm_length=16)
    _run_both(cfg)
    _run_both(cfg, with_prox=False)
    cfg_reg = _loss(policy, correction, aggregation=aggregation, kl_coef=0.1, entropy_coef=0.01)
    _run_both(cfg_reg)


def test_all_policies_share_the_on_policy_gradient():
    # u = 1 (π_θ = π_prox): every surrogate's gradient is -A·∇log π_θ (over the denominator).
    ones = [1.0] * 7
    grads = {}
    for policy in POLICY_LOSSES:
        _, _, grad = _run_both(_loss(policy, "none"), ratio=ones)
        grads[policy] = grad.tolist()
    for policy in POLICY_LOSSES:
        assert grads[policy] == pytest.approx(grads["ppo-clip"], abs=1e-12), policy
    assert grads["ppo-clip"][0] == pytest.approx(-1.5 / 7)  # A = 1.5, token-mean over 7


def test_gspo_clips_whole_sequences():
    # seq 0 (A > 0): every token's ratio 1.1 -> S = 1.1 > 1 + ε_high: all 4 tokens clipped, no gradient,
    # although a token-level clip of 0.3 would keep them. seq 1 (A < 0): ratios 0.6, 1.2, 1.2 average out
    # to S = exp(mean log) = 0.95 (inside [0.9, 1.05]): unclipped, every token gets -A·S / #tokens.
    ratio = [1.1, 1.1, 1.1, 1.1, 0.6, 1.2, 1.2]
    cfg = LossConfig(policy=GspoLoss(clip_low=0.1, clip_high=0.05), correction=NoCorrection())
    _, metrics, grad = _run_both(cfg, ratio=ratio)
    assert grad[:4].tolist() == [0.0] * 4
    s = math.exp((math.log(0.6) + 2 * math.log(1.2)) / 3)
    assert grad[4:].tolist() == pytest.approx([2.0 * s / 7] * 3, abs=1e-12)
    assert metrics["clipped_frac"] == pytest.approx(4 / 7)
    assert metrics["ratio_mean"] == pytest.approx((4 * 1.1 + 3 * s) / 7)
    _, _, grad_ppo = _run_both(_loss("ppo-clip", "none"), ratio=ratio)
    assert all(g != 0.0 for g in grad_ppo[:4].tolist())


def test_cispo_bounds_the_weight_but_keeps_every_gradient():
    # PPO-clip zeroes tokens 2 (A > 0, u = 1.31) and 4 (A < 0, u = 0.7); CISPO keeps both, with the
    # weight u itself inside [1 - ε_low, 1 + ε_high] and the bound outside it.
    cfg = LossConfig(policy=CispoLoss(clip_low=0.2, clip_high=0.25), correction=NoCorrection())
    _, metrics, grad = _run_both(cfg)
    assert all(g != 0.0 for g in grad.tolist())
    assert grad[1].item() == pytest.approx(-1.5 * 1.2 / 7)  # inside: w = u
    assert grad[2].item() == pytest.approx(-1.5 * 1.25 / 7)  # above: w = 1 + ε_high
    assert grad[6].item() == pytest.approx(2.0 * 1.25 / 7)  # A < 0, u = 4: w = 1.25
    assert grad[4].item() == pytest.approx(2.0 * 0.8 / 7)  # A < 0, u = 0.7 below: w = 0.8
    assert metrics["clipped_frac"] == pytest.approx(5 / 7)  # 1.31, 0.5, 0.7, 1.5, 4.0


def test_sapo_gate_decays_smoothly_and_faster_for_negative_advantages():
    # Gradient of -A·(4/τ)σ(τ(u-1)) w.r.t. log π_θ: -A·u·4σ(1-σ); no hard zero anywhere.
    cfg = LossConfig(policy=SapoLoss(tau_pos=1.0, tau_neg=2.0), correction=NoCorrection())
    _, metrics, grad = _run_both(cfg)
    assert all(g != 0.0 for g in grad.tolist())
    assert metrics["clipped_frac"] == 0.0

    def expected(a, u, tau):
        sig = 1 / (1 + math.exp(-tau * (u - 1)))
        return -a * u * 4 * sig * (1 - sig) / 7

    assert grad[6].item() == pytest.approx(expected(-2.0, 4.0, 2.0))
    assert grad[3].item() == pytest.approx(expected(1.5, 0.5, 1.0))
    # The same ratio decays more under τ_neg = 2 than under τ_pos = 1 (per unit of |A|).
    assert abs(expected(-1.0, 1.5, 2.0)) < abs(expected(1.0, 1.5, 1.0))


@pytest.mark.parametrize("policy", POLICY_LOSSES)
def test_config_accepts_listed_and_refuses_other_corrections(policy):
    for correction in CORRECTION_CASES:
        cfg = LearnerConfig(loss=_loss(policy, correction))
        if correction in POLICY_CORRECTIONS[policy]:
            validate(cfg)
        else:
            with pytest.raises(
                ValueError, match=f"loss: policy={policy} cannot take correction={correction}"
            ):
                validate(cfg)


def test_config_refuses_unknown_policy_and_bad_parameters():
    with pytest.raises(ValueError, match="loss.policy.type = 'grpo': expected one of 'ppo-clip', 'gspo'"):
        from_dict(LearnerConfig, {"loss": {"policy": "grpo"}})
    with pytest.raises(ValueError, match="loss.policy: tau_pos and tau_neg must be > 0"):
        from_dict(LearnerConfig, {"loss": {"policy": {"type": "sapo", "tau_neg": 0.0}}})
    with pytest.raises(ValueError, match="loss.policy: clip_low and clip_high must be >= 0"):
        from_dict(
            LearnerConfig, {"loss": {"policy": {"type": "cispo", "clip_high": -1.0}, "correction": "tis"}}
        )
    with pytest.raises(ValueError, match=r"unknown config keys \[loss.policy\] \['tau_pos'\]"):
        from_dict(LearnerConfig, {"loss": {"policy": {"type": "gspo", "tau_pos": 1.0}}})
    batch = TokenBatch(torch.zeros(2), torch.zeros(2), torch.ones(2), torch.tensor([0, 0]), 1)
    with pytest.raises(ValueError, match="unknown policy loss"):
        policy_loss(LossConfig(policy=PpoClipLoss(type="grpo")), batch)
