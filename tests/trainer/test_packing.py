"""Padding-free passes (packing.py) against the padded path: the packed row's layout worked by hand;
log-probs, entropies and parameter gradients equal to fp32 rounding for shared and unshared prompts,
the chunked head and whole logits, tied and untied heads, Llama with grouped-query attention, LoRA
(policy and adapter-disabled reference), gradient checkpointing, and bf16 autocast within its own
tolerance; a training step whose micro-batches are cut by tokens equals the padded one-pass step."""

import contextlib
import copy
import functools

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from grouprl import packing
from grouprl.lora import adapter_disabled
from grouprl.micro_batches import MicroBatch, packed_tokens, plan_micro_batches
from grouprl.policy import checkpointing as set_checkpointing, completion_logprobs
from grouprl.tasks.testing import build_tiny_architecture, with_random_lora
from tests.trainer.test_head_logprobs_path import CHUNKED, WHOLE, assert_same
from tests.trainer.test_micro_batches import rollout_of
from tests.trainer.test_shared_prompt import ragged_rollout


def run(model, rollout, *, packed, share=True, limit=WHOLE, autocast=None):
    model.zero_grad(set_to_none=True)
    mb = MicroBatch.from_rollout(rollout, torch.arange(len(rollout)), 0 if share else None)
    logp, ent = completion_logprobs(model, mb, temperature=0.7, autocast_dtype=autocast, with_entropy=True,
                                    max_logits_elements=limit, packed=packed)  # [n, T'] each
    assert logp.shape == ent.shape == mb.completion_ids.shape
    m = mb.completion_mask
    if packed:  # padding positions are not computed
        assert (logp[~m] == 0).all() and (ent[~m] == 0).all()
    weights = torch.linspace(-1, 1, m.numel()).view(m.shape)  # an arbitrary upstream gradient
    (logp * m * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach()[m], ent[m], grads


@pytest.fixture(scope="module")
def tied(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train()
    assert packing.enable(model) and packing.supports_packing(model)
    return model


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=120, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).train()
    assert packing.enable(model)
    return model


def _architecture(kind: str) -> torch.nn.Module:
    model, _ = build_tiny_architecture(kind, vocab_size=120, seed=0)
    model.train()
    assert packing.enable(model)
    return model


@pytest.fixture(scope="module")
def qwen3():
    """Qwen3: per-head q/k norms, a head size (16) that is not hidden / heads (48 / 4)."""
    return _architecture("qwen3")


@pytest.fixture(scope="module")
def smollm3():
    """SmolLM3: a layer without RoPE (NoPE)."""
    return _architecture("smollm3")


def test_layout_worked_by_hand():
    """Prompt 0 = [7, 8] continued by completions [1, 2] and [3]; prompt 1 = [9] (left-padded) by [4, 5].
    Prompt 0 is laid once, its completions after it with positions continuing it (2, 3 and 2);
    prompt 1 and its only completion form one sequence. The first completion token is predicted
    by the prompt's last position (1), later ones by the previous token."""
    layout = packing.pack(torch.tensor([[7, 8], [0, 9]]), torch.tensor([[1, 1], [0, 1]]), torch.tensor([0, 0, 1]),
                          torch.tensor([[1, 2], [3, 0], [4, 5]]), torch.tensor([[1, 1], [1, 0], [1, 1]]).bool(),
                          torch.device("cpu"))
    assert layout.input_ids.tolist() == [[7, 8, 1, 2, 3, 9, 4, 5]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2]]
    assert layout.segments == [(0, 2, 0, 0), (2, 2, 0, 2), (4, 1, 0, 2), (5, 3, 0, 0)]
    assert layout.pred_index.tolist() == [1, 2, 1, 5, 6] and layout.targets.tolist() == [1, 2, 3, 4, 5]
    assert packed_tokens([2, 1], [2, 1, 2], [0, 0, 1]) == layout.num_tokens == 8
    # an empty completion after a shared prompt: no segment, no prediction
    empty = packing.pack(torch.tensor([[7, 8]]), torch.tensor([[1, 1]]), torch.tensor([0, 0]), torch.tensor([[1], [0]]),
                         torch.tensor([[True], [False]]), torch.device("cpu"))
    assert empty.input_ids.tolist() == [[7, 8, 1]] and empty.segments == [(0, 2, 0, 0), (2, 1, 0, 2)]
    assert empty.pred_index.tolist() == [1] and empty.targets.tolist() == [1]


