"""The KV-cached engine against a naive no-cache decoder, and its sampling contract."""

import copy

import pytest
import torch

from grouprl.rollout import HFEngine, Rollout, SamplingParams, sample_next
from grouprl.tasks.testing import ARCHITECTURES, build_tiny_architecture, build_tiny_model, with_random_lora


@pytest.fixture(scope="module")
def model_and_tok():
    model, tok = build_tiny_model("tiny", seed=3)
    return model.eval(), tok


def naive_greedy(model, prompt: list[int], max_new: int, eos: int) -> list[int]:
    """Recompute the whole sequence every step, no cache, no padding."""
    ids = list(prompt)
    out = []
    for _ in range(max_new):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        tok = int(logits.argmax())
        out.append(tok)
        if tok == eos:
            break
        ids.append(tok)
    return out


def test_greedy_matches_naive_decoder_with_ragged_prompts(model_and_tok):
    model, tok = model_and_tok
    prompts = [tok("What is 1+2? ")["input_ids"], tok("Hi")["input_ids"], tok("a much longer prompt, 77")["input_ids"]]
    engine = HFEngine(model, (tok.eos_token_id,), tok.pad_token_id)
    ro = engine.generate(prompts, 1, SamplingParams(max_new_tokens=12, greedy=True))
    with torch.no_grad():
        for i, p in enumerate(prompts):
            want = naive_greedy(model, p, 12, tok.eos_token_id)
            got = ro.completion_ids[i][ro.completion_mask[i]].tolist()
            assert got == want
            assert bool(ro.truncated[i]) == (want[-1] != tok.eos_token_id)


def test_eos_rows_stop_and_are_padded(model_and_tok):
    model, tok = model_and_tok
    eos = tok.eos_token_id
    engine = HFEngine(model, (eos,), tok.pad_token_id)
    g = torch.Generator().manual_seed(9)
    ro = engine.generate([tok("x")["input_ids"]] * 2, 8, SamplingParams(max_new_tokens=20, temperature=3.0), g)
    assert ro.completion_ids.shape == (16, 20)
    assert 0 < int(ro.truncated.sum()) < 16  # both kinds of rows occur with this seed
    lengths = ro.lengths
    for i in range(16):
        row = ro.completion_ids[i]
        n = int(lengths[i])
        assert (row[n:] == tok.pad_token_id).all()
        has_eos = bool((row[:n] == eos).any())
        assert has_eos == (not bool(ro.truncated[i]))
        if has_eos:
            assert int(row[n - 1]) == eos and not (row[: n - 1] == eos).any()


def test_ignore_eos_gives_exact_length(model_and_tok):
    model, tok = model_and_tok
    engine = HFEngine(model, (tok.eos_token_id,), tok.pad_token_id)
    ro = engine.generate([tok("ab")["input_ids"], tok("abc")["input_ids"]], 4,
                         SamplingParams(max_new_tokens=9, temperature=2.0, ignore_eos=True),
                         torch.Generator().manual_seed(1))
    assert ro.completion_mask.all() and ro.lengths.tolist() == [9] * 8
    assert not ro.truncated.any()


def test_same_generator_state_same_samples_and_groups_share_prompts(model_and_tok):
    model, tok = model_and_tok
    engine = HFEngine(model, (tok.eos_token_id,), tok.pad_token_id, max_batch_size=4)
    prompts = [tok("one")["input_ids"], tok("three")["input_ids"]]
    p = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=20, top_p=0.9)
    a = engine.generate(prompts, 4, p, torch.Generator().manual_seed(5))
    b = engine.generate(prompts, 4, p, torch.Generator().manual_seed(5))
    assert torch.equal(a.completion_ids, b.completion_ids)
    for g, prompt in enumerate(prompts):
        for r in range(g * 4, g * 4 + 4):
            assert a.prompt_ids[r][a.prompt_mask[r].bool()].tolist() == prompt


