"""The built-in engine's continuation of a conversation from its KV cache (multi-turn rollouts):
the same logits as prefilling the whole conversation, and the same trajectories; and the kept
caches live no longer than their use."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, AutoTokenizer

import grouprl.rollout.compiled_decode as cd
from grouprl.rollout import GenerationEngine, HFEngine, SamplingParams
from grouprl.rollout.llama_decoder import FastDecoder
from grouprl.rollout.multiturn import MultiTurnDriver, TurnLimits
from grouprl.rollout.types import left_pad_prompts
from grouprl.tasks import TOOL_POLICY_DIR
from grouprl.tasks.products import mul, train_rows
from grouprl.tasks.testing import build_tiny_model
from grouprl.tools import get_tool_parser, resolve_tools
from tests.rollout.conftest import short_prompts
from tests.rollout.test_compiled_decode import SAMPLED, RecordedGraphs, _stops
from tests.rollout.test_compiled_decode import eager_graphs  # noqa: F401  (fixture)


class HostReads(TorchDispatchMode):
    """Counts the ops by which the host reads one device value (`int(t)`, `t.item()`, a tensor as a slice
    bound); `tolist()` reads a whole tensor at once, outside the dispatcher."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ in ("_local_scalar_dense", "item", "is_nonzero")
        return func(*args, **(kwargs or {}))


def test_start_from_a_cached_prefix_gives_the_logits_of_a_full_prefill():
    model, _ = build_tiny_model("tiny", seed=3)
    model.eval()
    g = torch.Generator().manual_seed(0)
    full = [torch.randint(4, 100, (n,), generator=g).tolist() for n in (9, 14, 5, 12)]
    cached = [6, 13, None, 1]  # tokens computed in an earlier call (None: nothing kept), ragged
    with torch.no_grad():
        ids, mask = left_pad_prompts(full, 0)  # [4, 14]
        want = FastDecoder(model).start(ids, mask, 1, 8)  # [4, V]
        rows = [i for i, c in enumerate(cached) if c is not None]
        earlier = FastDecoder(model)
        pids, pmask = left_pad_prompts([full[i][: cached[i]] for i in rows], 0)
        earlier.start(pids, pmask, 1, 8)
        kv = dict(zip(rows, earlier.snapshot(torch.arange(len(rows)))))
        assert [kv[i][0].shape[2] for i in rows] == [6, 13, 1]  # [layers, Hkv, c, D]: real tokens only
        dec = FastDecoder(model)
        with HostReads() as reads:  # on CUDA each read is a sync: the rows' columns are read once, not per copy
            got = dec.start_from(ids, mask, 8, [kv.get(i) for i in range(4)])
        assert reads.count == 0, reads.count
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        # and decoding goes on from there as it would after a full prefill
        ref = FastDecoder(model)
        ref.start(ids, mask, 1, 8)
        tok = torch.tensor([7, 8, 9, 10])
        torch.testing.assert_close(dec.step(tok), ref.step(tok), atol=2e-5, rtol=1e-5)