@pytest.mark.parametrize("segments", [
    [(0, 3, 0, 0), (3, 2, 0, 3), (5, 4, 0, 3), (9, 5, 0, 0)],  # a shared prompt (its own segment), a lone sequence
    [(0, 5, 0, 0), (5, 2, 0, 3), (7, 7, 0, 0)],  # a prefix that is not a segment of its own: sliced
])
def test_packed_attention_equals_masked_attention_over_the_row(segments):
    """Each query attends exactly to its prefix and its own earlier positions: outputs and the
    gradients of query, key and value against one SDPA call over the whole row with the block mask
    written out."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 14, 8, generator=g).requires_grad_() for _ in range(3))
    allowed = torch.zeros(14, 14, dtype=torch.bool)
    for start, L, p_start, p_len in segments:
        allowed[start:start + L, start:start + L] = torch.ones(L, L, dtype=torch.bool).tril()
        allowed[start:start + L, p_start:p_start + p_len] = True
    upstream = torch.randn(1, 14, 4, 8, generator=g)  # an arbitrary gradient from above
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (q, k, v))
    out = packing.packed_attention(q, k, v, segments, scaling=None)
    assert out.shape == (1, 14, 4, 8) and torch.allclose(out, ref, atol=1e-6)
    for got, want in zip(torch.autograd.grad((out * upstream).sum(), (q, k, v)), ref_grads):
        assert torch.allclose(got, want, atol=1e-5)


def test_block_mask_worked_by_hand():
    """A shared prompt of 2 (its own segment), a completion of 2 after it, and a lone sequence of 2:
    each query sees its prefix and its own earlier positions, nothing of another sequence."""
    mask = packing.block_mask([(0, 2, 0, 0), (2, 2, 0, 2), (4, 2, 0, 0)], 6, torch.device("cpu"))
    assert mask.int().tolist() == [[1, 0, 0, 0, 0, 0],
                                   [1, 1, 0, 0, 0, 0],
                                   [1, 1, 1, 0, 0, 0],
                                   [1, 1, 1, 1, 0, 0],
                                   [0, 0, 0, 0, 1, 0],
                                   [0, 0, 0, 0, 1, 1]]


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("segments", [
    [(0, 3, 0, 0), (3, 2, 0, 3), (5, 4, 0, 3), (9, 5, 0, 0)],
    [(0, 5, 0, 0), (5, 2, 0, 3), (7, 7, 0, 0)],
])
def test_one_masked_call_equals_the_per_segment_calls(segments, kv_heads):
    """The masked call over the row (a short row's path) gives the per-segment calls' outputs and
    gradients, grouped-query attention and a scale included."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 14, 8, generator=g).requires_grad_()
    k, v = (torch.randn(1, kv_heads, 14, 8, generator=g).requires_grad_() for _ in range(2))
    upstream = torch.randn(1, 14, 4, 8, generator=g)
    want = packing.packed_attention(q, k, v, segments, scaling=0.3)
    want_grads = torch.autograd.grad((want * upstream).sum(), (q, k, v))
    got = packing.masked_attention(q, k, v, packing.block_mask(segments, 14, torch.device("cpu")), scaling=0.3)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6)
    for a, b in zip(torch.autograd.grad((got * upstream).sum(), (q, k, v)), want_grads):
        assert torch.allclose(a, b, atol=1e-5)


