"""Each row's own most new tokens (`SamplingParams.row_max_new_tokens`, a multi-turn continuation's
room) in the built-in engine: a row stops there in every decode path (the eager loop, the generic
path, the slot loop and its compiled step), truncated and with no cache kept, and decodes until
then exactly the tokens it draws without a room. Counted, not timed: the tokens each loop feeds."""

import pytest
import torch

import grouprl.rollout.compiled_decode as cd
from grouprl.rollout import HFEngine, SamplingParams
from grouprl.rollout.engine import _HFDecoder
from grouprl.rollout.llama_decoder import FastDecoder
from grouprl.rollout.multiturn import TurnLimits
from tests.rollout.conftest import short_prompts
from tests.rollout.test_compiled_decode import RecordedGraphs, _stops
from tests.rollout.test_continuation import tool_rollouts
from tests.rollout.test_compiled_decode import compiles  # noqa: F401  (fixture)

T = 40
ROOMS = (3, 1, 40, 7, 12, 2, 25, 5)  # per prompt of short_prompts: below, at and above the rows' own lengths
PARAMS = {"sampled": SamplingParams(T, temperature=1.5, top_k=40, top_p=0.95),
          "greedy": SamplingParams(T, greedy=True)}


@pytest.fixture
def eager_graphs(monkeypatch):
    """test_compiled_decode's stand-in graphs on CPU, so the slot loop runs here with the eager step
    (no compiling); its events ("enter" once per slot-loop call)."""
    monkeypatch.setattr(cd, "GRAPH_BACKENDS", {"cpu": RecordedGraphs})
    monkeypatch.setattr(cd, "_GRAPHS_FAILED", {})
    RecordedGraphs.events = []
    return RecordedGraphs.events


def _engine(model, tok, loop: str, **kw) -> HFEngine:
    """The engine decoding in `loop`: "eager" (FastDecoder's eager loop), "generic" (the model's own
    forward) or "slot" (the slot loop's eager step, replayed by eager_graphs' stand-in graphs)."""
    if loop == "slot":
        return HFEngine(model, _stops(tok), tok.pad_token_id, check_every=1, **kw)
    return HFEngine(model, _stops(tok), tok.pad_token_id, cuda_graphs=False, fast=loop == "eager", **kw)


def _fed(monkeypatch) -> list[int]:
    """Records the rows each decode step is fed (eager steps of either decoder, the slot loop's steps
    direct or replayed)."""
    fed = []
    for cls in (FastDecoder, _HFDecoder):
        step = cls.step
        monkeypatch.setattr(cls, "step", lambda self, tok, step=step: (fed.append(tok.shape[0]), step(self, tok))[1])
    slot_step = cd.decode_step
    monkeypatch.setattr(cd, "decode_step", lambda dec, spec, tok, *a: (fed.append(tok.shape[0]),
                                                                       slot_step(dec, spec, tok, *a))[1])
    return fed


def _cut(free, rooms: torch.Tensor):
    """What a run with `rooms` [N] must give, from the run without them (`free`): each row's first
    min(length, room) tokens, truncated where its room cut it short."""
    lengths = torch.minimum(free.completion_mask.sum(-1), rooms)  # [N]
    mask = torch.arange(free.completion_ids.shape[1])[None] < lengths[:, None]  # [N, T]
    truncated = free.truncated | (free.completion_mask.sum(-1) > rooms)  # [N]
    return lengths, mask, free.completion_ids.masked_fill(~mask, 0), truncated


