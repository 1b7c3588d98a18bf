"""Where the loop's rollouts come from: this rank's prompts for each step (`PromptDraw`), and the
`RolloutProducer` (rollout/producer.py) that generates them, set up from the config (`make_producer`):

- synchronous (and `async_rollouts` with max_staleness 0): each batch is drawn and generated when
  the loop asks, in the loop's thread, by the trainer's own `generate` stage;
- `async_rollouts` with max_staleness > 0: a background thread generates up to max_staleness
  batches ahead while the loop scores and updates. A multi-turn driver tokenises tool and
  environment messages as it goes, and a Hugging Face tokenizer must not be used by two threads
  at once: the background driver gets a tokenizer (and prompt formatter) of its own, while the
  loop's thread keeps the trainer's for evaluation and preflight.
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Callable

import torch
from datasets import Dataset

from grouprl import distributed as D
from grouprl.config import TrainConfig
from grouprl.data import ChatForm, PromptBatch, PromptFormatter, PromptSampler
from grouprl.rollout.factory import make_rollouts
from grouprl.prompt_filter import PromptFilter
from grouprl.rollout import GenerationEngine, SamplingParams
from grouprl.rollout.producer import RolloutProducer
from grouprl.rollout.types import Trajectories


class PromptDraw:
    """This rank's prompts for each step: the sampler's next `prompts_per_step` indices (the prompt
    filter, when on, passes settled prompts over), the same global list on every rank, of which
    each rank takes its share (B/K whole groups), tokenised. The lock keeps the filter's draws and
    the loop's records of its groups apart (the async producer draws while the loop records)."""

    def __init__(self, sampler: PromptSampler, prompt_filter: PromptFilter | None, formatter: PromptFormatter,
                 dataset: Dataset, dist: D.DistContext, *, prompts_per_step: int, prompt_column: str):
        self.sampler, self.prompt_filter, self.formatter, self.dataset, self.dist = (sampler, prompt_filter,
                                                                                     formatter, dataset, dist)
        self.prompts_per_step, self.prompt_column = prompts_per_step, prompt_column
        self._lock = threading.Lock()

    def __call__(self) -> PromptBatch:
        B = self.prompts_per_step
        with self._lock:
            drawn = self.prompt_filter.draw(self.sampler, B) if self.prompt_filter else self.sampler.next(B)
        indices = D.shard_prompts(self.dist, drawn)
        return self.formatter.batch(self.dataset, indices, self.prompt_column)

    def record(self, prompt_index: list[int] | None, zero_std: torch.Tensor, G: int) -> None:
        """The groups of a scored (global) batch, `zero_std  # [B]` per group: the prompt filter's memory."""
        if self.prompt_filter is not None:
            with self._lock:
                self.prompt_filter.record(prompt_index[::G], zero_std.tolist())  # type: ignore[index]

    def metrics(self, G: int) -> dict[str, float]:
        """The prompt filter's counts so far (none without a filter)."""
        if self.prompt_filter is None:
            return {}
        return {"prompt_filter/skipped": self.prompt_filter.skipped,
                "prompt_filter/rollouts_saved": self.prompt_filter.skipped * G,
                "prompt_filter/settled": self.prompt_filter.num_settled}


def make_producer(cfg: TrainConfig, engine: GenerationEngine, draw: Callable[[], PromptBatch],
                  generate: Callable[[PromptBatch], Trajectories], *, model: torch.nn.Module, tokenizer: Any,
                  tools: dict, environment: type | None, sampling: SamplingParams,
                  generator: torch.Generator) -> RolloutProducer:
    """The producer of this rank's batches: `draw()` gives the next prompts, `generate(prompts)` (the
    trainer's stage) samples them when generated inline; ahead of time, a driver of the background
    thread's own samples them with `engine`, `sampling` and `generator`."""
    ahead = cfg.max_staleness if cfg.async_rollouts else 0
    if not ahead:
        return RolloutProducer(engine, draw, generate, 0)
    multiturn = bool(tools) or environment is not None  # its driver tokenises: a tokenizer of its own
    tok = copy.deepcopy(tokenizer) if multiturn else tokenizer
    formatter = PromptFormatter(tok, max_prompt_length=cfg.max_prompt_length, tools=[t.schema for t in tools.values()],
                                template_kwargs=cfg.chat_template_kwargs, chat=ChatForm.of(cfg))
    turns = make_rollouts(cfg, model, tok, formatter, tools, environment)  # single-turn: a SingleTurn

    def generate_ahead(prompts: PromptBatch) -> Trajectories:  # after the producer's close(), no next turn starts
        return turns.generate(producer.guarded, prompts.prompt_ids, cfg.num_generations, sampling, generator,
                              prompts=prompts.prompts, columns=prompts.columns)
    producer = RolloutProducer(engine, draw, generate_ahead, ahead, partial=cfg.partial_rollouts)
    return producer