class Prefilling(GenerationEngine):
    """The engine with GenerationEngine's default keep_conversations (nothing kept): each later turn
    prefills the whole conversation."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, *args, **kwargs):
        return self.engine.generate(*args, **kwargs)


def tool_rollouts(limits: TurnLimits, prompts: int, max_batch_size: int | None = None):
    """(tokenizer, the built-in engine, a multi-turn driver with the `mul` tool, the first `prompts`
    prompts' ids) on the tool policy."""
    tok = AutoTokenizer.from_pretrained(TOOL_POLICY_DIR)
    model = AutoModelForCausalLM.from_pretrained(TOOL_POLICY_DIR)
    tools = resolve_tools([mul])
    engine = HFEngine(model, (tok.eos_token_id,), tok.pad_token_id, max_batch_size=max_batch_size)
    driver = MultiTurnDriver(tok, limits, tools=tools, parser=get_tool_parser(tok, tools),
                             eos_token_ids=(tok.eos_token_id,))
    ids = [tok.apply_chat_template(r["prompt"], tokenize=True, return_dict=False) for r in train_rows()[:prompts]]
    return tok, engine, driver, ids


def test_multiturn_rollouts_continue_from_the_cache_with_the_same_tokens(monkeypatch):
    tok, engine, driver, ids = tool_rollouts(TurnLimits(80, max_turns=2, max_tool_calls=1), 8,
                                             max_batch_size=16)  # 2 calls per turn
    continued = []
    start_from = FastDecoder.start_from
    monkeypatch.setattr(FastDecoder, "start_from", lambda self, ids, mask, T, prefix: (
        continued.append(sum(p is not None for p in prefix)), start_from(self, ids, mask, T, prefix))[1])
    params = SamplingParams(80, temperature=1.0)
    a = driver.generate(engine, ids, 4, params, torch.Generator().manual_seed(0))
    b = driver.generate(Prefilling(engine), ids, 4, params, torch.Generator().manual_seed(0))
    second_turns = int(a.counts["turns"]) - 32
    assert second_turns > 0 and sum(continued) == second_turns  # every later turn continued from its row's cache
    assert torch.equal(a.rollout.completion_ids, b.rollout.completion_ids)
    assert torch.equal(a.rollout.action_mask, b.rollout.action_mask) and a.stop_reasons == b.stop_reasons
    assert engine._kept is None  # released when the rollout ends


@pytest.mark.parametrize("loop", ["eager", "slot"])
@pytest.mark.usefixtures("eager_graphs")
def test_the_last_call_a_block_allows_keeps_no_cache(model_and_tok, loop, monkeypatch):
    """keep_conversations(calls=2): the second call is the last the driver can make (its max_turns),
    so none of its rows is continued and it keeps no cache; without the bound it keeps its EOS rows'.
    Either way the second call continues every row from the first call's caches, with the same tokens."""
    model, tok = model_and_tok
    kw = {"check_every": 1} if loop == "slot" else {"cuda_graphs": False}
    engine = HFEngine(model, _stops(tok), tok.pad_token_id, **kw)
    continued = []
    start_from = FastDecoder.start_from
    monkeypatch.setattr(FastDecoder, "start_from", lambda self, ids, mask, T, prefix: (
        continued.append(sum(p is not None for p in prefix)), start_from(self, ids, mask, T, prefix))[1])
    out = {}
    for calls in (2, None):
        gen, continued[:] = torch.Generator().manual_seed(0), []
        with engine.keep_conversations(calls=calls):
            first = engine.generate(short_prompts(tok), 1, SAMPLED, gen)
            kept_first = len(engine._kept)
            follow = [p + first.token_lists()[i] + tok("ok")["input_ids"] for i, p in enumerate(short_prompts(tok))
                      if not first.truncated[i]]
            second = engine.generate(follow, 1, SAMPLED, gen)
            out[calls] = (kept_first, len(engine._kept), second.completion_ids, int((~second.truncated).sum()),
                          sum(continued), len(follow))
    assert out[2][0] == out[None][0] >= 5  # the first call keeps its EOS rows' caches under either
    assert out[2][1] == 0 and out[None][1] == out[None][3] > 0
    assert out[2][4] == out[2][5] and out[None][4] == out[None][5]  # every row of the last call from its cache
    assert torch.equal(out[2][2], out[None][2])


class UnboundedKeeping(Prefilling):
    """An engine wrapper written to the protocol before `calls` existed: keep_conversations() alone."""

    def keep_conversations(self):
        return self.engine.keep_conversations()


def test_the_driver_bounds_an_engine_that_takes_calls_and_still_runs_one_that_does_not(monkeypatch):
    _, engine, driver, ids = tool_rollouts(TurnLimits(40, max_turns=3, max_tool_calls=2), 2)
    bounds = []
    keep = HFEngine.keep_conversations
    monkeypatch.setattr(HFEngine, "keep_conversations", lambda self, calls=None: (bounds.append(calls),
                                                                                 keep(self, calls))[1])
    params = SamplingParams(40, temperature=1.0)
    a = driver.generate(engine, ids, 2, params, torch.Generator().manual_seed(0))
    b = driver.generate(UnboundedKeeping(engine), ids, 2, params, torch.Generator().manual_seed(0))
    assert bounds == [3, None]  # the driver's max_turns, then none for the engine that takes no bound
    assert torch.equal(a.rollout.completion_ids, b.rollout.completion_ids)


def _alive(refs: dict) -> set:
    """The keys of `refs` (token tuple -> weak references to a kept cache's k and v) still alive."""
    return {key for key, kv in refs.items() if any(r() is not None for r in kv)}


@pytest.mark.parametrize("per_call", [None, 2], ids=["one part", "parts of 2"])
@pytest.mark.parametrize("loop", ["eager", "slot"])
@pytest.mark.usefixtures("eager_graphs")  # the slot loop runs on CPU with stand-in graphs (test_compiled_decode)
def test_a_continuing_call_holds_no_kept_cache_it_has_copied_or_will_not_use_while_it_decodes(
        model_and_tok, monkeypatch, loop, per_call):
    """Inside keep_conversations, a second call continues half the rows that ended with EOS (the
    rest stopped, as answers do). While it decodes, no kept cache is alive but those of the
    prompts of its later parts, still to be copied: the unused ones went when the call matched
    its prompts, and each part's once in its cache (weak references, no garbage collection). The
    continued rows start from their caches, with the tokens of a call that prefills them whole."""
    model, tok = model_and_tok
    kw = {"check_every": 1} if loop == "slot" else {"cuda_graphs": False}
    engine = HFEngine(model, _stops(tok), tok.pad_token_id, max_batch_size=per_call, **kw)
    gen = torch.Generator().manual_seed(0)
    with engine.keep_conversations():
        first = engine.generate(short_prompts(tok), 1, SAMPLED, gen)
        refs = {key: tuple(weakref.ref(t) for t in kv) for key, kv in engine._kept.items()}
        ended = [i for i in range(8) if not first.truncated[i]]
        assert len(ended) >= 5 and len(refs) == len(ended)  # three or more go on: parts of 2 hold later ones
        follow = [short_prompts(tok)[i] + first.token_lists()[i] + tok("ok")["input_ids"] for i in ended[::2]]
        parts, held = _decode_events(monkeypatch, refs)
        second = engine.generate(follow, 1, SAMPLED, gen)
    keys = [next(k for k in refs if tuple(f[: len(k)]) == k) for f in follow]  # the cache each prompt continues
    size = per_call or len(follow)
    assert parts == [len(keys[i:i + size]) for i in range(0, len(follow), size)]  # each row from its cache
    assert held and all(alive == set(keys[(part + 1) * size:]) for part, alive in held)
    calls = len(range(0, 8, per_call or 8)) + len(parts)  # the parts of both calls
    assert RecordedGraphs.events.count("enter") == (calls if loop == "slot" else 0)
    want = HFEngine(model, _stops(tok), tok.pad_token_id, max_batch_size=per_call, **kw)
    gen = torch.Generator().manual_seed(0)
    want.generate(short_prompts(tok), 1, SAMPLED, gen)
    assert torch.equal(second.completion_ids, want.generate(follow, 1, SAMPLED, gen).completion_ids)
    assert engine._kept is None and _alive(refs) == set()


def _decode_events(monkeypatch, refs: dict) -> tuple[list[int], list[tuple[int, set]]]:
    """(the kept caches each part's start_from got, [(part, kept keys alive)] at each decode step of
    either loop)."""
    parts, held = [], []
    start_from = FastDecoder.start_from
    monkeypatch.setattr(FastDecoder, "start_from", lambda self, ids, mask, T, prefix: (
        parts.append(sum(p is not None for p in prefix)), start_from(self, ids, mask, T, prefix))[1])
    step, slot_step = FastDecoder.step, cd.decode_step
    monkeypatch.setattr(FastDecoder, "step", lambda self, tok: (
        held.append((len(parts) - 1, _alive(refs))), step(self, tok))[1])
    monkeypatch.setattr(cd, "decode_step", lambda *a: (held.append((len(parts) - 1, _alive(refs))), slot_step(*a))[1])
    return parts, held
