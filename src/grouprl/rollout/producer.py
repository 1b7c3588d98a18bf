"""The rollout stage: prompts in, rollouts out, either when asked (synchronous) or up to
`max_staleness` batches ahead while the trainer updates (one-step asynchronous GRPO, verl's
"one-step off-policy", OpenRLHF's `async_train`).

How the asynchronous mode works, and why it is built this way:
- one background thread runs the engine's `generate`; the trainer's thread draws and tokenises the
  prompts (tokenizers are not safe to share between threads) and does everything else;
- `next()` hands out the oldest batch, then tops the queue up to `max_staleness` batches, so the
  engine generates batch k+1 while the trainer scores and updates on batch k;
- `sync_weights` first waits for the batches in flight, then sends the new weights: a batch is
  sampled with one version of the weights, never a mix, and the engine is never asked to load
  weights while it generates. A batch generated after s weight syncs and trained on after s'
  has staleness s' - s, at most `max_staleness` (the queue is never deeper);
- partial rollouts (`partial=True`): `sync_weights` sends at once, and the batches in flight go on
  under the new weights (the vLLM server loads them between two decoding steps), so a trajectory's
  tokens may come from several versions, each token's sampler log-prob from the version that drew
  it. Staleness counts from the version its first token saw (the oldest), so the bound is the
  same; `Produced.overlapped` counts the updates that began while the batch was generated (the
  per-token versions are known only to lie in [oldest, oldest + overlapped]: the completions API
  returns a request's tokens at its end);
- the engine's log-probs travel in the rollout (`sampling_logp`) and the trainer recomputes
  pi_old with its current weights, so the importance-sampling correction (core/importance.py)
  weighs each token by pi_old(trainer, now) / pi(sampler, then): staleness and engine mismatch
  in one ratio;
- with max_staleness 0 there is no thread and no queue: `next()` generates inline, which is the
  synchronous loop, step for step.

Departure: on resume the batches that were generated ahead but not trained on are not
regenerated: the prompt sampler and the sampling seeds had already moved past them.

`close()` stops a batch in flight at its next call into the engine (`RolloutProducer.guarded`: a
multi-turn rollout's next turn), so a run that ends, or is stopped at once by a second signal, does not
wait for every remaining turn of a batch nobody will train on; a call already running is waited for
(an engine cannot be interrupted mid-batch).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from grouprl.rollout.types import GenerationEngine


@dataclass
class Produced:
    """One generated batch: its prompts (the trainer's PromptBatch), what `generate` returned (the
    trainer's: multiturn.Trajectories), how many weight syncs had happened when its generation began,
    and the engine's generation time."""

    prompts: Any
    result: Any
    synced: int
    seconds: float
    staleness: int = 0  # weight syncs between its generation and the moment it was handed out
    overlapped: int = 0  # weight updates begun while it was generated (partial rollouts only)


class RolloutCancelled(RuntimeError):
    """A batch generated ahead was stopped between two engine calls: the producer was closed."""


class _Guarded:
    """An engine whose `generate` refuses to start once `cancelled` is set; everything else is the engine's."""

    def __init__(self, engine: GenerationEngine, cancelled: threading.Event):
        self._engine, self._cancelled = engine, cancelled

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        if self._cancelled.is_set():
            raise RolloutCancelled("the rollout producer was closed: the batch generated ahead is dropped")
        return self._engine.generate(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class RolloutProducer:
    def __init__(self, engine: GenerationEngine, draw: Callable[[], Any],
                 generate: Callable[[Any], Any], max_staleness: int = 0, partial: bool = False):
        """`draw()` gives the next prompts (called in the caller's thread), `generate(prompts)`
        samples their completions with `engine` (called in the background when max_staleness > 0,
        where it should call `self.guarded`, the engine that `close()` stops between two calls).
        `partial`: weight updates do not wait for the batches in flight."""
        self.engine, self.draw, self.generate, self.depth = engine, draw, generate, max_staleness
        self.partial = partial
        self.cancelled = threading.Event()  # set by close()
        self.guarded: GenerationEngine = _Guarded(engine, self.cancelled)  # type: ignore[assignment]
        self.version, self.synced = 0, 0  # the engine starts with the weights of version 0; syncs so far
        self.begun = 0  # weight updates begun (synced, or one more while one is being sent)
        self.pending: deque[Future] = deque()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout") if max_staleness else None

    def next(self) -> Produced:
        """The next batch; in asynchronous mode the queue is then refilled in the background."""
        if not self.pending:
            self._submit()
        produced = self.pending.popleft().result()  # an engine's own waits carry their timeouts
        produced.staleness = self.synced - produced.synced
        while len(self.pending) < self.depth:
            self._submit()
        return produced

    def sync_weights(self, model: torch.nn.Module, version: int) -> None:
        """Wait for the batches being generated (unless partial), then send the weights."""
        if not self.partial:
            for job in self.pending:
                job.result()
        if version != self.version:
            self.begun = self.synced + 1
        self.engine.sync_weights(model, version)
        if version != self.version:
            self.version, self.synced = version, self.synced + 1

    def discard(self) -> int:
        """Drop every batch generated ahead or still being generated, and return how many: after a
        rollback they hold samples of the policy that collapsed. Those in flight are waited for (an
        engine cannot be interrupted mid-batch) and their errors dropped with them; the next `next()`
        samples the weights sent after this call. Their prompts are spent, as a rollback's steps are."""
        jobs, self.pending = list(self.pending), deque()
        for job in jobs:
            if not job.cancel():
                job.exception()  # waits; an error of a dropped batch is not the trainer's
        return len(jobs)

    def close(self) -> None:
        """Stop: batches not begun are dropped, one in flight stops at its next engine call (its error
        dropped with it), and a call already running is waited for."""
        self.cancelled.set()
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)

    def _submit(self) -> None:
        prompts = self.draw()

        def run() -> Produced:
            # the syncs so far when generation starts, not when the batch was queued: with partial
            # rollouts and max_staleness >= 2 a batch waits behind another while a sync goes out, and
            # is then sampled wholly from the new weights
            t0, synced = time.perf_counter(), self.synced
            result = self.generate(prompts)
            return Produced(prompts, result, synced, time.perf_counter() - t0, overlapped=self.begun - synced)

        if self._thread is None:  # synchronous: generate now, in this thread
            job: Future = Future()
            job.set_result(run())
        else:
            job = self._thread.submit(run)
        self.pending.append(job)
