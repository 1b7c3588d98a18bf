"""Per-token KL estimators to the reference policy (Schulman, "Approximating KL divergence", 2020).

With samples drawn from the policy and δ = logp − ref_logp (log π_θ − log π_ref):

    k1 = δ                       unbiased, high variance, can be negative
    k2 = ½·δ²                    biased, low variance, ≥ 0
    k3 = exp(−δ) + δ − 1         unbiased, ≥ 0; DeepSeekMath eq. 4: π_ref/π − log(π_ref/π) − 1

Worked numbers (docs/algorithms.md): π = 0.5, π_ref = 0.25 → δ = log 2, k3 = ½ + log 2 − 1 = 0.193147;
π = 0.25, π_ref = 0.5 → k3 = 2 − log 2 − 1 = 0.306853.

In the loss, what acts is each estimator's expected gradient on the policy's samples: k1's is 0,
k2's the reverse KL's (∇KL(π‖π_ref)), k3's the forward KL's (∇KL(π_ref‖π)); so the config refuses k1
with beta > 0 (docs/algorithms.md, section 5).

k3 is computed as expm1(−δ) + δ, the same value with an absolute rounding error of about
eps·|δ| instead of eps (exp(−δ) − 1 rounds to ~eps first); k3 ≈ δ²/2 for small δ.
No clamping of δ is applied (verl clamps k3 to ±10); padded positions are the caller's to mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .registry import Registry

KL_ESTIMATORS: Registry[Callable[[Tensor], Tensor]] = Registry("KL estimator", "grouprl.core.KL_ESTIMATORS.register")


@KL_ESTIMATORS.register("k1")
def _k1(delta: Tensor) -> Tensor:
    return delta


@KL_ESTIMATORS.register("k2")
def _k2(delta: Tensor) -> Tensor:
    return 0.5 * delta.square()


@KL_ESTIMATORS.register("k3")
def _k3(delta: Tensor) -> Tensor:
    return torch.expm1(-delta) + delta


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token KL estimate, same shape as ``logp`` (e.g. [N, T]); δ = logp − ref_logp."""
    estimator = KL_ESTIMATORS.get(kind, "kind")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp has shape {tuple(logp.shape)} but ref_logp has {tuple(ref_logp.shape)}; "
                         "compute both on the same completion tokens")
    return estimator(logp - ref_logp)
