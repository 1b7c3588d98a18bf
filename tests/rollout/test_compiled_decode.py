"""The compiled decode step (rollout/compiled_decode.py) draws the tokens the eager step draws, and
the counter-based uniforms behind every draw (rollout/sampling.py) are the hash they claim to be.

The compiled tests compile a handful of graphs (about 15-30 s each on a 2-core CPU); they skip with
the reason where this platform cannot compile (no C++ compiler)."""

import contextlib
import logging
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

import grouprl.rollout.compiled_decode as cd
import grouprl.rollout.llama_decoder as llama_decoder
from grouprl.rollout import HFEngine, SamplingParams
from grouprl.rollout.llama_decoder import FastDecoder
from grouprl.rollout import sampling
from grouprl.rollout.sampling import counter_uniforms, uniform_table
from grouprl.rollout.types import left_pad_prompts
from grouprl.tasks.testing import build_char_tokenizer, build_tiny_architecture, build_tiny_model
from tests.rollout.conftest import short_prompts

T = 40
SAMPLED = SamplingParams(T, temperature=1.5, top_k=40, top_p=0.95)


# ---------------------------------------------------------------- the counter-based uniforms
def _mix32_reference(x: int) -> int:
    """lowbias32 on Python integers (no overflow to avoid)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _uniform_reference(seed: int, row: int, step: int) -> float:
    lo, hi = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    base = _mix32_reference(_mix32_reference(row ^ lo) ^ step)
    a = _mix32_reference(base ^ hi) >> 5
    b = _mix32_reference(_mix32_reference(base ^ 0x9E3779B9) ^ hi) >> 6
    return (a * 2 ** 26 + b) / 2 ** 53


def test_counter_uniforms_are_the_hash_computed_on_python_integers():
    """The tensor version (int64 ops, each 32-bit product split in halves) equals a plain loop
    over Python's unbounded integers, for seeds that use all 62 bits."""
    gen = torch.Generator().manual_seed(1)
    for seed in [0, 1, 2 ** 40 + 12345, 2 ** 62 - 1, int(torch.randint(0, 2 ** 62, (1,), generator=gen))]:
        rows = torch.randint(0, 2 ** 31, (50,), generator=gen)
        steps = torch.randint(0, 2 ** 31, (50,), generator=gen)
        got = counter_uniforms(seed, rows, steps)
        want = torch.tensor([_uniform_reference(seed, int(r), int(s)) for r, s in zip(rows, steps)],
                            dtype=torch.float64)
        assert torch.equal(got, want)


def test_counter_uniforms_look_uniform_and_independent():
    """200,000 numbers of one seed over rows x steps: the Kolmogorov-Smirnov distance to U(0, 1)
    under its 1 % critical value, and neighbouring steps and rows uncorrelated; two seeds differ."""
    u = uniform_table(123, 400, 500, torch.device("cpu"))  # [400, 500]
    x = u.flatten().sort().values
    n = x.numel()
    grid = torch.arange(n + 1, dtype=torch.float64) / n
    ks = torch.maximum(grid[1:] - x, x - grid[:-1])
    assert float(ks.max()) < 1.63 / n ** 0.5
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    for a, b in [(u[:, :-1], u[:, 1:]), (u[:-1], u[1:])]:
        corr = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
        assert abs(float(corr)) < 0.01
    assert not torch.equal(u[:5, :5], uniform_table(124, 5, 5, torch.device("cpu")))



# ---------------------------------------------------------------- the running sum of a draw
@pytest.mark.parametrize("V, block", [(49_152, 4096), (4097, 4096), (1000, 64), (8192, 4096)])
def test_a_running_sum_in_blocks_is_the_one_piece_cumsum(V, block):
    """The two-scan running sum that CUDA's draws use (sampling.running_sum: no scan longer than
    `block`, vocabularies that are not a multiple of it padded) equals one cumsum to float64
    rounding, and comes back contiguous for searchsorted."""
    x = torch.rand(6, V, generator=torch.Generator().manual_seed(V), dtype=torch.float64)
    got = sampling.running_sum(x, block)
    assert got.shape == (6, V) and got.is_contiguous()
    assert torch.allclose(got, x.cumsum(-1), rtol=1e-13, atol=0)


def cuda_draws(monkeypatch, block: int) -> None:
    """CPU's draws take CUDA's path: the running sum in blocks, and the index counted, not searched."""
    monkeypatch.setitem(sampling.SCAN_BLOCK, "cpu", block)
    monkeypatch.setattr(sampling, "COUNTED_DRAWS", {"cpu"})


def searched_draws(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The reference draw, whatever path the draws take (tests/as_cuda.py sets CUDA's): one cumsum
    in float64, searched."""
    cdf = probs.double().cumsum(-1)
    index = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).squeeze(-1)
    return index.clamp_(max=probs.shape[-1] - 1)


def test_draws_over_a_running_sum_in_blocks_are_the_one_piece_draws(monkeypatch):
    """1,000 draws over SmolLM2's 49,152-token vocabulary (a peaked and a flat softmax, and a
    top-k filter that leaves most tokens at 0): the same tokens from CUDA's draw (the blocked running
    sum, its entries below the target counted) as from one cumsum searched, and never a token of
    probability 0."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1000, 49_152, generator=gen) * torch.tensor([4.0, 0.5]).repeat(500)[:, None]
    u = torch.rand(1000, dtype=torch.float64, generator=gen)
    u[:2] = torch.tensor([0.0, 1 - 2 ** -53], dtype=torch.float64)  # the ends of [0, 1)
    for params in (SamplingParams(1), SamplingParams(1, top_k=40)):
        probs = sampling.filtered_probs(logits, params)
        want = searched_draws(probs, u)
        assert torch.equal(sampling.inverse_cdf(probs, u), want)  # this device's draw
        with monkeypatch.context() as m:
            cuda_draws(m, 4096)
            got = sampling.inverse_cdf(probs, u)
        assert torch.equal(got, want) and len(set(want.tolist())) > 300
        assert bool((probs.gather(1, got[:, None]) > 0).all())


