"""Chunked token log-probs and entropies against torch.log_softmax references, values and gradients."""

import pytest
import torch

from grouprl.core import token_entropy, token_logprobs, token_logprobs_and_entropy

# chunk budgets with V = 11, T = 5: whole batch in one chunk; 2 rows per chunk; 2 tokens per chunk (T·V
# over budget); one token per chunk (budget below V)
CHUNKS = [1 << 24, 110, 25, 3]


def make(n=3, t=5, v=11, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(n, t, v, generator=g, dtype=torch.float64)).to(dtype)
    tokens = torch.randint(0, v, (n, t), generator=g)
    return logits, tokens


def ref_logprobs(logits, tokens, temperature):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return logp.gather(-1, tokens[..., None]).squeeze(-1)


def ref_entropy(logits, temperature):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_match_log_softmax(chunk, temperature, dtype):
    """bf16 logits are upcast exactly, so the reference is the fp64 log-softmax of the same values."""
    logits, tokens = make(dtype=dtype)
    got = token_logprobs(logits, tokens, temperature=temperature, max_chunk_elements=chunk)
    assert got.shape == (3, 5) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref_logprobs(logits, tokens, temperature), rtol=1e-6, atol=2e-6)
    ent = token_entropy(logits, temperature=temperature, max_chunk_elements=chunk)
    assert ent.shape == (3, 5) and ent.dtype == torch.float32
    torch.testing.assert_close(ent.double(), ref_entropy(logits, temperature), rtol=1e-6, atol=2e-6)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_one_pass_gives_both_values_and_the_logprob_gradient(chunk, temperature, dtype):
    """token_logprobs_and_entropy: the fp64 references' values; the gradient of token_logprobs
    bitwise (the same backward); no gradient through the entropy."""
    logits, tokens = make(dtype=dtype)
    x = logits.clone().requires_grad_()
    logp, ent = token_logprobs_and_entropy(x, tokens, temperature=temperature, max_chunk_elements=chunk)
    assert logp.shape == ent.shape == (3, 5) and logp.dtype == ent.dtype == torch.promote_types(dtype, torch.float32)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(logp.double(), ref_logprobs(logits, tokens, temperature), **tol)
    torch.testing.assert_close(ent.double(), ref_entropy(logits, temperature), **tol)
    assert not ent.requires_grad
    up = torch.randn(3, 5, generator=torch.Generator().manual_seed(1)).to(logp.dtype)
    (logp * up).sum().backward()
    y = logits.clone().requires_grad_()
    (token_logprobs(y, tokens, temperature=temperature, max_chunk_elements=chunk) * up).sum().backward()
    assert torch.equal(x.grad, y.grad)


def test_one_pass_entropy_stays_exact_when_nearly_deterministic():
    """One logit 30 above 999 others: H = 2.9e-9, a thousandth of fp32's resolution at lse = 30, so
    lse − Σ p·x would keep no digit of it. The two non-negative terms keep it to 4 %: Σ e·d / s
    exactly, log s (1e-10) rounds to 0 in fp32, as it does in token_entropy."""
    logits = torch.zeros(2, 3, 1000)
    logits[..., 7] = 30.0
    tokens = torch.full((2, 3), 7)
    _, ent = token_logprobs_and_entropy(logits, tokens)
    want = ref_entropy(logits, 1.0)
    assert (want > 0).all() and (want < 1e-8).all()
    torch.testing.assert_close(ent.double(), want, rtol=4e-2, atol=0)
    torch.testing.assert_close(ent, token_entropy(logits), rtol=1e-6, atol=0)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_gradients_match_autograd_reference(chunk, temperature):
    logits, tokens = make(dtype=torch.float64)
    up = torch.randn(3, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x = logits.clone().requires_grad_()
    (token_logprobs(x, tokens, temperature=temperature, max_chunk_elements=chunk) * up).sum().backward()
    y = logits.clone().requires_grad_()
    (ref_logprobs(y, tokens, temperature) * up).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-14)

    x.grad, y.grad = None, None
    (token_entropy(x, temperature=temperature, max_chunk_elements=chunk) * up).sum().backward()
    (ref_entropy(y, temperature) * up).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-13)


def test_gradcheck():
    logits, tokens = make(n=2, t=3, v=5, dtype=torch.float64)
    x = logits.requires_grad_()
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, tokens, temperature=0.8, max_chunk_elements=7), (x,))
    assert torch.autograd.gradcheck(lambda z: token_entropy(z, temperature=0.8, max_chunk_elements=7), (x,))


def test_bf16_gradient():
    """Gradient returned in bf16: the fp32 closed form (1[v = y] − p)·g/τ rounded once to bf16."""
    logits, tokens = make(dtype=torch.bfloat16)
    x = logits.clone().requires_grad_()
    token_logprobs(x, tokens, temperature=0.7, max_chunk_elements=25).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    y = logits.double().requires_grad_()
    ref_logprobs(y, tokens, 0.7).sum().backward()
    torch.testing.assert_close(x.grad, y.grad.to(torch.bfloat16), rtol=1.6e-2, atol=1e-5)


