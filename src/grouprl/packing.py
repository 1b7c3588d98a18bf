"""Padding-free ("packed") log-prob passes: the sequences of a micro-batch run as one row.

A padded micro-batch of n completions computes n x (P' + T') positions, P' and T' its longest
prompt and completion; with lengths from 50 to 4,000 most of them are padding. Packed, the real
tokens are laid end to end in one row [1, S] and each keeps its own position ids (restarting per
sequence, so RoPE sees the same positions as in the padded pass), and attention is confined to
each sequence. S is the number of real tokens, so memory and FLOPs follow the tokens, not the
longest row.

When the G completions of a group share their prompt (`MicroBatch.prompt_index`), the prompt is
laid down once and each completion attends to it as a prefix and to its own tokens causally:
the shared-prompt optimisation without a KV cache, so it also works with gradient checkpointing.

    segment  = (start, length, prefix_start, prefix_length)   prefix_length 0: a plain causal sequence
    query i of a segment attends to the prefix and to its own positions <= i

Attention runs per segment through `torch.nn.functional.scaled_dot_product_attention`, causal
(a completion after a shared prompt runs as prompt + completion, of which only the completion's
outputs are kept: the causal kernel, no mask), on pieces of one `split` of the row (a slice per
segment would cost a row-sized gradient per segment in the backward). It is exact: the same
positions attend to the same keys as in the padded pass, and the sums differ only by rounding.
Per-segment calls are the choice on CPU for long rows (measured in benchmarks/README.md, "Long
completions"): they compute sum(L_i^2) scores, where one SDPA call with a block-diagonal mask over
the packed row would compute S^2 and hold an [S, S] mask. A short row of many segments is the
opposite case: each segment's call then costs its dispatch (forward and backward, ~0.1 ms on a
2-core CPU) more than its arithmetic, and the row runs as one SDPA call with its block mask
(`block_mask`, built once per layout) while S^2·H·D <= MASKED_CALL_WORK x segments
(`one_masked_call`; measured in benchmarks/README.md, "Short packed rows": with a call per segment
the embedded task's update, one row of 144 segments of ~3 tokens after 7-token prompts, took 1.5x the
padded update's time).

On CUDA in bf16/fp16 the whole row goes through one call per layer instead: torch's varlen flash
kernel (`torch.nn.attention.varlen.varlen_attn`, torch >= 2.9), causal within each sequence given
by cumulative lengths. A GPU step runs 32 completions' segments as 32 SDPA calls per layer (three
times over with checkpointing), launch-bound: the packed update measured 3-4x TRL's padded one on
an H200 (benchmarks/README.md, "On a GPU"). A sequence after a shared prompt becomes prompt +
completion, gathered by one index per tensor and layer (as the per-segment path concatenates them),
and only the completion's outputs are kept. The kernel is CUDA-only: on CPU the wiring is tested
against a reference kernel (tests/trainer/test_packing.py); a GPU that cannot run it (before
Ampere, a head size it refuses, a backward it lacks: probed once, forward and backward, before the
first real pass) falls back to the per-segment path with one warning.

The model runs with an attention implementation registered under `grouprl+<its own>` (`enable`):
it behaves exactly as the wrapped one (same function, same masks) unless the forward call carries
`packed=PackedLayout`, which transformers passes down to every attention call. A packed call
hands the model a placeholder 4-D mask, which transformers' mask builder returns as is: no
[S, S] mask is ever built.

A layer with a sliding window (Mistral, Gemma 2/3, Qwen2 with use_sliding_window: transformers
passes `sliding_window` to its attention call) runs its packed row per sequence whenever a sequence
is longer than the window, each such one with the window's mask (a query sees the keys less than
`window` positions back), since the block mask and the varlen call know no window. Only SDPA models
are wrapped: eager attention is each model's own function, in no registry, so such a model runs
padded passes.
"""

from __future__ import annotations

import functools
import inspect
import logging
import traceback
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
PREFIX = "grouprl+"

try:  # torch >= 2.9; flash attention's varlen kernel, CUDA only
    from torch.nn.attention.varlen import varlen_attn as _varlen_kernel
