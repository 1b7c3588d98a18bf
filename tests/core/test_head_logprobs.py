"""head_logprobs (core/head_logprobs.py): the same numbers and gradients as the logits path
(F.linear, then token_logprobs_and_entropy), whatever the chunking, without [M, V] logits."""

import pytest
import torch
import torch.nn.functional as F

from grouprl.core import head_logprobs, token_logprobs_and_entropy


def reference(hidden, weight, bias, tokens, temperature, dtype=None):
    """The path the trainer took before: the head's logits whole, then the chunked log-softmax."""
    ctx = torch.autocast("cpu", dtype=dtype) if dtype is not None else torch.autocast("cpu", enabled=False)
    with ctx:
        logits = F.linear(hidden, weight, bias)  # [M, V]
    logp, entropy = token_logprobs_and_entropy(logits[None], tokens[None], temperature=temperature)
    return logp[0], entropy[0]


def inputs(M=37, H=16, V=101, dtype=torch.float64, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, H, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g, dtype=dtype) * 0.5).requires_grad_()
    b = (torch.randn(V, generator=g, dtype=dtype) * 0.1).requires_grad_() if bias else None
    tokens = torch.randint(0, V, (M,), generator=g)
    return hidden, weight, b, tokens


@pytest.mark.parametrize("chunk", [101, 5 * 101, 1000 * 101])  # 1 row, ragged 5-row chunks, one chunk
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [True, False])
def test_values_and_gradients_equal_the_logits_path_fp64(chunk, temperature, bias):
    hidden, weight, b, tokens = inputs(bias=bias)
    g = torch.randn(37, dtype=torch.float64)  # an arbitrary upstream gradient
    logp, entropy = head_logprobs(hidden, weight, tokens, bias=b, temperature=temperature, with_entropy=True,
                                  max_chunk_elements=chunk)
    got = torch.autograd.grad((logp * g).sum(), [hidden, weight] + ([b] if bias else []))
    ref_logp, ref_entropy = reference(hidden, weight, b, tokens, temperature)
    want = torch.autograd.grad((ref_logp * g).sum(), [hidden, weight] + ([b] if bias else []))
    assert logp.dtype == torch.float64 and logp.shape == (37,)
    assert torch.allclose(logp, ref_logp, atol=1e-12, rtol=0)
    assert torch.allclose(entropy, ref_entropy, atol=1e-12, rtol=0)
    for x, y in zip(got, want):
        assert torch.allclose(x, y, atol=1e-12, rtol=1e-10)
    assert not entropy.requires_grad


def test_fp32_within_fp32_tolerance_and_tied_weights_get_both_gradients():
    """A tied head: the embedding matrix is also the head; its gradient through the head adds to
    the embedding's own (autograd accumulates them as for the logits path)."""
    hidden, weight, _, tokens = inputs(dtype=torch.float32)
    ids = torch.randint(0, 101, (37,))
    emb = F.embedding(ids, weight)  # [M, H], the same matrix used as input embeddings
    h = hidden + emb
    logp, _ = head_logprobs(h, weight, tokens, max_chunk_elements=7 * 101)
    got = torch.autograd.grad(logp.sum(), [hidden, weight])
    ref, _ = reference(hidden + F.embedding(ids, weight), weight, None, tokens, 1.0)
    want = torch.autograd.grad(ref.sum(), [hidden, weight])
    assert torch.allclose(logp, ref, atol=1e-5, rtol=0)
    for x, y in zip(got, want):
        assert torch.allclose(x, y, atol=1e-5, rtol=1e-4)


def test_bf16_compute_matches_the_autocast_logits_path_within_bf16():
    hidden, weight, b, tokens = inputs(M=64, H=32, V=257, dtype=torch.float32)
    logp, entropy = head_logprobs(hidden, weight, tokens, bias=b, with_entropy=True, compute_dtype=torch.bfloat16,
                                  max_chunk_elements=9 * 257)
    got = torch.autograd.grad(logp.sum(), [hidden, weight, b])
    ref_logp, ref_entropy = reference(hidden, weight, b, tokens, 1.0, dtype=torch.bfloat16)
    want = torch.autograd.grad(ref_logp.sum(), [hidden, weight, b])
    assert logp.dtype == torch.float32
    assert torch.allclose(logp, ref_logp, atol=2e-2, rtol=0) and torch.allclose(entropy, ref_entropy, atol=2e-2)
    for x, y in zip(got, want):
        assert (x - y).abs().max() <= 2e-2 * y.abs().max()
    exact, _ = head_logprobs(hidden, weight, tokens, bias=b)  # fp32: bf16 really is another precision
    assert not torch.equal(exact, logp)


def test_bad_input():
    hidden, weight, _, tokens = inputs(dtype=torch.float32)
    with pytest.raises(ValueError, match="weight has shape"):
        head_logprobs(hidden, weight[:, :3], tokens)
    with pytest.raises(ValueError, match="tokens has shape"):
        head_logprobs(hidden, weight, tokens[:3])
    with pytest.raises(ValueError, match="temperature=0"):
        head_logprobs(hidden, weight, tokens, temperature=0)
    with pytest.raises(TypeError, match="integer token ids"):
        head_logprobs(hidden, weight, tokens.float())


@pytest.mark.parametrize("chunk", [101, 5 * 101, 1000 * 101])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_grad_through_the_head_is_the_analytic_gradient(chunk, temperature):
    """With entropy_grad, Σ a·logp + Σ b·H sends g_x = (a·(1[v = y] − p) − b·p·(log p + H))/τ through
    the head: ∂/∂h = g_x·W, ∂/∂W = g_xᵀ·h, ∂/∂b = Σ g_x (the formula, computed here from whole logits)."""
    hidden, weight, b, tokens = inputs()
    g = torch.Generator().manual_seed(3)
    a, c = torch.randn(37, generator=g, dtype=torch.float64), torch.randn(37, generator=g, dtype=torch.float64)
    logp, entropy = head_logprobs(hidden, weight, tokens, bias=b, temperature=temperature, with_entropy=True,
                                  max_chunk_elements=chunk, entropy_grad=True)
    assert entropy.requires_grad
    got = torch.autograd.grad((logp * a).sum() + (entropy * c).sum(), [hidden, weight, b])
    with torch.no_grad():
        z = F.linear(hidden, weight, b) / temperature  # [M, V]
        lp = torch.log_softmax(z, -1)
        p = lp.exp()
        h = -(p * lp).sum(-1, keepdim=True)  # [M, 1]
        onehot = F.one_hot(tokens, 101).double()
        gx = (a[:, None] * (onehot - p) - c[:, None] * p * (lp + h)) / temperature  # [M, V]
        assert torch.allclose(entropy, h[:, 0], atol=1e-12, rtol=0)
    for x, y in zip(got, [gx @ weight.detach(), gx.T @ hidden.detach(), gx.sum(0)]):
        assert torch.allclose(x, y, atol=1e-12, rtol=1e-10)
    # without entropy_grad the same call leaves the entropy constant: the log-probs' gradient alone
    logp2, entropy2 = head_logprobs(hidden, weight, tokens, bias=b, temperature=temperature, with_entropy=True,
                                    max_chunk_elements=chunk)
    assert not entropy2.requires_grad
    want = (a[:, None] * (onehot - p) / temperature) @ weight.detach()
    assert torch.allclose(torch.autograd.grad((logp2 * a).sum(), [hidden])[0], want, atol=1e-12, rtol=1e-10)
