"""Reward shaping computed from the completions themselves, added to the reward before the advantages.

DAPO soft overlong punishment (arXiv 2503.14476 eq. 13), with L the completion length in tokens:

    R(L) = 0                              if L ≤ L_max − L_cache
           ((L_max − L_cache) − L)/L_cache  if L_max − L_cache < L ≤ L_max
           −1                             if L > L_max

a linear ramp from 0 to −1 over the last L_cache tokens before the limit. Worked numbers:
docs/algorithms.md.
"""

from __future__ import annotations

import torch
from torch import Tensor


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