@pytest.mark.parametrize("how", list(PARAMS))
@pytest.mark.parametrize("loop", ["eager", "generic", "slot"])
def test_each_row_stops_at_its_own_room_with_the_tokens_it_draws_without_one(model_and_tok, eager_graphs,
                                                                            monkeypatch, loop, how):
    """Eight prompts x 2 rows under one seed, with rooms below, at and above the rows' own lengths:
    each row is the first min(length, room) tokens of the run without rooms, truncated where the
    room cut it, and the loop feeds no row past its end (eager: each row its length - 1 tokens;
    slot loop: steps until the longest row's end, looking every step). Rooms of max_new_tokens
    for every prompt change nothing."""
    model, tok = model_and_tok
    params, G = PARAMS[how], 2

    def gen(p):
        return _engine(model, tok, loop).generate(short_prompts(tok), G, p, torch.Generator().manual_seed(0))

    free = gen(params)
    fed = _fed(monkeypatch)
    got = gen(SamplingParams(**{**params.__dict__, "row_max_new_tokens": ROOMS}))
    rooms = torch.tensor(ROOMS).repeat_interleave(G)  # [N]
    lengths, mask, ids, truncated = _cut(free, rooms)
    assert (free.completion_mask.sum(-1) > rooms).sum() >= 6 and (free.completion_mask.sum(-1) < rooms).sum() >= 2
    assert torch.equal(got.completion_mask, mask) and torch.equal(got.truncated, truncated)
    assert torch.equal(got.completion_ids.masked_fill(~mask, 0), ids)
    if loop == "slot":
        assert len(fed) == int(lengths.max()) - 1 and eager_graphs.count("enter") == 2
        assert sum(fed) < len(fed) * len(rooms)  # rows at their rooms left the slots
    else:
        assert sum(fed) == int((lengths - 1).sum())
    same = gen(SamplingParams(**{**params.__dict__, "row_max_new_tokens": (T,) * len(ROOMS)}))
    for a, b in ((free, same), (free, gen(SamplingParams(**{**params.__dict__, "row_max_new_tokens": (T + 5,) * 8})))):
        assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.truncated, b.truncated)


def test_ignore_eos_rows_are_each_exactly_their_room_in_the_eager_and_the_slot_loop(model_and_tok, eager_graphs):
    """With ignore_eos a row is exactly its room long (not truncated, by request), the tokens of the
    run without rooms, in both loops."""
    model, tok = model_and_tok
    params = SamplingParams(T, temperature=1.5, ignore_eos=True)
    rooms = SamplingParams(**{**params.__dict__, "row_max_new_tokens": ROOMS})
    for loop in ("eager", "slot"):
        engine = _engine(model, tok, loop)
        free, got = (engine.generate(short_prompts(tok), 1, p, torch.Generator().manual_seed(1))
                     for p in (params, rooms))
        assert got.completion_mask.sum(-1).tolist() == list(ROOMS) and not got.truncated.any()
        assert torch.equal(got.completion_ids[got.completion_mask], free.completion_ids[got.completion_mask])
    assert eager_graphs.count("enter") == 2


def _kept_rows(model, tok, loop: str, rooms, pad: int):
    """One call inside keep_conversations with `rooms` (G = 1, the stop tokens as stops, `pad` the
    padding): the rollout and the caches kept."""
    engine = HFEngine(model, _stops(tok), pad, **({"check_every": 1} if loop == "slot" else {"cuda_graphs": False}))
    with engine.keep_conversations():
        params = SamplingParams(T, temperature=1.5, row_max_new_tokens=rooms)
        out = engine.generate(short_prompts(tok), 1, params, torch.Generator().manual_seed(0))
        return out, dict(engine._kept)


def test_a_row_cut_at_its_room_keeps_no_cache_and_one_ending_with_eos_there_keeps_its_own(model_and_tok,
                                                                                          eager_graphs):
    """Inside keep_conversations: a row whose room ends before its EOS keeps no cache, and a row
    whose EOS is its room's last token keeps the cache before it (not truncated), in the eager loop
    and in the slot loop, whose rows cut at their rooms write padding after them: here a stop
    token, which must not pass for their EOS."""
    model, tok = model_and_tok
    free = _kept_rows(model, tok, "eager", None, tok.pad_token_id)[0]
    rooms, ended, cut = [], [], []
    for i, n in enumerate(free.completion_mask.sum(-1).tolist()):
        if i % 2 == 0 and not free.truncated[i]:  # ends with EOS: the room ends there
            rooms.append(n)
            ended.append(i)
        elif n > 2:  # the room ends two tokens before the row's own end
            rooms.append(n - 2)
            cut.append(i)
        else:
            rooms.append(T)
    assert len(ended) >= 2 and len(cut) >= 2
    pad = _stops(tok)[1]
    outs = {loop: _kept_rows(model, tok, loop, tuple(rooms), pad) for loop in ("eager", "slot")}
    for out, kept in outs.values():
        assert out.truncated.tolist() == [i in cut or bool(free.truncated[i]) for i in range(8)]
        keys = {tuple(p + toks) for p, toks, truncated in zip(short_prompts(tok), out.token_lists(), out.truncated)
                if not truncated}
        assert kept.keys() == keys and len(keys) >= len(ended)
        assert all(kv[0].shape[2] == len(key) - 1 for key, kv in kept.items())  # the EOS never fed
    (a, kept_a), (b, kept_b) = outs["eager"], outs["slot"]
    assert torch.equal(a.completion_ids, b.completion_ids)
    for key, kv in kept_a.items():
        torch.testing.assert_close(kept_b[key], kv, atol=1e-5, rtol=1e-5)
    assert eager_graphs.count("enter") == 1


