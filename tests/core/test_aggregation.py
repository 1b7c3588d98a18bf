"""aggregate_loss (core/aggregation.py) against hand-worked numbers; the registered modes."""

import pytest
import torch

from grouprl.core import LOSS_AGGREGATIONS, aggregate_loss

AGGS = ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def test_aggregation_hand_worked():
    """ℓ = [[1,2,3],[4,·,·]], 4 real tokens, N = 2: token-mean 10/4; seq-mean-token-mean (2 + 4)/2;
    seq-mean-token-sum 10/2; seq-mean-token-sum-norm 10/(2·5) with L_max = 5."""
    loss = torch.tensor([[1.0, 2, 3], [4, float("nan"), float("inf")]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    want = {"token-mean": 2.5, "seq-mean-token-mean": 3.0, "seq-mean-token-sum": 5.0,
            "seq-mean-token-sum-norm": 1.0}
    for mode, value in want.items():
        assert aggregate_loss(loss, mask, mode, max_tokens=5).item() == value
    assert aggregate_loss(loss, mask, "token-mean", normalizer=8).item() == 10 / 8
    assert aggregate_loss(loss, mask, "seq-mean-token-mean", normalizer=4).item() == 6 / 4
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", max_tokens=5, normalizer=4).item() == 10 / 20


def test_bad_input_and_the_registered_modes():
    with pytest.raises(ValueError, match="agg='sum' is unknown"):
        aggregate_loss(torch.zeros(2, 3), torch.ones(2, 3), "sum")
    with pytest.raises(ValueError, match="per_token_loss"):
        aggregate_loss(torch.zeros(6), torch.ones(6), "token-mean")
    assert sorted(LOSS_AGGREGATIONS) == sorted(AGGS)
