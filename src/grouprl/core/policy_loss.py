"""The clipped policy loss of the GRPO family: ``policy_loss``, one call per micro-batch, with every
knob in a ``LossParams`` (loss_params.py) built (and validated) once. Formulas and sources: docs/algorithms.md.

Per token, with ρ the importance ratio and ℓ the policy term (``LOSS_TYPES``, policy_terms.py:
"clip", the PPO/GRPO clipped surrogate, by default):

    ℓ_{i,t} = POLICY_TERM(ρ, A)                      e.g. max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high))
    KL penalty (DeepSeekMath):                       ℓ += β·KL_{i,t}   (see kl.py)
    entropy bonus:                                   ℓ −= c·H_{i,t}    (c = ``entropy_coef``)
    token weights (importance.py, sampler/trainer IS correction; token_masks.py): the policy term,
    before the KL penalty is added, is multiplied by sg[weight_{i,t}]; TRL and verl leave the KL
    term unweighted too
    loss = aggregate_loss(ℓ, mask, agg)              (aggregation.py: the modes and the normaliser)

Entropy bonus: H_{i,t} = −Σ_v π_θ(v)·log π_θ(v), the entropy of the policy's whole next-token
distribution at each completion token, from the same pass as logp (logprobs.py/head_logprobs.py
give it a gradient, ∂H/∂z = −p·(log p + H)/τ, when asked). −c·H is added per token like the KL term
(not multiplied by the token weights) and aggregated with the policy term by the same ``agg`` and
normaliser, so raising c trades the policy objective for a broader distribution (PPO's c₂·S[π],
Schulman et al. 2017 eq. 9; verl's ``entropy_coeff`` aggregates it with the policy loss's own mode
too). c = 0 (the default) adds nothing and needs no entropy.

Ratio levels (``RATIO_LEVELS``):
    "token"    ρ_{i,t} = exp(logp − old)
    "sequence" GSPO (arXiv 2507.18071): s_i = exp((1/|o_i|)·Σ_t m·(logp − old)), in the GSPO-token
               form s_{i,t} = sg[s_i]·exp(logp_t − sg[logp_t]) whose value is s_i and whose gradient
               is s_i·∂logp_t; with seq-mean-token-mean this is GSPO's sequence gradient.

Choices: padding is removed with ``torch.where`` before any arithmetic, so garbage (even inf/nan)
in padded logp/old/ref/advantages changes nothing and gets zero gradient. ``old_logp`` and the
advantages are treated as constants (detached). ``approx_kl`` is cleanRL's (ρ − 1) − log ρ,
the k3 estimate of KL(π_old ‖ π_θ) on the sampled tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import policy_terms  # noqa: F401  (registers the loss types LossParams names)
from .aggregation import aggregate_loss, bool_mask
from .kl import kl_estimate
from .loss_params import LOSS_TYPES, RATIO_LEVELS, LossParams, is_per_sequence, register_ratio_level

@register_ratio_level("token")
def _token_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    return torch.exp(logp - old_logp)  # [N, T]


@register_ratio_level("sequence")
def _sequence_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    seq_logratio = (logp - old_logp).sum(-1) / mask.sum(-1).clamp(min=1)  # [N]
    s = torch.exp(seq_logratio).detach()  # [N] sg[s_i]
    return s[:, None] * torch.exp(logp - logp.detach())  # [N, T] value s_i, gradient s_i·∂logp


def _check_inputs(logp, old_logp, advantages, mask, ref_logp, token_weights, entropy) -> None:
    if not isinstance(logp, Tensor) or logp.dim() != 2:
        raise ValueError(f"logp must be a [N, T] tensor, got {getattr(logp, 'shape', type(logp))}")
    for name, x in (("old_logp", old_logp), ("ref_logp", ref_logp), ("token_weights", token_weights),
                    ("entropy", entropy)):
        if x is not None and (not isinstance(x, Tensor) or x.shape != logp.shape):
            raise ValueError(f"{name} has shape {tuple(getattr(x, 'shape', ()))}, expected "
                             f"{tuple(logp.shape)} like logp")
    if not isinstance(advantages, Tensor) or advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages has shape {tuple(getattr(advantages, 'shape', ()))}; expected "
                         f"[N]={tuple(logp.shape[:1])} (one per completion) or [N, T]={tuple(logp.shape)}")



def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, params: LossParams | None = None,
                *, ref_logp: Tensor | None = None, normalizer: float | Tensor | None = None,
                token_weights: Tensor | None = None, entropy: Tensor | None = None,
                **knobs) -> tuple[Tensor, dict[str, float]]:
    """Policy loss (scalar) and detached stats; see the module docstring.

    logp, old_logp, ref_logp, mask, token_weights, entropy  # [N, T];  advantages  # [N] or [N, T]
    mask is bool or 0/1 float (nonzero = real completion token). ``params`` holds every knob (built
    once, e.g. by the trainer); without it the knobs may be given as keywords, ``LossParams``' fields
    (``policy_loss(..., eps_low=0.2, agg="token-mean")``), validated on this call.
    token_weights (detached) multiply each token's policy term; they leave the normaliser alone.
    normalizer replaces the aggregation's divisor by the whole optimizer batch's count (aggregation.py).
    entropy (the policy's per-token entropy, with its gradient) is read when entropy_coef > 0.
    Stats (Python floats, means over this call's real tokens): clip_frac_low (ρ < 1−ε_low, A < 0),
    clip_frac_high (ρ > 1+ε_high, A > 0), clip_frac, ratio_mean, approx_kl, num_tokens; kl (the
    ``kl_kind`` estimate to ref) whenever ref_logp is given; entropy_bonus (c·H, the per-token size
    of the bonus) when entropy_coef > 0; the policy term's flags (dual_clip_frac when dual_clip is
    set with "clip", is_clip_frac with "cispo"; gmpo's clip_frac_low/high/clip_frac replace the
    ratio-space ones).
    """
    _check_inputs(logp, old_logp, advantages, mask, ref_logp, token_weights, entropy)
    valid = bool_mask(mask, logp.shape)  # [N, T]
    if params is None:
        params = LossParams(**knobs)
    elif knobs:
        raise TypeError(f"policy_loss got params and the keywords {sorted(knobs)}: put them in LossParams")
    if params.beta > 0 and ref_logp is None:
        raise ValueError(f"beta={params.beta} > 0 needs ref_logp (reference-model log-probs); pass "
                         "ref_logp or set beta=0")
    if params.entropy_coef > 0 and entropy is None:
        raise ValueError(f"entropy_coef={params.entropy_coef} > 0 needs entropy (the policy's per-token "
                         "entropy from the log-prob pass, with its gradient); pass entropy or set entropy_coef=0")

    # Padding goes first: nothing downstream may see garbage, not even through 0·inf.
    zero = logp.new_zeros(())
    logp = torch.where(valid, logp, zero)  # [N, T]
    old_logp = torch.where(valid, old_logp.detach(), zero)  # [N, T]
    adv = advantages.detach()
    adv = torch.where(valid, adv[:, None] if adv.dim() == 1 else adv, zero)  # [N, T]

    ratio = RATIO_LEVELS[params.ratio_level](logp, old_logp, valid)  # [N, T]
    sequence_inputs = {"mask": valid, "log_ratio": logp - old_logp} if is_per_sequence(params.loss_type) else {}
    per_token, flags = LOSS_TYPES[params.loss_type](logp, ratio, adv, params, **sequence_inputs)  # [N, T]
    if token_weights is not None:
        per_token = per_token * torch.where(valid, token_weights.detach(), zero)  # [N, T]
    kl = None
    if ref_logp is not None:
        kl = kl_estimate(logp, torch.where(valid, ref_logp.detach(), zero), params.kl_kind)  # [N, T]
        if params.beta > 0:
            per_token = per_token + params.beta * kl
    bonus = None
    if params.entropy_coef > 0:
        bonus = params.entropy_coef * torch.where(valid, entropy, zero)  # [N, T] c·H
        per_token = per_token - bonus
    loss = aggregate_loss(per_token, valid, params.agg, max_tokens=params.max_tokens, normalizer=normalizer)

    with torch.no_grad():
        num_tokens = valid.sum()
        denom = num_tokens.clamp(min=1).double()  # fp64 stats: fractions of counts stay exact

        def masked_mean(x: Tensor) -> Tensor:
            return torch.where(valid, x, zero).sum() / denom

        low = (ratio < 1 - params.eps_low) & (adv < 0) & valid
        high = (ratio > 1 + params.eps_high) & (adv > 0) & valid
        values = {
            "clip_frac_low": low.sum() / denom,
            "clip_frac_high": high.sum() / denom,
            "clip_frac": (low | high).sum() / denom,
            "ratio_mean": masked_mean(ratio),
            "approx_kl": masked_mean(kl_estimate(old_logp, logp, "k3")),
            "num_tokens": num_tokens,
        }
        if kl is not None:
            values["kl"] = masked_mean(kl)
        if bonus is not None:
            values["entropy_bonus"] = masked_mean(bonus)
        for name, flag in flags.items():
            values[name] = (flag & valid).sum() / denom
        floats = torch.stack([v.double() for v in values.values()]).tolist()  # one device sync
    return loss, dict(zip(values, floats))
