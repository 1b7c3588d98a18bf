"""Top-entropy token mask and DeepSeek-V3.2 off-policy sequence mask (core/token_masks.py): worked
numbers, naive loops, padding, and what micro-batching does to each."""

import pytest
import torch

from grouprl.core import TOKEN_MASKS, MaskInputs, off_policy_sequence_mask, policy_loss, top_entropy_mask

F64 = torch.float64


def ragged(seed, n, t):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]  # [N, T]
    return g, mask


# ---------------------------------------------------------------- top-entropy tokens

def test_top_entropy_worked_numbers():
    """Real entropies 0.1 0.5 0.9 | 0.3 0.7, sorted 0.1 0.3 0.5 0.7 0.9. ρ = 0.4: the 0.6 quantile sits
    at position 0.6·4 = 2.4, 0.5 + 0.4·(0.7 − 0.5) = 0.58, so 0.9 and 0.7 are kept (2 of 5 = ρ).
    ρ = 0.2: position 3.2, 0.7 + 0.2·0.2 = 0.74, only 0.9. Padding (nan here) is never kept."""
    h = torch.tensor([[0.1, 0.5, 0.9, float("nan")], [0.3, 0.7, float("nan"), float("inf")]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    assert top_entropy_mask(h, mask, 0.4).tolist() == [[False, False, True, False], [False, True, False, False]]
    assert top_entropy_mask(h, mask, 0.2).tolist() == [[False, False, True, False], [False, False, False, False]]
    assert top_entropy_mask(h, mask, 1.0).tolist() == mask.bool().tolist()


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("rho", [0.05, 0.2, 0.5, 0.9])
def test_top_entropy_matches_a_sorted_loop(seed, rho):
    """Naive: sort the real entropies, interpolate the (1 − ρ) quantile by hand, keep h ≥ it."""
    g, mask = ragged(seed, 6, 9)
    h = torch.rand(6, 9, generator=g, dtype=F64) * 3
    values = sorted(float(h[i, j]) for i in range(6) for j in range(9) if mask[i, j])
    pos = (1 - rho) * (len(values) - 1)
    lo = int(pos)
    tau = values[lo] + (pos - lo) * (values[min(lo + 1, len(values) - 1)] - values[lo])
    want = [[bool(mask[i, j]) and float(h[i, j]) >= tau for j in range(9)] for i in range(6)]
    got = top_entropy_mask(h, mask, rho)
    assert got.tolist() == want
    assert int(got.sum()) == pytest.approx(rho * len(values), abs=1.0)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100])
def test_top_entropy_threshold_is_torch_quantile(n):
    """The hand-rolled interpolation (no 2**24-element cap) picks the same tokens as torch.quantile."""
    h = torch.rand(1, n, generator=torch.Generator().manual_seed(n), dtype=F64)
    mask = torch.ones(1, n, dtype=torch.bool)
    for rho in (0.01, 0.2, 0.5, 0.99, 1.0):
        assert torch.equal(top_entropy_mask(h, mask, rho), h >= torch.quantile(h[mask], 1 - rho))


def test_masked_tokens_get_no_gradient_and_keep_the_normaliser():
    """As the paper (and TRL): 1[H ≥ τ] multiplies the policy term; the token-mean still divides by
    every real token, so the kept tokens' gradients are unchanged, the others are 0."""
    g, mask = ragged(1, 5, 7)
    h = torch.rand(5, 7, generator=g, dtype=F64)
    logp = (-torch.rand(5, 7, generator=g, dtype=F64)).requires_grad_(True)
    adv = torch.randn(5, generator=g, dtype=F64)
    keep = top_entropy_mask(h, mask, 0.3)
    policy_loss(logp, logp.detach(), adv, mask, agg="token-mean", token_weights=keep.to(F64))[0].backward()
    want = torch.where(keep, -adv[:, None] / mask.sum(), 0.0)
    torch.testing.assert_close(logp.grad, want, rtol=1e-12, atol=0)