def test_non_contiguous_slice_of_model_logits():
    """Typical use: logits[:, P-1:-1] of the full sequence, a non-contiguous view."""
    full, _ = make(n=2, t=9, v=11)
    logits = full[:, 3:-1]  # [2, 5, 11]
    tokens = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(3))
    assert not logits.is_contiguous()
    x = full.clone().requires_grad_()
    token_logprobs(x[:, 3:-1], tokens, max_chunk_elements=25).sum().backward()
    torch.testing.assert_close(token_logprobs(logits, tokens).double(), ref_logprobs(logits, tokens, 1.0),
                               rtol=1e-6, atol=2e-6)
    assert (x.grad[:, :3] == 0).all() and (x.grad[:, -1] == 0).all()
    torch.testing.assert_close(x.grad[:, 3:-1].sum(-1), torch.zeros(2, 5), rtol=0, atol=1e-6)  # Σ_v (1[v=y] − p) = 0


def test_inputs_are_not_modified_and_no_grad_works():
    logits, tokens = make()
    before = logits.clone()
    with torch.no_grad():
        token_logprobs(logits, tokens)
        token_entropy(logits)
    x = logits.clone().requires_grad_()
    token_logprobs(x, tokens).sum().backward()
    token_entropy(x).sum().backward()
    assert torch.equal(logits, before)
    assert torch.equal(x.detach(), before)


def test_int32_tokens_accepted():
    logits, tokens = make()
    torch.testing.assert_close(token_logprobs(logits, tokens.int()), token_logprobs(logits, tokens))


@pytest.mark.parametrize("call, exc, match", [
    (lambda l, t: token_logprobs(l, t[:, :4]), ValueError, r"tokens has shape \(3, 4\)"),
    (lambda l, t: token_logprobs(l, t.float()), TypeError, "integer token ids"),
    (lambda l, t: token_logprobs(l[0], t[0]), ValueError, r"\[N, T, V\]"),
    (lambda l, t: token_logprobs(l, t, temperature=0.0), ValueError, "temperature=0.0"),
    (lambda l, t: token_entropy(l, temperature=-1.0), ValueError, "temperature=-1.0"),
    (lambda l, t: token_entropy(l.long()), ValueError, "float"),
    (lambda l, t: token_entropy(l, max_chunk_elements=0), ValueError, "max_chunk_elements=0"),
])
def test_bad_input(call, exc, match):
    logits, tokens = make()
    with pytest.raises(exc, match=match):
        call(logits, tokens)


# ---------------------------------------------------------------- the entropy with a gradient (entropy bonus)

def analytic_logits_grad(logits, tokens, temperature, g_logp, g_entropy):
    """docs/algorithms.md section 9, per position, p = softmax(x/τ):
    ∂logp/∂z_v = (1[v = y] − p_v)/τ,   ∂H/∂z_v = −p_v·(log p_v + H)/τ."""
    logp_all = torch.log_softmax(logits.double() / temperature, dim=-1)  # [N, T, V]
    p = logp_all.exp()
    h = -(p * logp_all).sum(-1, keepdim=True)  # [N, T, 1]
    onehot = torch.nn.functional.one_hot(tokens, logits.shape[-1]).double()
    d_logp = (onehot - p) / temperature
    d_h = -p * (logp_all + h) / temperature
    return g_logp[..., None] * d_logp + g_entropy[..., None] * d_h  # [N, T, V]


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_grad_gives_the_analytic_gradient_of_both(chunk, temperature):
    """entropy_grad: the gradient of Σ a·logp + Σ b·H w.r.t. the logits is the closed form above, and
    the values are those without it."""
    logits, tokens = make(dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(3, 5, generator=g, dtype=torch.float64)
    x = logits.clone().requires_grad_()
    logp, ent = token_logprobs_and_entropy(x, tokens, temperature=temperature, max_chunk_elements=chunk,
                                           entropy_grad=True)
    assert ent.requires_grad
    torch.testing.assert_close(ent, ref_entropy(logits, temperature), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logp, ref_logprobs(logits, tokens, temperature), rtol=1e-12, atol=1e-12)
    ((logp * a).sum() + (ent * b).sum()).backward()
    torch.testing.assert_close(x.grad, analytic_logits_grad(logits, tokens, temperature, a, b), rtol=1e-10, atol=1e-13)
    # only the entropy used (the log-probs' gradient is then 0): −p·(log p + H)/τ alone
    y = logits.clone().requires_grad_()
    (token_logprobs_and_entropy(y, tokens, temperature=temperature, max_chunk_elements=chunk,
                                entropy_grad=True)[1] * b).sum().backward()
    torch.testing.assert_close(y.grad, analytic_logits_grad(logits, tokens, temperature, 0 * a, b), rtol=1e-10,
                               atol=1e-13)


def test_entropy_grad_gradcheck_and_bf16():
    logits, tokens = make(n=2, t=3, v=5, dtype=torch.float64)
    x = logits.requires_grad_()
    assert torch.autograd.gradcheck(lambda z: token_logprobs_and_entropy(z, tokens, temperature=0.8,
                                                                         max_chunk_elements=7, entropy_grad=True), (x,))
    # bf16 logits: the fp32 gradient, rounded to bf16 once
    logits, tokens = make(dtype=torch.bfloat16)
    up = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    x = logits.clone().requires_grad_()
    logp, ent = token_logprobs_and_entropy(x, tokens, entropy_grad=True)
    (logp * up + ent * up.flip(0)).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    want = analytic_logits_grad(logits, tokens, 1.0, up.double(), up.flip(0).double())
    torch.testing.assert_close(x.grad.double(), want, rtol=1e-2, atol=1e-3)