def test_top_k_and_top_p_restrict_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    top1 = {int(sample_next(logits, SamplingParams(1, top_k=1), g)) for _ in range(50)}
    assert top1 == {0}
    # top_p = 0.7: the smallest set reaching 0.7 is {0, 1}
    nucleus = {int(sample_next(logits, SamplingParams(1, top_p=0.7), g)) for _ in range(300)}
    assert nucleus == {0, 1}


def test_sampling_draws_the_categorical_distribution():
    """Frequencies of 200,000 draws (one row repeated) match the probabilities within 4.5 standard
    errors, a zero-probability token is never drawn, and the last token of a 49k vocabulary gets
    its share."""
    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05])
    n = 200_000
    logits = probs.log().expand(n, -1)  # log 0 = -inf: probability 0 after softmax
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(sample_next(logits, SamplingParams(1), g), minlength=5).double()
    assert counts[1] == 0
    se = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert ((counts / n - probs.double()).abs() <= 4.5 * se).all()
    V = 49_152
    p = torch.full((V,), (1 - 2e-2) / (V - 1), dtype=torch.float64)
    p[-1] = 2e-2
    draws = sample_next(p.log().float().expand(1_000, -1), SamplingParams(1), g)  # [1000, V]: ~0.6 GB at peak
    assert 5 <= int((draws == V - 1).sum()) <= 40  # expected 20


def test_cat_repads_prompts_left_and_completions_right():
    a = Rollout(torch.tensor([[7, 8]]), torch.tensor([[1, 1]]), torch.tensor([[1, 2, 3]]),
                torch.tensor([[True, True, False]]), torch.tensor([False]))
    b = Rollout(torch.tensor([[9]]), torch.tensor([[1]]), torch.tensor([[4]]),
                torch.tensor([[True]]), torch.tensor([True]))
    c = Rollout.cat([a, b], pad_token_id=0)
    assert c.prompt_ids.tolist() == [[7, 8], [0, 9]]
    assert c.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert c.completion_ids.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert c.lengths.tolist() == [2, 1]
    assert c.sampling_logp is None


def _with_logp(a: Rollout, logp: list[list[float]]) -> Rollout:
    return Rollout(a.prompt_ids, a.prompt_mask, a.completion_ids, a.completion_mask, a.truncated,
                   torch.tensor(logp))


def test_sampling_logp_travels_through_select_and_cat():
    a = _with_logp(Rollout(torch.tensor([[7, 8], [5, 6]]), torch.tensor([[1, 1], [1, 1]]),
                           torch.tensor([[1, 2, 3], [4, 0, 0]]),
                           torch.tensor([[True, True, True], [True, False, False]]),
                           torch.tensor([True, False])), [[-0.5, -1.0, -2.0], [-0.25, 0.0, 0.0]])
    b = _with_logp(Rollout(torch.tensor([[9]]), torch.tensor([[1]]), torch.tensor([[4]]),
                           torch.tensor([[True]]), torch.tensor([True])), [[-3.0]])
    assert a.select([1]).sampling_logp.tolist() == [[-0.25, 0.0, 0.0]]
    c = Rollout.cat([a.select([1, 0]), b], pad_token_id=0)
    assert c.sampling_logp.dtype == torch.float32
    assert c.sampling_logp.tolist() == [[-0.25, 0.0, 0.0], [-0.5, -1.0, -2.0], [-3.0, 0.0, 0.0]]
    assert c.select(torch.tensor([2])).sampling_logp.tolist() == [[-3.0, 0.0, 0.0]]


def test_cat_refuses_sampling_logp_on_some_parts_only():
    a = Rollout(torch.tensor([[7]]), torch.tensor([[1]]), torch.tensor([[1]]),
                torch.tensor([[True]]), torch.tensor([True]))
    with pytest.raises(ValueError, match="sampling_logp is set on 1 of 2 parts"):
        Rollout.cat([a, _with_logp(a, [[-1.0]])], pad_token_id=0)


# ---------------------------------------------------------------------- the fast decoder
from grouprl.precision import cpu_bf16_flags  # noqa: E402
from grouprl.rollout.llama_decoder import FastDecoder  # noqa: E402


