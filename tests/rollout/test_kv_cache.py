"""The built-in engine's KV cache follows the live rows and the tokens fed (FastDecoder grows its
columns in doubling blocks and moves into smaller tensors when rows finish), and decodes exactly
the tokens it decoded when it was allocated whole for rows x (prompt + max_new_tokens)."""

import pytest
import torch

import grouprl.rollout.llama_decoder as llama_decoder
from grouprl.rollout import HFEngine, SamplingParams
from grouprl.rollout.llama_decoder import FastDecoder
from grouprl.rollout.types import left_pad_prompts
from tests.rollout.conftest import short_prompts

T = 40  # new tokens: with a block of 2 the cache grows at t = 2, 4, 8, 16, 32 (then up to P + T)


@pytest.mark.cpu_rules  # instruments the plain eager loop
@pytest.mark.parametrize("params", [SamplingParams(T, temperature=3.0), SamplingParams(T, greedy=True)],
                         ids=["sampled", "greedy"])
def test_a_growing_cache_decodes_the_tokens_of_a_whole_one_and_of_the_generic_path(model_and_tok, monkeypatch,
                                                                                  params):
    """The same generator state gives the same tokens with a cache that starts at 2 new-token
    columns (grows mid-decode, shrinks when rows finish), one allocated whole up front (the layout
    before blocks), and the generic transformers path. Extra stop tokens make rows finish at
    different steps (greedy: 5 of the 8 prompts stop, at steps 4 to 31; the others repeat one
    character to the end)."""
    model, tok = model_and_tok
    stops = (tok.eos_token_id, *tok.convert_tokens_to_ids(list("|}y<6")))
    seen = []  # after each step: live rows, allocated rows, tokens fed, new-token columns allocated
    step = FastDecoder.step
    monkeypatch.setattr(FastDecoder, "step", lambda self, fed: (
        step(self, fed), seen.append((self.n, self.k[0].shape[0], self.t, self.cap - self.P)))[0])

    def generate(fast: bool, block: int):
        monkeypatch.setattr(llama_decoder, "CACHE_BLOCK", block)
        engine = HFEngine(model, stops, tok.pad_token_id, fast=fast)
        return engine.generate(short_prompts(tok), 2, params, torch.Generator().manual_seed(0))

    small = generate(True, 2)
    assert sorted({cols for *_, cols in seen}) == [2, 4, 8, 16, 32, T]  # grew mid-decode, up to P + T
    assert all(fed <= cols <= max(2, 2 * (fed - 1)) for *_, fed, cols in seen)  # at most twice the tokens fed
    assert all(allocated < 2 * live for live, allocated, *_ in seen)  # under twice the live rows
    assert min(live for live, *_ in seen) < 8  # most rows finished early
    whole, generic = generate(True, T), generate(False, T)
    lengths = small.completion_mask.sum(-1)  # [16]
    assert len(set(lengths.tolist())) >= 5 and 0 < int(small.truncated.sum()) < 8
    for other in (whole, generic):
        assert torch.equal(small.completion_ids, other.completion_ids)
        assert torch.equal(small.completion_mask, other.completion_mask)
        assert torch.equal(small.truncated, other.truncated)