@pytest.mark.usefixtures("compiles")
def test_compiled_rooms_give_the_eager_loops_rows_with_one_graph_for_calls_with_and_without(model_and_tok):
    """The compiled step reads the rooms as an input: its rows are the eager loop's (sampled, rooms
    below and above the rows' lengths, the host looking every 4 steps), and a call without rooms
    or with other rooms compiles no new graph."""
    model, tok = model_and_tok
    params = SamplingParams(T, temperature=1.5, top_k=40, top_p=0.95, row_max_new_tokens=ROOMS)
    want = _engine(model, tok, "eager").generate(short_prompts(tok), 2, params, torch.Generator().manual_seed(0))
    engine = HFEngine(model, _stops(tok), tok.pad_token_id, compile=True, check_every=4)
    got = engine.generate(short_prompts(tok), 2, params, torch.Generator().manual_seed(0))
    assert not cd._FAILED, cd._FAILED
    assert torch.equal(want.completion_ids, got.completion_ids) and torch.equal(want.truncated, got.truncated)
    assert torch.equal(want.completion_mask, got.completion_mask) and want.truncated.sum() >= 6
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for rooms in (None, (T,) * 8, ROOMS[::-1]):
        engine.generate(short_prompts(tok), 2, SamplingParams(**{**params.__dict__, "row_max_new_tokens": rooms}))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames


def test_rooms_must_match_the_prompts(model_and_tok):
    model, tok = model_and_tok
    engine = HFEngine(model, _stops(tok), tok.pad_token_id)
    with pytest.raises(ValueError, match="row_max_new_tokens has 2 entries for 8 prompts"):
        engine.generate(short_prompts(tok), 1, SamplingParams(T, row_max_new_tokens=(3, 4)))
    with pytest.raises(ValueError, match="row_max_new_tokens holds 0"):
        engine.generate(short_prompts(tok), 1, SamplingParams(T, row_max_new_tokens=(0,) + (T,) * 7))


class AllToMax:
    """The engine as one that decodes every row to max_new_tokens (rooms dropped): the driver's
    own cut at each row's room is then all that stops a row."""

    def __init__(self, engine):
        self.engine = engine

    def keep_conversations(self, calls=None):
        return self.engine.keep_conversations(calls)

    def generate(self, prompt_ids, G, params, generator=None):
        return self.engine.generate(prompt_ids, G, SamplingParams(**{**params.__dict__, "row_max_new_tokens": None}),
                                    generator)


def test_the_driver_gets_the_trajectories_of_its_own_cut_from_fewer_decoded_tokens(monkeypatch):
    """Multi-turn rollouts with a tool (later turns with rooms below max_new_tokens): the engine
    stopping rows at their rooms gives the trajectories the driver's cut gave, stop reasons and
    truncation included, feeding fewer tokens."""
    _, engine, driver, ids = tool_rollouts(TurnLimits(60, max_turns=3, max_tool_calls=2), 8)
    params = SamplingParams(60, temperature=1.0)
    fed = _fed(monkeypatch)
    a = driver.generate(engine, ids, 4, params, torch.Generator().manual_seed(0))
    fed_a = sum(fed)
    fed.clear()
    b = driver.generate(AllToMax(engine), ids, 4, params, torch.Generator().manual_seed(0))
    assert torch.equal(a.rollout.completion_ids, b.rollout.completion_ids)
    assert torch.equal(a.rollout.action_mask, b.rollout.action_mask) and torch.equal(a.rollout.truncated,
                                                                                     b.rollout.truncated)
    assert a.stop_reasons == b.stop_reasons and "max_length" in a.stop_reasons and a.counts["turns"] > 32
    assert fed_a < sum(fed)
