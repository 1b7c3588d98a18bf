"""aggregate_loss (core/aggregation.py) against hand-worked numbers; the registered modes."""

import pytest
import torch

from grouprl.core import LOSS_AGGREGATIONS, aggregate_loss, batch_normalizer, register_loss_agg

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


@pytest.mark.parametrize("mode", AGGS)
def test_batch_normalizer_makes_micro_batches_sum_to_the_full_batch(mode):
    """Rows split 2 + 3 with D = batch_normalizer(mode, whole mask): the parts add up to the
    full-batch loss for every mode (token-mean counts tokens, the others completions)."""
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(5, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    D = batch_normalizer(mode, mask)
    assert D == (10 if mode == "token-mean" else 5)  # 3 + 1 + 4 + 2 + 0 real tokens, 5 rows
    full = aggregate_loss(loss, mask, mode, max_tokens=4)
    parts = sum(aggregate_loss(loss[rows], mask[rows], mode, max_tokens=4, normalizer=D)
                for rows in (slice(0, 2), slice(2, 5)))
    assert torch.allclose(parts, full, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", AGGS)
def test_a_batch_with_no_real_token_has_a_zero_loss_and_gradient(mode):
    """Every completion masked (all truncated under mask_truncated_completions): the whole-batch
    normaliser is positive (token-mean counts 1, as its one-pass form does), and the loss of each
    micro-batch is exactly 0 with a zero gradient."""
    loss = torch.randn(3, 4, requires_grad=True)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    D = batch_normalizer(mode, mask)
    assert D == (1 if mode == "token-mean" else 3)
    out = aggregate_loss(loss[:2], mask[:2], mode, max_tokens=4, normalizer=D)
    out.backward()
    assert float(out) == 0.0 and torch.equal(loss.grad, torch.zeros(3, 4))


def test_a_registered_aggregation_declares_what_it_divides_by():
    @register_loss_agg("test-token-sum-over-tokens", divides_by="tokens")
    def _per_token(loss, mask, *, max_tokens=None, normalizer=None):
        return loss.sum() / (mask.sum() if normalizer is None else normalizer)

    try:
        mask = torch.tensor([[True, False], [True, True]])
        assert batch_normalizer("test-token-sum-over-tokens", mask) == 3
    finally:
        LOSS_AGGREGATIONS.unregister("test-token-sum-over-tokens")
    with pytest.raises(ValueError, match="divides by 'completions' or 'tokens'"):
        register_loss_agg("x", divides_by="rows")
    with pytest.raises(ValueError, match="agg='nope' is unknown"):
        batch_normalizer("nope", mask)
