"""Sampling G completions per prompt from a Hugging Face causal LM, with a KV cache.

What this engine does that `model.generate` does not, and why:
- each prompt is prefilled once and its KV cache repeated G times (the G completions of a group
  share the prompt), instead of prefilling B*G copies;
- a row that has emitted EOS leaves the batch: its cache rows are dropped, so finished rows cost
  nothing (`generate` keeps computing every row until the longest one ends);
- `ignore_eos` makes every completion exactly `max_new_tokens` long (benchmarks need both sides
  to compute the same tokens);
- `row_max_new_tokens` (a multi-turn continuation's rooms) stops each row at its own most new
  tokens: a row that reaches it leaves the batch as an EOS row does, truncated as a row cut at
  `max_new_tokens` is, and keeps no cache (in every decode path: the eager loop, the slot loop and
  its compiled step, rollout/compiled_decode.py);
- sampling draws from a caller-owned `torch.Generator`, so a resumed run samples the same tokens;
- inside `keep_conversations()` (the multi-turn driver's rollouts), each row that ends with EOS
  leaves its keys/values behind (in the eager loop and in compiled_decode.py's slot loop alike),
  and a later call whose prompt extends that row's tokens (the conversation so far) copies them in
  and prefills only the new tokens (FastDecoder models; the generic path prefills the whole prompt).
  Kept caches live no longer than that: a call drops every kept cache its prompts do not extend
  once it has matched them, and each one it continues from once it has copied it into its own
  cache, before it decodes. The driver's last allowed turn (`keep_conversations(calls=max_turns)`)
  keeps none: no call continues it.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field, replace

import torch
from transformers import DynamicCache

from grouprl.rollout.compiled_decode import CompileChoice, CompiledDecodeLoop, graphs_available
from grouprl.rollout.llama_decoder import FastDecoder
from grouprl.rollout.sampling import draw_seed, sample_next, uniform_table
from grouprl.rollout.types import GenerationEngine, Rollout, SamplingParams, cache_kwarg, left_pad_prompts

__all__ = ["HFEngine", "sample_next"]


@dataclass
class HFEngine(GenerationEngine):
    """Generation engine for any `transformers` causal LM that supports a DynamicCache."""

    model: torch.nn.Module
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    max_batch_size: int | None = None  # completions decoded together at most
    autocast_dtype: torch.dtype | None = None  # compute dtype of generation (None: the weights' dtype)
    fast: bool = True  # use FastDecoder for the models it supports (Llama, Mistral, Qwen2, Qwen3, SmolLM3)
    decode_threads: int | None = None  # torch threads while decoding; None: 1 for small models on CPU
    compile: bool | str = False  # FastDecoder models: the compiled decode step, True, False or "auto"
    planned_calls: int | None = None  # compile="auto": the generate calls the run will make
    check_every: int | None = None  # slot loop: the host reads the finished flags every this many tokens;
    # None: CHECK_EVERY for the device
    cuda_graphs: bool = True  # on CUDA: replay each decode step, compiled or eager, as a graph (compiled_decode.py)
    decodes_with_policy = True  # the engine runs the training model itself (class attribute)
    _kept: dict | None = field(default=None, init=False, repr=False)  # token tuple -> (k, v), see keep_conversations
    _calls_left: int | None = field(default=None, init=False, repr=False)  # keep_conversations(calls)
    _choice: CompileChoice = field(init=False, repr=False)
    _probe: list | None = field(default=None, init=False, repr=False)  # auto: a rollout's timed calls

    def __post_init__(self) -> None:
        self._choice = CompileChoice(self.compile, self.planned_calls)

    @contextlib.contextmanager
    def keep_conversations(self, calls: int | None = None):
        """Within this block, rows that end with EOS keep their KV cache until the next `generate`:
        that call (num_generations=1) continues each prompt that extends one of them from it, and
        drops the rest before it decodes. The weights must not change inside the block (the kept
        keys/values are theirs). `calls`: the most calls the block makes (the driver's max_turns);
        the last one's rows are never continued, so it keeps nothing."""
        self._kept, self._calls_left = {}, calls
        try:
            with self._probe_rollout():  # auto prices the whole multi-turn rollout, every turn's call
                yield self
        finally:
            self._kept = self._calls_left = None

    @contextlib.contextmanager
    def _probe_rollout(self):
        """While `auto` is probing, the decode calls of one rollout (a `generate` cut into generation_batch_size
        parts, or the turns of a `keep_conversations` block) are timed together and recorded as one call: the
        run makes one rollout a step (planned_calls is max_steps), however many calls each takes."""
        if self._probe is not None or not self._choice.probing():  # inside a rollout already, or decided
            yield
            return
        self._probe = []
        try:
            yield
            timed = self._probe
        finally:
            self._probe = None
        if timed:
            self._choice.record(sum(t[0] for t in timed), sum(t[1] for t in timed), timed[0][2], timed[0][3])

    def sync_weights(self, model: torch.nn.Module, version: int) -> None:
        """The engine decodes with the training model itself: nothing to copy."""
        self.model = model

    def close(self) -> None:
        """Nothing to release: the engine holds only the training model."""

    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 generator: torch.Generator | None = None) -> Rollout:
        """G completions for each of B prompts; rows g*G .. g*G+G-1 belong to prompt g."""
        per_call = max(1, (self.max_batch_size or len(prompt_ids) * num_generations) // num_generations)
        rooms = params.row_max_new_tokens
        if rooms is not None and len(rooms) != len(prompt_ids):
            raise ValueError(f"row_max_new_tokens has {len(rooms)} entries for {len(prompt_ids)} prompts: give "
                             "each prompt its own most new tokens, or None for max_new_tokens for every one")
        kept, keeping = self._kept, self._kept is not None  # the previous call's rows (keep_conversations)
        self._kept = {} if keeping else None  # this call's rows replace them
        if keeping and self._calls_left is not None:  # the block's last call: no later call continues a row
            self._calls_left -= 1
            keeping = self._calls_left > 0
        starts = range(0, len(prompt_ids), per_call)
        # the kept caches each part's prompts continue from (a continuation: G = 1): the others go now, and
        # each part empties its list once they are in its cache (_generate), so no copy outlives its use
        matched = _prefixes(kept, prompt_ids) if kept and num_generations == 1 and not params.ignore_eos else None
        prefixes = [None if matched is None else matched[i:i + per_call] for i in starts]
        if kept:
            kept.clear()
        del kept, matched  # the parts' lists hold the only references left
        with self._probe_rollout():
            parts = []
            for i, prefix in zip(starts, prefixes):
                part = params if rooms is None else replace(params, row_max_new_tokens=rooms[i:i + per_call])
                parts.append(self._generate(prompt_ids[i:i + per_call], num_generations, part, generator, keeping,
                                            prefix))
        return Rollout.cat(parts, self.pad_token_id)

    def _decode_threads(self, device: torch.device) -> int | None:
        """A decode step of a small model is microseconds of work per matmul, less than what OpenMP
        costs to fork and join threads (and far less when another process holds a core): such
        models decode on one thread."""
        if self.decode_threads is not None or device.type != "cpu":
            return self.decode_threads
        n_params = sum(p.numel() for p in self.model.parameters())
        return 1 if n_params <= SMALL_MODEL_PARAMS else None

    def _decoder(self, device: torch.device):
        if self.fast and FastDecoder.supports(self.model):
            return FastDecoder(self.model, dtype=self.autocast_dtype)
        return _HFDecoder(self.model, self.autocast_dtype, device)

    def _generate(self, prompt_ids: list[list[int]], G: int, params: SamplingParams,
                  generator: torch.Generator | None, keeping: bool = False,
                  prefix: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None) -> Rollout:
        """One part of a call. `keeping`: inside keep_conversations, not its last call (rows that end with
        EOS keep their caches); `prefix` [B]: the kept cache each prompt continues from, or None; the list is emptied
        once they are copied, before decoding (the caller holds no other reference to them)."""
        model, T = self.model, params.max_new_tokens
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        ids, mask = left_pad_prompts(prompt_ids, self.pad_token_id)  # [B, P]
        ids, mask = ids.to(device), mask.to(device)
        eos = torch.tensor(self.eos_token_ids, device=device)
        seed = draw_seed(generator)  # this call's counter-based uniforms (rollout/sampling.py)
        with torch.no_grad(), _num_threads(self._decode_threads(device)):
            decoder = self._decoder(device)
            keeps = keeping and isinstance(decoder, FastDecoder) and not params.ignore_eos
            fast = isinstance(decoder, FastDecoder)
            compiles = self._choice.use()
            # the slot loop: the compiled step, or on a device with graphs the eager step replayed as graphs
            slot_loop = (fast and T > 0  # (no token to decode: the eager loop returns [N, 0])
                         and (compiles or (self.cuda_graphs and graphs_available(device))))
            if fast and prefix and any(x is not None for x in prefix):  # (the block's last call keeps none)
                logits = decoder.start_from(ids, mask, T, prefix)  # [N, V]
            else:
                logits = decoder.start(ids, mask, G, T, zeroed=True) if slot_loop else decoder.start(ids, mask, G, T)
            if prefix:
                prefix.clear()  # copied into the decoder's cache: the kept ones are freed before decoding
            if T > 0 and not bool(torch.isfinite(logits).all()):  # one read a call; a draw over NaN is a silent token
                bad = int((~torch.isfinite(logits)).any(-1).sum())
                raise NonFiniteLogits(f"the policy's next-token logits are not finite (NaN or inf) for {bad} of "
                                      f"{logits.shape[0]} rows after their prompts: its weights (or a prompt's "
                                      "embedding) hold NaN or inf, and every draw would be a meaningless token; "
                                      "resume from an earlier checkpoint, or lower learning_rate")
            N = logits.shape[0]
            uniforms = uniform_table(seed, N, T, device)  # [N, T] float64
            limit = _row_limits(params, G, device)  # [N] each row's most new tokens, or None: T for every row
            out = None
            started = time.perf_counter()
            if slot_loop:
                keep = functools.partial(self._keep, prompt_ids, G) if keeps else None
                every = self.check_every or CHECK_EVERY.get(device.type, CHECK_EVERY["cuda"])
                out = CompiledDecodeLoop(device, every, self.cuda_graphs, compile=compiles).run(
                    decoder, logits, params, uniforms, eos, self.pad_token_id, keep=keep, limit=limit)
            if out is None:
                if slot_loop:  # no compiled step and no graphs: the eager loop over the same (zeroed) cache
                    decoder.n, decoder.t = N, 0
                completion, lengths = self._decode_eager(decoder, logits, params, uniforms, eos, prompt_ids, G, keeps,
                                                         limit)
            else:
                completion, lengths = out
            if fast and T > 0 and self._probe is not None:  # auto times the calls it decodes without compiling
                if device.type == "cuda":  # replayed graphs run asynchronously: the clock waits for the device
                    torch.cuda.synchronize(device)
                graphed = out is not None  # uncompiled, the slot loop runs only to replay the eager step as graphs
                self._probe.append((time.perf_counter() - started, int(lengths.max()) - 1, len(decoder.layers),
                                    device.type + ("+graphs" if graphed else "")))
            del decoder
        real = torch.arange(T, device=device)[None, :] < lengths[:, None]  # [N, T]
        truncated = ~(torch.isin(completion, eos) & real).any(-1)  # no EOS: a completion ending with one at the
        if params.ignore_eos:                                       # last allowed token (its own) is not truncated
            truncated = torch.zeros_like(truncated)  # every completion is exactly T tokens by request
        model.train(was_training)
        cmask = real
        completion = completion.masked_fill(~cmask, self.pad_token_id)
        return Rollout(
            prompt_ids=ids.repeat_interleave(G, dim=0).cpu(),
            prompt_mask=mask.repeat_interleave(G, dim=0).cpu(),
            completion_ids=completion.cpu(),
            completion_mask=cmask.cpu(),
            truncated=truncated.cpu(),
        )

    def _decode_eager(self, decoder, logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor,
                      eos: torch.Tensor, prompt_ids: list[list[int]], G: int, keeps: bool,
                      limit: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode loop, one eager step per token: rows that sample EOS, or reach their own most new
        tokens `limit` [N] (None: T for every row), leave the batch at once. Returns (completion [N, T],
        lengths [N])."""
        N, T, device = logits.shape[0], params.max_new_tokens, logits.device
        completion = torch.full((N, T), self.pad_token_id, dtype=torch.long, device=device)
        lengths = torch.full((N,), T, dtype=torch.long, device=device)
        active = torch.arange(N, device=device)  # rows still decoding
        for t in range(T):
            tok = sample_next(logits, params, u=uniforms[active, t])  # [n]
            completion[active, t] = tok
            ends = None if params.ignore_eos else torch.isin(tok, eos)  # [n] rows that drew EOS
            done = ends
            if limit is not None:  # and rows at their own most new tokens: cut there, as at T
                cut = limit[active] == t + 1  # [n]
                done = cut if ends is None else ends | cut
            any_done = done is not None and bool(done.any())
            if keeps and any_done:  # a conversation may go on from the EOS rows' caches (the last token's too)
                rows = ends.nonzero().squeeze(-1)
                if rows.numel() > 0:
                    self._keep(prompt_ids, G, active[rows].tolist(), completion[active[rows], : t + 1].tolist(),
                               decoder.snapshot(rows))
            if t == T - 1:
                break
            if any_done:
                lengths[active[done]] = t + 1
                keep = (~done).nonzero().squeeze(-1)  # [n']
                if keep.numel() == 0:
                    break
                active, tok = active[keep], tok[keep]
                decoder.keep(keep)  # finished rows leave the batch
            logits = decoder.step(tok)  # [n, V]
        return completion, lengths

    def _keep(self, prompt_ids: list[list[int]], G: int, rows: list[int], tokens: list[list[int]],
              caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep the caches of `rows` (of the call), which ended with EOS: the keys/values of each
        one's prompt and completion before that EOS (the EOS was never fed), under the tokens of
        prompt + completion up to and with the EOS (`tokens`), with which the next turn's prompt
        starts."""
        for n, toks, kv in zip(rows, tokens, caches):
            self._kept[tuple(prompt_ids[n // G] + toks)] = kv


class NonFiniteLogits(RuntimeError):
    """The policy's logits after the prompts hold NaN or inf: nothing it samples would mean anything."""


def _row_limits(params: SamplingParams, G: int, device: torch.device) -> torch.Tensor | None:
    """Each row's most new tokens [N] (row n: its prompt's `row_max_new_tokens`, at most max_new_tokens),
    or None where no prompt's room is below max_new_tokens."""
    rooms, T = params.row_max_new_tokens, params.max_new_tokens
    if rooms is None or min(rooms) >= T:
        return None
    if min(rooms) < 1:
        raise ValueError(f"row_max_new_tokens holds {min(rooms)}: every prompt it names needs room for at least "
                         "one new token (leave a row with no room out of the call)")
    return torch.tensor([min(r, T) for r in rooms], dtype=torch.long, device=device).repeat_interleave(G)  # [N]


def _prefixes(kept: dict, prompt_ids: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """For each prompt, the kept cache of the longest kept sequence it strictly extends, or None."""
    by_length = sorted(kept, key=len, reverse=True)
    out = []
    for p in prompt_ids:
        match = next((k for k in by_length if len(k) < len(p) and tuple(p[: len(k)]) == k), None)
        out.append(None if match is None else kept[match])
    return out


SMALL_MODEL_PARAMS = 5_000_000  # decode on a single CPU thread up to this many parameters
# How often the slot loop reads its rows' finished flags, by device type. On CPU a look is a few
# microseconds, and looking every step costs nothing measurable: benchmarks/check_every.py (tiny at
# 16 and 64 rows, 10m at 16, compiled; rows ending after ~40 of at most 128 tokens) put 1, 2 and 4
# within 5 % of each other, at 0.77-0.86x the eager loop's time, 8 at 0.79-0.87x, 16 at 0.80-0.89x,
# and 32 (tiny, 16 rows) at 1.00x. On CUDA a look is a sync that drains the queue of replayed
# graphs: 8 there is an estimate, not yet measured (scripts/gpu_check.sh's `every` part).
CHECK_EVERY = {"cpu": 1, "cuda": 8}


@contextlib.contextmanager
def _num_threads(n: int | None):
    if n is None or n == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class _HFDecoder:
    """The generic path: any `transformers` causal LM with a DynamicCache (same interface as FastDecoder)."""

    model: torch.nn.Module
    autocast_dtype: torch.dtype | None
    device: torch.device
    cache: DynamicCache = field(default_factory=DynamicCache)

    def _ac(self):
        return (torch.autocast(self.device.type, dtype=self.autocast_dtype)
                if self.autocast_dtype is not None else contextlib.nullcontext())

    def start(self, ids: torch.Tensor, mask: torch.Tensor, G: int, max_new_tokens: int) -> torch.Tensor:
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, P]
        with self._ac():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                             **{cache_kwarg(self.model): self.cache})
        self.cache.batch_repeat_interleave(G)
        self.attn = mask.repeat_interleave(G, dim=0)  # [N, P]
        self.next_pos = pos[:, -1].repeat_interleave(G) + 1  # [N]
        return out.logits[:, -1].float().repeat_interleave(G, dim=0)  # [N, V]

    def keep(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.attn, self.next_pos = self.attn[rows], self.next_pos[rows]

    def step(self, tok: torch.Tensor) -> torch.Tensor:
        self.attn = torch.cat([self.attn, self.attn.new_ones(self.attn.shape[0], 1)], dim=1)  # [n, P+t+1]
        with self._ac():
            out = self.model(input_ids=tok[:, None], attention_mask=self.attn, position_ids=self.next_pos[:, None],
                             use_cache=True, **{cache_kwarg(self.model): self.cache})
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1].float()  # [n, V]
