"""Sampler/trainer importance-sampling correction (TIS / MIS) and the mismatch metrics.

When an engine other than the trainer (vLLM) samples the completions, its log-probs
q = log π_sampler differ from the trainer's old = log π_old even with identical weights (other
kernels and precision, top-p/top-k truncation), so the samples are slightly off-policy. Per token,

    w_t = exp(old_t − q_t)                          token ratio π_old / π_sampler
    W_i = exp(Σ_t m_{i,t}·(old_{i,t} − q_{i,t}))    sequence ratio, one per completion

and the per-token policy loss is re-weighted, ℓ_{i,t} ← sg[weight_{i,t}]·ℓ_{i,t}, with one of the
modes (``IS_MODES``):

    token_truncate     weight_t = min(w_t, C)                    TIS, Yao et al. 2025, "Your efficient
                                                                 RL framework secretly brings you
                                                                 off-policy RL training" (C ≈ 2)
    token_mask         weight_t = 1[C_min ≤ w_t ≤ C]             MIS per token; IcePop masks tokens
                                                                 whose ratio leaves a band [α, β]
    sequence_truncate  weight_{i,t} = min(W_i, C)
    sequence_mask      weight_{i,t} = 1[C_min ≤ W_i ≤ C]         TRL's default (C = 3, no lower bound)

verl and OpenRLHF offer the token and sequence forms of both; verl's mask defaults C_min to 1/C,
TRL masks only above C (C_min = 0). Requiring C_min ≤ 1 ≤ C makes a ratio of exactly 1 (no
mismatch) always keep weight 1.

Metrics (``importance_weights``' stats), over the real tokens of ``mask``:
    mismatch_k3     mean of k3 between sampler and trainer: kl.py's k3 with δ = q − old, i.e.
                    w − log w − 1, the unbiased estimate of KL(π_sampler ‖ π_old) on samples from
                    the sampler
    ratio_mean/max  of the mode's ratio (w_t per real token, or W_i per completion with at least one
                    real token), before truncation or masking
    frac_corrected  fraction of those units truncated (ratio > C) or masked (outside [C_min, C])

Choices: padding is zeroed with ``torch.where`` before any arithmetic, so garbage there changes
nothing; weights are 0 on padding and detached (a stop-gradient: they re-weight the loss, never
move it). The ratio is bounded in log space, so a sequence ratio that overflows exp gives weight C
(truncate) or 0 (mask), not inf or nan. An empty mask gives weights 0 and all metrics 0.
Worked numbers: docs/algorithms.md, section 6.1.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from .kl import kl_estimate
from .registry import Registry

ISModeFn = Callable[[Tensor, float, float], tuple[Tensor, Tensor, Tensor]]
IS_MODES: Registry[ISModeFn] = Registry("importance-sampling mode", "grouprl.core.register_is_mode")


def register_is_mode(name: str) -> Callable[[ISModeFn], ISModeFn]:
    """Decorator: register ``fn(log_ratio, cap, cap_min) -> (log_w, weight, corrected)``. ``log_ratio
    [N, T]`` is old − q, zero on padding; the outputs are [N, U] with U = T (one unit per token) or
    U = 1 (one per completion); ``corrected`` is bool."""
    return IS_MODES.register(name)


def _truncate(log_w: Tensor, cap: float) -> tuple[Tensor, Tensor, Tensor]:
    log_cap = math.log(cap)
    return log_w, torch.exp(log_w.clamp(max=log_cap)), log_w > log_cap


def _mask(log_w: Tensor, cap: float, cap_min: float) -> tuple[Tensor, Tensor, Tensor]:
    log_min = math.log(cap_min) if cap_min > 0 else -math.inf
    keep = (log_w >= log_min) & (log_w <= math.log(cap))
    return log_w, keep.to(log_w.dtype), ~keep


@register_is_mode("token_truncate")
def _token_truncate(log_ratio: Tensor, cap: float, cap_min: float) -> tuple[Tensor, Tensor, Tensor]:
    return _truncate(log_ratio, cap)  # [N, T]


@register_is_mode("token_mask")
def _token_mask(log_ratio: Tensor, cap: float, cap_min: float) -> tuple[Tensor, Tensor, Tensor]:
    return _mask(log_ratio, cap, cap_min)  # [N, T]


@register_is_mode("sequence_truncate")
def _sequence_truncate(log_ratio: Tensor, cap: float, cap_min: float) -> tuple[Tensor, Tensor, Tensor]:
    return _truncate(log_ratio.sum(-1, keepdim=True), cap)  # [N, 1]


@register_is_mode("sequence_mask")
def _sequence_mask(log_ratio: Tensor, cap: float, cap_min: float) -> tuple[Tensor, Tensor, Tensor]:
    return _mask(log_ratio.sum(-1, keepdim=True), cap, cap_min)  # [N, 1]


def _check(old_logp, sampling_logp, mask, mode: str, cap: float, cap_min: float) -> None:
    if not isinstance(old_logp, Tensor) or old_logp.dim() != 2:
        raise ValueError(f"old_logp must be a [N, T] tensor, got {getattr(old_logp, 'shape', type(old_logp))}")
    for name, x in (("sampling_logp", sampling_logp), ("mask", mask)):
        if not isinstance(x, Tensor) or x.shape != old_logp.shape:
            raise ValueError(f"{name} has shape {tuple(getattr(x, 'shape', ()))}, expected "
                             f"{tuple(old_logp.shape)} like old_logp (one entry per completion token)")
    IS_MODES.get(mode, "mode")
    if not cap >= 1:
        raise ValueError(f"cap={cap} must be >= 1 so that a ratio of 1 (no mismatch) keeps weight 1 "
                         "(TIS uses 2, TRL's sequence mask 3)")
    if not 0 <= cap_min <= 1:
        raise ValueError(f"cap_min={cap_min} must be in [0, 1] (0: no lower bound)")
    if cap_min > 0 and mode.endswith("_truncate"):
        raise ValueError(f"cap_min={cap_min} has no effect with mode={mode!r}, which only truncates "
                         "from above: use a *_mask mode or cap_min=0")


def importance_weights(old_logp: Tensor, sampling_logp: Tensor, mask: Tensor, mode: str = "sequence_mask",
                       *, cap: float = 3.0, cap_min: float = 0.0) -> tuple[Tensor, dict[str, float]]:
    """IS weights ``[N, T]`` (detached, 0 on padding) and the mismatch stats (module docstring).

    old_logp: the trainer's log-probs of the sampling policy; sampling_logp: the sampler's;
    mask: nonzero on real completion tokens. old_logp, sampling_logp, mask  # [N, T]
    """
    _check(old_logp, sampling_logp, mask, mode, cap, cap_min)
    valid = mask if mask.dtype == torch.bool else mask != 0  # [N, T]
    with torch.no_grad():
        zero = old_logp.new_zeros(())
        old = torch.where(valid, old_logp, zero)  # [N, T]
        q = torch.where(valid, sampling_logp.to(old.dtype), zero)  # [N, T]
        log_w, weight, corrected = IS_MODES[mode](old - q, cap, cap_min)  # [N, U]
        units = valid if log_w.shape == valid.shape else valid.any(-1, keepdim=True)  # [N, U]
        weights = torch.where(valid, weight.expand_as(valid), zero)  # [N, T]

        n_units = units.sum().clamp(min=1).double()
        ratio = torch.where(units, log_w.double(), 0.0).exp()  # [N, U], 1 on padding units
        values = {
            "mismatch_k3": torch.where(valid, kl_estimate(q, old, "k3"), zero).sum() / valid.sum().clamp(min=1),
            "ratio_mean": torch.where(units, ratio, 0.0).sum() / n_units,
            "ratio_max": torch.where(units, ratio, 0.0).max(),
            "frac_corrected": (corrected & units).sum() / n_units,
        }
        floats = torch.stack([v.double() for v in values.values()]).tolist()  # one device sync
    return weights, dict(zip(values, floats))