def _hf_logits(model, ids, mask, autocast=None):
    """Next-token logits [B, S, V] of the transformers forward pass, no cache."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    ctx = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
    with torch.no_grad(), ctx:
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()


@pytest.mark.parametrize("dtype,atol,fuse,pack", [(None, 1e-4, True, False), (None, 1e-4, False, False),
                                                   (None, 1e-4, True, True), (torch.bfloat16, 0.15, None, False),
                                                   (torch.bfloat16, 0.15, True, True)])
def test_fast_decoder_logits_match_transformers_forward(model_and_tok, dtype, atol, fuse, pack):
    """Prefill + cached steps (with a row compacted out midway) give the logits of a full forward
    pass over the same left-padded sequences; bf16 is compared with transformers under autocast."""
    if pack and dtype == torch.bfloat16 and not cpu_bf16_flags():
        pytest.skip("packed bf16 weights need a CPU with native bf16 (precision.py)")
    _assert_fast_logits(*model_and_tok, dtype, atol, fuse, pack)


@pytest.mark.parametrize("dtype,atol,fuse", [(None, 1e-4, True), (None, 1e-4, False), (torch.bfloat16, 0.15, None)])
@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_fast_decoder_logits_match_transformers_forward_for_each_architecture(kind, dtype, atol, fuse):
    """Llama, Mistral (no window), Qwen2 and Qwen3 (per-head q/k RMSNorm before RoPE, a head size
    that is not hidden / heads), each with grouped-query attention and random norm weights: the
    fast decoder's logits are the transformers forward's, fused or not, and in bf16."""
    model, tok = build_tiny_architecture(kind, seed=5)
    assert FastDecoder.supports(model)
    _assert_fast_logits(model, tok, dtype, atol, fuse, False)


@pytest.mark.parametrize("kind", ["qwen3", "mistral"])
def test_lora_models_of_each_architecture_decode_fast_from_merged_weights(kind):
    model, tok = build_tiny_architecture(kind, seed=6)
    peft = _lora(model)
    assert FastDecoder.supports(peft)
    _assert_fast_logits(peft, tok, None, 1e-4, True, False)
    base = _hf_logits(model, *_padded(tok))
    assert (_hf_logits(peft, *_padded(tok)) - base).abs().max() > 0.1  # the adapters change the logits


@pytest.mark.parametrize("kind,config", [("mistral", {"sliding_window": 4096}), ("qwen3", {"use_sliding_window": True}),
                                         ("qwen3", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})])
def test_windowed_or_length_dependent_models_of_these_architectures_take_the_generic_path(kind, config):
    """A sliding window (Mistral v0.1's 4,096 on every layer; Qwen3's use_sliding_window) or a RoPE
    that follows the length is not what the fast decoder computes: such a model is not taken."""
    model, _ = build_tiny_architecture(kind, **config)
    assert not FastDecoder.supports(model)


def _padded(tok):
    """Two left-padded prompts: ids and mask [2, P]."""
    prompts = [tok("What is 1+2? ")["input_ids"], tok("Hi")["input_ids"]]
    P = max(map(len, prompts))
    ids = torch.full((2, P), tok.pad_token_id)
    mask = torch.zeros((2, P), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):], mask[b, P - len(p):] = torch.tensor(p), 1
    return ids, mask


def _assert_fast_logits(model, tok, dtype, atol, fuse, pack):
    ids, mask = _padded(tok)
    P, G, steps = ids.shape[1], 2, 6
    feed = torch.randint(4, 90, (4, steps), generator=torch.Generator().manual_seed(0))  # tokens fed per row
    with torch.no_grad():
        dec = FastDecoder(model, dtype=dtype, fuse=fuse, pack=pack)
        assert (dec.linear is not torch.nn.functional.linear) == pack
        got = [dec.start(ids, mask, G, steps + 1)]  # [4, V]
        rows = torch.arange(4)
        for t in range(steps):
            if t == 3:  # row 1 (first prompt, second sample) leaves the batch
                rows = torch.tensor([0, 2, 3])
                dec.keep(torch.tensor([0, 2, 3]))
            out = torch.full((4, got[0].shape[-1]), float("nan"))
            out[rows] = dec.step(feed[rows, t])
            got.append(out)
    full_ids = torch.cat([ids.repeat_interleave(G, 0), feed], 1)
    full_mask = torch.cat([mask.repeat_interleave(G, 0), torch.ones_like(feed)], 1)
    want = _hf_logits(model, full_ids, full_mask, dtype)[:, P - 1:]  # [4, steps+1, V]
    for t, g in enumerate(got):
        live = ~g.isnan().any(-1)
        assert live.sum() == (4 if t <= 3 else 3)
        torch.testing.assert_close(g[live], want[live, t], atol=atol, rtol=0)


def test_fast_and_generic_paths_sample_the_same_tokens(model_and_tok):
    """Same generator state, same samples: the fast path changes cost, not the distribution."""
    model, tok = model_and_tok
    prompts = [tok("What is 1+2? ")["input_ids"], tok("x")["input_ids"]]
    p = SamplingParams(max_new_tokens=20, temperature=3.0)
    fast = HFEngine(model, (tok.eos_token_id,), tok.pad_token_id, fast=True)
    slow = HFEngine(model, (tok.eos_token_id,), tok.pad_token_id, fast=False)
    a = fast.generate(prompts, 8, p, torch.Generator().manual_seed(2))
    b = slow.generate(prompts, 8, p, torch.Generator().manual_seed(2))
    assert 0 < int(a.truncated.sum()) < 16  # rows finish at different steps, so compaction happens
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_mask, b.completion_mask) and torch.equal(a.truncated, b.truncated)


def _lora(model, dropout=0.0, seed=0):
    """A LoRA copy of `model` whose B matrices are random (PEFT starts them at 0: no change)."""
    return with_random_lora(copy.deepcopy(model), r=4, alpha=8, dropout=dropout, seed=seed)


def test_lora_models_decode_fast_from_merged_weights(model_and_tok):
    """Prefill and steps of the fast decoder over a LoRA model give the adapter's own logits (not
    the base model's); with adapter dropout it falls back to the generic path."""
    model, tok = model_and_tok
    peft = _lora(model)
    assert FastDecoder.supports(peft) and not FastDecoder.supports(_lora(model, dropout=0.1))
    ids = torch.tensor([tok("What is 1+2? ")["input_ids"]])  # [1, P]
    feed = torch.tensor([[7, 30, 41]])
    with torch.no_grad():
        dec = FastDecoder(peft)
        got = [dec.start(ids, torch.ones_like(ids), 1, 4)] + [dec.step(feed[:, t]) for t in range(3)]
        full = torch.cat([ids, feed], 1)
        want = peft(input_ids=full).logits[0, ids.shape[1] - 1:]  # [4, V]
        base = model(input_ids=full).logits[0, ids.shape[1] - 1:]
    got = torch.cat(got)  # [4, V]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert (got - base).abs().max() > 0.1  # the adapter changes the logits, and the decoder sees it
    engine = HFEngine(peft, (tok.eos_token_id,), tok.pad_token_id)
    with torch.no_grad():
        assert isinstance(engine._decoder(torch.device("cpu")), FastDecoder)


