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
            (1/G Σ_i 1/|o_i| Σ_t, seq-mean-token-mean). TRL and verl compute the same gate.

cispo and sapo act on token ratios only (GSPO's sequence ratio is a clip variant): ``LossParams``
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
    gate = torch.sigmoid(tau * (ratio - 1)) * (4 / tau)  # [N, T]
    return -gate * adv, {}
