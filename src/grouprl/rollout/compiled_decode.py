"""The decode loop of `FastDecoder` with one compiled step (`generation_compile`).

A decode step of a small model is ~100 small ops; eagerly each one pays Python dispatch and a
kernel launch, which cost more than its arithmetic (the tiny workload's step took ~2 ms on CPU, its
matmuls ~0.4 ms of it). Here the whole step -- embedding, every layer, the logits, the draw of the
next token, the end-of-sequence check and the write into the completion buffer -- is one function
of tensors, compiled once by `torch.compile` (Inductor: fused C++/OpenMP loops around oneDNN/MKL
matmuls on CPU, Triton kernels on CUDA).

A row finishes when it draws EOS or reaches its own most new tokens (`limit`, an input of the graph
like the uniforms: a multi-turn continuation's room per row, max_new_tokens for every row of a
single-turn call), so one graph serves calls with and without rooms; a row cut at its room is
handled like an EOS row (it writes padding after its end and leaves at the next move), except
that it keeps no cache.

Shapes: one graph serves every call of a model and sampling setting. The slot count S (rows in the
batch), the attended width W, the completion length and the batch of the call are symbolic sizes
(`torch._dynamo.mark_dynamic`). Torch specialises a size of 1, so the slots never number fewer
than two (MIN_SLOTS): a call of one row, or the last row of a call, runs beside an empty slot
rather than compiling a second graph (measured: a 1-row call then a 16-row call compiled twice,
16 s each for the 50m model, before this).
- The rows: rows that finish keep their slot (they draw, but write padding into their own row past
  its end, and are never counted; an empty slot writes to a dump row) until the live rows fit in
  half the slots; then the live ones move into a batch of exactly their number (`_compact`), as the
  eager loop's cache does.
- The KV cache: [S, Hkv, C, D] per layer, zero-filled, passed whole (its strides never change, so
  no graph is specialised on a slice), written by `index_copy_` at the step's column, a tensor
  (`cursor`), so a new column is not a new graph. The step attends the first W columns, W the next
  multiple of WIDTH_STEP past its column (at most prompt + new tokens), always fewer than C: a step
  reads about as much of the cache as the eager step (which reads exactly the columns fed) -- on
  this CPU the reads of the cache are what a small model's step waits on, so attending all C would
  cost more than it saves. Replayed as graphs, where each width is a captured shape, the step is
  GRAPH_WIDTH_STEP.
  Columns not yet written are masked by `valid`. When W would reach C, the cache widens by
  doubling its new-token columns (`_grow`), keeping WIDTH_STEP spare ones.
- The weights are inputs of the graph, not constants: a new policy is not a new graph.

The host looks at the rows' finished flags only every `check_every` steps (engine.CHECK_EVERY: every
step on CPU, where a look is cheap and measured so; every 8 on a GPU, where it is a device sync); a
row that finished in between draws tokens that are replaced by padding. With ignore_eos and no row
below max_new_tokens nothing finishes early, and the host never looks. The draw uses the
counter-based uniforms of rollout/sampling.py, indexed by the row's number in the call and the step,
so the compiled loop draws exactly the tokens the eager loop draws from the same logits: equal
tokens wherever Inductor's reordered float sums leave the logits close enough not to move a draw
across a token boundary (tests/rollout/test_compiled_decode.py).

What stays eager: the prefill (`start`, one call of large ops per generate), the first token's draw,
and the moves between shapes. Inside `keep_conversations` (the multi-turn driver) the loop hands
each row that ended with EOS its cache up to that EOS (`keep`): a finished slot writes on past its
end but never before it, so its columns are copied whenever the host looks next before the slot is
given up (`_compact`), and at the end of the call. Until 2026-11-27 such calls decoded in the plain
eager loop, which on an H100 decodes the 135M shape at 16-20 ms a token against ~2.6 replayed as
graphs; the embedded tool task's multi-turn rollouts took 0.64x the time replayed (an H100, the
tiny tool policy, the same tokens).

On CUDA the graph runs as Triton kernels, and each step is then replayed as a captured CUDA graph
(`generation_cuda_graphs`, on by default): a 30-layer step is hundreds of kernels, whose launches
from Python cost more than their work at decode sizes (the eager 135M step took 20 ms a token on
an H200, the 1.7B's 15.5). A CUDA graph fixes every address it touches, so a graph lives for one
shape of one call (`CudaGraphs`):
- the first step at a new shape (slots, attended width, cache width) runs the compiled step
  directly, so its kernels are launched once outside any capture, as a capture needs (Triton tunes
  a kernel at its first launch, with a device sync);
- the next steps are recorded once and replayed, while the width stays and at least
  MIN_GRAPH_STEPS steps remain;
- the step's inputs are the decoder's own tensors, the same objects from capture to replay: the
  cache, `valid` and the completion are written in place, the uniforms read at `cursor`, `pos`
  and `cursor` advance in place, and the captured step copies its next tokens and finished flags
  into the tensors it read them from, so a replay leaves the next one its inputs;
- the whole loop runs on one side stream, so a capture never sees a first use of that stream
  (cuBLAS keeps a workspace per stream);
- a capture that fails (an op the stream cannot record) warns once, naming the reason, and the
  run goes on with the compiled step launched kernel by kernel.
A graph removes the launches whether or not Inductor fused the kernels, so on a device with graphs
the loop also runs the eager `decode_step`, replayed the same way: when the run does not compile
(`generation_compile: false`, or `auto` before it decides) and when the compile fails. The kernels
are then torch's own, unfused, but none is launched from Python after a shape's capture.
`generation_cuda_graphs: false` keeps the plain eager loop of engine.py there.

On the first GPU run (an H100, torch 2.11) the compile failed at code generation: the draw's float64
running sum over the vocabulary was a "split scan" that Inductor could not generate. The draw now
sums in blocks on CUDA (sampling.running_sum). On the next H100 run the eager step replayed as
graphs decoded at 2.5-2.8 ms a token (135M shape, 16 rows, one to nine captures a call, none
failed), but the compile failed again, lowering searchsorted over the blocked sum ("InductorError:
NotImplementedError: View", torch 2.11): the draw now counts instead (sampling.COUNTED_DRAWS).
On the third H100 run the whole step compiled (61 s at the 135M shape, 51 s at the 1.7B) and,
replayed as graphs, decoded 16 rows at 1.60 and 2.65 ms a token, against 2.87 and 3.88 for the eager
step replayed and 12.2 and 9.5 launched (benchmarks/decode.py; benchmarks/README.md, "One H100
(2026-11-27, eighteenth session)").

Where compiling fails (no C++ compiler, an op Inductor does not lower), the first step's error is
caught: one warning names it, and this and later calls decode with the eager step, replayed as
graphs where the device has them, else in the eager loop.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grouprl.rollout.sampling import filtered_probs, inverse_cdf, sample_next
from grouprl.rollout.types import SamplingParams

log = logging.getLogger(__name__)

WIDTH_STEP = 32  # the step attends the cache's first W columns, W the next multiple of this past the column
# With graphs each width is a new shape, and a new shape costs a direct step and a capture, each
# launching the step's kernels from Python (~10 ms a shape at the 135M shape's 800 kernels, from
# the H100's eager 15 us a kernel), where a replay takes ~2 ms: at 32 a 256-token call would pay
# 8 shapes. At 128 it pays 2-3, and each step reads on average 64 more masked columns of the
# cache (16 rows of the 1.7B shape: ~0.2 GB, ~0.07 ms at an H100's bandwidth). Measured on an
# H100 (135M shape, 16 rows, 256 tokens): 3 captures a call at 128 and 9 at 32, 2.62 and 2.55 ms a
# token, within the runs' spread (`benchmarks/decode.py --graph-width-step`).
GRAPH_WIDTH_STEP = 128
MIN_SLOTS = 2  # torch specialises a size of 1: a batch never shrinks below 2 slots, so no second graph
MIN_GRAPH_STEPS = 4  # CUDA graphs: a shape is captured only when at least this many steps will replay it


@dataclass(frozen=True)
class StepSpec:
    """The constants a compiled step is specialised on (a change is a new graph)."""

    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    pad_token_id: int
    stop_on_eos: bool
    return_logits: bool = False  # also return the step's logits (tests compare them with the eager step's)


def decode_step(dec, spec: StepSpec, tok: torch.Tensor, pos: torch.Tensor, cursor: torch.Tensor,
                rowmap: torch.Tensor, finished: torch.Tensor, width: torch.Tensor, valid: torch.Tensor,
                kc: list[torch.Tensor], vc: list[torch.Tensor], uniforms: torch.Tensor, completion: torch.Tensor,
                eos: torch.Tensor, limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Feed tok [S] (one per slot) at positions pos [S] into cache column cursor[1], draw each slot's
    next token with uniforms[rowmap, cursor[0]], write it to completion[rowmap, cursor[0]], advance
    pos and cursor; returns (next tokens [S], finished [S], the logits [S, V] fp32 if
    spec.return_logits else None). A slot finishes when it draws EOS (spec.stop_on_eos) or when its
    row has its most new tokens, limit[rowmap] (limit [N+1], the dump row's included). Mutates valid,
    kc, vc, completion, pos and cursor in place. Attention reads the first W = len(width) columns of
    the cache (W > the column written): the caches are passed whole, so their strides never change,
    and W is a size, not a value."""
    S, W = tok.shape[0], width.shape[0]
    t, col = cursor[0:1].expand(S), cursor[1:2]  # [S], [1]
    valid.index_fill_(1, col, True)
    cos, sin = dec.cos[pos][:, None, None], dec.sin[pos][:, None, None]  # [S, 1, 1, D]
    Hkv, r, D = dec.Hkv, dec.H // dec.Hkv, dec.D
    # the key mask as an additive bias, built once a step for every layer: [S*Hkv, 1, W], 0 or -inf
    bias = torch.zeros(S, W, dtype=dec.adtype, device=tok.device).masked_fill_(~valid[:, :W], float("-inf"))
    bias = bias[:, None].expand(S, Hkv, W).reshape(S * Hkv, 1, W)

    def write(l, k, v):
        kc[l].index_copy_(2, col, k)
        vc[l].index_copy_(2, col, v)

    def attend(l, q):  # q [S, H, 1, D]: one query per row, written out (Inductor fuses it; SDPA's
        # CPU kernel took ~0.5 ms a call here against the matmuls' ~0.15 ms). The heads sharing a key
        # head are one batch entry [S*Hkv, r, D]; the scale and the mask ride in the scores' matmul.
        keys = kc[l][:, :, :W].reshape(S * Hkv, W, D)  # a view: rows and key heads are the cache's outer dims
        # the scores come out in the cache's dtype: bf16 on CUDA (rounded before the fp32 softmax, where SDPA's
        # kernels keep fp32 scores): a review measured 6 % relative error in the probabilities on CPU-made bf16
        # inputs; fp32 inputs would triple the key cache's traffic. To measure on a GPU (issue 36's lease).
        scores = torch.baddbmm(bias, q.reshape(S * Hkv, r, D), keys.transpose(1, 2), alpha=dec.scale)  # [S*Hkv, r, W]
        probs = scores.softmax(-1, dtype=torch.float32).to(vc[l].dtype)  # the softmax in fp32, as before
        out = torch.bmm(probs, vc[l][:, :, :W].reshape(S * Hkv, W, D))  # [S*Hkv, r, D]
        return out.view(S, dec.H, 1, D)

    x = dec._layers(F.embedding(tok[:, None], dec.embed), cos, sin, write, attend)  # [S, 1, d]
    logits = dec._logits(x[:, 0]).float()  # [S, V]
    if spec.greedy:
        nxt = logits.argmax(-1)
    else:
        params = SamplingParams(1, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k)
        nxt = inverse_cdf(filtered_probs(logits, params), uniforms[rowmap, t])  # [S]
    if spec.stop_on_eos:
        nxt = torch.where(finished, spec.pad_token_id, nxt)
        finished = finished | (nxt[:, None] == eos).any(-1)  # not isin: for many stop tokens it sorts, and may sync
    finished = finished | (t + 1 >= limit[rowmap])  # the row's t+1 tokens are its most (a multi-turn room)
    completion.index_put_((rowmap, t), nxt)
    pos.add_(1)
    cursor.add_(1)
    return nxt, finished, (logits if spec.return_logits else None)