def test_the_blocked_draw_compiles_as_one_graph(compiles, monkeypatch):
    """CUDA's draw (the blocked running sum, its entries counted) traces into one graph (fullgraph,
    rows a symbolic size) and picks the tokens that one cumsum searched eagerly picks: on CUDA it
    sits inside the compiled decode step."""
    gen = torch.Generator().manual_seed(1)
    cases = [(torch.softmax(torch.randn(rows, 1500, generator=gen) * 3, -1),
              torch.rand(rows, dtype=torch.float64, generator=gen)) for rows in (5, 9)]
    wants = [searched_draws(probs, u) for probs, u in cases]
    cuda_draws(monkeypatch, 256)
    draw = torch.compile(lambda p, u: sampling.inverse_cdf(p, u), fullgraph=True, dynamic=True)
    for (probs, u), want in zip(cases, wants):
        assert torch.equal(draw(probs, u), want)


def _stops(tok):
    return (tok.eos_token_id, *tok.convert_tokens_to_ids(list("|}y<6")))


def test_a_row_draws_the_same_tokens_whatever_else_is_in_its_batch(model_and_tok):
    """A row's numbers depend on (seed, its row in the call, step) only: the first prompt's
    completions are the same next to other prompts whose rows finish at other steps."""
    model, tok = model_and_tok
    engine = HFEngine(model, _stops(tok), tok.pad_token_id)
    p = short_prompts(tok)
    a = engine.generate([p[0], p[1], p[2]], 2, SAMPLED, torch.Generator().manual_seed(5))
    b = engine.generate([p[0], p[5]], 2, SAMPLED, torch.Generator().manual_seed(5))
    assert torch.equal(a.completion_ids[:2], b.completion_ids[:2])
    assert not torch.equal(a.completion_ids[2:4], b.completion_ids[2:4])


# ---------------------------------------------------------------- compiled against eager
@pytest.fixture(scope="module")
def compiles():
    try:
        torch.compile(lambda x: x * 2 + 1, fullgraph=True)(torch.ones(3))
    except Exception as err:  # noqa: BLE001 — whatever stops Inductor here is the reason to skip
        pytest.skip(f"torch.compile cannot compile on this platform: {type(err).__name__}: {err}")


def _both(model, tok, params, prompts, G=2, stops=None, **kw):
    out = []
    for compile in (False, True):  # the eager side is the plain eager loop (no graphs of the eager step)
        engine = HFEngine(model, stops or _stops(tok), tok.pad_token_id, compile=compile,
                          **(kw if compile else {**kw, "cuda_graphs": False}))
        out.append(engine.generate(prompts, G, params, torch.Generator().manual_seed(0)))
    assert not cd._FAILED, cd._FAILED  # the compiled side compiled (no eager fallback)
    return out


def _assert_same(eager, compiled):
    assert torch.equal(eager.completion_ids, compiled.completion_ids)
    assert torch.equal(eager.completion_mask, compiled.completion_mask)
    assert torch.equal(eager.truncated, compiled.truncated)


def test_compiled_sampling_draws_the_eager_tokens_as_rows_finish_and_leave(model_and_tok, compiles, monkeypatch):
    """Temperature, top-k and top-p under one seed; six stop tokens make rows finish at different
    steps, so the compiled loop masks finished rows, moves the live ones into smaller batches and
    reads the finished flags only every 4 steps. Same tokens, lengths and truncation as eager."""
    model, tok = model_and_tok
    moves = []
    compact = cd.CompiledDecodeLoop._compact
    monkeypatch.setattr(cd.CompiledDecodeLoop, "_compact", staticmethod(
        lambda dec, live, S, *a: (moves.append((live.numel(), S)), compact(dec, live, S, *a))[1]))
    eager, compiled = _both(model, tok, SAMPLED, short_prompts(tok), check_every=4)
    _assert_same(eager, compiled)
    lengths = eager.completion_mask.sum(-1)
    assert len(set(lengths.tolist())) >= 5 and 0 < int(eager.truncated.sum()) < 16  # rows ended at many steps
    assert moves and all(S == live < 16 for live, S in moves)  # CPU: exactly the live rows


def test_compiled_greedy_equals_eager_across_cache_growth_and_reuses_its_graph(model_and_tok, compiles,
                                                                              monkeypatch):
    """ignore_eos with a 2-column first cache: the cache widens five times during the call; then
    calls with other prompts, other row counts (one row included) and lengths run without compiling
    another graph."""
    model, tok = model_and_tok
    monkeypatch.setattr(llama_decoder, "CACHE_BLOCK", 2)
    params = SamplingParams(T, greedy=True, ignore_eos=True)
    eager, compiled = _both(model, tok, params, short_prompts(tok))
    _assert_same(eager, compiled)
    assert bool(compiled.completion_mask.all())
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    params = SamplingParams(T - 9, greedy=True, ignore_eos=True)
    eager, compiled = _both(model, tok, params, short_prompts(tok)[:3], G=3)
    _assert_same(eager, compiled)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames  # nothing recompiled
    eager, compiled = _both(model, tok, params, short_prompts(tok)[:1], G=1)  # one row, beside an empty slot
    _assert_same(eager, compiled)
    assert compiled.completion_ids.shape[0] == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames  # a size of 1 would be a new graph


def _llama_gqa(seed=0):
    """A small model of SmolLM2's architecture: Llama, grouped-query attention (9 query heads on 3
    key/value heads), tied embeddings."""
    tok = build_char_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=72, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, rope_theta=100000.0)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval(), tok


def test_compiled_greedy_equals_eager_with_grouped_query_attention(compiles):
    model, tok = _llama_gqa()
    eager, compiled = _both(model, tok, SamplingParams(T, greedy=True), short_prompts(tok), G=1)
    _assert_same(eager, compiled)


