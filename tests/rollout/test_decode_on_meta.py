"""The decode loop as a CUDA graph runs it, checked on the meta device, where no GPU is at hand.

A meta tensor has a shape, a dtype and a device but no data. Every host read of a device value
raises on it: `.item()`, `.tolist()`, `bool()`, nonzero, a boolean-mask index, `.cpu()`. Inside a
CUDA capture each of these is a sync, which the capture refuses. On CPU some of them dispatch no op
at all (`.tolist()` reads memory directly), so test_compiled_decode's op recorder cannot see them.
Every op of a captured step is also checked to take only device tensors: a host tensor there is an
upload from pageable memory, which a capture refuses too (0-dim host tensors are passed by value).

The shapes are SmolLM2-135M's, with two layers: a 49,152-token vocabulary, and 9 query heads over 3
key heads of size 64. The vocabulary's running sum is taken in CUDA's blocks (`sampling.SCAN_BLOCK`)
and the draw counts its entries (`sampling.COUNTED_DRAWS`), as on CUDA. The model is built on meta,
and the decoder takes the choices it takes off the CPU, as on CUDA: no packed weights, and the
cache in the matmuls' dtype. The graph backend is test_compiled_decode's
stand-in with a graph's contract (nothing runs at capture; a replay runs the captured step), and
each replay's ops are recorded for the checks.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_leaves
from transformers import LlamaConfig, LlamaForCausalLM

from grouprl.rollout import SamplingParams
from grouprl.rollout import compiled_decode as cd
from grouprl.rollout import sampling
from grouprl.rollout.llama_decoder import CACHE_BLOCK, FastDecoder
from tests.rollout.test_compiled_decode import (OpsOfReplays, RecordedGraphs, RecordOps, _assert_graph_discipline,
                                                _direct)

META = torch.device("meta")
T = 80  # new tokens: past two widths (WIDTH_STEP) and one growth of the cache (CACHE_BLOCK)
STOPS = (0, 2, 17, 4_000, 31_337, 49_151)


@pytest.fixture(scope="module")
def model():
    cfg = LlamaConfig(vocab_size=49_152, hidden_size=576, intermediate_size=1_536, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                      max_position_embeddings=2_048)
    with META:
        return LlamaForCausalLM(cfg).eval()


def host_inputs(ops: list) -> list[str]:
    """The recorded ops (RecordOps) that took a host tensor of one or more dimensions."""
    return [func.overloadpacket.__name__ for func, args, kwargs in ops
            if any(isinstance(x, torch.Tensor) and x.device != META and x.dim() > 0
                   for x in tree_leaves((args, kwargs)))]


@pytest.fixture
def meta_graphs(monkeypatch):
    """test_compiled_decode's stand-in graphs for "meta", recording each replay's ops (OpsOfReplays)
    and the loop's direct steps (its events)."""
    monkeypatch.setitem(cd.GRAPH_BACKENDS, "meta", OpsOfReplays)
    monkeypatch.setattr(cd, "_GRAPHS_FAILED", {})
    monkeypatch.setitem(sampling.SCAN_BLOCK, "meta", sampling.SCAN_BLOCK["cuda"])
    monkeypatch.setattr(sampling, "COUNTED_DRAWS", sampling.COUNTED_DRAWS | {"meta"})
    monkeypatch.setattr(cd, "GRAPH_WIDTH_STEP", cd.WIDTH_STEP)  # more shapes in 80 tokens: each one captured
    monkeypatch.setattr(cd, "decode_step", _direct(cd.decode_step))
    RecordedGraphs.events, OpsOfReplays.ops = [], []
    return RecordedGraphs.events