def _dynamic(x: torch.Tensor, *dims: int) -> None:
    """Compile `x`'s `dims` as symbolic sizes: one graph serves every slot count, attended width,
    completion length and batch (a size of 1 would still be specialised: see MIN_SLOTS)."""
    for d in dims:
        if x.shape[d] > 1:
            torch._dynamo.mark_dynamic(x, d)


_COMPILED: dict[str, object] = {}  # device type -> the compiled decode_step (one per process)
_FAILED: dict[str, str] = {}  # device type -> why compiling failed (warned once)
_COMPILE_SECONDS: dict[str, float] = {}  # device type -> the first compile's duration


def compiled_step(device: torch.device):
    """The compiled `decode_step` for `device`'s type, or None when compiling failed before."""
    kind = device.type
    if kind in _FAILED:
        return None
    if kind not in _COMPILED:
        _COMPILED[kind] = torch.compile(decode_step, fullgraph=True, dynamic=None)
    return _COMPILED[kind]


def _is_compile_error(err: BaseException) -> bool:
    """An error of Dynamo or Inductor (InductorError, BackendCompilerFailed, Unsupported, ...): compiling
    failed, at whatever step a compile happens (a later call's new sampling spec compiles anew)."""
    from torch._dynamo.exc import TorchDynamoException

    return isinstance(err, TorchDynamoException)


