"""Clipped policy loss of the GRPO family, its aggregation modes, and DAPO length shaping.

Per token, with ρ the importance ratio and ℓ from the loss type (``LOSS_TYPES``, policy_losses.py:
"clip", the PPO/GRPO clipped surrogate, by default):

    ℓ_{i,t} = LOSS_TYPE(ρ, A)                         e.g. max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high))
    KL penalty (DeepSeekMath):                       ℓ += β·KL_{i,t}   (see kl.py)
    token weights (importance.py, sampler/trainer IS correction; token_masks.py): the policy term,
    before the KL penalty is added, is multiplied by sg[weight_{i,t}]; TRL and verl leave the KL
    term unweighted too

Ratio levels (``RATIO_LEVELS``):
    "token"    ρ_{i,t} = exp(logp − old)
    "sequence" GSPO (arXiv 2507.18071): s_i = exp((1/|o_i|)·Σ_t m·(logp − old)), in the GSPO-token
               form s_{i,t} = sg[s_i]·exp(logp_t − sg[logp_t]) whose value is s_i and whose gradient
               is s_i·∂logp_t; with seq-mean-token-mean this is GSPO's sequence gradient.

Aggregation modes (``LOSS_AGGREGATIONS``, one reducer ``aggregate_loss``), D the divisor:
    "token-mean"              Σ_{i,t} m·ℓ / D,   D = Σ_{i,t} m          DAPO
    "seq-mean-token-mean"     Σ_i (Σ_t m·ℓ / Σ_t m) / D,   D = N        GRPO paper
    "seq-mean-token-sum"      Σ_{i,t} m·ℓ / D,   D = N
    "seq-mean-token-sum-norm" Σ_{i,t} m·ℓ / (D·L_max),   D = N          Dr. GRPO (L_max = max_tokens)
``normalizer`` replaces D by the count over the whole optimizer batch, so micro-batches and
data-parallel ranks sum to the full-batch loss and gradient exactly. A sequence with no real
tokens contributes 0 to its seq-mean (0/1) but still counts in N.

DAPO soft overlong punishment (arXiv 2503.14476 eq. 13), added to the reward:
    R(L) = 0 if L ≤ L_max − L_cache;  ((L_max − L_cache) − L)/L_cache if L ≤ L_max;  −1 beyond.

Choices: padding is removed with ``torch.where`` before any arithmetic, so garbage (even inf/nan)
in padded logp/old/ref/advantages changes nothing and gets zero gradient. ``old_logp`` and the
advantages are treated as constants (detached). ``approx_kl`` is cleanRL's (ρ − 1) − log ρ,
the k3 estimate of KL(π_old ‖ π_θ) on the sampled tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .kl import KL_ESTIMATORS, kl_estimate
from .policy_losses import LOSS_TYPES, LossParams

RatioFn = Callable[[Tensor, Tensor, Tensor], Tensor]
AggFn = Callable[..., Tensor]
RATIO_LEVELS: dict[str, RatioFn] = {}
LOSS_AGGREGATIONS: dict[str, AggFn] = {}


def _registrar(registry: dict, kind: str, name: str) -> Callable:
    def decorator(fn: Callable) -> Callable:
        if name in registry:
            raise ValueError(f"{kind} {name!r} is already registered; pick another name")
        registry[name] = fn
        return fn

    return decorator


def register_ratio_level(name: str) -> Callable[[RatioFn], RatioFn]:
    """Decorator: register ``fn(logp, old_logp, mask) -> ratio [N, T]`` (inputs already zero on padding)."""
    return _registrar(RATIO_LEVELS, "ratio level", name)


def register_loss_agg(name: str) -> Callable[[AggFn], AggFn]:
    """Decorator: register ``fn(loss, mask, *, max_tokens, normalizer) -> scalar`` (loss zero on padding)."""
    return _registrar(LOSS_AGGREGATIONS, "loss aggregation", name)


def _lookup(registry: dict, value: str, arg: str):
    if value not in registry:
        raise ValueError(f"{arg}={value!r} is unknown; use one of {sorted(registry)}")
    return registry[value]


@register_ratio_level("token")
def _token_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    return torch.exp(logp - old_logp)  # [N, T]


@register_ratio_level("sequence")
def _sequence_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    seq_logratio = (logp - old_logp).sum(-1) / mask.sum(-1).clamp(min=1)  # [N]
    s = torch.exp(seq_logratio).detach()  # [N] sg[s_i]
    return s[:, None] * torch.exp(logp - logp.detach())  # [N, T] value s_i, gradient s_i·∂logp


@register_loss_agg("token-mean")
def _token_mean(loss: Tensor, mask: Tensor, *, max_tokens=None, normalizer=None) -> Tensor:
    count = mask.sum().clamp(min=1) if normalizer is None else normalizer
    return loss.sum() / count


@register_loss_agg("seq-mean-token-mean")
def _seq_mean_token_mean(loss: Tensor, mask: Tensor, *, max_tokens=None, normalizer=None) -> Tensor:
    seq_mean = loss.sum(-1) / mask.sum(-1).clamp(min=1)  # [N]
    return seq_mean.sum() / (loss.shape[0] if normalizer is None else normalizer)


@register_loss_agg("seq-mean-token-sum")
def _seq_mean_token_sum(loss: Tensor, mask: Tensor, *, max_tokens=None, normalizer=None) -> Tensor:
    return loss.sum() / (loss.shape[0] if normalizer is None else normalizer)


@register_loss_agg("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss: Tensor, mask: Tensor, *, max_tokens=None, normalizer=None) -> Tensor:
    if max_tokens is None:
        raise ValueError("agg='seq-mean-token-sum-norm' needs max_tokens (L_max, the maximum number "
                         "of completion tokens, e.g. max_completion_length)")
    if max_tokens <= 0:
        raise ValueError(f"max_tokens={max_tokens} must be positive")
    n_seq = loss.shape[0] if normalizer is None else normalizer
    return loss.sum() / (n_seq * max_tokens)


def _bool_mask(mask: Tensor, shape: torch.Size) -> Tensor:
    if not isinstance(mask, Tensor) or mask.shape != shape:
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"mask has shape {got}, expected {tuple(shape)} (one entry per completion token)")
    return mask if mask.dtype == torch.bool else mask != 0


def aggregate_loss(per_token_loss: Tensor, mask: Tensor, mode: str, *, max_tokens: int | None = None,
                   normalizer: float | Tensor | None = None) -> Tensor:
    """Reduce ``per_token_loss  # [N, T]`` over real tokens (``mask  # [N, T]``) with ``mode``."""
    agg_fn = _lookup(LOSS_AGGREGATIONS, mode, "agg")
    if per_token_loss.dim() != 2:
        raise ValueError(f"per_token_loss has shape {tuple(per_token_loss.shape)}; expected [N, T]")
    valid = _bool_mask(mask, per_token_loss.shape)  # [N, T]
    if isinstance(normalizer, (int, float)) and normalizer <= 0:
        raise ValueError(f"normalizer={normalizer} must be positive (the optimizer batch's count)")
    loss = torch.where(valid, per_token_loss, torch.zeros_like(per_token_loss))  # [N, T]
    return agg_fn(loss, valid, max_tokens=max_tokens, normalizer=normalizer)