def test_the_masked_call_is_chosen_for_short_rows_of_many_segments():
    """S^2·H·D against MASKED_CALL_WORK per segment: the embedded task's row (144 segments, ~500 tokens,
    4 heads of 32) and a 16-row pass of it (18 segments, 62 tokens) take the masked call; tiny-32's
    (468 tokens), a SmolLM2-shaped row of 64-token completions (9 heads of 64, 1,064 tokens) and a row
    of one sequence keep the per-segment calls."""
    assert packing.one_masked_call(496, 144, 4, 32) and packing.one_masked_call(62, 18, 4, 32)
    assert not packing.one_masked_call(468, 18, 4, 32)
    assert not packing.one_masked_call(1064, 18, 9, 64)
    assert not packing.one_masked_call(8, 1, 4, 32)


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """What torch's varlen flash kernel computes (CUDA only), written out for CPU: each sequence of
    the cumulative lengths attends causally to itself, with an explicit [L, L] mask."""
    assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
    bounds = cu_q.tolist()
    assert max_q == max_k == max(b - a for a, b in zip(bounds, bounds[1:]))
    assert enable_gqa == (q.shape[1] != k.shape[1])
    out = []
    for a, b in zip(bounds, bounds[1:]):
        mask = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        out.append(torch.nn.functional.scaled_dot_product_attention(
            *(x[a:b].transpose(0, 1) for x in (q, k, v)), attn_mask=mask, scale=scale,
            enable_gqa=enable_gqa).transpose(0, 1))
    return torch.cat(out)


class _NoBackward(torch.autograd.Function):
    """A kernel whose forward works and whose backward does not (as on a GPU it lacks)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, window_size, enable_gqa, scale):
        return reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size,
                                enable_gqa=enable_gqa)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("FlashAttention backward for head dim 8 is not supported")


def forward_only_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    return _NoBackward.apply(q, k, v, cu_q, cu_k, max_q, max_k, window_size, enable_gqa, scale)


def test_the_probe_passes_a_working_kernel_once(monkeypatch, caplog):
    monkeypatch.setattr(packing, "_varlen_kernel", reference_varlen)
    monkeypatch.setattr(packing, "_PROBED", {})
    cpu = torch.device("cpu")
    with torch.no_grad(), caplog.at_level("INFO", logger="grouprl.packing"):  # the first packed pass is often
        assert packing.varlen_works(cpu, torch.float32, 8, True)  # a no-grad one: the probe still has autograd
    assert [m.getMessage() for m in caplog.records] == [
        "packed attention: one varlen flash call per layer on cpu in float32 (head size 8, grouped-query)"]
    with torch.inference_mode():
        assert packing.varlen_works(cpu, torch.float32, 16, False)
    assert packing.varlen_works(cpu, torch.float32, 8, True)
    assert packing._PROBED == {("cpu", None, torch.float32, 8, True): True,
                               ("cpu", None, torch.float32, 16, False): True}


def test_varlen_plan_worked_by_hand():
    """The hand layout's segments: the shared prompt [0, 2), two completions after it, a lone
    sequence. The call runs prompt | prompt + completion | prompt + completion | lone sequence, and
    keeps the prompt's outputs from the first and the completions' from theirs."""
    plan = packing.varlen_plan([(0, 2, 0, 0), (2, 2, 0, 2), (4, 1, 0, 2), (5, 3, 0, 0)], torch.device("cpu"))
    assert plan.gather.tolist() == [0, 1, 0, 1, 2, 3, 0, 1, 4, 5, 6, 7]
    assert plan.cu_seqlens.tolist() == [0, 2, 6, 9, 12] and plan.max_len == 4
    assert plan.keep.tolist() == [0, 1, 4, 5, 8, 9, 10, 11]
    plain = packing.varlen_plan([(0, 3, 0, 0), (3, 2, 0, 0)], torch.device("cpu"))
    assert plain.gather is None and plain.keep is None and plain.cu_seqlens.tolist() == [0, 3, 5]


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("segments", [
    [(0, 3, 0, 0), (3, 2, 0, 3), (5, 4, 0, 3), (9, 5, 0, 0)],
    [(0, 5, 0, 0), (5, 2, 0, 3), (7, 7, 0, 0)],
    [(0, 6, 0, 0), (6, 1, 0, 0), (7, 7, 0, 0)],
])
def test_varlen_attention_equals_masked_attention_over_the_row(monkeypatch, segments, kv_heads):
    """The one-call path (CUDA's) with the reference kernel: outputs and gradients of query, key
    and value against one SDPA call over the row with the block mask written out, grouped-query
    attention included."""
    monkeypatch.setattr(packing, "_varlen_kernel", reference_varlen)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 14, 8, generator=g).requires_grad_()
    k, v = (torch.randn(1, kv_heads, 14, 8, generator=g).requires_grad_() for _ in range(2))
    allowed = torch.zeros(14, 14, dtype=torch.bool)
    for start, L, p_start, p_len in segments:
        allowed[start:start + L, start:start + L] = torch.ones(L, L, dtype=torch.bool).tril()
        allowed[start:start + L, p_start:p_start + p_len] = True
    upstream = torch.randn(1, 14, 4, 8, generator=g)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=0.3,
                                                           enable_gqa=kv_heads != 4).transpose(1, 2)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (q, k, v))
    out = packing.varlen_attention(q, k, v, packing.varlen_plan(segments, torch.device("cpu")), scaling=0.3)
    assert out.shape == (1, 14, 4, 8) and torch.allclose(out, ref, atol=1e-6)
    for got, want in zip(torch.autograd.grad((out * upstream).sum(), (q, k, v)), ref_grads):
        assert torch.allclose(got, want, atol=1e-5)


def older_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, return_aux=None):
    """torch 2.9-2.10's signature: `is_causal`, no window, no grouped-query heads, the default scale."""
    assert is_causal and q.shape[1] == k.shape[1]
    return reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, 0))