def _reason(err: BaseException) -> str:
    """An error as a warning names it: its type and its message's first line."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def _compile_failed(device: torch.device, err: BaseException) -> None:
    # the whole traceback, for a report (benchmarks/decode.py prints it): the warning names the error only
    log.debug("generation_compile: the compile's error on %s", device.type, exc_info=err)
    reason = _FAILED[device.type] = _reason(err)
    eager = "with the eager step, replayed as graphs," if graphs_available(device) else "eagerly"
    warnings.warn(f"generation_compile: compiling the decode step failed on {device.type} ({reason}); "
                  f"decoding {eager} for the rest of this run. Set generation_compile: false to skip the try.",
                  RuntimeWarning, stacklevel=3)


# generation_compile: auto. On a 2-core CPU (benchmarks/decode.py, benchmarks/README.md "Decode
# step") a first compile took 17 s for the tiny model (2 layers), 23-37 s for 50m (10 layers) and
# 112 s for SmolLM2-135M (30 layers); the compiled step saved 0.2-0.25 ms per layer and step on the
# tiny model (dispatch it no longer pays) and nothing measurable on 50m, whose step is bound by
# reading its weights. So auto prices a compile at COMPILE_BASE_S + COMPILE_PER_LAYER_S x layers
# and a step's saving at SAVED_PER_LAYER_STEP_S x layers, at most MAX_SAVED_FRACTION of the eager
# step's time, both by device type. On CUDA, measured on a lent H100 (eighteenth session, 16 rows,
# bf16, benchmarks/README.md "One H100 (2026-11-27, eighteenth session)"): the compiled step saved
# 4.96 ms of 12.19 at the 135M shape (30 layers) and 4.15 of 9.47 at 1.7B (24), 165-173 us per layer
# and step, 41-44 %, where each step launches its kernels ("cuda"); where the probe's calls replayed
# the eager step as graphs ("cuda+graphs", the default on CUDA), compiling saves what fusing the
# kernels saves: 1.27 ms of 2.87 and 1.23 of 3.88, 42 and 51 us per layer and step, 44 and 32 %. The
# compile is priced as on CPU everywhere: on that machine's 16-core host the first compile took 61 s
# (135M) and 51 s (1.7B), the 135M's first compiled call 122 s, against 135 and 111 s priced here.
COMPILE_BASE_S = 15.0
COMPILE_PER_LAYER_S = 4.0
SAVED_PER_LAYER_STEP_S = {"cpu": 1e-4, "cuda": 1.6e-4, "cuda+graphs": 4.2e-5}
MAX_SAVED_FRACTION = {"cpu": 0.3, "cuda": 0.45, "cuda+graphs": 0.45}
PROBE_CALLS = 2  # auto decodes this many calls eagerly, timing them, before it decides


@dataclass
class CompileChoice:
    """Whether a call decodes with the compiled step. `setting` True or False is final; "auto"
    times the first PROBE_CALLS calls eagerly and then compiles if the time the remaining calls
    would save exceeds the compile's estimated cost. Without `planned_calls` (how many calls the
    run makes) auto stays eager. The engine records a rollout as one call, whatever calls it made
    (engine.py, `_probe_rollout`): the run plans one a step."""

    setting: bool | str = False
    planned_calls: int | None = None
    calls: int = 0
    seconds: float = 0.0
    steps: int = 0
    decided: bool | None = None

    def use(self) -> bool:
        if isinstance(self.setting, bool):
            return self.setting
        return bool(self.decided)

    def probing(self) -> bool:
        return self.setting == "auto" and self.decided is None

    def record(self, seconds: float, steps: int, n_layers: int, device_type: str = "cpu") -> None:
        """One eager call's decode time and decode steps while probing; decides after PROBE_CALLS.
        `device_type` keys the pricing: "cuda+graphs" where the call replayed the eager step as graphs."""
        self.calls += 1
        self.seconds += seconds
        self.steps += steps
        if self.calls < PROBE_CALLS:
            return
        remaining = max(0, (self.planned_calls or 0) - self.calls)
        saved = SAVED_PER_LAYER_STEP_S.get(device_type, SAVED_PER_LAYER_STEP_S["cpu"])
        cap = MAX_SAVED_FRACTION.get(device_type, MAX_SAVED_FRACTION["cpu"])
        per_call = min(saved * n_layers * self.steps, cap * self.seconds) / self.calls
        saved = remaining * per_call
        cost = COMPILE_BASE_S + COMPILE_PER_LAYER_S * n_layers
        self.decided = saved > cost
        log.info("generation_compile: auto %s: %d more calls of ~%.2f s decoding would save ~%.0f s, a compile "
                 "of %d layers costs ~%.0f s", "compiles" if self.decided else "stays eager", remaining,
                 self.seconds / self.calls, saved, n_layers, cost)


def compile_seconds(device_type: str) -> float | None:
    """How long the first compile of the decode step took in this process, or None."""
    return _COMPILE_SECONDS.get(device_type)


class CudaGraphs:
    """The CUDA graphs of one decode call: captures and replays on one side stream (`running`), all
    graphs of the call in one memory pool (a call replays one graph at a time, so they may share
    it; the pool is freed with the last graph)."""

    _streams: dict[torch.device, torch.cuda.Stream] = {}  # one side stream per device and process: the
    # allocator caches freed blocks per stream, so every call's cache moves reuse the same stream's blocks

    def __init__(self, device: torch.device):
        self.device = device
        if device not in CudaGraphs._streams:
            CudaGraphs._streams[device] = torch.cuda.Stream(device)
        self.stream = CudaGraphs._streams[device]
        self.pool = torch.cuda.graph_pool_handle()
        # Every graph captured in this call, kept until the call ends. A pool handle is only an id:
        # the allocator's pool lives while some graph captured into it does, and a capture into an id
        # whose graphs are all gone fails ("use_count > 0 INTERNAL ASSERT FAILED",
        # CUDACachingAllocator.cpp). The loop drops a shape's replay at the next width, so without
        # these a call's second capture (a 256-token call passes widths 128, 256, ...) failed: the
        # likely cause of the capture that failed in a training step on an H100, whose reason a log
        # filter dropped. A kept graph is never replayed again, so the next capture may reuse the
        # blocks its capture freed (graphs sharing a pool must replay in capture order): a call's
        # graphs hold about the memory of its largest, not the sum.
        self.graphs: list = []

    @contextlib.contextmanager
    def running(self):
        """Run the block's work on the side stream, ordered after the caller's stream and before
        whatever the caller's stream does next; yields the caller's stream."""
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self.stream):
                yield caller
        finally:
            caller.wait_stream(self.stream)

    def capture(self, one_step):
        """Record `one_step`'s kernels (nothing runs) and return what replays them. Direct
        capture_begin/capture_end rather than `torch.cuda.graph`, which synchronises the device and
        empties the allocator's cache before every capture: here a call captures a graph per
        shape. "thread_local": a capture fails only on this thread's unsafe calls, not on a
        training thread's allocations (async rollouts decode beside the update)."""
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        self.graphs.append(graph)  # from here on the pool counts it (see __init__)
        try:
            one_step()
        except BaseException:
            with contextlib.suppress(Exception):  # the capture is invalid: end it, report the first error
                graph.capture_end()
            raise
        graph.capture_end()
        return graph.replay


