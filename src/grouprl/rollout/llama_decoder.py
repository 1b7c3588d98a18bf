"""A lean decoder for Llama-family causal LMs (Llama, Mistral, Qwen2, Qwen3, SmolLM3) with a
preallocated KV cache.

Taken by `FastDecoder.supports`: SiLU MLPs without bias, no sliding window (Mistral: `sliding_window`
null, as in v0.3 and Nemo), plain Parameters, RoPE
of a fixed table (default, linear, llama3, yarn: not dynamic-NTK or LongRoPE, whose frequencies
follow the sequence's length), and PEFT adapters that merge as W + s·BA (lora.mergeable). Anything
else decodes through the generic path, the model's own forward.

The same math as the `transformers` forward pass of these models, per layer l:

    h   = x + W_o · attn(RoPE(nq(W_q·n1(x))), RoPE(nk(W_k·n1(x))), W_v·n1(x))     n1, n2: RMSNorm
    x'  = h + W_down · (silu(W_gate·n2(h)) ⊙ W_up·n2(h))
    logits = W_lm · norm(x_L)

where nq and nk are Qwen3's RMSNorms over each head of the queries and keys (the identity for the
others), and SmolLM3's NoPE layers (every 4th) leave out RoPE. W_q/W_k/W_v carry biases in Qwen2.

computed without the per-step costs of the generic path: the KV cache is one tensor per layer
(no `torch.cat` per step), the RoPE table is built once per call, W_q/W_k/W_v and W_gate/W_up are
fused into one matmul each (small models, and any model whose weights are copied anyway: cast to
bf16 or packed), RoPE turns queries and keys in one go, larger models on CPU use weights packed once
per call for oneDNN's small-batch matmul, no attention mask object is rebuilt per step, and rows
that have finished are compacted out of the cache so they cost nothing afterwards. On a GPU a
small model's step waits on its kernels one by one, so their count is what these choices cut:
benchmarks/decode_launches.py counts them.

The cache's memory follows the live rows and the tokens fed, not rows x max_new_tokens: it starts
with the prompt plus CACHE_BLOCK columns and doubles its new-token columns when a step fills it (at
most prompt + max_new_tokens; the copies add up to less than one final cache), and when finished
rows leave it holding at most half the rows it has room for, it moves into tensors of the live rows.
Both moves go one layer at a time, so the old and new caches never coexist whole. For SmolLM2-135M
(46 KB per row and token in fp32), 16 rows x 4,096 new tokens used to allocate 3 GB up front: on CPU
only address space in a first call (pages never written are not resident), but all of it on a GPU
and in a continuation, whose cache is zeroed: 16 second turns that stopped within 31 tokens peaked
at +3.1 GB RSS before, +0.25 GB now (benchmarks/generation_memory.py --stop-early --second-turn).

What is compiled (`generation_compile`, rollout/compiled_decode.py): the decode step, `step`'s math
for one token per row, including the draw of the next token and the checks for EOS and for the row's
own most new tokens (a multi-turn room), as one graph over the cache passed whole
(`start(..., zeroed=True)`: columns not yet written are read, masked, so they must hold numbers),
and on CUDA replayed as one captured CUDA graph per shape of a call
(`generation_cuda_graphs`). What is not: `start` and `start_from` (the prefill: a few large ops per
call, which a launch costs little against), `keep` and the cache's growth (moves between shapes,
rare), `snapshot` (the multi-turn driver's kept rows: each finished row's cache up to its own EOS,
copied on the host's side of the loop before its slot is given up), and the generic `transformers`
path.

`FastDecoder.supports(model)` says whether a model fits (Llama-family weights, SiLU MLP, no sliding
window); the engine falls back to the generic `transformers` path otherwise. A PEFT model with LoRA
adapters (no adapter dropout) decodes from merged weights W + s·BA, built per call as the cast or
packed copies are: the same logits as the adapter's forward, and on SmolLM2-135M with r = 16 the
generic path took 3.5x as long.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from grouprl.lora import base_model, is_peft_model, merged_weight, mergeable

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")
FUSE_MAX_PARAMS = 20_000_000  # fuse projection weights only for models up to this size (see __init__)
PACK_MIN_PARAMS = 5_000_000  # on CPU (fp32, or native bf16), models from this size decode with oneDNN-packed weights
CACHE_BLOCK = 64  # new-token columns of the first KV-cache allocation; each growth doubles them


# torch's oneDNN ops below are private (`torch.ops.mkldnn._*`, what inductor's CPU path calls; no
# public op packs a linear weight), each behind one small function and checked on torch 2.13.0;
# `_can_pack` tries the packing ops on a small matmul first, so a torch without them decodes unpacked.
def _pack(w: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] reordered into oneDNN's blocked layout for a batch of ~16 rows."""
    return torch.ops.mkldnn._reorder_linear_weight(w, 16)


