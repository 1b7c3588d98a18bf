"""Drawing the next token: temperature, top-k, top-p, greedy, and the random numbers behind a draw.

A draw takes one uniform number per row. In `generate`, those numbers come from a counter-based
generator: one seed per call, drawn from the caller's `torch.Generator`, and each row's number at
step t is a hash of (seed, row, t) (`uniform_table`). A row therefore draws the same tokens whatever
else is in its batch, in whatever order rows finish and leave it, and whether the decode step runs
eagerly or compiled (rollout/compiled_decode.py), where a `torch.Generator` cannot be read inside
the graph and rows that have finished stay in the batch for a few steps. The hash is two rounds of
a 32-bit integer mixer ("lowbias32", constants from Wellons' hash-prospector search) over the seed,
row and step, computed with int64 tensor ops whose products stay below 2^63 (each 32-bit product is
split in two 16-bit halves), so CPU and CUDA, eager and compiled give the same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grouprl.rollout.types import SamplingParams

_MASK32 = 0xFFFFFFFF
_C1, _C2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) int64, without an int64 overflow."""
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (hi + x * (c & 0xFFFF)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def counter_uniforms(seed: int, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Uniform float64 numbers in [0, 1), one per (row, step) pair of the broadcast int64 tensors
    `rows` and `steps` (each in [0, 2^31)), a pure function of (seed, row, step): 53 random bits
    from two 32-bit hashes."""
    s_lo, s_hi = seed & _MASK32, (seed >> 32) & _MASK32
    base = _mix32(_mix32(rows ^ s_lo) ^ steps)
    a = _mix32(base ^ s_hi) >> 5  # 27 bits
    b = _mix32(_mix32(base ^ 0x9E3779B9) ^ s_hi) >> 6  # 26 bits
    return (a * 67108864 + b).double() / 9007199254740992.0  # (a * 2^26 + b) / 2^53


def draw_seed(generator: torch.Generator | None) -> int:
    """One seed for a call's counter-based numbers, from `generator` (the global one when None)."""
    where = generator.device if generator is not None else torch.device("cpu")
    return int(torch.randint(0, 2 ** 62, (1,), generator=generator, device=where))


def uniform_table(seed: int, n_rows: int, n_steps: int, device: torch.device) -> torch.Tensor:
    """[n_rows, n_steps] float64: row r's number at step t."""
    rows = torch.arange(n_rows, device=device)[:, None]
    steps = torch.arange(n_steps, device=device)[None, :]
    return counter_uniforms(seed, rows, steps)


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
                u: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row from logits [n, V] with temperature, top-k and top-p; greedy if asked.
    `u` [n] (float64 in [0, 1)) are the rows' uniform numbers; without it they are drawn from
    `generator`."""
    if params.greedy:
        return logits.argmax(-1)
    if u is None:
        where = generator.device if generator is not None else logits.device  # a CPU generator serves a GPU too
        u = torch.rand(len(logits), dtype=torch.float64, generator=generator, device=where).to(logits.device)
    return inverse_cdf(filtered_probs(logits, params), u)  # [n]


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a draw samples from [n, V]: softmax(logits / temperature), with the tokens
    outside top-k and outside the top-p nucleus at probability 0 (not renormalised: the draw scales
    by the total)."""
    logits = logits.float() / params.temperature  # [n, V]
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [n, V]
        p_sorted = sorted_logits.softmax(-1)
        drop_sorted = p_sorted.cumsum(-1) - p_sorted >= params.top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


# The longest running sum taken in one piece on CUDA. Inductor (torch.compile on CUDA) turns a scan
# longer than 8,192 over few rows into a "split scan", and torch 2.11 could not generate one in
# float64: an H100 run of the compiled decode step stopped with "Error in codegen for ... SplitScan
# ... torch.float64, size=[s0, 49152]" and decoded eagerly. Two scans of at most this length each
# stay single kernels (benchmarks/README.md, "Decode step").
SCAN_BLOCK = {"cuda": 4096}

# Where a draw counts the running sum's entries at or below its target instead of searching them:
# the same index, as a running sum of probabilities does not decrease (up to rounding). On CUDA,
# torch 2.11's Inductor could not compile searchsorted over the blocked sum, a view of two scans:
# an H100 run of the compiled decode step stopped with "InductorError: NotImplementedError: View"
# (eleventh session) and decoded eagerly. There the count is one more pass over a row just
# written, microseconds; on CPU it took 0.86 ms at 16 x 49,152 against 2 us for the search.
COUNTED_DRAWS = {"cuda"}


def running_sum(x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """cumsum over the last dimension of x [n, V]; on CUDA (or with `block`) as two scans of at
    most `block` entries: a running sum within each block, then the blocks' totals carried in. The
    same sums up to float rounding (the order of additions differs)."""
    block = block or SCAN_BLOCK.get(x.device.type)
    n, V = x.shape
    if block is None or V <= block:
        return x.cumsum(-1)
    pad = -V % block
    within = F.pad(x, (0, pad)).view(n, (V + pad) // block, block).cumsum(-1)  # [n, blocks, block]
    totals = within[:, :, -1]  # [n, blocks]
    before = totals.cumsum(-1) - totals  # [n, blocks]: the sum of the blocks before each one
    out = (within + before[:, :, None]).view(n, V + pad)
    return out[:, :V].contiguous() if pad else out  # contiguous: searchsorted copies (and warns) otherwise


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row of probs [n, V]: the first token whose cumulative probability exceeds
    u * total, u [n] uniform in [0, 1). Exactly the categorical distribution (a token of probability
    0 is never drawn), with one random number per row: `torch.multinomial` draws V exponentials per
    row, which on SmolLM2's 49k vocabulary was a quarter of the decode time on CPU. The running sum
    is fp64, so even a token of probability 1e-12 keeps its share."""
    cdf = running_sum(probs.double())  # [n, V]
    target = u.to(cdf.device)[:, None] * cdf[:, -1:]  # [n, 1]
    if cdf.device.type in COUNTED_DRAWS:
        index = (cdf <= target).sum(-1)  # [n]: the entries at or below the target, so the first above it
    else:
        index = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [n]
    return index.clamp_(max=probs.shape[-1] - 1)
