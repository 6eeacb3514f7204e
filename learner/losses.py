"""Policy-gradient losses of the learner: PPO-clip, GSPO, CISPO, SAPO, with off-policy corrections.

Inputs are the flattened response tokens of one packed micro-batch (no padding): per token
the current logprob log π_θ (with grad), the behaviour logprob log μ (vLLM, as sampled), the
proximal logprob log π_prox (the learner's policy before this optimizer step; `None` means
"not recomputed", then π_prox := μ), the sequence's advantage and the sequence index.

Per token, with u = π_θ/π_prox and k = π_prox/μ (engine mismatch + staleness), the surrogate pg
of `LossConfig.policy` (its `type`; ε and τ are that variant's parameters; sg = stop-gradient):
    ppo-clip : pg = max(-A·u, -A·clip(u, 1-ε_low, 1+ε_high))     clip-higher (DAPO)
    gspo     : the same on s = sg(S)·u/sg(u), S = exp(mean_seq log u) (GSPO-token: every token
               carries its sequence's ratio S and the gradient of its own log π_θ), clipped by
               GspoLoss's clip_low/high, so a whole sequence is in or out of the trust region
    cispo    : pg = -A · sg(clip(u, 1-ε_low^IS, 1+ε_high^IS)) · log π_θ   (MiniMax-M1)
    sapo     : pg = -A · (4/τ)·σ(τ·(u-1)),  τ = τ_pos if A > 0 else τ_neg   (soft gate, Qwen)
    ppo-clip and gspo: pg = min(pg, -A·c) where A < 0            dual clip (c > 1; 0 disables)
    loss = w · pg  (+ β·low_var_kl(π_θ, π_ref))  (- λ·entropy)
At u = 1 (one optimizer step per batch with π_prox detached) all four have the gradient -A·∇log π_θ;
they differ once π_θ moves away from π_prox (mini-batches, recomputed π_prox). GSPO's paper
aggregates seq-mean-token-mean (then each sequence weighs the same, whatever its length).
The off-policy weight w is chosen by `LossConfig.correction` (its `type`, with that variant's parameters):
    none      : w = 1 (naive PPO on π_prox, or on μ when π_prox is not recomputed)
    decoupled : w = k (AReaL); tokens with k > `weight_cap` (when > 0) get w = 0
    tis       : w = min(k, cap)                                 truncated IS (Yao et al.)
    icepop    : w = k if low ≤ k ≤ high else 0                  IcePop's M(k)
    geo_mask  : w = 1 if low ≤ exp(mean_seq log k) ≤ high else 0 whole sequence rejected
w is a constant (no gradient flows through it). Which corrections each policy takes, and why:
learner/loss_config.py POLICY_CORRECTIONS (checked by LossConfig.validate).

Aggregation (`LossConfig.aggregation`) divides a numerator by a denominator; the trainer
passes the denominator of the whole optimizer step (all micro-batches, all ranks) so that
gradient accumulation gives the same update as one big batch:
    token-mean              : Σ_t loss / #tokens
    seq-mean-token-mean     : Σ_s mean_t∈s loss / #sequences
    seq-mean-token-sum-norm : Σ_t loss / (#sequences · norm_length)   (Dr.GRPO's constant)
Masked tokens count in the denominators (they contribute zero), so masking never rescales
the surviving tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from learner.loss_config import POLICY_LOSSES, CispoLoss, GspoLoss, LossConfig, PpoClipLoss, SapoLoss


@dataclass
class TokenBatch:
    """Flattened response tokens of one micro-batch (all tensors of shape (T,))."""

    logprobs: Tensor
    """log π_θ of the sampled tokens under the current parameters (requires grad)."""
    behaviour_logprobs: Tensor
    """log μ: the generator's logprobs as sampled."""
    advantages: Tensor
    """Advantage of each token's sequence."""
    seq_index: Tensor
    """Index (0..num_seqs-1) of the sequence each token belongs to (long)."""
    num_seqs: int
    proximal_logprobs: Tensor | None = None
    """log π_prox (no grad); None means not recomputed, π_prox := μ."""
    ref_logprobs: Tensor | None = None
    """log π_ref of a frozen reference policy, for the KL penalty."""
    entropy: Tensor | None = None
    """Per-token entropy of π_θ (with grad when the entropy bonus is on)."""


