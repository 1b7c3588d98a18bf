"""Per-token policy-gradient terms of the GRPO family (``LOSS_TYPES``, the config's ``loss_type``), one
registered function each. Formulas and worked numbers: docs/algorithms.md.

``policy_loss`` (policy_loss.py) computes the ratio ρ (token or sequence level, ``RATIO_LEVELS``), then
calls the loss type for the per-token term ℓ_{i,t}, then applies the token weights, adds β·KL and
aggregates. Every loss type sees padding already zeroed (A = 0 and logp = old there, so ρ = 1).

    "clip"  PPO clip (Schulman et al. 2017; GRPO, DeepSeekMath eq. 3):
            ℓ = max(−A·min(ρ, δ), −A·clip(ρ, 1−ε_low, 1+ε_high))
            dual clip (Ye et al. 2020), tokens with A < 0:  ℓ = min(ℓ, −c·A)
            δ (INTELLECT-2 two-sided cap): the unclipped term uses min(ρ, δ)
            Tokens whose clipped branch is active get no gradient.

    "cispo" CISPO, MiniMax-M1 (arXiv 2506.13585) §3.1: clip the importance-sampling weight,
            not the update, and stop its gradient:
                ℓ = −sg[clip(ρ, 1−ε_low, 1+ε_high)]·A·log π_θ,     ∂ℓ/∂logp = −clip(ρ)·A
            so every token keeps a gradient (the clip only bounds its size). The value of ℓ is not a
            surrogate of the return (it holds log π); only its gradient matters. The paper sets no
            lower bound in practice ("ε_low large"): ε_low = 1 gives 1−ε_low = 0. Aggregated by
            token-mean over the batch (1/Σ|o_i|). Departure from TRL: TRL clamps ρ at ``epsilon_high``
            itself (recommending 5.0); we follow the paper's 1+ε_high, so the cispo preset's
            ε_high = 4 is the same cap of 5 (ScaleRL, arXiv 2510.13786, as TRL reports). flags:
            ``is_clip_frac``, the fraction of tokens whose weight was clipped.

    "sapo"  SAPO, Gao et al. 2025 (Qwen, arXiv 2511.20347), the method section's gate f_{i,t}: a smooth
            gate instead of the clip,
                f(ρ) = σ(τ·(ρ − 1))·4/τ,   τ = τ_pos if A > 0 else τ_neg,   ℓ = −f(ρ)·A
            ∂ℓ/∂logp = −4·σ(1 − σ)·ρ·A, the weight 4σ(1−σ) = 1 at ρ = 1 (the plain policy gradient
            on-policy) and decays smoothly as ρ leaves 1, faster for τ_neg > τ_pos (negative
            advantages). Paper defaults τ_pos = 1.0, τ_neg = 1.05; sequence-mean aggregation
            (1/G Σ_i 1/|o_i| Σ_t, seq-mean-token-mean). TRL and verl compute the same gate. Nothing
            is clipped, so flags: ``clip_frac_low`` / ``clip_frac_high`` / ``clip_frac`` are 0
            (replacing the ratio-space ones, which would count against an ε the gate never reads),
            and ``sapo_damped_frac``, the fraction of tokens whose gradient weight 4σ(1−σ) is below
            1/2: the gate's soft counterpart of a clip fraction.

    "gmpo"  GMPO, Zhao et al. 2025 (arXiv 2507.20673), Geometric-Mean Policy Optimization: the
            geometric mean of the token ratios, each clipped in log space first, one-sided by the
            sign of the advantage (PPO's pessimistic bound), as one sequence-level objective
                J_i = sgn(A_i)·Π_t |min(ρ_t·A_i, clip(ρ_t, e^−ε_low, e^ε_high)·A_i)|^{1/|o_i|}
                    = A_i·exp((1/|o_i|)·Σ_t δ̃_t),   δ_t = logp_t − old_t,
                δ̃_t = min(δ_t, ε_high) if A_i ≥ 0 else max(δ_t, −ε_low)
            (the paper's log-space code, callsys/GMPO; verl's "geo_mean" the same). Written per token
            in the GSPO-token form (policy_loss.py), with s̃_i = exp((1/|o_i|)·Σ_t δ̃_t):
                ℓ_{i,t} = −A·sg[s̃_i]·exp(δ̃_t − sg[δ̃_t])      value −A·s̃_i,  ∂ℓ/∂logp_t = −A·s̃_i·1[δ_t unclipped]
            so seq-mean-token-mean gives exactly the paper's loss −(1/N)·Σ_i A_i·s̃_i and its gradient
            (1/|o_i| per token); other aggregations weight each completion's term by their own
            counts. ε_low/ε_high are in LOG space here: the paper's (e^−0.4, e^0.4) is ε = 0.4 (the
            gmpo preset). flags: ``clip_frac_low`` / ``clip_frac_high`` are GMPO's own (δ < −ε_low
            with A < 0, δ > ε_high with A > 0), replacing the ratio-space ones. Departures: per-token
            advantages (process supervision) weight each token's gradient by its own A_{i,t} and pick
            its own side of the clip (the paper has one A per completion; verl averages A over the
            completion instead); token weights (sampler IS correction, token masks) multiply each
            token's term like any policy term's, so a completion's weight is their arithmetic mean
            (verl's geo_mean weights a completion by their geometric mean); a completion with no
            real token gives 0 (s̃ = 1, A = 0 there).

cispo, sapo and gmpo act on token ratios only (GSPO's sequence ratio is a clip variant): ``LossParams``
rejects them with ratio_level="sequence", as it rejects dual_clip and delta, which only "clip" reads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .loss_params import LossParams, register_loss_type


@register_loss_type("clip")
def clip_loss(logp: Tensor, ratio: Tensor, adv: Tensor, p: LossParams) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO/GRPO clipped surrogate (module docstring); flags ``dual_clip_frac`` when dual_clip is set."""
    ratio_unclipped = ratio if p.delta is None else ratio.clamp(max=p.delta)
    pg_unclipped = -adv * ratio_unclipped  # [N, T]
    pg_clipped = -adv * ratio.clamp(1 - p.eps_low, 1 + p.eps_high)  # [N, T]
    per_token = torch.maximum(pg_unclipped, pg_clipped)  # [N, T]
    flags: dict[str, Tensor] = {}
    if p.dual_clip is not None:
        cap = -p.dual_clip * adv  # [N, T]
        dual_active = (adv < 0) & (per_token > cap)
        per_token = torch.where(dual_active, cap, per_token)
        flags["dual_clip_frac"] = dual_active
    return per_token, flags