except ImportError:  # pragma: no cover - older torch
    _varlen_kernel = None
VARLEN = {"enabled": True}  # set False (benchmarks, a kernel that failed) to run every row per segment


@dataclass
class PackedLayout:
    """Where each sequence of a packed row lies. Tensors on the model's device."""

    input_ids: torch.Tensor     # [1, S] real tokens end to end
    position_ids: torch.Tensor  # [1, S] each sequence's own positions (a completion continues its prompt's)
    segments: list[tuple[int, int, int, int]]  # (start, length, prefix_start, prefix_length), in order, covering S
    pred_index: torch.Tensor    # [M] packed position whose output predicts each real completion token
    targets: torch.Tensor       # [M] the real completion tokens, in row-major order of completion_mask
    _varlen: VarlenPlan | None = field(default=None, repr=False, compare=False)
    _mask: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def varlen_plan(self) -> VarlenPlan:
        """The row as the varlen kernel takes it, built once per layout (every layer uses it)."""
        if self._varlen is None:
            self._varlen = varlen_plan(self.segments, self.input_ids.device)
        return self._varlen

    def block_mask(self) -> torch.Tensor:
        """[S, S] bool, built once per layout (every layer uses it): see `block_mask`."""
        if self._mask is None:
            self._mask = block_mask(self.segments, self.num_tokens, self.input_ids.device)
        return self._mask


@dataclass
class VarlenPlan:
    """Sequences for one varlen call: each segment's prefix (if any) then its own positions."""

    gather: torch.Tensor | None  # [T] packed positions in call order; None when no segment has a prefix (T = S)
    keep: torch.Tensor | None    # [S] call positions of each packed position's own output, in packed order
    cu_seqlens: torch.Tensor     # [n + 1] int32 cumulative sequence lengths of the call
    max_len: int


def varlen_plan(segments: list[tuple[int, int, int, int]], device: torch.device) -> VarlenPlan:
    lengths = [p_len + L for _, L, _, p_len in segments]
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    max_len = max(lengths, default=0)
    if all(p_len == 0 for *_, p_len in segments):
        return VarlenPlan(None, None, cu, max_len)
    gather, keep, at = [], [], 0
    for start, L, p_start, p_len in segments:
        gather += [torch.arange(p_start, p_start + p_len), torch.arange(start, start + L)]
        keep.append(torch.arange(at + p_len, at + p_len + L))
        at += p_len + L
    return VarlenPlan(torch.cat(gather).to(device), torch.cat(keep).to(device), cu, max_len)


@functools.lru_cache(maxsize=4)
def _kernel_arguments(kernel) -> frozenset[str]:
    """The keyword arguments the installed varlen kernel takes: torch 2.9-2.10 have `is_causal` and
    no `window_size`; `enable_gqa` and `scale` came later."""
    return frozenset(inspect.signature(kernel).parameters)


def uses_varlen(device: torch.device, dtype: torch.dtype, head_dim: int, dropout: float) -> bool:
    """Whether a packed call runs as one varlen flash call: CUDA, half precision (flash has no fp32),
    a head size flash takes, no dropout (the kernel has none)."""
    return (VARLEN["enabled"] and _varlen_kernel is not None and device.type == "cuda"
            and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256
            and dropout == 0.0)


_PROBED: dict[tuple, bool] = {}