def loss_denominator(cfg: LossConfig, num_tokens: int, num_seqs: int) -> float:
    """The denominator of `cfg.aggregation` for a batch of these totals."""
    if cfg.aggregation == "token-mean":
        return float(max(num_tokens, 1))
    if cfg.aggregation == "seq-mean-token-mean":
        return float(max(num_seqs, 1))
    if cfg.aggregation == "seq-mean-token-sum-norm":
        return float(max(num_seqs, 1) * cfg.norm_length)
    raise ValueError(f"unknown aggregation {cfg.aggregation!r} (learner.loss_config.Aggregation)")


def low_var_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 estimator of KL(π_θ || π_ref) per token (veRL's low_var_kl), clamped to [-10, 10]."""
    log_ratio = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return (log_ratio.exp() - log_ratio - 1.0).clamp(-10.0, 10.0)


def behaviour_kl(logprobs: Tensor, behaviour_logprobs: Tensor) -> Tensor:
    """k3 estimator of KL(μ || π_θ) per token on the behaviour policy's samples, r = π_θ/μ: r - 1 - log r
    (a metric of how far learner and generator disagree; no gradient)."""
    log_r = (logprobs.detach() - behaviour_logprobs).clamp(-20.0, 20.0)
    return log_r.exp() - log_r - 1.0


def seq_mean(values: Tensor, seq_index: Tensor, num_seqs: int) -> Tensor:
    """Mean of `values` over the tokens of each sequence, shape (num_seqs,); empty sequences give 0."""
    sums = torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(0, seq_index, values)
    counts = torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(
        0, seq_index, torch.ones_like(values)
    )
    return sums / counts.clamp(min=1.0)


def off_policy_weight(cfg: LossConfig, log_k: Tensor, batch: TokenBatch) -> Tensor:
    """The constant per-token weight w of `cfg.correction` from log k = log π_prox - log μ."""
    corr = cfg.correction
    if corr.type == "none":
        return torch.ones_like(log_k)
    k = log_k.clamp(-20.0, 20.0).exp()
    if corr.type == "decoupled":
        if corr.weight_cap > 0:
            return torch.where(k > corr.weight_cap, torch.zeros_like(k), k)
        return k
    if corr.type == "tis":
        return k.clamp(max=corr.cap)
    if corr.type == "icepop":
        keep = (k >= corr.low) & (k <= corr.high)
        return torch.where(keep, k, torch.zeros_like(k))
    if corr.type == "geo_mask":
        geo = seq_mean(log_k, batch.seq_index, batch.num_seqs).exp()
        keep_seq = (geo >= corr.low) & (geo <= corr.high)
        return keep_seq[batch.seq_index].to(log_k.dtype)
    raise ValueError(f"unknown correction {corr.type!r} (learner.loss_config.Correction)")


def _clipped(cfg: PpoClipLoss | GspoLoss, ratio: Tensor, adv: Tensor):
    """max(-A·r, -A·clip(r)) with the dual clip: (pg, clipped mask, dual-clip mask)."""
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    clipped = pg_clipped > pg_unclipped
    dual_active = torch.zeros_like(pg, dtype=torch.bool)
    if cfg.dual_clip > 1.0:
        pg_dual = -adv * cfg.dual_clip
        dual_active = (adv < 0) & (pg_dual < pg)
        pg = torch.where(adv < 0, torch.minimum(pg, pg_dual), pg)
    return pg, clipped, dual_active


def ppo_clip_surrogate(cfg: PpoClipLoss, log_u: Tensor, logp: Tensor, adv: Tensor, batch: TokenBatch):
    """PPO-clip on the token ratio u: (pg, ratio, clipped mask, dual-clip mask)."""
    ratio = log_u.exp()
    pg, clipped, dual_active = _clipped(cfg, ratio, adv)
    return pg, ratio, clipped, dual_active


def gspo_surrogate(cfg: GspoLoss, log_u: Tensor, logp: Tensor, adv: Tensor, batch: TokenBatch):
    """GSPO-token: the sequence ratio exp(mean log u) as each token's value, its own log u's gradient."""
    log_seq = seq_mean(log_u.detach(), batch.seq_index, batch.num_seqs)[batch.seq_index]
    ratio = (log_seq + log_u - log_u.detach()).exp()
    pg, clipped, dual_active = _clipped(cfg, ratio, adv)
    return pg, ratio, clipped, dual_active


def cispo_surrogate(cfg: CispoLoss, log_u: Tensor, logp: Tensor, adv: Tensor, batch: TokenBatch):
    """CISPO: -A · sg(clip(u)) · log π_θ; the clip bounds the weight and never zeroes a gradient."""
    ratio = log_u.detach().exp()
    weight = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    clipped = weight != ratio
    return -adv * weight * logp, ratio, clipped, torch.zeros_like(clipped)


def sapo_surrogate(cfg: SapoLoss, log_u: Tensor, logp: Tensor, adv: Tensor, batch: TokenBatch):
    """SAPO: -A · (4/τ)·σ(τ(u-1)), with gradient -A·u·4σ(1-σ)·∇log π_θ (= -A·∇log π_θ at u = 1)."""
    ratio = log_u.exp()
    tau = torch.where(adv > 0, torch.full_like(ratio, cfg.tau_pos), torch.full_like(ratio, cfg.tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    none = torch.zeros_like(ratio, dtype=torch.bool)
    return -adv * gate, ratio, none, none


SURROGATES = {
    "ppo-clip": ppo_clip_surrogate,
    "gspo": gspo_surrogate,
    "cispo": cispo_surrogate,
    "sapo": sapo_surrogate,
}
"""`LossConfig.policy.type` -> its surrogate, called with that variant; each returns (pg, ratio, clipped mask,
dual-clip mask) per token."""


def _aggregate(cfg: LossConfig, token_loss: Tensor, batch: TokenBatch, denom: float) -> Tensor:
    if cfg.aggregation == "seq-mean-token-mean":
        return seq_mean(token_loss, batch.seq_index, batch.num_seqs).sum() / denom
    return token_loss.sum() / denom


def policy_loss(
    cfg: LossConfig, batch: TokenBatch, denom: float | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """The micro-batch's loss (already divided by `denom`) and its token-mean metrics (`_metrics`).

    `denom` defaults to this micro-batch's own `loss_denominator`.
    """
    logp = batch.logprobs
    behav = batch.behaviour_logprobs.to(logp.dtype)
    prox = behav if batch.proximal_logprobs is None else batch.proximal_logprobs.to(logp.dtype).detach()
    adv = batch.advantages.to(logp.dtype)
    if denom is None:
        denom = loss_denominator(cfg, logp.numel(), batch.num_seqs)

    log_u = (logp - prox).clamp(-20.0, 20.0)
    surrogate = SURROGATES.get(cfg.policy.type)
    if surrogate is None:
        raise ValueError(f"unknown policy loss {cfg.policy.type!r}; choose one of {POLICY_LOSSES}")
    pg, ratio, clipped, dual_active = surrogate(cfg.policy, log_u, logp, adv, batch)

    weight = off_policy_weight(cfg, (prox - behav).detach(), batch).detach()
    token_loss = weight * pg
    kl = None
    if cfg.kl_coef > 0:
        if batch.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl = low_var_kl(logp, batch.ref_logprobs.to(logp.dtype).detach())
        token_loss = token_loss + cfg.kl_coef * kl
    if cfg.entropy_coef > 0:
        if batch.entropy is None:
            raise ValueError("entropy_coef > 0 needs entropy")
        token_loss = token_loss - cfg.entropy_coef * batch.entropy
    loss = _aggregate(cfg, token_loss, batch, denom)
    metrics = _metrics(batch, logp, behav, ratio, clipped, dual_active, weight, kl)
    return loss, metrics


def _metrics(batch, logp, behav, ratio, clipped, dual_active, weight, kl) -> dict[str, Tensor]:
    """Token means over the micro-batch, for logging; weight them by `num_tokens`. Detached 0-dim tensors on
    the loss's device: reading one (`float`) waits for the GPU, so the learner adds them up there and reads
    the step's sums once (learner/update.py), instead of stalling before every backward."""
    with torch.no_grad():
        log_r = (logp.detach() - behav).clamp(-20.0, 20.0)  # learner vs behaviour
        masked = weight == 0
        out = {
            "num_tokens": torch.full((), float(logp.numel()), device=logp.device),  # no host-to-device copy
            "mismatch_kl": behaviour_kl(logp, behav).mean(),
            "mismatch_kl_k1": (-log_r).mean(),
            "mismatch_abs_logprob_diff": log_r.abs().mean(),
            "clipped_frac": clipped.float().mean(),
            "dual_clipped_frac": dual_active.float().mean(),
            "masked_frac": masked.float().mean(),
            "is_weight_mean": weight.mean(),
            "ratio_mean": ratio.detach().mean(),
            "ratio_max": ratio.detach().max() if ratio.numel() else torch.zeros((), device=logp.device),
        }
        if kl is not None:
            out["kl_ref"] = kl.detach().mean()
        if batch.entropy is not None:
            out["entropy"] = batch.entropy.detach().float().mean()
    return {key: value.detach().float() for key, value in out.items()}