def started(model, dtype: torch.dtype, G: int = 8) -> tuple[FastDecoder, torch.Tensor]:
    """A decoder prefilled with two prompts of 12 tokens x G rows, and the first token's logits [2G, V]."""
    dec = FastDecoder(model, dtype=dtype)
    assert dec.linear is torch.nn.functional.linear and dec.adtype == dtype  # CUDA's choices, not CPU's
    ids = torch.zeros(2, 12, dtype=torch.long, device=META)
    with torch.no_grad():
        return dec, dec.start(ids, torch.ones_like(ids), G, T, zeroed=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("params", [SamplingParams(T, temperature=0.7, top_k=50, top_p=0.9, ignore_eos=True),
                                    SamplingParams(T, greedy=True, ignore_eos=True)], ids=["sampled", "greedy"])
def test_the_slot_loop_decodes_with_no_host_read_and_no_host_tensor_in_a_captured_step(model, meta_graphs, dtype,
                                                                                        params):
    """The eager step in the slot loop, replayed as graphs, decodes 80 tokens for 16 rows on meta:
    no host read anywhere in the loop (ignore_eos: the loop itself looks only to stop), every step a
    direct step or a replay, three shapes captured as the attended width and the cache grow, and no
    host tensor in any captured step. A sampled step sums the vocabulary in CUDA's blocks."""
    events = meta_graphs
    dec, first = started(model, dtype)
    N = first.shape[0]
    uniforms = torch.zeros(N, T, dtype=torch.float64, device=META)
    loop = cd.CompiledDecodeLoop(META, compile=False)
    with torch.no_grad():
        completion, lengths = loop.run(dec, first, params, uniforms, torch.tensor(STOPS, device=META), 1)
    assert completion.device == lengths.device == META and completion.shape == (N, T)
    steps, replays, captures = (events.count(e) for e in ("direct", "replay", "capture"))
    assert steps + replays == T - 1
    assert captures >= 3 and replays > 4 * steps, (captures, replays, steps)
    _assert_graph_discipline(events)
    assert dec.k[0].shape[2] > 12 + CACHE_BLOCK and dec.k[0].dtype == dtype  # it grew, and stayed in dtype
    assert host_inputs(OpsOfReplays.ops) == []
    scans = [tuple(args[0].shape) for func, args, _ in OpsOfReplays.ops if func.overloadpacket.__name__ == "cumsum"]
    if params.greedy:
        assert scans == []
    else:  # the draw's running sum within blocks [S, 12, 4096] (top-p's own sum over sorted probs is 2-D)
        blocks = [x for x in scans if len(x) == 3]
        assert blocks and all(x[1:] == (12, 4_096) for x in blocks), scans


def _stop_step(dec):
    S = dec.k[0].shape[0]
    return (dec, cd.StepSpec(False, 0.7, 50, 0.9, 1, True),
            torch.zeros(S, dtype=torch.long, device=META), dec.next_pos.clone(),
            torch.tensor([1, dec.P], dtype=torch.long, device=META), torch.arange(S, device=META),
            torch.zeros(S, dtype=torch.bool, device=META), torch.empty(cd.WIDTH_STEP, dtype=torch.bool, device=META),
            dec.valid, dec.k, dec.v, torch.zeros(S + 1, T, dtype=torch.float64, device=META),
            torch.zeros(S + 1, T, dtype=torch.long, device=META), torch.tensor(STOPS, device=META),
            torch.full((S + 1,), T, dtype=torch.long, device=META))


def test_a_step_that_checks_six_stop_tokens_takes_no_host_read_and_no_host_tensor(model, meta_graphs):
    """The step as the loop calls it with stop tokens (top-k, top-p, six stops): on meta, every op
    on device tensors, and the finished flags come back as a device tensor."""
    dec, _ = started(model, torch.bfloat16, G=4)
    ops = []
    with torch.no_grad(), RecordOps(ops):
        nxt, finished, _ = cd.decode_step(*_stop_step(dec))
    assert nxt.device == finished.device == META and finished.dtype == torch.bool and nxt.shape == (8,)
    assert ops and host_inputs(ops) == []


@pytest.mark.parametrize("planted", ["tolist", "host index"])
def test_the_checks_catch_a_planted_host_read_and_a_planted_host_tensor(model, meta_graphs, monkeypatch, planted):
    """Each check can fail: a draw that reads its tokens back with .tolist() (which dispatches no op
    on CPU) raises on meta, and one that indexes with a host tensor is recorded."""
    dec, _ = started(model, torch.float32, G=4)
    real = cd.inverse_cdf

    def tolist(probs, u):
        out = real(probs, u)
        return out.new_tensor(out.tolist())

    def host_index(probs, u):
        return real(probs, u)[torch.arange(probs.shape[0])]

    monkeypatch.setattr(cd, "inverse_cdf", tolist if planted == "tolist" else host_index)
    ops = []
    with torch.no_grad(), RecordOps(ops):
        if planted == "tolist":
            with pytest.raises(NotImplementedError, match="meta"):
                cd.decode_step(*_stop_step(dec))
        else:
            cd.decode_step(*_stop_step(dec))
            assert host_inputs(ops) == ["index"]