def test_compiled_decoding_of_qwen3_equals_eager(compiles):
    """Qwen3 (per-head q/k norms before RoPE, head size 16 over a hidden size of 48) through the
    compiled step: the eager loop's sampled tokens, as rows finish and leave (Mistral's step is
    Llama's, tested above)."""
    model, tok = build_tiny_architecture("qwen3", seed=2)
    eager, compiled = _both(model, tok, SAMPLED, short_prompts(tok))
    _assert_same(eager, compiled)
    assert len(set(eager.completion_mask.sum(-1).tolist())) >= 3  # rows ended at different steps


def test_compiled_bf16_logits_stay_within_bf16_tolerance_of_the_eager_step(compiles):
    """bf16 matmuls (FastDecoder's dtype): each compiled step's logits against the eager step's for
    the same fed tokens, within a bf16 rounding of the logits' scale; the greedy tokens agree
    wherever the eager top-2 margin exceeds that tolerance."""
    model, tok = _llama_gqa(seed=1)
    ids, mask = left_pad_prompts(short_prompts(tok), tok.pad_token_id)
    eager = FastDecoder(model, dtype=torch.bfloat16)
    comp = FastDecoder(model, dtype=torch.bfloat16)
    with torch.no_grad():
        first = eager.start(ids, mask, 1, 16)
        assert torch.equal(first, comp.start(ids, mask, 1, 16, zeroed=True))
        N = first.shape[0]
        step = cd.compiled_step(torch.device("cpu"))
        spec = cd.StepSpec(True, 1.0, 0, 1.0, tok.pad_token_id, False, return_logits=True)
        tok_e = first.argmax(-1)
        tok_c, pos = tok_e.clone(), comp.next_pos.clone()
        cursor = torch.tensor([1, comp.P])
        completion = torch.zeros(N + 1, 16, dtype=torch.long)
        uniforms = torch.zeros(N + 1, 16, dtype=torch.float64)
        for t in range(1, 12):
            le = eager.step(tok_e)
            W = comp.P + t
            tok_c, _, lc = step(comp, spec, tok_c, pos, cursor, torch.arange(N), torch.zeros(N, dtype=torch.bool),
                                torch.empty(W), comp.valid, comp.k, comp.v, uniforms, completion,
                                torch.tensor([tok.eos_token_id]), torch.full((N + 1,), 16))
            tol = 2 ** -7 * le.abs().amax(-1, keepdim=True)  # one bf16 rounding of the largest logit
            assert bool(((lc - le).abs() <= tol).all()), float((lc - le).abs().max())
            top2 = le.topk(2, -1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * tol[:, 0]
            assert torch.equal(lc.argmax(-1)[clear], le.argmax(-1)[clear])
            tok_e = le.argmax(-1)
            tok_c = tok_e.clone()  # both feed the same tokens next


def test_compiled_decoding_of_a_lora_model_equals_eager(compiles):
    """A PEFT model with nonzero LoRA adapters decodes from the merged weights in both loops."""
    peft = pytest.importorskip("peft")
    model, tok = build_tiny_model("tiny", seed=3)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    lora = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    lora.eval()
    eager, compiled = _both(lora, tok, SAMPLED, short_prompts(tok))
    _assert_same(eager, compiled)
    plain_model = build_tiny_model("tiny", seed=3)[0].eval()  # get_peft_model changed `model` in place
    plain = HFEngine(plain_model, _stops(tok), tok.pad_token_id).generate(short_prompts(tok), 2, SAMPLED,
                                                                           torch.Generator().manual_seed(0))
    assert not torch.equal(plain.completion_ids, compiled.completion_ids)  # the adapters mattered


def _two_turns(engine, tok, G=2):
    """Two calls inside keep_conversations (the multi-turn driver's pattern): G sampled completions
    per prompt, then each continued (G = 1) after "ok"; returns the two rollouts and the caches kept
    after the first call (token tuple -> (k, v))."""
    gen = torch.Generator().manual_seed(0)
    with engine.keep_conversations():
        first = engine.generate(short_prompts(tok), G, SAMPLED, gen)
        kept = dict(engine._kept)
        prompts = [p for p in short_prompts(tok) for _ in range(G)]
        follow = [p + c + tok("ok")["input_ids"] for p, c in zip(prompts, first.token_lists())]
        second = engine.generate(follow, 1, SAMPLED, gen)
    return first, second, kept


def _assert_same_turns(want, got):
    """The same tokens in both turns, and the same rows kept, each with its cache to rounding."""
    for a, b in zip(want[:2], got[:2]):
        _assert_same(a, b)
    assert want[2].keys() == got[2].keys() and len(want[2]) >= 4
    for key, (k, v) in want[2].items():
        assert got[2][key][0].shape == k.shape and k.shape[2] == len(key) - 1  # [layers, Hkv, c, D]: EOS not fed
        torch.testing.assert_close(got[2][key], (k, v), atol=1e-5, rtol=1e-5)


def _recording_keeps(monkeypatch):
    """(per slot-loop call, the rows each hand to `keep` gave, in order, with "move" where the live
    rows moved into fewer slots; the prefixes start_from got)."""
    handed, prefixes = [], []
    run, keep_finished, compact = cd.CompiledDecodeLoop.run, cd.CompiledDecodeLoop._keep_finished, \
        cd.CompiledDecodeLoop._compact
    monkeypatch.setattr(cd.CompiledDecodeLoop, "run", lambda self, *a, **k: (handed.append([]), run(self, *a, **k))[1])
    monkeypatch.setattr(cd.CompiledDecodeLoop, "_keep_finished", staticmethod(
        lambda dec, finished, rowmap, completion, eos, limit, kept, keep, caller: keep_finished(
            dec, finished, rowmap, completion, eos, limit, kept,
            lambda rows, *a: (handed[-1].append(rows), keep(rows, *a)), caller)))
    monkeypatch.setattr(cd.CompiledDecodeLoop, "_compact", staticmethod(
        lambda *a: (handed[-1].append("move"), compact(*a))[1]))
    start_from = FastDecoder.start_from
    monkeypatch.setattr(FastDecoder, "start_from", lambda self, ids, mask, T, prefix: (
        prefixes.append(sum(p is not None for p in prefix)), start_from(self, ids, mask, T, prefix))[1])
    return handed, prefixes


def test_multiturn_calls_decode_in_the_slot_loop_with_the_eager_loops_tokens_and_caches(
        model_and_tok, eager_graphs, monkeypatch):
    """Inside keep_conversations the slot loop (here the eager step replayed as stand-in graphs, as
    on CUDA without compiling) keeps each row that ends with EOS: the caches of the rows that
    finished are taken before the live rows move into fewer slots, and the rest at the end. The
    same rows are kept, with the same keys/values, as the plain eager loop keeps, and the second
    turn continues from them with the same tokens."""
    model, tok = model_and_tok
    monkeypatch.setattr(cd, "compiled_step", lambda device: pytest.fail("compiled with compile=False"))
    want = _two_turns(HFEngine(model, _stops(tok), tok.pad_token_id, cuda_graphs=False), tok)
    assert eager_graphs == []  # the plain eager loop
    handed, prefixes = _recording_keeps(monkeypatch)
    got = _two_turns(HFEngine(model, _stops(tok), tok.pad_token_id, check_every=4), tok)
    _assert_same_turns(want, got)
    assert eager_graphs.count("enter") == 2 and eager_graphs.count("replay") > 0  # both turns in the slot loop
    _assert_graph_discipline(eager_graphs)
    first = handed[0]
    rows = [r for hand in first if hand != "move" for r in hand]
    assert sorted(rows) == (~got[0].truncated).nonzero().squeeze(-1).tolist()  # each row ended by EOS, once
    moves = [i for i, hand in enumerate(first) if hand == "move"]
    assert moves and all(i > 0 and first[i - 1] != "move" for i in moves)  # finished rows handed before each move
    assert prefixes == [len(rows)]  # the second turn: every row that ended with EOS goes on from its cache


def test_rows_kept_at_the_first_and_the_last_token_with_a_stop_token_as_padding(model_and_tok, eager_graphs):
    """Rows that end at their first token and at the last allowed one, the padding itself a stop
    token, in a call of 8 rows and in a call of one (a lone row runs beside an empty slot): the slot
    loop keeps the rows the eager loop keeps, with the same caches. A row's draws depend on the seed,
    its row and the step only, so a stop token taken from a run without stops ends a row where that
    run drew it."""
    model, tok = model_and_tok
    T, prompts = 10, short_prompts(tok)
    params = SamplingParams(T, temperature=1.5)

    def run(rows, stops, pad, **kw):
        engine = HFEngine(model, stops, pad, **kw)
        with engine.keep_conversations():
            out = engine.generate([prompts[r] for r in rows], 1, params, torch.Generator().manual_seed(0))
            return out, dict(engine._kept)

    comp = run(range(8), (tok.eos_token_id,), tok.pad_token_id, cuda_graphs=False)[0].completion_ids.tolist()
    first = comp[0][0]  # row 0 ends at its first token
    last = next(r for r in range(1, 8) if first not in comp[r] and comp[r][T - 1] not in comp[r][: T - 1])
    alone = run([last], (tok.eos_token_id,), tok.pad_token_id, cuda_graphs=False)[0].completion_ids[0, 0].item()
    cases = [(range(8), (first, comp[last][T - 1]), {(0, 1), (last, T)}),  # (row, length) of rows that must be kept
             ([last], (alone,), {(0, 1)})]
    for rows, stops, ends in cases:
        want, got = (run(rows, stops, stops[0], **kw) for kw in ({"cuda_graphs": False}, {"check_every": 4}))
        _assert_same(want[0], got[0])
        assert want[1].keys() == got[1].keys()
        for key, kv in want[1].items():
            torch.testing.assert_close(got[1][key], kv, atol=1e-5, rtol=1e-5)
        for row, length in ends:
            key = tuple(prompts[rows[row]] + got[0].completion_ids[row, :length].tolist())
            assert key[-1] in stops and got[1][key][0].shape[2] == len(key) - 1  # the stop never fed
    assert eager_graphs.count("enter") == 2  # both calls in the slot loop


def test_multiturn_continuation_with_compile_on_equals_eager(model_and_tok, compiles, monkeypatch):
    """The same with the compiled step: both turns decode in the compiled slot loop, keep the eager
    loop's rows and caches, and give its tokens."""
    model, tok = model_and_tok
    want = _two_turns(HFEngine(model, _stops(tok), tok.pad_token_id, compile=False), tok)
    runs = []
    run = cd.CompiledDecodeLoop.run
    monkeypatch.setattr(cd.CompiledDecodeLoop, "run", lambda self, *a, **k: (runs.append(1), run(self, *a, **k))[1])
    got = _two_turns(HFEngine(model, _stops(tok), tok.pad_token_id, compile=True, check_every=4), tok)
    assert not cd._FAILED, cd._FAILED
    assert len(runs) == 2
    _assert_same_turns(want, got)


# ---------------------------------------------------------------- captured steps (CUDA graphs' discipline)
class RecordedGraphs:
    """A stand-in for CudaGraphs on CPU with a graph's contract: `capture` runs nothing and returns
    a replay that runs the captured function again over the very objects it was given, so the loop
    must keep every step's state in those tensors. `events` is the order of direct steps, captures
    and replays."""

    events: list[str] = []
    replaying = False

    def __init__(self, device):
        self.device = device

    @contextlib.contextmanager
    def running(self):
        RecordedGraphs.events.append("enter")
        yield
        RecordedGraphs.events.append("exit")

    def capture(self, one_step):
        RecordedGraphs.events.append("capture")

        def replay():
            RecordedGraphs.events.append("replay")
            RecordedGraphs.replaying = True
            try:
                one_step()
            finally:
                RecordedGraphs.replaying = False

        return replay


@pytest.fixture
def recorded_graphs(monkeypatch, compiles):
    monkeypatch.setattr(cd, "GRAPH_BACKENDS", {"cpu": RecordedGraphs})
    monkeypatch.setattr(cd, "_GRAPHS_FAILED", {})
    RecordedGraphs.events = []
    direct = _direct(cd.compiled_step(torch.device("cpu")))
    monkeypatch.setattr(cd, "compiled_step", lambda device: direct)
    return RecordedGraphs.events


def _direct(step):
    """`step`, recording each call the loop makes itself as "direct" (a replay calls it inside one_step)."""
    def direct(*args):
        if not RecordedGraphs.replaying:
            RecordedGraphs.events.append("direct")
        return step(*args)

    return direct


def _runs(events):
    """Collapse the event list into (event, count) runs."""
    out = []
    for e in events:
        if out and out[-1][0] == e:
            out[-1][1] += 1
        else:
            out.append([e, 1])
    return [tuple(r) for r in out]


def _assert_graph_discipline(events):
    runs = _runs(events)
    assert ("capture", 1) in runs and all(n == 1 for e, n in runs if e == "capture")
    for i, (e, _) in enumerate(runs):
        if e == "capture":  # right after a direct step of its shape, and replayed
            assert runs[i - 1][0] == "direct" and i + 1 < len(runs) and runs[i + 1][0] == "replay"


def test_captured_steps_replay_the_tokens_of_the_direct_steps(model_and_tok, recorded_graphs, monkeypatch):
    """With a graph backend on CPU: sampled rows that finish and leave (the batch shrinks) and a
    greedy call whose cache widens from 2 new-token columns give the eager tokens. Each shape runs one direct step
    first (its kernels' first launch is never inside a capture), then one capture, then replays;
    a shape is captured only when at least MIN_GRAPH_STEPS steps follow, and every decode step is
    a direct step or a replay."""
    model, tok = model_and_tok
    events = recorded_graphs
    eager, graphed = _both(model, tok, SAMPLED, short_prompts(tok), check_every=4)
    _assert_same(eager, graphed)
    monkeypatch.setattr(llama_decoder, "CACHE_BLOCK", 2)
    prompts = short_prompts(tok)
    P = max(map(len, prompts))  # steps t = 1 .. T2-1 write cache columns P .. P+T2-2
    T2 = cd.GRAPH_WIDTH_STEP + 3 - P  # the second width (columns 128-130, the call's last) gets 2 steps: too
    # few to capture
    eager2, graphed2 = _both(model, tok, SamplingParams(T2, greedy=True, ignore_eos=True), prompts)
    _assert_same(eager2, graphed2)
    calls = [i for i, e in enumerate(events) if e == "enter"]
    assert len(calls) == 2 and events.count("exit") == 2
    second = events[calls[1]:]
    assert second.count("direct") + second.count("replay") == T2 - 1  # ignore_eos: every step runs
    assert _runs(second)[-3:] == [("replay", cd.GRAPH_WIDTH_STEP - P - 1), ("direct", 2), ("exit", 1)]
    _assert_graph_discipline(events)


class FailingGraphs(RecordedGraphs):
    def capture(self, one_step):
        RecordedGraphs.events.append("capture")
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


class UnbuildableGraphs(RecordedGraphs):
    def __init__(self, device):
        raise AttributeError("module 'torch.cuda' has no attribute 'graph_pool_handle'")


def _warns_once(model, tok, match: str):
    """Two compiled calls: the first warns, matching `match`, the second warns nothing (the failure
    is remembered); both must give the eager loop's tokens."""
    eager = HFEngine(model, _stops(tok), tok.pad_token_id, cuda_graphs=False).generate(
        short_prompts(tok), 2, SAMPLED, torch.Generator().manual_seed(0))
    engine = HFEngine(model, _stops(tok), tok.pad_token_id, compile=True)
    with pytest.warns(RuntimeWarning, match=match):
        first = engine.generate(short_prompts(tok), 2, SAMPLED, torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = engine.generate(short_prompts(tok), 2, SAMPLED, torch.Generator().manual_seed(0))
    _assert_same(eager, first)
    _assert_same(eager, second)


def test_a_backend_that_cannot_be_built_warns_once_and_the_steps_run_directly(model_and_tok, recorded_graphs,
                                                                             monkeypatch):
    monkeypatch.setattr(cd, "GRAPH_BACKENDS", {"cpu": UnbuildableGraphs})
    _warns_once(*model_and_tok, "has no attribute 'graph_pool_handle'")
    assert set(recorded_graphs) == {"direct"}


def test_a_capture_that_fails_warns_once_and_the_steps_run_directly(model_and_tok, recorded_graphs, monkeypatch):
    """The first failed capture warns, naming the error; the call and later calls give the eager
    tokens from direct steps, and nothing is captured again."""
    monkeypatch.setattr(cd, "GRAPH_BACKENDS", {"cpu": FailingGraphs})
    _warns_once(*model_and_tok, "operation not permitted when stream is capturing")
    assert recorded_graphs.count("capture") == 1 and "replay" not in recorded_graphs
    assert recorded_graphs.count("enter") == 1  # the second call found no backend to run on


def test_generation_cuda_graphs_false_captures_nothing(model_and_tok, recorded_graphs, make_cfg):
    """The config's generation_cuda_graphs reaches the engine, and false steps directly."""
    from grouprl.rollout.factory import make_engine

    model, tok = model_and_tok
    for setting in (True, False):
        assert make_engine(make_cfg(generation_cuda_graphs=setting), model, tok, None, None).cuda_graphs is setting
    engine = HFEngine(model, _stops(tok), tok.pad_token_id, compile=True, cuda_graphs=False)
    engine.generate(short_prompts(tok), 2, SAMPLED, torch.Generator().manual_seed(0))
    assert set(recorded_graphs) == {"direct"}


def test_a_platform_that_cannot_compile_decodes_eagerly_with_one_warning(model_and_tok, monkeypatch):
    """The compile error is caught once: one RuntimeWarning naming it, the eager tokens, and no
    second try in later calls."""
    calls = _compile_fails(monkeypatch, "InvalidCxxCompiler: No working C++ compiler found")
    _warns_once(*model_and_tok, "InvalidCxxCompiler: No working C\\+\\+ compiler found")
    assert len(calls) == 1


def _compile_fails(monkeypatch, message: str) -> list:
    """torch.compile gives a step that raises `message` when called, with no compile remembered;
    returns the list that each call of it appends to."""
    monkeypatch.setattr(cd, "_COMPILED", {})
    monkeypatch.setattr(cd, "_FAILED", {})
    monkeypatch.setattr(cd, "_COMPILE_SECONDS", {})
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError(message)

    monkeypatch.setattr(cd.torch, "compile", lambda fn, **kw: broken)
    return calls



@pytest.fixture
def eager_graphs(monkeypatch):
    """RecordedGraphs on CPU, with the eager step's direct calls recorded (no compiling needed)."""
    monkeypatch.setattr(cd, "GRAPH_BACKENDS", {"cpu": RecordedGraphs})
    monkeypatch.setattr(cd, "_GRAPHS_FAILED", {})
    RecordedGraphs.events = []
    monkeypatch.setattr(cd, "decode_step", _direct(cd.decode_step))
    return RecordedGraphs.events


def test_without_compiling_the_eager_step_is_replayed_as_graphs(model_and_tok, eager_graphs, monkeypatch):
    """On a device with graphs (CUDA; here the stand-in), a run that does not compile still replays
    its steps: the eager decode_step in the slot loop, captured once per shape. The tokens of the
    plain eager loop, for sampled rows that finish and leave and for a greedy call whose cache
    widens; nothing is compiled; generation_cuda_graphs: false keeps the plain eager loop."""
    model, tok = model_and_tok
    monkeypatch.setattr(cd, "compiled_step", lambda device: pytest.fail("compiled with compile=False"))
    for params, block in ((SAMPLED, None), (SamplingParams(cd.WIDTH_STEP + 6, greedy=True, ignore_eos=True), 2)):
        if block:
            monkeypatch.setattr(llama_decoder, "CACHE_BLOCK", block)
        want = HFEngine(model, _stops(tok), tok.pad_token_id, cuda_graphs=False).generate(
            short_prompts(tok), 2, params, torch.Generator().manual_seed(0))
        assert eager_graphs == []  # the plain loop: no slot loop, no graphs
        got = HFEngine(model, _stops(tok), tok.pad_token_id, check_every=4).generate(
            short_prompts(tok), 2, params, torch.Generator().manual_seed(0))
        _assert_same(want, got)
        _assert_graph_discipline(eager_graphs)
        assert eager_graphs.count("replay") > eager_graphs.count("direct")
        eager_graphs.clear()


def test_a_failed_compile_goes_on_with_the_eager_step_replayed_as_graphs(model_and_tok, eager_graphs, monkeypatch,
                                                                         caplog):
    """A compile that fails at its first step (as Inductor's code generation did on an H100) warns
    once and the same call goes on with the eager step, replayed as graphs; a later call does not
    try again. Both give the eager loop's tokens. The error's whole traceback is logged at DEBUG
    (the warning names the error only; benchmarks/decode.py prints it)."""
    calls = _compile_fails(monkeypatch, "Error in codegen for ComputedBuffer(name='buf629', data=SplitScan(...))")
    with caplog.at_level("DEBUG", logger="grouprl.rollout.compiled_decode"):
        _warns_once(*model_and_tok, "Error in codegen.*decoding with the eager step, replayed as graphs")
    assert len(calls) == 1 and eager_graphs.count("enter") == 2  # both calls ran in the slot loop
    _assert_graph_discipline(eager_graphs)
    logged = [r for r in caplog.records if r.exc_info and "Error in codegen" in str(r.exc_info[1])]
    assert len(logged) == 1 and logged[0].levelname == "DEBUG" and logged[0].exc_info[2] is not None


class RecordOps(TorchDispatchMode):
    """Appends (op, args, kwargs) of every aten op dispatched inside it to `ops`."""

    def __init__(self, ops: list):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


class OpsOfReplays(RecordedGraphs):
    """RecordedGraphs whose replays record every aten op they dispatch, with its arguments."""

    ops: list = []

    def capture(self, one_step):
        replay = super().capture(one_step)

        def recorded():
            with RecordOps(OpsOfReplays.ops):
                replay()

        return recorded


# ops whose result a CUDA stream cannot produce without the host reading a device value (a sync,
# which a capture refuses), by their overload packets
_SYNCING = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select", "_unique2",
            "unique_dim", "unique_consecutive", "repeat_interleave", "isin"}  # isin: for many test elements it sorts


def test_the_eager_step_makes_no_host_sync_that_a_cuda_capture_refuses(model_and_tok, eager_graphs, monkeypatch):
    """What a CUDA graph can record: every op of the eager decode step, as a replay dispatches it
    (sampling with temperature, top-k and top-p, six stop tokens), is a device op whose sizes do not
    depend on a device value -- no .item(), nonzero, unique, boolean-mask index or other read-back.
    (On CPU, where no sync exists, this is the check that stands in for torch's capture.)"""
    model, tok = model_and_tok
    monkeypatch.setattr(cd, "GRAPH_BACKENDS", {"cpu": OpsOfReplays})
    OpsOfReplays.ops = []
    HFEngine(model, _stops(tok), tok.pad_token_id).generate(short_prompts(tok), 2, SAMPLED,
                                                            torch.Generator().manual_seed(0))
    names = {func.overloadpacket.__name__ for func, _, _ in OpsOfReplays.ops}
    counted = "cpu" in sampling.COUNTED_DRAWS  # as on CUDA, under tests/as_cuda.py
    draw = {"le", "sum"} if counted else {"searchsorted"}
    assert {"mm", "index_copy_", "topk", "sort", "eq", "index_put_"} | draw <= names  # the whole step
    assert ("searchsorted" in names) != counted
    assert not names & _SYNCING, names & _SYNCING
    bool_index = [func for func, args, _ in OpsOfReplays.ops if func.overloadpacket.__name__ in ("index", "index_put_")
                  and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))]
    assert not bool_index  # a boolean index is a nonzero inside


