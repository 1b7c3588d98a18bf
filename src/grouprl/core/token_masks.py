"""Which tokens carry gradient: masks that multiply the policy term as token weights (policy_loss's
``token_weights``; the KL penalty and the loss normaliser are left alone, as in both sources).

Top-entropy tokens (Wang et al. 2025, "Beyond the 80/20 Rule", arXiv 2506.01939, the RLVR objective
restricted to high-entropy "forking" tokens, building on DAPO): only the tokens whose entropy
H_{i,t} reaches the (1−ρ) quantile τ_ρ of the batch's token entropies keep a gradient,

    keep_{i,t} = 1[H_{i,t} ≥ τ_ρ],   τ_ρ = quantile_{1−ρ}{H over real tokens},   ρ = 0.2 in the paper.

The quantile interpolates linearly between sorted values (torch.quantile's rule; TRL's choice, the
paper does not say). The entropies come from the same forward pass as the log-probs, so the
quantile is taken over the tokens of one micro-batch (on one rank). Departure: the paper's τ_ρ
is over the whole batch B; a micro-batch quantile equals it only when the micro-batch is the whole
optimizer batch (one micro-batch, one rank). Smaller micro-batches choose their top ρ each, so
the update does change with micro_batch_size (about ρ of each micro-batch's tokens is kept instead
of ρ of the batch's) — the one option in grouprl that is not micro-batch invariant. TRL takes the quantile over the
micro-batch gathered across ranks, so its result changes with the per-device batch too.

Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556, eq. 9): a completion with negative
advantage whose mean per-token log-ratio to the sampling policy exceeds δ is dropped,

    keep_i = 0  if  A_i < 0  and  (1/|o_i|)·Σ_t m·(log π_sampler − log π_θ) > δ,   else 1

with π_sampler the probabilities the inference engine sampled with (the paper's π_old "directly
returned by the inference framework") and π_θ the current policy, so both sampler/trainer mismatch
and staleness (μ > 1, async) count. The statistic is the k1 estimate of KL(π_sampler ‖ π_θ) on the
sampled tokens. Per completion, so it does not depend on micro-batching. The paper gives no δ; TRL
suggests 0.5. With μ = 1 and the built-in engine, π_sampler = π_θ and nothing is dropped.

Padding: entropies and log-probs of padded positions are never read (``torch.where`` first); the
masks are False there.

Both are registered in ``TOKEN_MASKS`` under one signature, ``fn(inputs: MaskInputs, value) -> keep``
with ``keep`` bool [n, T] and ``value`` the mask's one parameter (ρ, δ), so the trainer's glue
(objective.py) multiplies the token weights by every mask the config switches on, and reports the
fraction of real tokens each one dropped as ``<name>/dropped_frac``. Formulas: docs/algorithms.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .registry import Registry


@dataclass(frozen=True, eq=False)
class MaskInputs:
    """One micro-batch, as a token mask may read it. All [n, T] unless noted."""

    logp: Tensor                          # log π_θ of the sampled tokens (this pass)
    mask: Tensor                          # bool, True on real completion tokens
    advantages: Tensor                    # [n], or [n, T] per token
    entropy: Tensor | None = None         # H_{i,t} from the same pass (None when not computed)
    sampling_logp: Tensor | None = None   # log π_sampler (None on-policy, when nothing else sampled)


MaskFn = Callable[[MaskInputs, float], Tensor]
TOKEN_MASKS: Registry[MaskFn] = Registry("token mask", "grouprl.core.TOKEN_MASKS.register")


def _valid(mask: Tensor, shape: torch.Size, name: str) -> Tensor:
    if not isinstance(mask, Tensor) or mask.shape != shape:
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"mask has shape {got}, expected {tuple(shape)} like {name}")
    return mask if mask.dtype == torch.bool else mask != 0


def top_entropy_mask(entropy: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """Bool [N, T]: real tokens whose entropy is at least the (1 − ``quantile``) quantile of the real
    tokens' entropies. entropy, mask  # [N, T]. quantile = ρ in (0, 1]; 1 keeps every real token."""
    if not 0 < quantile <= 1:
        raise ValueError(f"top_entropy_quantile={quantile} must be in (0, 1] (the paper keeps 0.2; 1 keeps all)")
    if not isinstance(entropy, Tensor) or entropy.dim() != 2:
        raise ValueError(f"entropy must be a [N, T] tensor, got {getattr(entropy, 'shape', type(entropy))}")
    valid = _valid(mask, entropy.shape, "entropy")  # [N, T]
    if quantile == 1 or not valid.any():
        return valid
    h = entropy.detach().double()  # [N, T]
    values = h[valid].sort().values  # [K] real tokens' entropies, ascending
    pos = (1 - quantile) * (values.numel() - 1)  # torch.quantile's linear rule, without its 2**24 cap
    lo = int(pos)
    hi = min(lo + 1, values.numel() - 1)
    threshold = values[lo] + (pos - lo) * (values[hi] - values[lo])  # scalar τ_ρ
    return valid & (torch.where(valid, h, -torch.inf) >= threshold)  # [N, T]


def off_policy_sequence_mask(logp: Tensor, sampling_logp: Tensor, advantages: Tensor, mask: Tensor,
                             threshold: float) -> Tensor:
    """Bool [N]: False for completions with A < 0 whose mean log(π_sampler/π_θ) over real tokens
    exceeds ``threshold`` (δ), True otherwise. logp, sampling_logp, mask  # [N, T];
    advantages  # [N] (or [N, T] per-token: a completion is negative when its mean over real tokens is)."""
    if not threshold >= 0:
        raise ValueError(f"off_policy_mask_threshold={threshold} must be >= 0 (TRL suggests 0.5)")
    if not isinstance(logp, Tensor) or logp.dim() != 2:
        raise ValueError(f"logp must be a [N, T] tensor, got {getattr(logp, 'shape', type(logp))}")
    valid = _valid(mask, logp.shape, "logp")  # [N, T]
    if not isinstance(sampling_logp, Tensor) or sampling_logp.shape != logp.shape:
        raise ValueError(f"sampling_logp has shape {tuple(getattr(sampling_logp, 'shape', ()))}, "
                         f"expected {tuple(logp.shape)} like logp")
    with torch.no_grad():
        zero = logp.new_zeros((), dtype=torch.float64)
        log_ratio = torch.where(valid, sampling_logp.double() - logp.detach().double(), zero)  # [N, T]
        count = valid.sum(-1).clamp(min=1)  # [N]
        mean_kl = log_ratio.sum(-1) / count  # [N]
        adv = advantages.detach().double()
        if adv.dim() == 2:
            adv = torch.where(valid, adv, zero).sum(-1) / count  # [N]
        if adv.shape != mean_kl.shape:
            raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected [N]={tuple(mean_kl.shape)} "
                             f"or [N, T]={tuple(logp.shape)}")
        return ~((adv < 0) & (mean_kl > threshold))  # [N]


@TOKEN_MASKS.register("entropy_mask")
def _entropy_mask(x: MaskInputs, quantile: float) -> Tensor:
    return top_entropy_mask(x.entropy, x.mask, quantile)  # [n, T]


@TOKEN_MASKS.register("off_policy_mask")
def _off_policy_mask(x: MaskInputs, threshold: float) -> Tensor:
    if x.sampling_logp is None:  # on-policy: nothing to drop
        return torch.ones_like(x.mask, dtype=torch.bool)  # [n, T]
    keep = off_policy_sequence_mask(x.logp, x.sampling_logp, x.advantages, x.mask, threshold)  # [n]
    return keep[:, None].expand_as(x.mask)  # [n, T]
