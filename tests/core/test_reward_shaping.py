"""overlong_penalty (core/reward_shaping.py), DAPO's soft overlong punishment, against worked numbers."""

import pytest
import torch

from grouprl.core import overlong_penalty


def test_overlong_worked_numbers():
    """L_max 20480, L_cache 4096: soft zone starts at 16384; (16384 − 17408)/4096 = −0.25, etc."""
    lengths = torch.tensor([100, 16384, 17408, 18432, 20480, 20481, 30000])
    got = overlong_penalty(lengths, 20480, 4096)
    assert got.dtype == torch.float32 and got.shape == (7,)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]
    assert overlong_penalty(torch.tensor([10, 11]), 10, 0).tolist() == [0.0, -1.0]  # hard cutoff


def test_bad_input():
    with pytest.raises(ValueError, match="cache_len=5000"):
        overlong_penalty(torch.tensor([1]), 4096, 5000)
    with pytest.raises(TypeError, match="lengths"):
        overlong_penalty([1, 2], 4096, 1024)