def _packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


# The compiled step (compiled_decode.py) cannot take a oneDNN-packed weight as a graph input (an
# opaque mkldnn tensor, which Inductor does not lower), and without packing SmolLM2's fp32 decode
# matmuls took 3x as long. So in the graph a packed weight is a `PackedSlot` (its index in a table
# the running decoder fills for its thread, and its output size), and the matmul is this custom op,
# which the graph calls as an opaque kernel: the indices are the same in every call, so a new
# policy's weights are a new table, not a new graph.
_PACKED = threading.local()


# Defined with torch.library.Library and a CPU kernel rather than `torch.library.custom_op`, whose
# wrapper cost ~20 us a call on top of the matmul's ~15 (measured at 16 x 64 bf16): at 121 calls a
# step that was ~2 ms of SmolLM2's compiled decode step. Decoding runs without autograd, and packed
# weights exist only on CPU, so the CPU kernel is the only one.
_LIBRARY = torch.library.Library("grouprl", "FRAGMENT")
_LIBRARY.define("packed_linear(Tensor x, Tensor? bias, int slot, int out_features) -> Tensor")


def _packed_linear_kernel(x: torch.Tensor, bias: torch.Tensor | None, slot: int, out_features: int) -> torch.Tensor:
    """x @ W[slot].T + bias with the packed weight W[slot] of this thread's running decoder."""
    return _packed_linear(x, _PACKED.weights[slot], bias)


_LIBRARY.impl("packed_linear", _packed_linear_kernel, "CPU")