def test_the_cache_is_sized_by_live_rows_and_fed_columns(model_and_tok):
    """Shapes of every layer's keys/values and of the key mask after prefill, growth and compaction;
    the logits equal those of a decoder that allocated everything up front, step by step."""
    model, tok = model_and_tok
    ids, mask = left_pad_prompts(short_prompts(tok)[:2], tok.pad_token_id)  # [2, P]
    P, G, new = ids.shape[1], 4, 10
    feed = torch.randint(4, 90, (2 * G, new), generator=torch.Generator().manual_seed(0))  # [N, new]
    with torch.no_grad():
        dec, ref = FastDecoder(model, cache_block=4), FastDecoder(model, cache_block=new)

        def step_both(rows: torch.Tensor, t: int):
            torch.testing.assert_close(dec.step(feed[rows, t]), ref.step(feed[rows, t]), rtol=0, atol=0)

        def shapes():
            assert len({k.shape for k in dec.k + dec.v}) == 1  # every layer alike
            return tuple(dec.k[0].shape), tuple(dec.valid.shape)

        torch.testing.assert_close(dec.start(ids, mask, G, new), ref.start(ids, mask, G, new), rtol=0, atol=0)
        assert shapes() == ((8, model.config.num_key_value_heads, P + 4, dec.D), (8, P + 4))
        rows = torch.arange(8)
        for t in range(4):
            step_both(rows, t)
        assert shapes()[1] == (8, P + 4)  # 4 tokens fed: the first block is full, not grown yet
        step_both(rows, 4)
        assert shapes()[1] == (8, P + 8)  # the fifth token doubled the new-token columns
        keep = torch.tensor([0, 2, 3, 5, 7])  # 5 of 8 live: compacted in place, still 8 rows
        dec.keep(keep), ref.keep(keep)
        rows = rows[keep]
        assert shapes()[1] == (8, P + 8)
        keep = torch.tensor([3, 0, 4])  # 3 of 8 live: moved into tensors of 3 rows
        dec.keep(keep), ref.keep(keep)
        rows = rows[keep]
        assert shapes()[1] == (3, P + 8)
        for t in range(5, new):
            step_both(rows, t)
        assert shapes()[1] == (3, P + new)  # grown once more, to P + max_new_tokens at most
        for (k, v), (k_ref, v_ref) in zip(dec.snapshot(torch.arange(3)), ref.snapshot(torch.arange(3))):
            assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_start_from_a_cached_prefix_grows_its_cache_too(model_and_tok):
    """A continuation (`start_from`) starts with a block of new-token columns as `start` does and
    grows from there, with the logits of a continuation whose cache was allocated whole."""
    model, tok = model_and_tok
    prompts = [tok("What is 1+2? And 3+4?")["input_ids"], tok("Hi there, you")["input_ids"]]
    with torch.no_grad():
        earlier = FastDecoder(model)
        pids, pmask = left_pad_prompts([p[:6] for p in prompts], tok.pad_token_id)
        earlier.start(pids, pmask, 1, 4)
        prefix = earlier.snapshot(torch.arange(2))
        ids, mask = left_pad_prompts(prompts, tok.pad_token_id)  # [2, P]
        dec, ref = FastDecoder(model, cache_block=1), FastDecoder(model, cache_block=8)
        got, want = dec.start_from(ids, mask, 8, prefix), ref.start_from(ids, mask, 8, prefix)
        assert dec.k[0].shape[2] == ids.shape[1] + 1
        for t in range(7):
            tok_t = torch.tensor([10 + t, 20 + t])
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            got, want = dec.step(tok_t), ref.step(tok_t)
        assert dec.k[0].shape[2] == ids.shape[1] + 8  # 1, 2, 4, 8 new-token columns


def test_the_cache_goes_by_the_keyword_the_models_forward_takes(model_and_tok):
    """transformers 5.24 renamed forward's `past_key_values` to `cache` (the old name warns at every
    call, and goes in 5.40; seen on a lent GPU machine): the keyword is read from the model class's
    forward, through a DDP-like `.module` and a PEFT-like base model."""
    from grouprl.rollout.types import cache_kwarg

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            pass

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None):
            pass

    class Wrapped(torch.nn.Module):  # a DDP wrapper: the model is `.module`
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    class Peft(torch.nn.Module):  # a PEFT model: its forward takes **kwargs, its base model says
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def get_base_model(self):
            return self.inner

        def forward(self, *args, **kwargs):
            pass

    assert [cache_kwarg(m) for m in (Old(), New(), Wrapped(New()), Peft(New()), Wrapped(Peft(Old())))] == [
        "past_key_values", "cache", "cache", "cache", "past_key_values"]
    model, tok = model_and_tok  # the installed transformers' own name, with no FutureWarning from a call
    name = cache_kwarg(model)
    assert name in ("cache", "past_key_values")
    assert name in __import__("inspect").signature(type(model).forward).parameters


def test_the_generic_path_warns_of_no_deprecated_cache_keyword(model_and_tok):
    """The generic path (transformers' forward with its cache) and the shared-prompt forward pass the
    cache by the installed transformers' keyword: no FutureWarning (transformers 5.24 and later warned
    at every token while grouprl passed `past_key_values`)."""
    import warnings

    model, tok = model_and_tok
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*", category=FutureWarning)
        HFEngine(model, (tok.eos_token_id,), tok.pad_token_id, fast=False).generate(
            short_prompts(tok), 2, SamplingParams(4), torch.Generator().manual_seed(0))
