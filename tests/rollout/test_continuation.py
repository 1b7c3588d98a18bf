"""The built-in engine's continuation of a conversation from its KV cache (multi-turn rollouts):
the same logits as prefilling the whole conversation, and the same trajectories."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, AutoTokenizer

from grouprl.rollout import GenerationEngine, HFEngine, SamplingParams
from grouprl.rollout.llama_decoder import FastDecoder
from grouprl.rollout.multiturn import MultiTurnDriver, TurnLimits
from grouprl.rollout.types import left_pad_prompts
from grouprl.tasks import TOOL_POLICY_DIR
from grouprl.tasks.products import mul, train_rows
from grouprl.tasks.testing import build_tiny_model
from grouprl.tools import get_tool_parser, resolve_tools


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


def test_multiturn_rollouts_continue_from_the_cache_with_the_same_tokens(monkeypatch):
    tok = AutoTokenizer.from_pretrained(TOOL_POLICY_DIR)
    model = AutoModelForCausalLM.from_pretrained(TOOL_POLICY_DIR)
    tools = resolve_tools([mul])
    engine = HFEngine(model, (tok.eos_token_id,), tok.pad_token_id, max_batch_size=16)  # 2 calls per turn
    driver = MultiTurnDriver(tok, TurnLimits(80, max_turns=2, max_tool_calls=1), tools=tools,
                             parser=get_tool_parser(tok, tools), eos_token_ids=(tok.eos_token_id,))
    ids = [tok.apply_chat_template(r["prompt"], tokenize=True, return_dict=False) for r in train_rows()[:8]]
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