@register_loss_type("cispo")
def cispo_loss(logp: Tensor, ratio: Tensor, adv: Tensor, p: LossParams) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (module docstring): −sg[clip(ρ, 1−ε_low, 1+ε_high)]·A·logp."""
    rho = ratio.detach()  # [N, T]
    weight = rho.clamp(1 - p.eps_low, 1 + p.eps_high)  # [N, T], sg[clip(ρ)]
    clipped = (rho > 1 + p.eps_high) | (rho < 1 - p.eps_low)
    return -weight * adv * logp, {"is_clip_frac": clipped}


@register_loss_type("sapo")
def sapo_loss(logp: Tensor, ratio: Tensor, adv: Tensor, p: LossParams) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (module docstring): −σ(τ(ρ − 1))·4/τ·A with τ = τ_pos for A > 0, τ_neg otherwise."""
    tau = torch.where(adv > 0, ratio.new_tensor(p.sapo_tau_pos), ratio.new_tensor(p.sapo_tau_neg))  # [N, T]
    sigma = torch.sigmoid(tau * (ratio - 1))  # [N, T]
    none = torch.zeros_like(ratio, dtype=torch.bool)  # [N, T] nothing is clipped
    flags = {"clip_frac_low": none, "clip_frac_high": none, "clip_frac": none,
             "sapo_damped_frac": 4 * sigma * (1 - sigma) < 0.5}
    return -sigma * (4 / tau) * adv, flags


@register_loss_type("gmpo", per_sequence=True)
def gmpo_loss(logp: Tensor, ratio: Tensor, adv: Tensor, p: LossParams, *, mask: Tensor,
              log_ratio: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO (module docstring): −A·sg[s̃_i]·exp(δ̃_t − sg[δ̃_t]), s̃_i the geometric mean of the clipped ratios."""
    high = log_ratio.clamp(max=p.eps_high)  # [N, T] A ≥ 0: only increases are bounded
    low = log_ratio.clamp(min=-p.eps_low)  # [N, T] A < 0: only decreases are bounded
    clipped = torch.where(adv >= 0, high, low)  # [N, T] δ̃, zero on padding (δ = 0 there)
    count = mask.sum(-1).clamp(min=1)  # [N] |o_i|
    seq_ratio = torch.exp(clipped.sum(-1) / count).detach()  # [N] s̃_i
    per_token = -adv * seq_ratio[:, None] * torch.exp(clipped - clipped.detach())  # [N, T]
    flags = {"clip_frac_low": (adv < 0) & (log_ratio < -p.eps_low),
             "clip_frac_high": (adv > 0) & (log_ratio > p.eps_high)}
    flags["clip_frac"] = flags["clip_frac_low"] | flags["clip_frac_high"]
    return per_token, flags