def _in_use(t: torch.Tensor) -> None:
    """Before the loop drops a CUDA tensor mid-call: the allocator may hand its block to another
    stream only once this stream's queued work is done (under CudaGraphs the loop runs on a side
    stream, and the cache it replaces was allocated on the caller's, whose other users, such as a
    training thread beside async rollouts, could otherwise be given the block while queued steps
    still read it). A no-op on CPU and on the tensor's own stream."""
    if t.is_cuda:
        t.record_stream(torch.cuda.current_stream(t.device))


def _handed_out(t: torch.Tensor, caller) -> None:
    """A tensor made on the loop's side stream (CudaGraphs.running) for the caller's stream to keep:
    its block must not go back to the side stream's pool while the caller's stream may read it."""
    if caller is not None and t.is_cuda:
        t.record_stream(caller)


GRAPH_BACKENDS: dict[str, type] = {"cuda": CudaGraphs}  # device type -> its step graphs (a test adds "cpu")
_GRAPHS_FAILED: dict[str, str] = {}  # device type -> why capturing failed (warned once)


def _graphs_failed(device: torch.device, err: BaseException) -> None:
    reason = _GRAPHS_FAILED[device.type] = _reason(err)
    warnings.warn(f"generation_cuda_graphs: capturing the decode step as a graph failed on {device.type} "
                  f"({reason}); launching its kernels one by one for the rest of this run. Set "
                  "generation_cuda_graphs: false to skip the try.", RuntimeWarning, stacklevel=3)