@pytest.mark.parametrize("scaling", [None, 0.3])
def test_varlen_attention_with_an_older_kernel_signature(monkeypatch, scaling):
    """An older kernel (no window_size, enable_gqa or scale): grouped-query heads are repeated and a
    custom scale goes into the queries; the result is the same as with the newer kernel."""
    segments = [(0, 3, 0, 0), (3, 2, 0, 3), (5, 4, 0, 3), (9, 5, 0, 0)]
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 14, 8, generator=g)
    k, v = (torch.randn(1, 2, 14, 8, generator=g) for _ in range(2))
    plan = packing.varlen_plan(segments, torch.device("cpu"))
    monkeypatch.setattr(packing, "_varlen_kernel", reference_varlen)
    want = packing.varlen_attention(q, k, v, plan, scaling)
    monkeypatch.setattr(packing, "_varlen_kernel", older_varlen)
    assert torch.allclose(packing.varlen_attention(q, k, v, plan, scaling), want, atol=1e-6)


@pytest.mark.cpu_rules  # calls the installed kernel, which tests/as_cuda.py replaces
@pytest.mark.skipif(packing._varlen_kernel is None, reason="this torch has no varlen attention kernel (torch < 2.9)")
@pytest.mark.parametrize("scaling", [None, 0.125])
def test_the_installed_varlen_kernel_takes_the_call_as_packing_makes_it(scaling):
    """The tests above stand a reference kernel in for torch's. This one calls torch's own kernel,
    with the keywords this torch takes, on the meta device in bf16: SmolLM2's heads (9 query heads
    over 3 key heads of 64) and a shared-prompt plan, forward and backward, and the probe. Its
    Python entry point checks the arguments and its meta kernel gives the output shapes; the
    arithmetic needs a GPU."""
    meta = torch.device("meta")
    plan = packing.varlen_plan([(0, 3, 0, 0), (3, 2, 0, 3), (5, 4, 0, 3), (9, 5, 0, 0)], meta)
    q = torch.empty(1, 9, 14, 64, device=meta, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.empty(1, 3, 14, 64, device=meta, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    try:
        out = packing.varlen_attention(q, k, v, plan, scaling)
    except NotImplementedError as e:  # written against torch 2.13, whose kernel has a meta implementation
        pytest.skip(f"this torch's varlen kernel runs on no meta device: {e}")
    assert out.shape == (1, 14, 9, 64) and out.dtype == torch.bfloat16 and out.device == meta
    out.float().sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == v.grad.shape == k.shape
    packing._probe(meta, torch.bfloat16, 64, True)  # the probe's own call: raises if the kernel refuses it


@pytest.mark.cpu_rules  # asks the real uses_varlen
def test_varlen_is_chosen_on_cuda_in_half_precision_only():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert packing.uses_varlen(cuda, torch.bfloat16, 64, 0.0) and packing.uses_varlen(cuda, torch.float16, 128, 0.0)
    assert not packing.uses_varlen(cuda, torch.float32, 64, 0.0)  # flash has no fp32: per segment
    assert not packing.uses_varlen(cpu, torch.bfloat16, 64, 0.0)  # no CPU kernel
    assert not packing.uses_varlen(cuda, torch.bfloat16, 64, 0.1)  # no dropout in the kernel
    assert not packing.uses_varlen(cuda, torch.bfloat16, 60, 0.0) and not packing.uses_varlen(cuda, torch.bfloat16,
                                                                                               320, 0.0)


@pytest.mark.parametrize("share", [True, False])
def test_a_model_through_the_varlen_path_equals_the_padded_pass(monkeypatch, llama, share):
    """The whole packed pass of a grouped-query Llama with every attention call through the varlen
    path (as on a CUDA device in bf16, the reference kernel standing in): log-probs, entropies and
    gradients equal the padded pass's; the plan is built once per pass, not per layer."""
    calls, built = [], []

    @functools.wraps(reference_varlen)  # the path reads the kernel's signature
    def counted(*a, **kw):
        calls.append(1)
        return reference_varlen(*a, **kw)

    monkeypatch.setattr(packing, "_varlen_kernel", counted)
    monkeypatch.setattr(packing, "uses_varlen", lambda *a: True)
    monkeypatch.setattr(packing, "varlen_works", lambda *a: True)  # the probe's own call is tested apart
    real_plan = packing.varlen_plan
    monkeypatch.setattr(packing, "varlen_plan", lambda *a: built.append(1) or real_plan(*a))
    r = ragged_rollout([3, 9, 5], G=4, seed=1)
    got = run(llama, r, packed=True, share=share)
    assert len(calls) == llama.config.num_hidden_layers and len(built) == 1  # one packed pass
    assert_same(got, run(llama, r, packed=False, share=share), atol=1e-5, grad_rtol=1e-5)


def test_the_probe_inside_a_checkpointed_layer_leaves_the_recomputation_alone(monkeypatch, llama):
    """The update's packed pass under gradient checkpointing is often the first packed pass of a run,
    so the kernel is probed inside the first layer's checkpointed forward. The probe's tensors were
    counted as that layer's, its recomputation (probe done) saved fewer, and backward raised torch's
    CheckpointError ("A different number of tensors was saved ...", 53 against 45 on an H100 at the
    135M shape). The pass equals the padded one, and the kernel is probed once."""
    probes = []
    real_probe = packing._probe
    monkeypatch.setattr(packing, "_varlen_kernel", reference_varlen)
    monkeypatch.setattr(packing, "uses_varlen", lambda *a: True)
    monkeypatch.setattr(packing, "_PROBED", {})
    monkeypatch.setattr(packing, "_probe", lambda *a: probes.append(1) or real_probe(*a))
    r = ragged_rollout([3, 9, 5], G=4, seed=1)
    padded = run(llama, r, packed=False)
    ckpt = copy.deepcopy(llama)
    set_checkpointing(ckpt, True)
    assert_same(run(ckpt, r, packed=True), padded, atol=1e-5, grad_rtol=1e-5)
    assert probes == [1] and list(packing._PROBED.values()) == [True]


def test_under_bf16_autocast_over_fp32_weights_the_varlen_path_runs_in_bf16(monkeypatch, llama):
    """The trainer's default on a GPU: fp32 master weights, bf16 autocast. RoPE's fp32 cos/sin turn q and
    k back to fp32 while v stays bf16, so the path was asked about fp32, said no, and the varlen
    kernel never ran. It is asked about autocast's dtype, and the kernel gets bf16 q, k and v; the
    pass stays within bf16's tolerance of the padded one."""
    asked, seen = [], []

    @functools.wraps(reference_varlen)
    def recorded(q, k, v, *a, **kw):
        seen.append((q.dtype, k.dtype, v.dtype))
        return reference_varlen(q, k, v, *a, **kw)

    monkeypatch.setattr(packing, "_varlen_kernel", recorded)
    monkeypatch.setattr(packing, "uses_varlen",
                        lambda device, dtype, *a: asked.append(dtype) or dtype == torch.bfloat16)
    monkeypatch.setattr(packing, "varlen_works", lambda *a: True)
    r = ragged_rollout([3, 9, 5], G=4, seed=1)
    got = run(llama, r, packed=True, autocast=torch.bfloat16)
    assert set(asked) == {torch.bfloat16} and seen and set(seen) == {(torch.bfloat16,) * 3}
    assert_same(got, run(llama, r, packed=False, autocast=torch.bfloat16), atol=3e-2, grad_rtol=3e-2)


def no_varlen_kernel(*a, **kw):
    raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.\nmore")


def checkpoint_of_torch_2_11(function, *args, **kwargs):
    """torch's non-reentrant checkpoint as torch 2.11 runs it: when the checkpointed forward raises,
    the checkpoint's generator is left suspended inside its saved-tensor hooks, which stay on until
    the generator is collected (torch 2.13 throws the error into it, which takes them off).
    Whatever is saved meanwhile goes to the failed layer's frame, and the backward then recomputes
    that layer to match it: torch's CheckpointError."""
    gen = torch.utils.checkpoint._checkpoint_without_reentrant_generator(
        function, True, torch.utils.checkpoint.noop_context_fn, "default", False, True, *args, **kwargs)
    next(gen)
    out = function(*args, **kwargs)
    with contextlib.suppress(StopIteration):
        next(gen)
    return out


def varlen_failing_past_the_probe(q, k, v, cu_q, *a, **kw):
    """Runs the probe's two toy sequences, fails at a real pass's sizes."""
    if q.shape[0] > 4:
        raise RuntimeError("CUDA error: invalid configuration argument\nmore")
    return reference_varlen(q, k, v, cu_q, *a, **kw)


@pytest.mark.parametrize("kernel, message, probe_passed", [
    (no_varlen_kernel, "Ampere", False),  # fails outright: the probe finds it
    (forward_only_varlen, "backward for head dim 8", False),  # only its backward fails, past any fallback
    (functools.wraps(reference_varlen)(varlen_failing_past_the_probe), "invalid configuration", True),
])
@pytest.mark.parametrize("checkpointing", [None, "torch's", "torch 2.11's", "torch 2.11's, the error kept"])
def test_a_varlen_kernel_that_fails_warns_once_and_the_rows_run_per_sequence(monkeypatch, llama, caplog, kernel,
                                                                             message, probe_passed, checkpointing):
    """Forward and backward once on toy sequences, before the first real pass (the probe), find a
    kernel that fails outright or only in its backward (inside the update's backward(), where no
    fallback could catch it); a failure at a real pass's sizes starts the pass again per sequence.
    Each warns once with the error's first line, and the pass runs per sequence: log-probs,
    entropies and gradients equal the padded pass's. Under gradient checkpointing too (CUDA's
    default), where a layer whose path changed between its forward and its recomputation raised
    torch's CheckpointError; and under torch 2.11's checkpoint, whose failed layer left its hooks on
    (an H100's suite), also while something keeps the kernel's error (a log handler holding
    exc_info, an error reporter): its frames then keep the whole failed call stack alive."""
    if checkpointing:
        llama = copy.deepcopy(llama)
        set_checkpointing(llama, True)
    if checkpointing and checkpointing.startswith("torch 2.11's"):
        for module in llama.modules():
            if hasattr(module, "_gradient_checkpointing_func"):
                module._gradient_checkpointing_func = checkpoint_of_torch_2_11
    kept = []
    if checkpointing == "torch 2.11's, the error kept":
        give_up = packing._give_up_varlen
        monkeypatch.setattr(packing, "_give_up_varlen", lambda error: kept.append(error) or give_up(error))
    monkeypatch.setattr(packing, "_varlen_kernel", kernel)
    monkeypatch.setattr(packing, "uses_varlen", lambda *a: packing.VARLEN["enabled"])
    monkeypatch.setitem(packing.VARLEN, "enabled", True)
    monkeypatch.setattr(packing, "_PROBED", {})
    r = ragged_rollout([4, 6], G=3, seed=2)
    with caplog.at_level("WARNING", logger="grouprl.packing"):
        got = run(llama, r, packed=True)
    warned = [m.getMessage() for m in caplog.records if "varlen flash kernel failed" in m.getMessage()]
    assert len(warned) == 1 and message in warned[0] and "more" not in warned[0]
    assert list(packing._PROBED.values()) == [probe_passed] and packing.VARLEN["enabled"] is False
    assert_same(got, run(llama, r, packed=False), atol=1e-5, grad_rtol=1e-5)


@pytest.fixture(params=[pytest.param("masked", marks=pytest.mark.cpu_rules), "per-segment"])
def attention(request, monkeypatch):
    """Both attention paths of a packed row on CPU: the tests' rows are short, so the per-segment calls
    are forced for its half (one masked call is what `one_masked_call` picks for them)."""
    if request.param == "per-segment":
        monkeypatch.setattr(packing, "MASKED_CALL_WORK", 0)
    called = []
    monkeypatch.setattr(packing, "masked_attention", lambda *a, **k: called.append(1) or real_masked(*a, **k))
    yield request.param
    assert bool(called) == (request.param == "masked"), (  # the path named is the one that ran
        f"the {request.param} path was asked for, and the masked call ran {len(called)} times")


real_masked = packing.masked_attention


@pytest.mark.parametrize("limit", [WHOLE, CHUNKED])
@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("which", ["tied", "llama", "qwen3", "smollm3"])
def test_packed_equals_padded(request, which, share, limit, attention):
    model = request.getfixturevalue(which)
    r = ragged_rollout([3, 9, 5], G=4, seed=1)
    assert_same(run(model, r, packed=True, share=share, limit=limit), run(model, r, packed=False, share=share),
                atol=1e-5, grad_rtol=1e-5)


def test_lora_policy_and_its_adapter_disabled_reference(tied):
    lora = with_random_lora(copy.deepcopy(tied)).train()
    assert packing.supports_packing(lora)
    r = ragged_rollout([4, 7], G=3, seed=2)
    assert_same(run(lora, r, packed=True), run(lora, r, packed=False), atol=1e-5, grad_rtol=1e-5)
    with torch.no_grad(), adapter_disabled(lora):
        mb = MicroBatch.from_rollout(r, torch.arange(len(r)), 0)
        ref = completion_logprobs(lora, mb, temperature=0.7, packed=True)[0][mb.completion_mask]
    base = completion_logprobs(tied, mb, temperature=0.7)[0][mb.completion_mask].detach()
    assert torch.allclose(ref, base, atol=1e-5, rtol=0)


def test_gradient_checkpointing_runs_packed_with_shared_prompts(llama, attention):
    r = ragged_rollout([5, 2], G=3, seed=5)
    padded = run(llama, r, packed=False, share=False)
    ckpt = copy.deepcopy(llama)
    set_checkpointing(ckpt, True)
    assert_same(run(ckpt, r, packed=True), padded, atol=1e-5, grad_rtol=1e-5)


def test_bf16_autocast_within_bf16_tolerance(tied):
    r = ragged_rollout([5, 8], G=4, seed=3)
    assert_same(run(tied, r, packed=True, autocast=torch.bfloat16),
                run(tied, r, packed=False, autocast=torch.bfloat16), atol=3e-2, grad_rtol=3e-2)


def test_packed_budget_counts_real_tokens_and_each_prompt_once():
    """Prompts 4, 4, 6 tokens (rows 0 and 1 share one prompt), completions 2, 3, 5: packed, rows
    0-1 cost 4 + 2 + 3 = 9 and adding row 2 costs 9 + 6 + 5 = 20; padded, rows 0-1 cost 2 x 7 = 14."""
    r = rollout_of([4, 4, 6], [2, 3, 5])
    r.prompt_ids[2, -1] = 6  # a different prompt
    assert [b.tolist() for b in plan_micro_batches(r, torch.arange(3), 8, 20, packed=True)[0]] == [[0, 1, 2]]
    assert [b.tolist() for b in plan_micro_batches(r, torch.arange(3), 8, 19, packed=True)[0]] == [[0, 1], [2]]
    assert [b.tolist() for b in plan_micro_batches(r, torch.arange(3), 8, 13, packed=False)[0]] == [[0], [1], [2]]
    assert [b.tolist() for b in plan_micro_batches(r, torch.arange(3), 8, 9, packed=True)[0]] == [[0, 1], [2]]


def test_a_step_cut_by_tokens_and_packed_equals_the_padded_one_pass_step(make_cfg):
    """Same seed, same samples: the gradient of one optimizer step, packed with a small token budget
    (many passes), equals the padded single pass's to fp32 rounding, KL term included (the
    whole-batch normaliser makes it independent of the split)."""
    from grouprl.trainer import Trainer

    grads, passes = [], []
    for extra in (dict(padding_free=True, max_tokens_per_micro_batch=40, micro_batch_size=1),
                  dict(padding_free=False, micro_batch_size=16)):
        trainer = Trainer(make_cfg(beta=0.04, **extra))
        assert trainer.updater.planner.packed == extra["padding_free"]
        step = trainer.optimizer.step  # the step's accumulated gradient, read as the optimizer gets it
        trainer.optimizer.step = lambda step=step, trainer=trainer: grads.append(
            {n: p.grad.clone() for n, p in trainer.model.named_parameters()}) or step()
        trainer.train_step()
        passes.append(len(trainer.updater.planner.plan(trainer.sample_batch()[0].rollout, trainer.cfg)))
    assert passes[0] > 4 and passes[1] == 1
    for name, g in grads[1].items():
        assert float(g.norm()) > 0, name
        assert float((grads[0][name] - g).norm()) <= 1e-5 * float(g.norm()), name


def test_the_gradients_are_freed_after_the_optimizer_step(make_cfg):
    """Gradients live from the first backward of a step to its optimizer step, no longer: the next
    generation runs without them (issue 34: on a GPU they held |θ| fp32 bytes at the step's peak)."""
    from grouprl.trainer import Trainer

    trainer = Trainer(make_cfg(num_iterations=2))
    seen = []
    step = trainer.optimizer.step
    trainer.optimizer.step = lambda: seen.append(all(p.grad is not None for p in trainer.model.parameters())) or step()
    trainer.train_step()
    assert seen == [True, True]  # both optimizer steps had every gradient
    assert all(p.grad is None for p in trainer.model.parameters())


@pytest.mark.parametrize("limit", [WHOLE, CHUNKED])
@pytest.mark.parametrize("share", [True, False])
def test_a_packed_pass_of_empty_completions_only(llama, share, limit):
    """Every completion of a pass is empty (an engine may return none; with micro_batch_size 1 one such
    completion is a pass of its own): nothing to score, zero log-probs and entropies that still carry a
    gradient, and a backward that runs. (It was a ZeroDivisionError in the chunking of the logits.)"""
    r = rollout_of([3, 3, 2], [0, 0, 0])
    mb = MicroBatch.from_rollout(r, torch.arange(3), 0 if share else None)
    llama.zero_grad(set_to_none=True)
    logp, ent = completion_logprobs(llama, mb, temperature=0.7, with_entropy=True, entropy_grad=True,
                                    max_logits_elements=limit, packed=True)
    assert logp.shape == ent.shape == (3, 1) and not logp.any() and not ent.any() and logp.requires_grad
    (logp.sum() + ent.sum()).backward()


def windowed(kind: str) -> torch.nn.Module:
    """A tiny model whose attention sees the 4 positions back only (its sequences here run to 17)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    sizes = dict(vocab_size=120, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                 num_key_value_heads=2, sliding_window=4, attn_implementation="sdpa")
    model = (MistralForCausalLM(MistralConfig(**sizes)) if kind == "mistral" else  # every layer
             Qwen2ForCausalLM(Qwen2Config(**sizes, use_sliding_window=True, max_window_layers=1)))  # the 2nd only
    assert packing.enable(model)
    return model.train()


@pytest.mark.parametrize("limit", [WHOLE, CHUNKED])
@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_a_sliding_window_holds_in_packed_passes(kind, share, limit):
    """Mistral (a window on every layer) and Qwen2 with use_sliding_window (on the layers past
    max_window_layers), the window shorter than the sequences: the packed pass equals the padded one,
    whose masks are transformers' own (it was up to 0.13 off in log-probs, the window ignored)."""
    model = windowed(kind)
    r = ragged_rollout([3, 9, 5], G=4, seed=1)
    assert_same(run(model, r, packed=True, share=share, limit=limit), run(model, r, packed=False, share=share),
                atol=1e-5, grad_rtol=1e-5)


def test_a_model_with_eager_attention_runs_padded():
    """Eager attention is each model's own function, in no registry a packed pass could wrap: such a
    model is not enabled (it was a KeyError while the policy loaded), and keeps its attention."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=120, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, attn_implementation="eager")
    model = LlamaForCausalLM(cfg)
    assert not packing.enable(model) and not packing.supports_packing(model)
    assert model.config._attn_implementation == "eager"