class PoolCountingGraph:
    """torch.cuda.CUDAGraph on CPU with the caching allocator's bookkeeping of private pools
    (create_or_incref_pool and releasePool in CUDACachingAllocator.cpp): a capture into a pool id
    counts one more user, a graph's destruction one fewer, and a pool whose users all went stays
    known at 0, where a new capture into it fails the allocator's assert."""

    pools: dict = {}  # pool id -> use_count
    captures = 0

    def capture_begin(self, pool=None, capture_error_mode="global"):
        count = PoolCountingGraph.pools.get(pool)
        if count == 0:
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED at "
                               "\"c10/cuda/CUDACachingAllocator.cpp\":2630, please report a bug to PyTorch.")
        PoolCountingGraph.pools[pool] = (count or 0) + 1
        PoolCountingGraph.captures += 1
        self.pool = pool

    def capture_end(self):
        pass

    def replay(self):
        pass

    def __del__(self):
        if hasattr(self, "pool"):
            PoolCountingGraph.pools[self.pool] -= 1


class _Stream:
    def wait_stream(self, other):
        pass


class CudaGraphsOnCpu(cd.CudaGraphs):
    """The real CudaGraphs over PoolCountingGraph; its captured function runs at each replay, not
    at capture (a CUDA capture records kernels and runs none)."""

    def capture(self, one_step):
        recorded = []
        replay = super().capture(lambda: recorded.append(one_step))

        def run():
            replay()
            recorded[0]()

        return run