@torch.library.register_fake("grouprl::packed_linear")
def _packed_linear_shape(x, bias, slot, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


packed_linear_op = torch.ops.grouprl.packed_linear.default


@dataclass(frozen=True)
class PackedSlot:
    """A packed weight as the compiled step sees it: its row in the thread's table, its output size."""

    slot: int
    out_features: int


def _slot_linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(w, PackedSlot):
        return packed_linear_op(x, b, w.slot, w.out_features)
    return F.linear(x, w, b)


def _native_bf16() -> bool:
    """Whether oneDNN multiplies bf16 natively on this CPU (AVX512-BF16 or AMX)."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _can_pack(model: torch.nn.Module, dtype: torch.dtype, n_params: int) -> bool:
    """oneDNN-packed weights: measured 1.4x (50 M) to 1.9x (10 M) faster than MKL's sgemm for the
    16-row decode matmuls on this project's CPU (weights read from memory once per step, in the
    blocked order the kernel wants); slower for tiny models, whose matrices sit in cache. In bf16
    (on a CPU with native bf16) SmolLM2-135M's decode matmuls took 11 ms a step packed against
    15 ms plain (and 19 ms packed fp32, 57 ms plain fp32)."""
    w = model.lm_head.weight
    if w.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or w.dtype != torch.float32:
        return False
    if not torch.backends.mkldnn.is_available() or n_params < PACK_MIN_PARAMS:
        return False
    if dtype == torch.bfloat16 and not _native_bf16():
        return False
    try:
        x = torch.randn(3, w.shape[1]).to(dtype)
        want = F.linear(x, w.to(dtype)).float()
        rtol, atol = (1e-4, 1e-5) if dtype == torch.float32 else (2e-2, 5e-2)
        return torch.allclose(_packed_linear(x, _pack(w.to(dtype))).float(), want, rtol=rtol, atol=atol)
    except (RuntimeError, AttributeError):  # a torch build without these oneDNN ops
        return False


def rope_type(cfg) -> str:
    """The RoPE scaling's type ("default" without one), by either of transformers' names for it."""
    scaling = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"


class DecoderLayer(NamedTuple):
    """One layer's weights as the decode step reads them (copies or views of the model's, see __init__)."""
    w_in: torch.Tensor  # input RMSNorm's weight
    eps_in: float
    qkv: list  # [(W, bias)]: W_q, W_k, W_v, or one fused [W_q; W_k; W_v]
    w_o: torch.Tensor
    b_o: torch.Tensor | None
    w_post: torch.Tensor  # post-attention RMSNorm's weight
    eps_post: float
    gate_up: list  # [W_gate, W_up], or one fused [W_gate; W_up]
    w_down: torch.Tensor
    qk_norm: tuple[torch.Tensor, float] | None  # Qwen3: ([H+Hkv, D] per-head weights, eps)
    rope: bool  # False: this layer's queries and keys carry no positions (SmolLM3's NoPE layers)


class FastDecoder:
    """Prefill and single-token decode steps for one `generate` call, over a KV cache that grows
    with the tokens fed and shrinks with the live rows."""

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        if is_peft_model(model):
            if not mergeable(model):
                return False
            model = base_model(model)
        cfg = getattr(model, "config", None)
        if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            return False
        if not hasattr(model, "model") or not hasattr(model, "lm_head"):
            return False
        if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
            return False
        if "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
            return False
        if getattr(cfg, "use_sliding_window", False):
            return False
        if cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None) is not None:
            return False  # Mistral attends through its window in every layer when one is set (v0.1: 4,096)
        if rope_type(cfg) in ("dynamic", "longrope"):
            return False  # frequencies that follow the sequence's length: the table here is built once, for P + T
        if any(type(p) is not torch.nn.Parameter for p in model.parameters()):
            return False  # e.g. FSDP2-sharded (DTensor) parameters: the generic path handles those
        base = model.model
        return all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb"))

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None = None, fuse: bool | None = None,
                 pack: bool | None = None, cache_block: int | None = None):
        model = base_model(model)  # PEFT: LoRA layers are read as merged weights
        self.cache_block = cache_block or CACHE_BLOCK  # read here, not at import, so a test can set it
        cfg, base = model.config, model.model
        self.wdtype = model.lm_head.weight.dtype  # the residual stream, norms and RoPE stay in this dtype
        self.dtype = dtype or self.wdtype  # matmuls run in this one
        # attention and the KV cache: the same, but fp32 for bf16 on CPU, where SDPA's bf16 kernel took
        # 3.7x the time of its fp32 one on SmolLM2-135M's decode steps (and is the more exact)
        cpu_bf16 = self.dtype == torch.bfloat16 and model.lm_head.weight.device.type == "cpu"
        self.adtype = torch.float32 if cpu_bf16 else self.dtype
        self.H = cfg.num_attention_heads
        self.Hkv = getattr(cfg, "num_key_value_heads", None) or self.H
        self.D = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.H
        self.rotary = base.rotary_emb
        self.embed = base.embed_tokens.weight.detach()  # detached: plain tensors whether or not training needs grad
        self.norm = (base.norm.weight.detach(), base.norm.variance_epsilon)
        self.lm_head = merged_weight(model.lm_head).detach()
        self.layers = []
        casts = self.dtype != self.embed.dtype  # the weights are copied into the matmuls' dtype
        cast = (lambda t: t.detach().to(self.dtype)) if casts else (lambda t: t.detach())

        def cast_bias(layer: torch.nn.Module) -> torch.Tensor | None:
            bias = getattr(layer, "base_layer", layer).bias
            return None if bias is None else cast(bias)

        n_params = sum(p.numel() for p in model.parameters())
        pack = pack if pack is not None else _can_pack(model, self.dtype, n_params)
        self.linear = _packed_linear if pack else F.linear
        # fusing W_q/W_k/W_v and W_gate/W_up saves three matmul calls per layer and step (and RoPE then
        # runs on queries and keys in one go), which is what a small model's decode step costs; for a
        # large model the fused copies would only add memory, unless its weights are copied anyway:
        # packed, or cast to the matmuls' dtype (bf16 over fp32 master weights, the default on a GPU)
        fuse = fuse if fuse is not None else (pack or n_params <= FUSE_MAX_PARAMS or casts)
        mat = (lambda t: _pack(cast(t))) if pack else cast  # weight matrices (biases stay plain)
        for layer in base.layers:
            a, m = layer.self_attn, layer.mlp
            qk_norm = None
            if getattr(a, "q_norm", None) is not None:  # Qwen3: RMSNorm over each head of q and k, before RoPE
                qk_norm = (torch.cat([a.q_norm.weight.detach()[None].expand(self.H, -1),
                                      a.k_norm.weight.detach()[None].expand(self.Hkv, -1)]),  # [H+Hkv, D]
                           a.q_norm.variance_epsilon)
            qkv = [(cast(merged_weight(p)), cast_bias(p)) for p in (a.q_proj, a.k_proj, a.v_proj)]
            gu = [cast(merged_weight(m.gate_proj)), cast(merged_weight(m.up_proj))]
            if fuse:
                bias = None
                if any(b is not None for _, b in qkv):
                    bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in qkv])
                qkv = [(torch.cat([w for w, _ in qkv]), bias)]
                gu = [torch.cat(gu)]
            self.layers.append(DecoderLayer(
                layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon,
                [(mat(w), b) for w, b in qkv],
                mat(merged_weight(a.o_proj)), cast_bias(a.o_proj),
                layer.post_attention_layernorm.weight.detach(), layer.post_attention_layernorm.variance_epsilon,
                [mat(w) for w in gu], mat(merged_weight(m.down_proj)), qk_norm,
                bool(getattr(a, "use_rope", True)),  # SmolLM3: every 4th layer attends without positions (NoPE)
            ))
        self.lm_head = mat(self.lm_head)
        self.scale = getattr(layer.self_attn, "scaling", self.D ** -0.5)

    def use_slots(self) -> None:
        """For the compiled step: packed weights become PackedSlots over a table of this decoder
        (installed for the calling thread by `activate_slots`); unpacked ones stay tensors."""
        if self.linear is not _packed_linear:
            return
        table: list[torch.Tensor] = []

        def slot(w: torch.Tensor) -> PackedSlot:
            table.append(w)
            return PackedSlot(len(table) - 1, w.shape[0])

        self.layers = [layer._replace(qkv=[(slot(w), b) for w, b in layer.qkv], w_o=slot(layer.w_o),
                                      gate_up=[slot(w) for w in layer.gate_up], w_down=slot(layer.w_down))
                       for layer in self.layers]
        self.lm_head = slot(self.lm_head)
        self.linear, self._table = _slot_linear, table

    def activate_slots(self) -> None:
        """Install this decoder's packed weights as the calling thread's table (see use_slots)."""
        _PACKED.weights = getattr(self, "_table", None)

    # ------------------------------------------------------------------ pieces
    @staticmethod
    def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension, scaled by `w` [D], or by `w` [heads, D] for x [.., heads, D]."""
        if x.dtype == w.dtype == torch.float32:  # the same math in one call (one fused kernel where torch has it)
            if w.dim() > 1:
                return F.rms_norm(x, (x.shape[-1],), None, eps) * w
            return F.rms_norm(x, (x.shape[-1],), w, eps)
        xf = x.float()  # a half-precision stream: normalised in fp32, rounded, then scaled, as transformers does
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return w * xf.to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE with `sin` sign-folded (`_positions`): x·cos + rotate_half(x)·sin, where
        rotate_half(x) = [-x2, x1] = roll(x, D/2)·[-1, +1]: the same products, one op instead of three."""
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, write, attend) -> torch.Tensor:
        """x [n, S, d]; cos/sin [n, 1, S, D]. `write(l, k, v)` stores the new keys/values,
        `attend(l, q)` returns the attention output [n, H, S, D]."""
        n, S, _ = x.shape
        H, Hkv, D = self.H, self.Hkv, self.D
        for l, (w_in, eps1, qkv_w, w_o, b_o, w_post, eps2, gu_w, w_down, qk_norm, rope) in enumerate(self.layers):
            dt = self.dtype  # like autocast: matmul inputs in dt, the residual stream in wdtype
            h = self._rms(x, w_in, eps1).to(dt)
            if len(qkv_w) == 1:  # queries and keys side by side: RoPE on both at once
                qk, v = self.linear(h, *qkv_w[0]).split([(H + Hkv) * D, Hkv * D], dim=-1)
            else:
                q, k, v = (self.linear(h, w, b) for w, b in qkv_w)  # [n, S, H*D], [n, S, Hkv*D] x 2
                qk = torch.cat([q, k], -1)
            qk = qk.view(n, S, H + Hkv, D)
            if qk_norm is not None:  # Qwen3: each head's q and k normalised, with q_norm's and k_norm's weights
                qk = self._rms(qk, *qk_norm)
            qk = qk.transpose(1, 2)  # [n, H+Hkv, S, D]
            qk = (self._rope(qk, cos, sin) if rope else qk).to(self.adtype)
            q, k = qk.split([H, Hkv], dim=1)  # [n, H, S, D], [n, Hkv, S, D]
            write(l, k, v.view(n, S, Hkv, D).transpose(1, 2).to(self.adtype))
            o = attend(l, q).transpose(1, 2).reshape(n, S, H * D).to(dt)
            x = x + self.linear(o, w_o, b_o)
            h = self._rms(x, w_post, eps2).to(dt)
            if len(gu_w) == 1:
                gate, up = self.linear(h, gu_w[0]).chunk(2, dim=-1)
            else:
                gate, up = (self.linear(h, w) for w in gu_w)
            x = x + self.linear(F.silu(gate) * up, w_down)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self._rms(x, *self.norm).to(self.dtype), self.lm_head)  # [n, V]

    # ------------------------------------------------------------------ the call
    def _positions(self, mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Size the first cache for left-padded prompts `mask` [B, P] plus a block of new tokens,
        tabulate the rotary cos/sin of every position up to P + max_new_tokens (one row's worth, not
        the cache's), and return the prompt tokens' positions [B, P]."""
        P = mask.shape[1]
        self.P, self.max_cap = P, P + max_new_tokens
        self.cap = P + min(max_new_tokens, self.cache_block)  # columns allocated
        kind = mask.device.type  # a device without autocast (meta, where tests/rollout/test_decode_on_meta.py runs)
        with torch.autocast(kind, enabled=False) if torch.amp.is_autocast_available(kind) else contextlib.nullcontext():
            cos, sin = self.rotary(self.embed[:1], torch.arange(self.max_cap, device=mask.device)[None])  # [1, P+T, D]
        half = cos.shape[-1] // 2
        self.cos = cos[0].to(self.wdtype)  # [P+T, D]
        self.sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1).to(self.wdtype)  # sign-folded for `_rope`
        return (mask.cumsum(-1) - 1).clamp(min=0)  # [B, P]

    def _reallocate(self, rows: torch.Tensor | slice, cap: int) -> None:
        """Move the cache into new tensors of `cap` columns holding only `rows` of the current batch
        (in that order), with the P + t columns fed so far. One layer at a time: besides the new
        cache, only one layer's old keys or values are alive at any moment."""
        c = self.P + self.t
        for cache in (self.k, self.v):
            for l, old in enumerate(cache):
                kept = old[rows, :, :c]  # [n', Hkv, c, D]
                cache[l] = old.new_empty(kept.shape[0], self.Hkv, cap, self.D)
                cache[l][:, :, :c] = kept
                del old, kept  # the old layer is freed here, before the next one is allocated
        valid = self.valid.new_zeros(self.k[0].shape[0], cap)  # [n', cap]
        valid[:, :c] = self.valid[rows, :c]
        self.valid, self.cap = valid, cap

    def start(self, ids: torch.Tensor, mask: torch.Tensor, G: int, max_new_tokens: int,
              zeroed: bool = False) -> torch.Tensor:
        """Prefill B left-padded prompts ids/mask [B, P] once, repeat each prompt's cache G times,
        and return the next-token logits [B*G, V] (fp32). For compiled_decode.CompiledDecodeLoop, which
        reads columns it has not written (masked): `zeroed` fills the cache with zeros."""
        B, P = ids.shape
        device = ids.device
        pos = self._positions(mask, max_new_tokens)  # [B, P]
        N = rows = B * G
        alloc = torch.zeros if zeroed else torch.empty
        self.k = [alloc(rows, self.Hkv, self.cap, self.D, dtype=self.adtype, device=device) for _ in self.layers]
        self.v = [alloc(rows, self.Hkv, self.cap, self.D, dtype=self.adtype, device=device) for _ in self.layers]
        self.valid = torch.zeros(rows, self.cap, dtype=torch.bool, device=device)  # key columns a row may attend
        self.valid[:N, :P] = mask.bool().repeat_interleave(G, dim=0)
        self.next_pos = pos[:, -1].repeat_interleave(G) + 1  # [N]
        self.n, self.t = N, 0

        # prefill: causal attention among each prompt's real tokens (a padding query sees itself only)
        allowed = torch.tril(torch.ones(P, P, dtype=torch.bool, device=device))[None] & mask.bool()[:, None, :]
        allowed |= torch.eye(P, dtype=torch.bool, device=device)[None]
        allowed = allowed[:, None]  # [B, 1, P, P]
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [B, 1, P, D]
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def write(l, k, v):
            kv[l] = (k, v)
            self.k[l][:N, :, :P] = k.repeat_interleave(G, dim=0)
            self.v[l][:N, :, :P] = v.repeat_interleave(G, dim=0)

        def attend(l, q):
            k, v = kv.pop(l)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale,
                                                  enable_gqa=self.Hkv != self.H)

        x = self._layers(F.embedding(ids, self.embed), cos, sin, write, attend)  # [B, P, d]
        return self._logits(x[:, -1]).float().repeat_interleave(G, dim=0)  # [N, V]

    def start_from(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int,
                   prefix: list[tuple[torch.Tensor, torch.Tensor] | None]) -> torch.Tensor:
        """`start` with G = 1 for rows whose first c_b real tokens were computed before: `prefix[b]`
        is None or (k, v) [layers, Hkv, c_b, D] of those tokens (`snapshot`), c_b < the row's real
        length. Their keys/values are copied in and only the columns from the earliest uncomputed
        one on are run (a row's cached tokens inside that window are recomputed, the same values).
        Returns the next-token logits [B, V], as `start` does."""
        B, P = ids.shape
        device = ids.device
        pos = self._positions(mask, max_new_tokens)  # [B, P]
        self.k = [torch.zeros(B, self.Hkv, self.cap, self.D, dtype=self.adtype, device=device) for _ in self.layers]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.valid = torch.zeros(B, self.cap, dtype=torch.bool, device=device)
        self.valid[:, :P] = mask.bool()
        self.next_pos = pos[:, -1] + 1  # [B]
        self.n, self.t = B, 0
        first = (P - mask.sum(-1)).tolist()  # each row's first real column: one read of the device, not one a copy
        done = list(first)  # columns before done[b] hold cached keys/values
        for b, cached in enumerate(prefix):
            if cached is None:
                continue
            k, v = cached
            c = k.shape[2]
            for l in range(len(self.layers)):
                self.k[l][b, :, first[b]: first[b] + c] = k[l].to(self.adtype)
                self.v[l][b, :, first[b]: first[b] + c] = v[l].to(self.adtype)
            done[b] += c
        w0 = min(done)  # the window [w0, P) is computed for every row
        allowed = torch.tril(torch.ones(P, P, dtype=torch.bool, device=device))[None] & mask.bool()[:, None, :]
        allowed |= torch.eye(P, dtype=torch.bool, device=device)[None]
        allowed = allowed[:, None, w0:]  # [B, 1, P-w0, P]
        cos, sin = self.cos[pos[:, w0:]][:, None], self.sin[pos[:, w0:]][:, None]  # [B, 1, P-w0, D]

        def write(l, k, v):
            self.k[l][:, :, w0:P] = k
            self.v[l][:, :, w0:P] = v

        def attend(l, q):
            return F.scaled_dot_product_attention(q, self.k[l][:, :, :P], self.v[l][:, :, :P], attn_mask=allowed,
                                                  scale=self.scale, enable_gqa=self.Hkv != self.H)

        x = self._layers(F.embedding(ids[:, w0:], self.embed), cos, sin, write, attend)  # [B, P-w0, d]
        return self._logits(x[:, -1]).float()  # [B, V]

    def snapshot(self, rows: torch.Tensor, fed: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The keys/values of every real token fed so far, per row of the current batch: (k, v)
        [layers, Hkv, c, D] each, copied (compaction overwrites the cache). `fed` [len(rows)]: the new
        tokens to take of each row, where rows stopped at different steps (the slot loop of
        compiled_decode.py, whose finished rows write on past their end); default all fed, self.t."""
        ends = [self.t] * rows.numel() if fed is None else fed.tolist()
        out = []
        for r, t in zip(rows.tolist(), ends):
            cols = self.valid[r, : self.P + t].nonzero().squeeze(-1)  # one host read a row, not one a layer
            out.append((torch.stack([k[r].index_select(1, cols) for k in self.k]),
                        torch.stack([v[r].index_select(1, cols) for v in self.v])))
        return out

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (indices into the current batch) in the cache, in that order."""
        c = self.P + self.t
        n = rows.numel()
        if 2 * n <= self.k[0].shape[0]:  # at most half the allocated rows are live: release the rest
            self._reallocate(rows, self.cap)
        else:  # compact in place: the rows past n stay allocated, unused
            for l in range(len(self.layers)):
                self.k[l][:n, :, :c] = self.k[l][rows, :, :c]
                self.v[l][:n, :, :c] = self.v[l][rows, :, :c]
            self.valid[:n] = self.valid[rows].clone()
        self.next_pos = self.next_pos[rows]
        self.n = n

    def step(self, tok: torch.Tensor) -> torch.Tensor:
        """Feed one token per active row, tok [n]; returns the next-token logits [n, V] (fp32)."""
        n, col = self.n, self.P + self.t
        if col == self.cap:  # full: double the new-token columns (amortised copies), at most P + T
            self._reallocate(slice(0, n), min(self.max_cap, self.P + 2 * (self.cap - self.P)))
        self.valid[:n, col] = True
        pos = self.next_pos
        cos, sin = self.cos[pos][:, None, None], self.sin[pos][:, None, None]  # [n, 1, 1, D]
        key_mask = self.valid[:n, None, None, : col + 1]  # [n, 1, 1, col+1]

        def write(l, k, v):
            self.k[l][:n, :, col: col + 1] = k
            self.v[l][:n, :, col: col + 1] = v

        def attend(l, q):
            return F.scaled_dot_product_attention(q, self.k[l][:n, :, : col + 1], self.v[l][:n, :, : col + 1],
                                                  attn_mask=key_mask, scale=self.scale,
                                                  enable_gqa=self.Hkv != self.H)

        x = self._layers(F.embedding(tok[:, None], self.embed), cos, sin, write, attend)  # [n, 1, d]
        self.next_pos = pos + 1
        self.t += 1
        return self._logits(x[:, 0]).float()