def graphs_available(device: torch.device) -> bool:
    """Whether decode steps on `device` can be replayed as captured graphs: its type has a graph
    backend (CUDA) and no capture has failed there in this process."""
    return device.type in GRAPH_BACKENDS and device.type not in _GRAPHS_FAILED


class CompiledDecodeLoop:
    """The decode loop over one step function in fixed slots: `run` takes a FastDecoder right after
    `start(..., zeroed=True)` and the first token's logits, and fills the completion buffer. The
    step is the compiled `decode_step` (`compile`), or, where steps are replayed as graphs, the
    eager one: on CUDA a graph removes the launches whether or not Inductor fused the kernels, so a
    run that does not compile, or whose compile failed, still replays its steps."""

    def __init__(self, device: torch.device, check_every: int = 8, graphs: bool = True, compile: bool = True):
        self.device = device
        self.check_every = check_every
        self.graphs = graphs  # replay steps as captured graphs where the device has them (GRAPH_BACKENDS)
        self.compile = compile  # the compiled step; False: the eager step (only worth it replayed as graphs)

    def _graph_backend(self):
        """The device's graph backend for one call (the caller checked `graphs_available`), or None."""
        try:
            return GRAPH_BACKENDS[self.device.type](self.device)
        except Exception as err:  # noqa: BLE001 — a torch without graph pools or streams here: no graphs
            _graphs_failed(self.device, err)
            return None

    def run(self, dec, first_logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor,
            eos: torch.Tensor, pad_token_id: int, keep=None,
            limit: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Decode up to params.max_new_tokens tokens for the N rows of `first_logits` [N, V], row n
        at most limit[n] (None: max_new_tokens for each); the first token is drawn eagerly with
        uniforms[:, 0]. Returns (completion [N, T], lengths [N]), or
        None when the step could not be compiled (the decoder's first n rows are then as `start`
        left them: nothing moves before the first step but a lone row's spare slot).
        `keep(rows, tokens, caches)`, when given, is called with rows of the call that ended with EOS,
        each row's tokens up to and with its EOS, and its cache before that EOS (`dec.snapshot`), once
        per row, before the row's slot is given up (a row cut at its limit is not kept)."""
        device = self.device
        graphed = self.graphs and graphs_available(device)
        step = compiled_step(device) if self.compile else None
        if step is None:
            if not graphed:
                return None  # no compiled step and no graphs: the caller's eager loop is the faster one
            step = decode_step
        graphs = self._graph_backend() if graphed else None
        if graphs is None and step is decode_step:
            return None  # the graph backend could not be built (warned): the caller's eager loop
        N, T = first_logits.shape[0], params.max_new_tokens
        S = dec.k[0].shape[0]  # slots: N
        dec.use_slots()  # oneDNN-packed weights enter the graph as table slots (llama_decoder.py)
        dec.activate_slots()
        stop = not params.ignore_eos
        looks = stop or limit is not None  # rows may finish before T: the host looks at their flags
        limit = torch.cat([limit if limit is not None else torch.full((N,), T, dtype=torch.long, device=device),
                           torch.tensor([T], dtype=torch.long, device=device)])  # [N+1]: the dump row's too
        spec = StepSpec(params.greedy, float(params.temperature), int(params.top_k or 0), float(params.top_p),
                        int(pad_token_id), stop)
        completion = torch.full((N + 1, T), pad_token_id, dtype=torch.long, device=device)  # row N: a dump
        tok = sample_next(first_logits, params, u=uniforms[:, 0])  # [N]
        completion[:N, 0] = tok

        def slots(x: torch.Tensor, fill) -> torch.Tensor:  # [N] -> [S]
            return torch.cat([x, x.new_full((S - N,), fill)])

        rowmap = slots(torch.arange(N, device=device), N)  # slot -> row of the call (N: the dump row)
        finished = slots((torch.isin(tok, eos) & stop) | (limit[:N] <= 1), True)  # an empty slot counts as finished
        tok, pos = slots(tok, pad_token_id), slots(dec.next_pos, 0)
        dec.valid[N:, 0] = True  # an empty slot attends one (zero) column: no row of only -inf scores
        if S < MIN_SLOTS:  # one row: an empty slot beside it (see MIN_SLOTS)
            S = MIN_SLOTS
            tok, pos, rowmap, finished = self._compact(dec, torch.arange(N, device=device), S, tok, pos, rowmap,
                                                       finished, N)
        cursor = torch.tensor([1, dec.P], dtype=torch.long, device=device)  # [step, cache column], advanced by the step
        kept = torch.zeros(N + 1, dtype=torch.bool, device=device)  # rows handed to `keep`; N: the dump row
        kept[N] = True
        uniforms = torch.cat([uniforms, uniforms.new_zeros(1, uniforms.shape[1])])  # the dump row's
        for x in (completion, uniforms):
            _dynamic(x, 0, 1)
        _dynamic(eos, 0)
        _dynamic(limit, 0)
        for x in (dec.cos, dec.sin):
            _dynamic(x, 0)
        t, col, W, views, replay = 1, dec.P, 0, None, None
        with graphs.running() if graphs is not None else contextlib.nullcontext() as caller:
            while t < T:
                if looks and (t - 1) % self.check_every == 0:
                    live = (~finished).nonzero().squeeze(-1)  # the host looks: a sync every check_every steps
                    if live.numel() == 0:
                        break
                    # not before the first step: a compile that fails there hands the caller's eager
                    # loop the cache as `start` left it
                    if 2 * live.numel() <= S and max(live.numel(), MIN_SLOTS) < S and t > 1:
                        if keep is not None:  # the finished slots go now: their caches first
                            self._keep_finished(dec, finished, rowmap, completion, eos, limit, kept, keep, caller)
                        S = max(live.numel(), MIN_SLOTS)
                        tok, pos, rowmap, finished = self._compact(dec, live, S, tok, pos, rowmap, finished, N)
                        views = None
                C = dec.k[0].shape[2]
                if col >= W:  # attend up to the next multiple of the width step, no more than the call can
                    # fill, and always fewer columns than the cache has (W == C: contiguous slices, another graph)
                    width_step = GRAPH_WIDTH_STEP if graphs is not None else WIDTH_STEP
                    W = min((col // width_step + 1) * width_step, dec.max_cap)
                    if W >= C:  # double the new-token columns, keeping WIDTH_STEP spare ones past the last
                        self._grow(dec, max(W, min(dec.max_cap, dec.P + 2 * (C - dec.P))) + WIDTH_STEP)
                    views = None
                if views is None:
                    views, replay = self._views(dec, W, tok, pos, rowmap, finished), None
                if replay is not None:  # a captured step: it advances tok, finished, pos and cursor in place
                    replay()
                    t, col = t + 1, col + 1
                    continue
                started = time.perf_counter()
                try:
                    tok, finished, _ = step(dec, spec, tok, pos, cursor, rowmap, finished, *views, uniforms,
                                            completion, eos, limit)
                except Exception as err:  # noqa: BLE001 — compiling failed: the eager step, or the caller's loop
                    first = t == 1 and device.type not in _COMPILE_SECONDS  # the process's first compile
                    if step is decode_step or not (first or _is_compile_error(err)):
                        raise  # the eager step failed, or the compiled step ran before and this is no compile
                    _compile_failed(device, err)  # a first compile, or a later one (a new spec or shape)
                    if graphs is None and t == 1:
                        return None
                    step = decode_step  # nothing ran: the same step again, eagerly, and replayed from here on
                    continue
                if step is not decode_step and device.type not in _COMPILE_SECONDS:
                    _COMPILE_SECONDS[device.type] = time.perf_counter() - started
                    log.info("generation_compile: compiled the decode step on %s in %.1f s (once per process)",
                             device.type, _COMPILE_SECONDS[device.type])
                t, col = t + 1, col + 1
                if graphs is not None and min(W - col, T - t) >= MIN_GRAPH_STEPS:
                    replay = self._capture(graphs, step, (dec, spec, tok, pos, cursor, rowmap, finished, *views,
                                                          uniforms, completion, eos, limit))
                    if replay is None:
                        graphs = None  # capturing failed: the compiled step, launched kernel by kernel
            if keep is not None and stop:  # on the loop's stream, which made the cache it reads
                self._keep_finished(dec, finished, rowmap, completion, eos, limit, kept, keep, caller)
        completion, limit = completion[:N], limit[:N]
        if not stop:
            return completion, limit.clone()
        is_eos = torch.isin(completion, eos)  # [N, T]: a finished row wrote padding after its EOS or its limit
        return completion, torch.minimum(torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, T), limit)

    @staticmethod
    def _keep_finished(dec, finished, rowmap, completion, eos, limit, kept, keep, caller) -> None:
        """Hand `keep` the rows whose slots have finished by an EOS draw and that it has not had yet:
        their tokens up to and with the EOS, and their caches before it. A slot also finishes when its
        row reaches its limit without EOS: such a row is marked as had and kept nowhere. An empty slot
        is finished from the start, but maps to the dump row N, which `kept` marks as had."""
        slots = (finished & ~kept[rowmap]).nonzero().squeeze(-1)
        if slots.numel() == 0:
            return
        rows = rowmap[slots]
        kept[rows] = True
        done = completion[rows]  # [n, T]
        # an EOS within the row's own tokens: one cut at its limit wrote padding after it, maybe a stop token
        is_eos = torch.isin(done, eos) & (torch.arange(done.shape[1], device=done.device) < limit[rows, None])
        ended = is_eos.any(-1).nonzero().squeeze(-1)
        if ended.numel() == 0:
            return
        slots, rows, done = slots[ended], rows[ended], done[ended]
        ends = is_eos[ended].int().argmax(-1)  # the first EOS: the row's own
        caches = dec.snapshot(slots, ends)
        for cache in caches:
            for x in cache:
                _handed_out(x, caller)
        tokens = [row[: e + 1] for row, e in zip(done.tolist(), ends.tolist())]
        keep(rows.tolist(), tokens, caches)

    def _capture(self, graphs, step, args: tuple):
        """Capture one step over `args` (the current shape's tensors, bound here: a replay reads and
        writes these objects, whatever the loop's names point to later); returns its replay, or
        None when capturing failed (warned once per process)."""
        tok, finished = args[2], args[6]

        def one_step():
            nxt, now_finished, _ = step(*args)
            tok.copy_(nxt)  # the next step reads its tokens and flags where this one read them
            finished.copy_(now_finished)

        try:
            replay_graph = graphs.capture(one_step)
        except Exception as err:  # noqa: BLE001 — any failure: the run goes on without graphs
            _graphs_failed(self.device, err)
            return None

        def replay(held=args) -> None:  # `held`: the graph's tensors live as long as its replay
            replay_graph()

        return replay

    def _views(self, dec, W: int, *per_slot: torch.Tensor) -> tuple:
        """(width [W], valid, keys, values): the step's arguments about the cache, their varying
        sizes marked symbolic."""
        width = torch.empty(W, dtype=torch.bool, device=self.device)
        for x in dec.k + dec.v:
            _dynamic(x, 0, 2)
        _dynamic(dec.valid, 0, 1)
        for x in (width, *per_slot):
            _dynamic(x, 0)
        return width, dec.valid, dec.k, dec.v

    @staticmethod
    def _compact(dec, live: torch.Tensor, S: int, tok, pos, rowmap, finished, N: int):
        """Move the live slots into a batch of S slots (S >= live rows), one layer at a time."""
        n = live.numel()

        def moved(x: torch.Tensor, fill) -> torch.Tensor:
            out = x.new_full((S,) + tuple(x.shape[1:]), fill)
            out[:n] = x[live]
            return out

        for cache in (dec.k, dec.v):
            for l, old in enumerate(cache):
                cache[l] = moved(old, 0)
                _in_use(old)
                del old
        _in_use(dec.valid)
        dec.valid = moved(dec.valid, False)
        dec.valid[n:, 0] = True
        return moved(tok, 0), moved(pos, 0), moved(rowmap, N), moved(finished, True)

    @staticmethod
    def _grow(dec, C: int) -> None:
        """Widen the cache to C columns (zeros past the old ones), one layer at a time."""
        for cache in (dec.k, dec.v):
            for l, old in enumerate(cache):
                new = old.new_zeros(old.shape[0], old.shape[1], C, old.shape[3])
                new[:, :, : old.shape[2]] = old
                cache[l] = new
                _in_use(old)
                del old
        valid = dec.valid.new_zeros(dec.valid.shape[0], C)
        valid[:, : dec.valid.shape[1]] = dec.valid
        _in_use(dec.valid)
        dec.valid = valid