def varlen_works(device: torch.device, dtype: torch.dtype, head_dim: int, gqa: bool) -> bool:
    """Whether the kernel runs forward *and backward* here: probed once per device, dtype, head size
    and head grouping on two toy sequences, so that a kernel failing only in the backward (inside
    the update's `backward()`, where no fallback could catch it) is found before any real pass."""
    key = (device.type, device.index, dtype, head_dim, gqa)
    if key not in _PROBED:
        # The first packed pass is often a no-grad one (the reference's): the probe needs autograd. Or it
        # is the update's, under gradient checkpointing: the probe then runs inside a layer's checkpointed
        # forward, whose saved-tensor hooks would count the probe's tensors with the layer's, and the
        # recomputation (probe done) would save fewer: torch's CheckpointError, seen on an H100. The
        # innermost pair of hooks is the one applied, so plain ones keep the probe's tensors its own.
        try:
            with (torch.inference_mode(False), torch.enable_grad(),
                  torch.autograd.graph.saved_tensors_hooks(_keep, _keep)):
                _probe(device, dtype, head_dim, gqa)
            _PROBED[key] = True
            log.info("packed attention: one varlen flash call per layer on %s in %s (head size %d%s)", device,
                     str(dtype).removeprefix("torch."), head_dim, ", grouped-query" if gqa else "")
        except torch.cuda.OutOfMemoryError:
            raise
        except (RuntimeError, NotImplementedError, TypeError) as e:
            _PROBED[key] = False
            _give_up_varlen(e)
    return _PROBED[key] and VARLEN["enabled"]


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _probe(device: torch.device, dtype: torch.dtype, head_dim: int, gqa: bool) -> None:
    """Two toy sequences through the kernel, forward and backward (fixed values: no random stream is
    drawn from, and no device generator is needed)."""
    def toy(heads: int) -> torch.Tensor:
        n = heads * 4 * head_dim
        return torch.linspace(-1, 1, n, device=device).view(1, heads, 4, head_dim).to(dtype).requires_grad_()

    q, k, v = toy(2), toy(1 if gqa else 2), toy(1 if gqa else 2)
    varlen_attention(q, k, v, varlen_plan([(0, 1, 0, 0), (1, 3, 0, 0)], device), None).float().sum().backward()


def _give_up_varlen(error: Exception) -> None:
    VARLEN["enabled"] = False
    log.warning("packed attention: the varlen flash kernel failed (%s); every packed row runs per sequence "
                "from now on", str(error).splitlines()[0][:200])


def compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype attention computes in: autocast's where it is on (SDPA follows it), else the query's.
    Under bf16 autocast over fp32 weights (the trainer's default), RoPE's fp32 cos/sin turn q and k back
    to fp32 while v stays bf16: the query's own dtype would say fp32, and the varlen kernel never ran."""
    kind = query.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else query.dtype


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: VarlenPlan,
                     scaling: float | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`query  # [1, H, S, D]`, `key/value  # [1, Hkv, S, D]` in one varlen call, in `dtype` (default the
    query's: the kernel is no autocast op, so mixed inputs are cast here); returns [1, S, H, D]."""
    dtype = dtype or query.dtype
    q, k, v = (x[0].transpose(0, 1).to(dtype) for x in (query, key, value))  # [S, H|Hkv, D]
    if plan.gather is not None:
        q, k, v = (x.index_select(0, plan.gather) for x in (q, k, v))  # [T, H|Hkv, D]
    takes = _kernel_arguments(_varlen_kernel)
    kwargs = {"window_size": (-1, 0)} if "window_size" in takes else {"is_causal": True}  # torch 2.11+ / 2.9-2.10
    if q.shape[1] != k.shape[1]:  # grouped-query attention
        if "enable_gqa" in takes:
            kwargs["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    if scaling is not None:
        if "scale" in takes:
            kwargs["scale"] = scaling
        else:  # the kernel's own scale is D^-1/2
            q = q * (scaling * q.shape[-1] ** 0.5)
    q, k, v = (x.contiguous() for x in (q, k, v))
    out = _varlen_kernel(q, k, v, plan.cu_seqlens, plan.cu_seqlens, plan.max_len, plan.max_len, **kwargs)  # [T, H, D]
    if plan.keep is not None:
        out = out.index_select(0, plan.keep)
    return out[None]  # [1, S, H, D]


# One SDPA call with the block mask instead of a call per segment while S^2·H·D <= this x segments,
# S the row's tokens, H the query heads, D the head size: the masked call's work grows as S^2·H·D,
# the per-segment calls' as their count. Measured on a 2-core CPU, forward and backward (benchmarks/
# README.md, "Short packed rows"): they break even near 2^21 per segment (H·D 128 and 576, 9-36
# segments); half that keeps the masked call where it clearly wins (5x at the embedded task's
# row). Long rows keep the per-segment calls, whose scores grow only as sum(L_i^2). On CUDA, for
# rows the varlen kernel does not take (fp32, or a GPU it fails on), the same rule applies unmeasured:
# a call there costs a launch more than its arithmetic, so if anything it picks the masked call too rarely.
MASKED_CALL_WORK = 1 << 20


def one_masked_call(num_tokens: int, num_segments: int, heads: int, head_dim: int) -> bool:
    """Whether a packed row runs as one SDPA call over the row with its block mask."""
    return num_segments > 1 and num_tokens * num_tokens * heads * head_dim <= MASKED_CALL_WORK * num_segments


def block_mask(segments: list[tuple[int, int, int, int]], num_tokens: int, device: torch.device) -> torch.Tensor:
    """[S, S] bool: query i may attend key j when j is in i's segment at or before i, or in that
    segment's prefix (a shared prompt laid down before it); the same keys as the per-segment calls."""
    lengths = torch.tensor([L for _, L, _, _ in segments])
    own_start, p_start, p_len = (torch.tensor([seg[i] for seg in segments]).repeat_interleave(lengths)[:, None]
                                 for i in (0, 2, 3))  # [S, 1] each, per query position
    q, k = torch.arange(num_tokens)[:, None], torch.arange(num_tokens)[None, :]
    mask = ((k >= own_start) & (k <= q)) | ((k >= p_start) & (k < p_start + p_len))
    return mask.to(device)


def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     scaling: float | None, dropout: float = 0.0) -> torch.Tensor:
    """Attention of a packed row in one call: `query  # [1, H, S, D]`, `key/value  # [1, Hkv, S, D]`,
    `mask  # [S, S]` (`block_mask`); returns [1, S, H, D]."""
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous()


def pack(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, prompt_index: torch.Tensor,
         completion_ids: torch.Tensor, completion_mask: torch.Tensor, device: torch.device) -> PackedLayout:
    """The packed row of a micro-batch: `prompt_ids/prompt_mask  # [u, P']` left-padded,
    `prompt_index  # [n]` each completion's prompt, `completion_ids/completion_mask  # [n, T']`
    right-padded (real tokens first). A prompt continued by more than one completion is laid down
    once, before its completions; a prompt with one completion forms one sequence with it.

    The layout is worked out on Python ints (where each packed token comes from in the prompts and
    completions laid end to end, its position, which position predicts each completion token), and
    the tensors are made at the end by one gather each: a tensor op per sequence would cost a dispatch
    per op (~300 in an update of 32 completions: benchmarks/update_launches.py)."""
    p_len = prompt_mask.sum(-1).tolist()  # [u]
    c_len = completion_mask.sum(-1).tolist()  # [n]
    index = prompt_index.tolist()
    users: dict[int, list[int]] = {}
    for i, j in enumerate(index):
        users.setdefault(j, []).append(i)
    P, T = prompt_ids.shape[1], completion_ids.shape[1]
    completions_at = prompt_ids.numel()  # where the completions start in the joined source
    source, pos, segments = [], [], []  # per packed token: its index in the source, its position id
    pred_of_row: list[list[int]] = [[] for _ in index]
    start = 0
    for j in sorted(users):
        Lp = p_len[j]
        prompt = range(j * P + P - Lp, j * P + P)  # its real tokens in the source
        rows = users[j]
        shared = len(rows) > 1
        if shared:  # the prompt once, then its completions attend to it as a prefix
            source += prompt
            pos += range(Lp)
            segments.append((start, Lp, 0, 0))
            prefix_start, start = start, start + Lp
        for i in rows:
            L = c_len[i]
            completion = range(completions_at + i * T, completions_at + i * T + L)
            if shared:
                source += completion
                pos += range(Lp, Lp + L)
                if L:  # an empty completion has no positions to attend from
                    segments.append((start, L, prefix_start, Lp))
                # the prompt's last token predicts the first completion token, then each token the next
                pred_of_row[i] = [prefix_start + Lp - 1, *range(start, start + L - 1)][:L]
                start += L
            else:
                source += prompt
                source += completion
                pos += range(Lp + L)
                segments.append((start, Lp + L, 0, 0))
                pred_of_row[i] = list(range(start + Lp - 1, start + Lp + L - 1))
                start += Lp + L
    joined = torch.cat([prompt_ids.reshape(-1), completion_ids.reshape(-1)])
    ids = joined[torch.tensor(source, dtype=torch.long)]
    pred = [p for row in pred_of_row for p in row]  # row-major order of completion_mask
    return PackedLayout(input_ids=ids[None].to(device),
                        position_ids=torch.tensor(pos, dtype=torch.long)[None].to(device),
                        segments=segments, pred_index=torch.tensor(pred, dtype=torch.long).to(device),
                        targets=completion_ids[completion_mask].to(device))


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     segments: list[tuple[int, int, int, int]], scaling: float | None,
                     dropout: float = 0.0, window: int | None = None) -> torch.Tensor:
    """Attention of a packed row, sequence by sequence: `query  # [1, H, S, D]`,
    `key/value  # [1, Hkv, S, D]`; returns [1, S, H, D] (transformers' attention output layout).
    `window`: a sliding window (Mistral, Gemma 2/3, Qwen2 with use_sliding_window): a query sees the
    keys less than `window` positions back, as transformers' own masks let it; a sequence longer
    than the window runs with that mask instead of the plain causal kernel.

    The row is cut into its segments by one `split` per tensor, not by a slice per segment: a
    slice's backward writes its gradient into a zero tensor of the whole row, so n segments cost
    n row-sized zero-fills and additions per tensor and layer, where the split's backward joins the
    pieces once (measured: the attention's forward and backward in 0.2-0.7x the time, 18-36
    segments, benchmarks/README.md "Per-step overhead"). The same kernels run on the same
    values, so outputs and gradients are unchanged."""
    gqa = query.shape[1] != key.shape[1]
    lengths = [L for _, L, _, _ in segments]
    pieces = [x.split(lengths, 2) for x in (query, key, value)]  # [1, H|Hkv, L_i, D] each
    where = {(start, L): i for i, (start, L, _, _) in enumerate(segments)}  # a shared prompt is its own segment
    out = []
    for i, (start, L, p_start, p_len) in enumerate(segments):
        own = [x[i] for x in pieces]
        if window is not None and p_len + L > window:  # the window cuts: causal within it, by an explicit mask
            prefix = [x[:, :, p_start:p_start + p_len] for x in (query, key, value)]
            q, k, v = (torch.cat([a, b], 2) for a, b in zip(prefix, own))  # [1, H|Hkv, p+L, D]
            pos = torch.arange(p_len + L, device=query.device)
            seen = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)  # [p+L, p+L]
            out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=seen, dropout_p=dropout, scale=scaling,
                                                      enable_gqa=gqa)[:, :, p_len:])
            continue
        if p_len == 0:
            out.append(F.scaled_dot_product_attention(*own, is_causal=L > 1, dropout_p=dropout, scale=scaling,
                                                      enable_gqa=gqa))
            continue
        # prefix and own tokens as one causal sequence; only the own queries' outputs are kept (the
        # prefix's outputs come from its own segment): the causal kernel, no [L, p+L] mask (measured:
        # 2.4x faster and half the memory of a masked call at L = 4096 on CPU)
        j = where.get((p_start, p_len))
        prefix = ([x[j] for x in pieces] if j is not None
                  else [x[:, :, p_start:p_start + p_len] for x in (query, key, value)])
        q, k, v = (torch.cat([a, b], 2) for a, b in zip(prefix, own))  # [1, H|Hkv, p+L, D]
        out.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=scaling,
                                                  enable_gqa=gqa)[:, :, p_len:])
    return torch.cat(out, 2).transpose(1, 2).contiguous()  # [1, S, H, D]