def test_micro_batch_quantile_equals_the_batch_only_for_the_whole_batch():
    """The quantile is over the tokens of one forward pass. One micro-batch = the batch: the paper's
    τ_ρ exactly. Two micro-batches choose their own top ρ: here batch quantile keeps the two
    high-entropy tokens of row 0 only, while row 1's micro-batch keeps its own best token too.
    Rows: [0.9, 0.8, 0.1] and [0.3, 0.2, 0.1], ρ = 1/3: batch τ = quantile_{2/3} = 0.3 + ... """
    h = torch.tensor([[0.9, 0.8, 0.1], [0.3, 0.2, 0.1]], dtype=F64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    whole = top_entropy_mask(h, mask, 1 / 3)
    # 6 values 0.1 0.1 0.2 0.3 0.8 0.9; position (2/3)·5 = 3.33: 0.3 + 0.33·0.5 = 0.4667 → 0.9, 0.8
    assert whole.tolist() == [[True, True, False], [False, False, False]]
    split = torch.cat([top_entropy_mask(h[:1], mask[:1], 1 / 3), top_entropy_mask(h[1:], mask[1:], 1 / 3)])
    # row 0 alone: 0.1 0.8 0.9, position 1.33 → 0.8 + 0.33·0.1 = 0.833 → 0.9; row 1: 0.2 + 0.033 → 0.3
    assert split.tolist() == [[True, False, False], [True, False, False]]
    assert not torch.equal(whole, split)


def test_top_entropy_bad_input():
    with pytest.raises(ValueError, match=r"top_entropy_quantile=0 must be in \(0, 1\]"):
        top_entropy_mask(torch.ones(2, 2), torch.ones(2, 2), 0)
    with pytest.raises(ValueError, match="mask has shape"):
        top_entropy_mask(torch.ones(2, 2), torch.ones(2, 3), 0.2)
    assert not top_entropy_mask(torch.ones(2, 2), torch.zeros(2, 2), 0.2).any()  # no real token


# ---------------------------------------------------------------- off-policy sequence mask

def test_off_policy_mask_worked_numbers():
    """δ = 0.5. Mean log(π_sampler/π_θ) per completion: row 0 (0.8 + 0.4)/2 = 0.6, row 1 0.4,
    row 2 0.9, row 3 0.5 (exactly δ: kept, the test is >), row 4 0.6 with A = 0 (kept: only negative
    advantages are dropped). A = [−1, −1, +1, −1, 0] → keep [F, T, T, T, T]. Padding holds garbage."""
    sampler = torch.tensor([[0.8, 0.4], [0.4, 9.0], [0.9, 0.9], [0.25, 0.75], [0.6, 0.6]], dtype=F64)
    logp = torch.tensor([[0.0, 0.0], [0.0, float("nan")], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 1]])
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0, 0.0])
    assert off_policy_sequence_mask(logp, sampler, adv, mask, 0.5).tolist() == [False, True, True, True, True]
    per_token_adv = adv[:, None].expand(5, 2).clone()
    assert off_policy_sequence_mask(logp, sampler, per_token_adv, mask, 0.5).tolist() == [False, True, True, True, True]


@pytest.mark.parametrize("seed", range(5))
def test_off_policy_mask_matches_loop_and_does_not_depend_on_micro_batching(seed):
    g, mask = ragged(seed, 10, 6)
    logp = -torch.rand(10, 6, generator=g, dtype=F64) * 2
    sampler = logp + 2 * torch.randn(10, 6, generator=g, dtype=F64)
    adv = torch.randn(10, generator=g, dtype=F64)
    adv[::2] = -adv[::2].abs()  # half the completions have negative advantage
    delta = 0.1
    want = []
    for i in range(10):
        toks = [j for j in range(6) if mask[i, j]]
        kl = sum(float(sampler[i, j] - logp[i, j]) for j in toks) / len(toks)
        want.append(not (float(adv[i]) < 0 and kl > delta))
    got = off_policy_sequence_mask(logp, sampler, adv, mask, delta)
    assert got.tolist() == want and not all(want)
    parts = torch.cat([off_policy_sequence_mask(logp[r], sampler[r], adv[r], mask[r], delta)
                       for r in (slice(0, 3), slice(3, 4), slice(4, 10))])
    assert torch.equal(parts, got)


def test_on_policy_nothing_is_dropped_and_bad_threshold_rejected():
    g, mask = ragged(0, 4, 5)
    logp = -torch.rand(4, 5, generator=g)
    assert off_policy_sequence_mask(logp, logp.clone(), -torch.ones(4), mask, 0.0).all()
    with pytest.raises(ValueError, match="off_policy_mask_threshold=-1 must be >= 0"):
        off_policy_sequence_mask(logp, logp, torch.ones(4), mask, -1)
    with pytest.raises(ValueError, match="sampling_logp has shape"):
        off_policy_sequence_mask(logp, logp[:, :2], torch.ones(4), mask, 0.5)


# ---------------------------------------------------------------- the registry

def test_registered_masks_share_one_signature_and_give_token_masks():
    """Each registered mask reads a MaskInputs and returns keep [n, T]: top-entropy per token, the
    off-policy mask broadcast over each completion's tokens, keeping everything on-policy (no sampler)."""
    g, mask = ragged(1, 6, 5)
    logp = -torch.rand(6, 5, generator=g, dtype=F64)
    entropy = torch.rand(6, 5, generator=g, dtype=F64)
    sampler = logp + torch.randn(6, 5, generator=g, dtype=F64)
    adv = -torch.rand(6, generator=g, dtype=F64)
    x = MaskInputs(logp, mask, adv, entropy, sampler)
    assert torch.equal(TOKEN_MASKS.get("entropy_mask")(x, 0.3), top_entropy_mask(entropy, mask, 0.3))
    keep = TOKEN_MASKS.get("off_policy_mask")(x, 0.2)
    assert keep.shape == (6, 5) and keep.dtype == torch.bool
    assert torch.equal(keep, off_policy_sequence_mask(logp, sampler, adv, mask, 0.2)[:, None].expand(6, 5))
    on_policy = TOKEN_MASKS.get("off_policy_mask")(MaskInputs(logp, mask, adv, entropy), 0.0)
    assert on_policy.shape == (6, 5) and on_policy.all()