@pytest.mark.parametrize("fast", [True, False])
def test_a_policy_whose_logits_are_not_finite_is_an_error_not_a_rollout(model_and_tok, fast):
    """NaN in the weights (a diverged update, a damaged checkpoint): every draw over NaN was the last
    token of the vocabulary (on CUDA, token 0), a greedy one token 0, with no error."""
    from grouprl.rollout.engine import NonFiniteLogits

    model, tok = model_and_tok
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.model.norm.weight[0] = float("nan")
    engine = HFEngine(broken, (tok.eos_token_id,), tok.pad_token_id, fast=fast)
    for params in (SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=4, greedy=True)):
        with pytest.raises(NonFiniteLogits, match=r"not finite \(NaN or inf\) for 4 of 4 rows after their prompts"):
            engine.generate([tok("ab")["input_ids"], tok("c")["input_ids"]], 2, params,
                            torch.Generator().manual_seed(0))


def test_unsupported_models_fall_back_to_the_generic_path():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    assert not FastDecoder.supports(gpt2)
    engine = HFEngine(gpt2, (0,), 1)
    ro = engine.generate([[5, 6, 7], [8]], 2, SamplingParams(max_new_tokens=5, greedy=True))
    for i, p in enumerate([[5, 6, 7], [5, 6, 7], [8], [8]]):
        with torch.no_grad():
            want = naive_greedy(gpt2, p, 5, 0)
        assert ro.completion_ids[i][ro.completion_mask[i]].tolist() == want


