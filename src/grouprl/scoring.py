"""The score stage (`Trainer.score`): trajectories of a batch of prompts into a scored `StepBatch`.

The reward functions (rewards/) see each completion's prompt, its text (or a multi-turn
trajectory's messages), the dataset row's other columns repeated per completion, the token ids
and lengths, and what the trajectory reports (`env_reward`). Their weighted total is shaped by the
overlong penalty when asked (DAPO), step rewards are built for process supervision, and the audit
functions are scored beside the reward, never in it.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from grouprl.batch import StepBatch
from grouprl.config import ConfigError, TrainConfig
from grouprl.core import overlong_penalty
from grouprl.data import DataError, PromptBatch, completion_objects
from grouprl.rewards import RewardScores, process_rewards, resolve_reward_spec, score_completions
from grouprl.rewards.workers import RewardWorkers
from grouprl.rollout.types import Trajectories


def score_trajectories(cfg: TrainConfig, tokenizer: Any, reward_funcs: list[Callable], audit_funcs: list[Callable],
                       prompts: PromptBatch, trajectories: Trajectories, workers: RewardWorkers | None = None
                       ) -> StepBatch:
    """The reward and audit functions on `trajectories` of `prompts` (G per prompt), weighted and
    shaped as configured; those the reward `workers` run, there."""
    rollout = trajectories.rollout
    G = len(rollout) // len(prompts.prompts)
    ids = rollout.token_lists()  # [N][T_i]
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    per_prompt = [p for p in prompts.prompts for _ in range(G)]
    cols = {k: [v for v in vals for _ in range(G)] for k, vals in prompts.columns.items()}
    cols.update(completion_ids=ids, completion_lengths=[len(x) for x in ids])
    reported = trajectories.reward_columns()  # `env_reward`, with an environment
    clash = sorted(set(reported) & set(cols))
    if clash:
        raise DataError(f"the dataset has a column named {clash[0]!r}, which the environment's rewards also take: "
                        f"rename the column (ds.rename_column({clash[0]!r}, 'dataset_{clash[0]}'))")
    cols.update(reported)
    completions = trajectories.messages or completion_objects(texts, prompts.conversational)
    scores: RewardScores = score_completions(
        reward_funcs, cfg.reward_weights, per_prompt, completions,
        cols, timeout_s=cfg.reward_timeout_s, fallback=cfg.reward_fallback, step_delimiter=cfg.step_delimiter,
        workers=workers, group_size=G)
    shaping = (overlong_penalty(rollout.lengths, cfg.max_completion_length, cfg.overlong_cache_len)
               if cfg.overlong_shaping else None)  # [N]
    rewards = scores.total.float() if shaping is None else scores.total.float() + shaping  # [N]
    steps = process_rewards(scores.steps, scores.per_func, cfg.reward_weights, ids, texts, tokenizer,
                            shaping, estimator=cfg.advantage_estimator)
    audit = score_completions(audit_funcs, None, per_prompt, completions, cols, timeout_s=cfg.reward_timeout_s,
                              fallback=cfg.reward_fallback, workers=workers,
                              group_size=G).per_func if audit_funcs else {}
    index = None if prompts.indices is None else [i for i in prompts.indices for _ in range(G)]
    calls = None if trajectories.messages is None else [
        [f"{c['function']['name']}({json.dumps(c['function']['arguments'])})"
         for m in msgs for c in m.get("tool_calls", [])] for msgs in trajectories.messages]
    return StepBatch(rollout, per_prompt, texts, rewards, scores.per_func, scores.metrics, steps, audit, index,
                     trajectories.stop_reasons, calls, None if shaping is None else scores.total.float(),
                     scores.fallback)


def reward_from_config(spec: Any) -> Callable:
    """A reward (or audit) function from its config entry; what cannot be resolved is a ConfigError."""
    try:
        return resolve_reward_spec(spec)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_reward_columns(funcs: list[Callable], names: list[str], **datasets: Any) -> None:
    """Before any model loads: each reward (or audit) function that says which dataset column it reads
    (`needs_column`: its alternatives; the built-ins that compare with a gold answer or run tests) finds
    one in each data set given (`train_data=`, `eval_data=`; None: no such set). Otherwise the first
    step's reward call failed, after the model loaded, with advice to fix the function."""
    for func, name in zip(funcs, names):
        wanted = getattr(func, "needs_column", ())
        for which, ds in datasets.items():
            if wanted and ds is not None and not set(wanted) & set(ds.column_names):
                raise ConfigError(f"reward function {name!r} reads the dataset column "
                                  f"{' or '.join(map(repr, wanted))}, which {which} lacks (its columns: "
                                  f"{', '.join(ds.column_names)}): add it, or rename the column that holds it "
                                  "(docs/rewards.md lists each built-in's columns)")


def start_reward_workers(cfg: TrainConfig, reward_funcs: list[Callable], audit_funcs: list[Callable],
                         from_config: bool) -> RewardWorkers | None:
    """The run's reward worker processes (`reward_workers`), or None for none; functions built `from_config`
    are built again in each worker from their config entries."""
    if not cfg.reward_workers:
        return None
    specs = (list(cfg.reward_funcs) if from_config else [None] * len(reward_funcs)) + list(cfg.audit_funcs)
    try:
        return RewardWorkers(cfg.reward_workers, reward_funcs + audit_funcs, specs, preload=["grouprl.trainer"],
                             seed=cfg.seed)
    except ValueError as e:  # a function the workers cannot load
        raise ConfigError(str(e)) from None