def _check_inputs(logp, old_logp, advantages, mask, ref_logp, token_weights) -> None:
    if not isinstance(logp, Tensor) or logp.dim() != 2:
        raise ValueError(f"logp must be a [N, T] tensor, got {getattr(logp, 'shape', type(logp))}")
    for name, x in (("old_logp", old_logp), ("ref_logp", ref_logp), ("token_weights", token_weights)):
        if x is not None and (not isinstance(x, Tensor) or x.shape != logp.shape):
            raise ValueError(f"{name} has shape {tuple(getattr(x, 'shape', ()))}, expected "
                             f"{tuple(logp.shape)} like logp")
    if not isinstance(advantages, Tensor) or advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages has shape {tuple(getattr(advantages, 'shape', ()))}; expected "
                         f"[N]={tuple(logp.shape[:1])} (one per completion) or [N, T]={tuple(logp.shape)}")


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                eps_low: float = 0.2, eps_high: float | None = None, ratio_level: str = "token",
                agg: str = "seq-mean-token-mean", max_tokens: int | None = None,
                ref_logp: Tensor | None = None, beta: float = 0.0, kl_kind: str = "k3",
                dual_clip: float | None = None, delta: float | None = None,
                normalizer: float | Tensor | None = None, token_weights: Tensor | None = None,
                loss_type: str = "clip", sapo_tau_pos: float = 1.0,
                sapo_tau_neg: float = 1.05) -> tuple[Tensor, dict[str, float]]:
    """Policy loss (scalar) and detached stats; see the module docstring.

    logp, old_logp, ref_logp, mask, token_weights  # [N, T];  advantages  # [N] or [N, T]
    mask is bool or 0/1 float (nonzero = real completion token). eps_high=None means eps_low.
    token_weights (detached) multiply each token's policy term; they leave the normaliser alone.
    loss_type picks the per-token term (``LOSS_TYPES``: "clip", "cispo", "sapo"; policy_losses.py);
    eps_low/eps_high bound cispo's IS weight too; sapo_tau_pos/neg are SAPO's gate temperatures.
    Stats (Python floats, means over this call's real tokens): clip_frac_low (ρ < 1−ε_low, A < 0),
    clip_frac_high (ρ > 1+ε_high, A > 0), clip_frac, ratio_mean, approx_kl, num_tokens; kl (the
    ``kl_kind`` estimate to ref) whenever ref_logp is given; the loss type's flags (dual_clip_frac
    when dual_clip is set with "clip", is_clip_frac with "cispo").
    """
    _check_inputs(logp, old_logp, advantages, mask, ref_logp, token_weights)
    valid = _bool_mask(mask, logp.shape)  # [N, T]
    ratio_fn = _lookup(RATIO_LEVELS, ratio_level, "ratio_level")
    loss_fn = _lookup(LOSS_TYPES, loss_type, "loss_type")
    _lookup(LOSS_AGGREGATIONS, agg, "agg")
    _lookup(KL_ESTIMATORS, kl_kind, "kl_kind")
    eps_high = eps_low if eps_high is None else eps_high
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"eps_low={eps_low}, eps_high={eps_high}: clip ranges must be >= 0")
    if beta < 0:
        raise ValueError(f"beta={beta} must be >= 0 (0 disables the KL penalty)")
    if beta > 0 and ref_logp is None:
        raise ValueError(f"beta={beta} > 0 needs ref_logp (reference-model log-probs); pass "
                         "ref_logp or set beta=0")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip={dual_clip} must be > 1 (typical 3) or None")
    if delta is not None and delta <= 1:
        raise ValueError(f"delta={delta} must be > 1 (INTELLECT-2 uses 4) or None")
    if loss_type != "clip" and (dual_clip is not None or delta is not None or ratio_level != "token"):
        raise ValueError(f"loss_type={loss_type!r} acts on token ratios without the PPO clip: dual_clip, "
                         "delta and ratio_level='sequence' apply to loss_type='clip' only; drop them")
    if not (sapo_tau_pos > 0 and sapo_tau_neg > 0):
        raise ValueError(f"sapo_tau_pos={sapo_tau_pos}, sapo_tau_neg={sapo_tau_neg} must be > 0 "
                         "(SAPO uses 1.0 and 1.05)")

    # Padding goes first: nothing downstream may see garbage, not even through 0·inf.
    zero = logp.new_zeros(())
    logp = torch.where(valid, logp, zero)  # [N, T]
    old_logp = torch.where(valid, old_logp.detach(), zero)  # [N, T]
    adv = advantages.detach()
    adv = torch.where(valid, adv[:, None] if adv.dim() == 1 else adv, zero)  # [N, T]

    ratio = ratio_fn(logp, old_logp, valid)  # [N, T]
    params = LossParams(eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip, delta=delta,
                        sapo_tau_pos=sapo_tau_pos, sapo_tau_neg=sapo_tau_neg)
    per_token, flags = loss_fn(logp, ratio, adv, params)  # [N, T]
    if token_weights is not None:
        per_token = per_token * torch.where(valid, token_weights.detach(), zero)  # [N, T]
    kl = None
    if ref_logp is not None:
        kl = kl_estimate(logp, torch.where(valid, ref_logp.detach(), zero), kl_kind)  # [N, T]
        if beta > 0:
            per_token = per_token + beta * kl
    loss = aggregate_loss(per_token, valid, agg, max_tokens=max_tokens, normalizer=normalizer)

    with torch.no_grad():
        num_tokens = valid.sum()
        denom = num_tokens.clamp(min=1).double()  # fp64 stats: fractions of counts stay exact

        def masked_mean(x: Tensor) -> Tensor:
            return torch.where(valid, x, zero).sum() / denom

        low = (ratio < 1 - eps_low) & (adv < 0) & valid
        high = (ratio > 1 + eps_high) & (adv > 0) & valid
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
        for name, flag in flags.items():
            values[name] = (flag & valid).sum() / denom
        floats = torch.stack([v.double() for v in values.values()]).tolist()  # one device sync
    return loss, dict(zip(values, floats))


def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int) -> Tensor:
    """DAPO soft overlong punishment [N] for completion ``lengths  # [N]`` (module docstring)."""
    if not isinstance(lengths, Tensor):
        raise TypeError(f"lengths must be a torch.Tensor of shape [N], got {type(lengths).__name__}")
    if max_len <= 0 or not 0 <= cache_len <= max_len:
        raise ValueError(f"max_len={max_len}, cache_len={cache_len}: need max_len > 0 and "
                         "0 <= cache_len <= max_len")
    lengths = lengths.to(torch.float32)  # [N], exact for lengths below 2**24
    soft_start = max_len - cache_len
    ramp = (soft_start - lengths) / max(cache_len, 1)  # [N]
    penalty = torch.where(lengths <= max_len, ramp, torch.full_like(ramp, -1.0))
    penalty = torch.where(lengths <= soft_start, torch.zeros_like(ramp), penalty)
    return penalty  # [N]