def pool_counting_graphs(monkeypatch, device_type: str = "cpu") -> None:
    """CudaGraphsOnCpu as `device_type`'s graph backend, over PoolCountingGraph and stand-ins for
    torch.cuda's streams (also tests/as_cuda.py's)."""
    for name, value in (("CUDAGraph", PoolCountingGraph),
                        ("graph_pool_handle", lambda: (0, len(PoolCountingGraph.pools))),
                        ("Stream", lambda device: _Stream()), ("current_stream", lambda device=None: _Stream()),
                        ("stream", lambda s: contextlib.nullcontext())):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(cd.CudaGraphs, "_streams", {})
    monkeypatch.setattr(cd, "GRAPH_BACKENDS", {**cd.GRAPH_BACKENDS, device_type: CudaGraphsOnCpu})
    monkeypatch.setattr(cd, "_GRAPHS_FAILED", {})
    monkeypatch.setattr(PoolCountingGraph, "pools", {})
    monkeypatch.setattr(PoolCountingGraph, "captures", 0)


def test_a_call_that_passes_several_widths_captures_each_one(model_and_tok, monkeypatch):
    """An ignore_eos call of 150 tokens crosses GRAPH_WIDTH_STEP (128) columns: one capture per width,
    all in the call's one pool. The loop drops a width's replay at the next width; a pool whose graphs
    were all freed cannot take another capture (the likely cause of a capture that failed in a 256-token
    training call on an H100, which then decoded eagerly), so the call keeps its graphs. The eager
    loop's tokens."""
    model, tok = model_and_tok
    pool_counting_graphs(monkeypatch)
    params = SamplingParams(150, temperature=1.0, ignore_eos=True)
    want = HFEngine(model, _stops(tok), tok.pad_token_id, cuda_graphs=False).generate(
        short_prompts(tok), 2, params, torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = HFEngine(model, _stops(tok), tok.pad_token_id).generate(
            short_prompts(tok), 2, params, torch.Generator().manual_seed(0))
    _assert_same(want, got)
    assert PoolCountingGraph.captures == 2  # widths 128 and 150 + P
    assert set(PoolCountingGraph.pools.values()) == {0}  # every graph freed once the call ended


# ---------------------------------------------------------------- generation_compile: auto
def test_auto_compiles_when_the_projected_saving_exceeds_the_compile_cost(caplog):
    """After PROBE_CALLS timed calls: compile iff the remaining calls x the saving per call
    (SAVED_PER_LAYER_STEP_S x layers x decode steps, at most MAX_SAVED_FRACTION of the call's
    eager time, both of the device type) > COMPILE_BASE_S + COMPILE_PER_LAYER_S x layers."""
    layers, steps = 4, 100  # per call
    cost = cd.COMPILE_BASE_S + cd.COMPILE_PER_LAYER_S * layers
    per_call = cd.SAVED_PER_LAYER_STEP_S["cpu"] * layers * steps  # 0.04 s: below the cap for a 1 s call
    enough = int(cost / per_call) + cd.PROBE_CALLS + 2  # saving just above the cost
    cases = [(enough, 1.0, True), (enough - 4, 1.0, False), (None, 1.0, False),
             (enough, per_call / cd.MAX_SAVED_FRACTION["cpu"] / 2, False)]  # the cap: half the saving
    for planned, seconds, want in cases:
        choice = cd.CompileChoice("auto", planned)
        with caplog.at_level(logging.INFO, logger=cd.__name__):
            for _ in range(cd.PROBE_CALLS):
                assert choice.probing() and not choice.use()
                choice.record(seconds, steps, layers)
        assert not choice.probing() and choice.use() is want, (planned, seconds)
    assert "auto compiles" in caplog.text and "stays eager" in caplog.text
    # on CUDA a step is launches: 5x the saving per layer and step, capped at 80 % of the eager time
    cuda_enough = int(cost / (cd.SAVED_PER_LAYER_STEP_S["cuda"] * layers * steps)) + cd.PROBE_CALLS + 2
    for device_type, want in [("cuda", True), ("cpu", False)]:
        choice = cd.CompileChoice("auto", cuda_enough)
        for _ in range(cd.PROBE_CALLS):
            choice.record(1.0, steps, layers, device_type)
        assert choice.use() is want, device_type
    # probe calls that replayed the eager step as graphs: compiling adds only the fusion, priced apart
    graphed_enough = int(cost / (cd.SAVED_PER_LAYER_STEP_S["cuda+graphs"] * layers * steps)) + cd.PROBE_CALLS + 2
    for planned, want in [(graphed_enough, True), (cuda_enough, False)]:
        choice = cd.CompileChoice("auto", planned)
        for _ in range(cd.PROBE_CALLS):
            choice.record(1.0, steps, layers, "cuda+graphs")
        assert choice.use() is want, planned
    assert cd.CompileChoice(True).use() and not cd.CompileChoice(False).use()
    assert not cd.CompileChoice(False).probing()


def test_compiled_decoding_with_onednn_packed_weights_equals_eager(model_and_tok, compiles, monkeypatch):
    """Models from PACK_MIN_PARAMS up decode with oneDNN-packed weights on CPU; the compiled step
    reaches them through the grouprl::packed_linear op (here the tiny model, packed by lowering
    the threshold). Same tokens as the eager packed loop."""
    model, tok = model_and_tok
    monkeypatch.setattr(llama_decoder, "PACK_MIN_PARAMS", 0)
    if not llama_decoder._can_pack(model, torch.float32, 1):
        pytest.skip("this torch build has no oneDNN packing ops")
    eager, compiled = _both(model, tok, SAMPLED, short_prompts(tok))
    _assert_same(eager, compiled)


@pytest.mark.cpu_rules  # counts the plain eager loop's calls
def test_generation_compile_reaches_the_engine_and_auto_decides_after_probing(model_and_tok, make_cfg, monkeypatch):
    """The config's generation_compile is the engine's setting (auto with the run's max_steps as
    its planned calls); a wrong value is a ConfigError naming the choices. An auto engine whose
    run is long enough compiles from its third call on."""
    from grouprl.config import ConfigError
    from grouprl.rollout.factory import make_engine

    model, tok = model_and_tok
    for setting, want in [("auto", "auto"), (True, True), (False, False)]:
        engine = make_engine(make_cfg(generation_compile=setting, max_steps=7), model, tok, None, None)
        assert engine.compile == want and engine.planned_calls == 7
    with pytest.raises(ConfigError, match="generation_compile='sometimes' is not one of: auto, true, false"):
        make_cfg(generation_compile="sometimes").validate()
    runs = []
    loop = cd.CompiledDecodeLoop.run
    monkeypatch.setattr(cd.CompiledDecodeLoop, "run", lambda self, *a, **k: (runs.append(1), loop(self, *a, **k))[1])
    monkeypatch.setattr(cd, "COMPILE_BASE_S", 0.0)
    monkeypatch.setattr(cd, "COMPILE_PER_LAYER_S", 0.0)  # any saving pays
    engine = HFEngine(model, _stops(tok), tok.pad_token_id, compile="auto", planned_calls=10)
    for i in range(3):
        engine.generate(short_prompts(tok)[:2], 2, SAMPLED, torch.Generator().manual_seed(i))
        assert len(runs) == (1 if i == 2 else 0)


def test_auto_prices_a_rollout_as_one_call_however_many_calls_it_makes(model_and_tok, monkeypatch):
    """auto's probe counts rollouts, as its planned calls (max_steps) do: a rollout cut into
    generation_batch_size calls, and a multi-turn rollout's turns, are timed together and recorded once,
    with their decode steps summed."""
    model, tok = model_and_tok
    engine = HFEngine(model, _stops(tok), tok.pad_token_id, compile="auto", planned_calls=1000, max_batch_size=2)
    recorded, steps = [], []
    record, generate = engine._choice.record, engine._generate
    monkeypatch.setattr(engine._choice, "record", lambda *a: (recorded.append(a), record(*a))[1])

    def counted(*a, **k):
        out = generate(*a, **k)
        steps.append(int(out.completion_mask.sum(-1).max()) - 1)
        return out

    monkeypatch.setattr(engine, "_generate", counted)
    prompts = short_prompts(tok)[:2]
    engine.generate(prompts, 2, SAMPLED, torch.Generator().manual_seed(0))  # 2 prompts x 2 rows, 2 rows a call
    assert len(steps) == 2 and len(recorded) == 1 and recorded[0][1] == sum(steps)
    assert engine._choice.probing()
    with engine.keep_conversations():
        for turn in range(3):  # a multi-turn rollout: one call a turn
            engine.generate(prompts[:1], 1, SAMPLED, torch.Generator().manual_seed(turn + 1))
        assert len(recorded) == 1  # priced when the rollout ends
    assert len(steps) == 5 and len(recorded) == 2 and recorded[1][1] == sum(steps[2:])
    assert not engine._choice.probing() and engine._choice.calls == cd.PROBE_CALLS


def test_a_compile_that_fails_after_an_earlier_one_succeeded_falls_back_with_one_warning(model_and_tok,
                                                                                        monkeypatch):
    """A run whose greedy eval compiled first: the training call's sampled spec compiles anew, and an
    Inductor error there (as the sampled draw's code generation failed on an H100) warns once and
    decodes eagerly, with the eager tokens, instead of ending the run."""
    from torch._inductor.exc import InductorError

    model, tok = model_and_tok
    monkeypatch.setattr(cd, "_COMPILED", {})
    monkeypatch.setattr(cd, "_FAILED", {})
    monkeypatch.setattr(cd, "_COMPILE_SECONDS", {})
    monkeypatch.setattr(cd, "GRAPH_BACKENDS", {})  # no graphs: a later failure goes on in the slot loop
    eager_step = cd.decode_step

    def compiled(dec, spec, *args):  # a stand-in for Inductor: the greedy spec compiles, the sampled one fails
        if not spec.greedy:
            raise InductorError(NotImplementedError("View (the sampled draw)"), None)
        return eager_step(dec, spec, *args)

    monkeypatch.setattr(cd.torch, "compile", lambda fn, **kw: compiled)
    greedy = SamplingParams(T, greedy=True)
    engine = HFEngine(model, _stops(tok), tok.pad_token_id, compile=True)
    engine.generate(short_prompts(tok), 1, greedy)
    assert "cpu" in cd._COMPILE_SECONDS and not cd._FAILED
    eager = HFEngine(model, _stops(tok), tok.pad_token_id, cuda_graphs=False).generate(
        short_prompts(tok), 2, SAMPLED, torch.Generator().manual_seed(0))
    with pytest.warns(RuntimeWarning, match=r"NotImplementedError: View \(the sampled draw\)\); decoding eagerly"):
        got = engine.generate(short_prompts(tok), 2, SAMPLED, torch.Generator().manual_seed(0))
    _assert_same(eager, got)