def _wrapped_attention(inner_name: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner = ALL_ATTENTION_FUNCTIONS[inner_name]

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, packed=None, **kwargs):
        if packed is None:
            return inner(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        window = kwargs.get("sliding_window")  # this layer's (None: full attention)
        if window is not None and max(L + p_len for _, L, _, p_len in packed.segments) > window:
            # the masked call's block mask and the varlen kernel as called here know no window: per
            # sequence, each longer than the window with its mask
            return packed_attention(query, key, value, packed.segments, scaling, dropout, window=window), None
        dtype = compute_dtype(query)
        if (uses_varlen(query.device, dtype, query.shape[-1], dropout)
                and varlen_works(query.device, dtype, query.shape[-1], key.shape[1] != query.shape[1])):
            try:
                return varlen_attention(query, key, value, packed.varlen_plan(), scaling, dtype), None
            except torch.cuda.OutOfMemoryError:
                raise
            except (RuntimeError, NotImplementedError, TypeError) as e:  # a GPU, build or torch the kernel fails on
                _give_up_varlen(e)
                raise _VarlenGaveUp from e  # the whole pass again, per sequence (forward_packed)
        if one_masked_call(packed.num_tokens, len(packed.segments), query.shape[1], query.shape[-1]):
            return masked_attention(query, key, value, packed.block_mask(), scaling, dropout), None
        return packed_attention(query, key, value, packed.segments, scaling, dropout), None

    return attention


# attention implementations that a packed pass can wrap: those in transformers' registry whose kernel
# is exact (eager attention is each model's own function, in no registry: such a model runs padded)
WRAPPABLE = ("sdpa",)


def enable(model: torch.nn.Module) -> bool:
    """Let `model` (a transformers model using SDPA attention) run packed passes; other uses are
    unchanged. Returns whether packing is available for it (not with eager or flash attention)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    current = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if current is not None and current.startswith(PREFIX):
        return True
    if current not in WRAPPABLE or not hasattr(model, "set_attn_implementation"):
        return False
    name = PREFIX + current
    if name not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(name, _wrapped_attention(current))
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
    model.set_attn_implementation(name)
    return True


def supports_packing(model: torch.nn.Module) -> bool:
    """Whether `model` (under DDP, FSDP2 or PEFT wrappers) was `enable`d."""
    inner = getattr(model, "module", model)
    config = getattr(inner, "config", None)
    return str(getattr(config, "_attn_implementation", "")).startswith(PREFIX)


class _VarlenGaveUp(Exception):
    """The varlen kernel failed inside a pass (it had passed the probe). The pass starts again with
    every layer per sequence: under gradient checkpointing a layer's recomputation must take the path
    its forward took, and the layers before the failure had taken the kernel (torch's CheckpointError
    otherwise, as with the probe: see varlen_works)."""


def forward_packed(model: torch.nn.Module, layout: PackedLayout, logits_to_keep) -> torch.Tensor:
    """The model on a packed row; returns its logits at `logits_to_keep` (an int or an index tensor)."""
    placeholder = torch.zeros(1, 1, 0, 0, dtype=torch.bool, device=layout.input_ids.device)  # see module doc

    def forward() -> torch.Tensor:
        return model(input_ids=layout.input_ids, position_ids=layout.position_ids, attention_mask=placeholder,
                     use_cache=False, logits_to_keep=logits_to_keep, packed=layout).logits

    try:
        return forward()
    except _VarlenGaveUp as gave_up:  # once per process: the kernel is off from now on
        _release_frames(gave_up)
    return forward()


def _release_frames(error: BaseException) -> None:
    """Clear the frames that `error` (and the errors it chains) unwound, so that what they held goes
    now, not when the error is collected. Torch 2.11's checkpoint (2.13 throws the error into it)
    leaves the failed layer's generator suspended inside that layer's saved-tensor hooks until it
    is collected: the retried pass's tensors were saved into the failed layer's frame, and the
    backward, recomputing that layer on the per-sequence path, raised torch's CheckpointError (an
    H100's suite). Retrying after the except block frees the error, unless something keeps it (a
    log handler holding exc_info, an error reporter): its frames then hold the failed call stack."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)  # the frame running this except block is skipped
        error = error.__cause__ or error.__context__