def test_packed_weights_only_for_larger_fp32_models_on_cpu(model_and_tok, monkeypatch):
    """The default: oneDNN-packed weights from PACK_MIN_PARAMS parameters, in fp32, and in bf16
    where oneDNN has bf16 kernels."""
    import grouprl.rollout.llama_decoder as fast

    model, _ = model_and_tok
    assert FastDecoder(model).linear is torch.nn.functional.linear  # 0.5 M parameters: plain MKL
    monkeypatch.setattr(fast, "PACK_MIN_PARAMS", 1000)
    assert FastDecoder(model).linear is fast._packed_linear
    bf16_packs = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # oneDNN has bf16 kernels for this CPU
    assert (FastDecoder(model, dtype=torch.bfloat16).linear is fast._packed_linear) == bf16_packs


@pytest.mark.cpu_rules  # instruments the plain eager loop
def test_small_models_decode_on_one_thread_and_restore_the_setting(model_and_tok, monkeypatch):
    model, tok = model_and_tok
    seen = []
    engine = HFEngine(model, (tok.eos_token_id,), tok.pad_token_id)
    step = FastDecoder.step
    monkeypatch.setattr(FastDecoder, "step", lambda self, t: (seen.append(torch.get_num_threads()), step(self, t))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine.generate([tok("ab")["input_ids"]], 2, SamplingParams(max_new_tokens=3, greedy=True))
        assert seen and set(seen) == {1}  # 0.5 M parameters: below SMALL_MODEL_PARAMS
        assert torch.get_num_threads() == 2
        seen.clear()
        HFEngine(model, (tok.eos_token_id,), tok.pad_token_id, decode_threads=2).generate(
            [tok("ab")["input_ids"]], 2, SamplingParams(max_new_tokens=3, greedy=True))
        assert set(seen) == {2}
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "factor": 4.0},
    {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0, 2.0, 4.0, 8.0],
     "original_max_position_embeddings": 16},
])
def test_rope_that_follows_the_length_decodes_as_the_whole_sequence_recomputed(rope):
    """Dynamic-NTK and LongRoPE pick their frequencies from the sequence's length. The fast decoder
    builds its table once, for prompt + max_new_tokens, from the first token: past the original
    context (16) it sampled from another model than the one the trainer scores. Such a model takes
    the generic path, whose greedy tokens are those of the whole sequence recomputed at every step
    (transformers' own cached generate departs from that once positions pass the original context)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, rope_scaling=rope)
    model = LlamaForCausalLM(cfg).eval()
    assert not FastDecoder.supports(model)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18, 19]]
    ro = HFEngine(model, (0,), 1).generate(prompts, 1, SamplingParams(max_new_tokens=30, greedy=True, ignore_eos=True))
    for i, p in enumerate(prompts):
        with torch.no_grad():
            assert ro.completion_ids[i].tolist() == naive_greedy(model, p, 30, eos=-1)


def test_zero_new_tokens_is_an_empty_completion_on_every_path(model_and_tok, monkeypatch):
    """max_new_tokens=0: [N, 0] completions, from the eager loop and from the slot loop (compiled or
    replayed as graphs), which read the first token's column unconditionally."""
    model, tok = model_and_tok
    prompts = [tok("What is 1+2? ")["input_ids"], tok("Hi")["input_ids"]]
    for compile in (False, True):
        ro = HFEngine(model, (tok.eos_token_id,), tok.pad_token_id, compile=compile).generate(
            prompts, 2, SamplingParams(max_new_tokens=0), torch.Generator().manual_seed(0))
        assert ro.completion_ids.shape == (4, 0) and ro.completion_mask.shape == (4, 0)
