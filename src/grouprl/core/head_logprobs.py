"""Per-token log-probabilities (and entropies) from the last hidden states, through the LM head, a
chunk of positions at a time, forward and backward: the [M, V] logits never exist whole.

With h_t the final hidden state at a position, W [V, H] (and b) the LM head, τ the temperature:

    x_t = (W·h_t + b) / τ,   log π(y_t) = x_{t,y_t} − lse_t,   H_t = −Σ_v p_{t,v}·log p_{t,v}

(the formulas of logprobs.py, docs/algorithms.md section 9). The forward computes the logits of a
chunk of positions, reduces them to lse, log π(y) and H, and drops them; it saves only h, W, the
targets and lse (one fp32 number per position). The backward recomputes each chunk's logits and
sends  g_x = (1[v = y] − p)·g / τ  through the head:

    ∂L/∂h_t = g_x·W,    ∂L/∂W = Σ_t g_xᵀ·h_t,    ∂L/∂b = Σ_t g_x

so the head's peak memory is one chunk's logits and a few temporaries of its size, whatever the
number of positions M or the vocabulary. This costs the head's matmul once more in the backward
(2·M·H·V multiply-adds); the model's own backward is untouched. Same approach as verl's and
prime-rl's chunked log-probs and Liger's fused linear cross-entropy (their code is not used).

``compute_dtype`` is the matmul precision (the autocast dtype of the caller, bf16 say): h, W and b
are cast to it for the head matmuls, as autocast would cast the model's own `lm_head`, and the
softmax runs in fp32 (fp64 inputs stay fp64). The entropy is returned without a gradient (a metric
or a mask in the update) unless ``entropy_grad`` asks for one (an entropy bonus in the loss): then
it is saved too, and the backward's one softmax per chunk carries both gradients,

    g_x = ((1[v = y] − p)·g − p·(log p + H)·g_H) / τ

so the entropy costs no extra matmul. Rows of chunks: ``max_chunk_elements`` logits, V per row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Logits elements per chunk, by device type. The head matmul reads all of W once per chunk, so
# chunks are larger than logprobs.py's cache-sized ones (measured: benchmarks/README.md). On CUDA a
# chunk of 2^24 (64 MB of fp32 logits, ~340 positions at a 49k vocabulary: a matmul a GPU still
# fills) keeps the head's working set small beside the model's (not yet measured on a GPU).
HEAD_CHUNK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 24}
DEFAULT_HEAD_CHUNK_ELEMENTS = 1 << 25


def _cast(x: Tensor | None, dtype: torch.dtype | None) -> Tensor | None:
    return x if x is None or dtype is None else x.to(dtype)


def _logits(h: Tensor, w: Tensor, b: Tensor | None, temperature: float) -> Tensor:
    x = F.linear(h, w, b)  # [m, V] in the compute dtype
    x = x.to(torch.promote_types(x.dtype, torch.float32))  # the softmax in fp32 (or fp64)
    return x if temperature == 1.0 else x / temperature


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor, temperature: float,
                with_entropy: bool, compute_dtype: torch.dtype | None, rows: int, entropy_grad: bool):
        M = hidden.shape[0]
        w, b = _cast(weight, compute_dtype), _cast(bias, compute_dtype)
        out_dtype = torch.promote_types(w.dtype, torch.float32)
        logp = torch.empty(M, dtype=out_dtype, device=hidden.device)  # [M]
        lse = torch.empty_like(logp)  # [M]
        entropy = torch.empty_like(logp) if with_entropy else None  # [M]
        with torch.autocast(hidden.device.type, enabled=False):  # the precision is ours: compute_dtype
            for r in range(0, M, rows):
                x = _logits(_cast(hidden[r:r + rows], compute_dtype), w, b, temperature)  # [m, V]
                m = x.amax(-1, keepdim=True)  # [m, 1]
                d = x - m  # [m, V], <= 0
                e = d.exp()
                s = e.sum(-1)  # [m], >= 1
                log_s = s.log()
                lse[r:r + rows] = m.squeeze(-1) + log_s
                if entropy is not None:
                    entropy[r:r + rows] = log_s - e.mul_(d).sum(-1) / s  # log s − Σ e·d / s
                logp[r:r + rows] = x.gather(-1, tokens[r:r + rows, None]).squeeze(-1) - lse[r:r + rows]
        ctx.temperature, ctx.compute_dtype, ctx.rows = temperature, compute_dtype, rows
        ctx.entropy_grad = entropy is not None and entropy_grad
        # the entropy is saved (one number per position) only when it carries a gradient
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, entropy if ctx.entropy_grad else None)
        if entropy is None:
            return logp, logp.new_empty(0)
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor):
        hidden, weight, bias, tokens, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if not (need_h or need_w or need_b):
            return (None,) * 9
        tau, rows = ctx.temperature, ctx.rows
        w, b = _cast(weight, ctx.compute_dtype), _cast(bias, ctx.compute_dtype)
        grad_h = torch.empty_like(hidden) if need_h else None  # [M, H]
        grad_w = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if need_w else None  # [V, H]
        grad_b = torch.zeros(bias.shape, dtype=lse.dtype, device=bias.device) if need_b else None  # [V]
        with torch.autocast(hidden.device.type, enabled=False):
            for r in range(0, hidden.shape[0], rows):
                h = _cast(hidden[r:r + rows], ctx.compute_dtype)  # [m, H]
                x = _logits(h, w, b, tau)  # [m, V]
                g = grad_logp[r:r + rows, None].to(x.dtype) / tau  # [m, 1]
                if ctx.entropy_grad:  # −p·(g + (log p + H)·g_H) / τ: the entropy's gradient from the same p
                    g_h = grad_entropy[r:r + rows, None].to(x.dtype) / tau  # [m, 1]
                    logp = x - lse[r:r + rows, None]  # [m, V]
                    p = logp.exp()
                    gx = logp.mul_(-g_h).add_(-(g + g_h * entropy[r:r + rows, None])).mul_(p)
                else:
                    gx = (x - lse[r:r + rows, None]).exp_().mul_(-g)  # −p·g / τ
                gx.scatter_add_(-1, tokens[r:r + rows, None], g)  # + 1[v = y]·g / τ: ∂L/∂(W·h + b)
                gx_c = gx.to(w.dtype)  # [m, V], the matmuls in the compute dtype
                if need_h:
                    grad_h[r:r + rows] = (gx_c @ w).to(hidden.dtype)  # [m, H]
                if need_w:
                    grad_w += (gx_c.T @ h).to(grad_w.dtype)  # [V, H]
                if need_b:
                    grad_b += gx.sum(0)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None, None)


def head_rows_per_chunk(vocab: int, device: torch.device, max_chunk_elements: int | None = None) -> int:
    """Positions per chunk: about `max_chunk_elements` logits (the device's default when None)."""
    budget = max_chunk_elements or HEAD_CHUNK_ELEMENTS.get(device.type, DEFAULT_HEAD_CHUNK_ELEMENTS)
    return max(1, int(budget) // vocab)


def head_logprobs(hidden: Tensor, weight: Tensor, tokens: Tensor, *, bias: Tensor | None = None,
                  temperature: float = 1.0, with_entropy: bool = False, compute_dtype: torch.dtype | None = None,
                  max_chunk_elements: int | None = None,
                  entropy_grad: bool = False) -> tuple[Tensor, Tensor | None]:
    """log softmax((W·h + b) / temperature) at ``tokens``, and the entropy when asked.

    hidden  # [M, H];  weight  # [V, H];  bias  # [V] or None;  tokens  # [M] int
    Returns fp32 (fp64 for fp64 inputs) ``logp  # [M]`` (differentiable in hidden, weight, bias)
    and ``entropy  # [M]`` or None; the entropy is differentiable too with ``entropy_grad`` (an
    entropy bonus), else a constant. See the module docstring."""
    if not isinstance(hidden, Tensor) or hidden.dim() != 2 or not hidden.is_floating_point():
        raise ValueError(f"hidden must be a float [M, H] tensor, got {getattr(hidden, 'shape', type(hidden))}")
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight has shape {tuple(getattr(weight, 'shape', ()))}, expected [V, "
                         f"{hidden.shape[1]}] (the LM head's [vocabulary, hidden size])")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected [{weight.shape[0]}]")
    if not isinstance(tokens, Tensor) or tuple(tokens.shape) != (hidden.shape[0],):
        raise ValueError(f"tokens has shape {tuple(getattr(tokens, 'shape', ()))}, expected [{hidden.shape[0]}]")
    if tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise TypeError(f"tokens has dtype {tokens.dtype}; pass integer token ids")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0 (use the sampling temperature)")
    rows = head_rows_per_chunk(weight.shape[0], hidden.device, max_chunk_elements)
    logp, entropy = _HeadLogprobs.apply(hidden, weight, bias, tokens.long(), float(temperature), with_entropy,
                                        compute_dtype, rows, bool(entropy_grad))
    return logp, entropy if with_entropy else None
