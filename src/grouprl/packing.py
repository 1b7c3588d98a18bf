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
Per-segment calls are the choice on CPU (measured in benchmarks/README.md, "Long completions"):
they compute sum(L_i^2) scores, where one SDPA call with a block-diagonal mask over the packed
row would compute S^2 and hold an [S, S] mask. Flash-attention's varlen kernel would serve CUDA
with one call per layer; it is not wired here (no GPU to test it on).

The model runs with an attention implementation registered under `grouprl+<its own>` (`enable`):
it behaves exactly as the wrapped one (same function, same masks) unless the forward call carries
`packed=PackedLayout`, which transformers passes down to every attention call. A packed call
hands the model a placeholder 4-D mask, which transformers' mask builder returns as is: no
[S, S] mask is ever built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PREFIX = "grouprl+"


@dataclass
class PackedLayout:
    """Where each sequence of a packed row lies. Tensors on the model's device."""

    input_ids: torch.Tensor     # [1, S] real tokens end to end
    position_ids: torch.Tensor  # [1, S] each sequence's own positions (a completion continues its prompt's)
    segments: list[tuple[int, int, int, int]]  # (start, length, prefix_start, prefix_length), in order, covering S
    pred_index: torch.Tensor    # [M] packed position whose output predicts each real completion token
    targets: torch.Tensor       # [M] the real completion tokens, in row-major order of completion_mask

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def pack(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, prompt_index: torch.Tensor,
         completion_ids: torch.Tensor, completion_mask: torch.Tensor, device: torch.device) -> PackedLayout:
    """The packed row of a micro-batch: `prompt_ids/prompt_mask  # [u, P']` left-padded,
    `prompt_index  # [n]` each completion's prompt, `completion_ids/completion_mask  # [n, T']`
    right-padded (real tokens first). A prompt continued by more than one completion is laid down
    once, before its completions; a prompt with one completion forms one sequence with it."""
    p_len = prompt_mask.sum(-1).tolist()  # [u]
    c_len = completion_mask.sum(-1).tolist()  # [n]
    index = prompt_index.tolist()
    users: dict[int, list[int]] = {}
    for i, j in enumerate(index):
        users.setdefault(j, []).append(i)
    P = prompt_ids.shape[1]
    ids, pos, pred, segments = [], [], [], []
    start = 0
    pred_of_row: list[torch.Tensor] = [None] * len(index)  # type: ignore[list-item]
    for j in sorted(users):
        prompt = prompt_ids[j, P - p_len[j]:]  # [Lp] its real tokens
        rows = users[j]
        shared = len(rows) > 1
        if shared:  # the prompt once, then its completions attend to it as a prefix
            ids.append(prompt)
            pos.append(torch.arange(p_len[j]))
            segments.append((start, p_len[j], 0, 0))
            prefix_start, start = start, start + p_len[j]
        for i in rows:
            L = c_len[i]
            if shared:
                ids.append(completion_ids[i, :L])
                pos.append(torch.arange(p_len[j], p_len[j] + L))
                if L:  # an empty completion has no positions to attend from
                    segments.append((start, L, prefix_start, p_len[j]))
                first = prefix_start + p_len[j] - 1  # the prompt's last token predicts the first completion token
                pred_of_row[i] = torch.cat([torch.tensor([first]), torch.arange(start, start + max(L - 1, 0))])
                start += L
            else:
                ids.append(torch.cat([prompt, completion_ids[i, :L]]))
                pos.append(torch.arange(p_len[j] + L))
                segments.append((start, p_len[j] + L, 0, 0))
                pred_of_row[i] = torch.arange(start + p_len[j] - 1, start + p_len[j] + L - 1)
                start += p_len[j] + L
    pred = [pred_of_row[i][: c_len[i]] for i in range(len(index))]  # row-major order of completion_mask
    return PackedLayout(input_ids=torch.cat(ids)[None].to(device), position_ids=torch.cat(pos)[None].to(device),
                        segments=segments, pred_index=torch.cat(pred).to(device),
                        targets=completion_ids[completion_mask].to(device))


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     segments: list[tuple[int, int, int, int]], scaling: float | None,
                     dropout: float = 0.0) -> torch.Tensor:
    """Attention of a packed row, sequence by sequence: `query  # [1, H, S, D]`,
    `key/value  # [1, Hkv, S, D]`; returns [1, S, H, D] (transformers' attention output layout).

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
        return packed_attention(query, key, value, packed.segments, scaling, dropout), None

    return attention


# attention implementations that a packed pass can wrap: transformers' own exact kernels
WRAPPABLE = ("sdpa", "eager")


def enable(model: torch.nn.Module) -> bool:
    """Let `model` (a transformers model using SDPA or eager attention) run packed passes; other
    uses are unchanged. Returns whether packing is available for it."""
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


def forward_packed(model: torch.nn.Module, layout: PackedLayout, logits_to_keep) -> torch.Tensor:
    """The model on a packed row; returns its logits at `logits_to_keep` (an int or an index tensor)."""
    placeholder = torch.zeros(1, 1, 0, 0, dtype=torch.bool, device=layout.input_ids.device)  # see module doc
    return model(input_ids=layout.input_ids, position_ids=layout.position_ids, attention_mask=placeholder,
                 use_cache=False, logits_to_keep=logits_to_keep, packed=layout).logits
