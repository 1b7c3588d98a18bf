"""The GRPO training loop.

`Trainer.train_step` is one step, one call per stage (docs/architecture.md's data path):

    sample_batch  -> generate (engine, turns) -> score (rewards) [-> more rounds: DAPO dynamic sampling]
    advantages    -> group-relative, per completion or per token; PPO: GAE (value.py); a teacher (distillation.py)
    update        -> old/ref log-probs, then num_iterations optimizer steps over micro-batches
    sync_weights  -> the engine samples the new policy next

Each stage is a public method, so a script can run any of them alone: `generate(prompts, greedy=True)` and
`score(prompts, trajectories)` sample and score with the current policy, `evaluate(dataset)` runs the eval,
`logprobs(rollout)` scores tokens under the policy or the reference. What a stage calls lives with its owner:
rollout_source.py (prompts, the producer), scoring.py, update.py and micro_batches.py, value.py (PPO's value head),
evaluation.py (the best model too), guard.py (what an alarm asks for), training_state.py (what a checkpoint holds).

Deliberate choices:
- with num_iterations = 1 the sampling policy is the current one, so `old_logp = logp.detach()` and no extra
  forward pass is made; old log-probs are computed only when num_iterations > 1, when the rollout carries the
  sampler's own log-probs (vLLM) and the importance-sampling correction compares them with the trainer's
  (core/importance.py), or for distillation's signal; a teacher model exists only then (distillation.py);
- reference log-probs are computed only when beta > 0, and no reference model exists otherwise;
- each of the num_iterations passes is one optimizer step over the whole batch: its micro-batches add up to the
  full-batch gradient for every aggregation mode, and a step whose loss or gradient norm is not finite is
  skipped, the scheduler still stepping (update.py, `skipped_nonfinite`);
- the loss parameters are built once from the config (objective.policy_loss_params), not on every micro-batch;
- rollouts are generated inline by the `generate` stage, or ahead by a background thread with `async_rollouts`;
- under torchrun each rank generates and scores whole groups, then the scored batch is gathered so every rank
  computes advantages and DAPO decisions on the global batch and runs its share of the micro-batches
  (grouprl/distributed.py explains why the update does not depend on K);
- a first SIGTERM or SIGINT ends the run after the current step with a checkpoint (signals.py).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, NoReturn

import torch
from datasets import Dataset
from transformers import set_seed

from grouprl import distributed as D
from grouprl.batch import StepBatch
from grouprl.checkpoint import checkpoint_path
from grouprl.config import ConfigError, TrainConfig
from grouprl.data import ChatForm, PromptBatch, PromptFormatter, PromptSampler, load_datasets, load_prompts
from grouprl.distillation import load_teacher
from grouprl.evaluation import BestModel, check_eval_names, run_evaluation
from grouprl.guard import RunGuard
from grouprl.objective import (corrects_sampler, loss_mask, policy_loss_params, sampler_weights, step_advantages,
                               value_targets)
from grouprl.optim import make_optimizer
from grouprl.memory import checkpoint_mode, token_budget
from grouprl.micro_batches import UpdateBatch
from grouprl.policy import Reference, check_model_source, load_policy, policy_tokenizer
from grouprl.precision import describe_precision, resolve_bf16
from grouprl.preflight import run as run_preflight
from grouprl.prompt_filter import PromptFilter
from grouprl.rewards import reward_names, sandbox_mechanism
from grouprl.rollout import Rollout, SamplingParams
from grouprl.rollout.factory import make_engine, make_rollouts, resolve_multiturn
from grouprl.rollout.types import Trajectories
from grouprl.rollout_source import PromptDraw, make_producer
from grouprl.runlog import Progress, RunLogger, run_metadata
from grouprl.sample_stats import SampleTally, batch_metrics, completion_rows
from grouprl.scoring import check_reward_columns, reward_from_config, score_trajectories, start_reward_workers
from grouprl.signals import StopSignals, TrainingStopped
from grouprl.timings import Timings
from grouprl.trackers import tracker_problems
from grouprl.training_state import (LoopState, TrainingParts, load_trainable_weights, prepare_output_dir,
                                    record_loop_state, restore_training_state, save_training_state)
from grouprl.update import make_policy_update

logger = logging.getLogger(__name__)


class Trainer:
    """GRPO and its family on a Hugging Face causal LM.

    `Trainer(config).train()` is what `grouprl train` runs. In Python, datasets, reward functions
    and tools can also be passed directly: `Trainer(cfg, train_dataset=ds, reward_funcs=[f], tools=[g])`.
    """

    def __init__(self, config: TrainConfig, *, train_dataset: Dataset | None = None,
                 eval_dataset: Dataset | None = None, reward_funcs: list[Callable] | None = None,
                 tools: list[Callable] | None = None):
        in_memory = {"train_data": train_dataset, "eval_data": eval_dataset, "reward_funcs": reward_funcs,
                     "tools": tools}
        placeholders = {k: ["<in memory>"] * len(v) if k in ("reward_funcs", "tools") else "<in memory>"
                        for k, v in in_memory.items() if v is not None}
        cfg = replace(config, **placeholders).validate()
        # model/tokenizer paths and GGUF files probed before any model loads (data paths: load_datasets)
        cfg.model, cfg.gguf_file = check_model_source(cfg.model, cfg.gguf_file, cfg.tokenizer)
        self.cfg = cfg = replace(cfg, **{k: getattr(config, k) for k in placeholders})
        self.dist = D.init_distributed(cfg.ddp_timeout)
        if cfg.prompts_per_step % self.dist.world_size:
            raise ConfigError(f"prompts_per_step={cfg.prompts_per_step} does not split over {self.dist.world_size} "
                              f"processes (each rank generates whole groups): use a multiple of {self.dist.world_size}")
        set_seed(cfg.seed)  # random, numpy and torch (every device)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)

        # data and reward functions first: their errors come before any model loads
        self.train_ds, self.eval_ds = load_datasets(cfg, train_dataset, eval_dataset)  # data.py
        self.reward_funcs = reward_funcs or [reward_from_config(spec) for spec in cfg.reward_funcs]
        self.reward_names = reward_names(self.reward_funcs)  # as the scores are keyed
        if problems := tracker_problems(cfg.report_to, cfg.output_dir):  # packages, stores, folders: no model yet
            raise ConfigError("; ".join(problems))
        self.audit_funcs = [reward_from_config(spec) for spec in cfg.audit_funcs]  # scored, never rewarded
        self.audit_names = reward_names(self.audit_funcs)
        self.reward_workers = start_reward_workers(cfg, self.reward_funcs, self.audit_funcs, not reward_funcs)
        self.guard = RunGuard(cfg, self.reward_names, self.audit_names, is_main=self.dist.is_main)  # guard.py
        check_eval_names(cfg, self.eval_ds is not None, self.reward_names)  # evaluation.py
        check_reward_columns(self.reward_funcs + self.audit_funcs, self.reward_names + self.audit_names,
                             train_data=self.train_ds, eval_data=self.eval_ds)  # scoring.py
        isolations = {getattr(f, "sandbox_isolation", "") for f in self.reward_funcs} - {""}
        self.tools, self.environment = resolve_multiturn(cfg, tools)
        for sandbox in sorted({sandbox_mechanism(i).describe() for i in isolations}):
            if self.dist.is_main:  # once per run: which walls hold the programs the rewards execute
                logger.info("sandbox for untrusted code: %s", sandbox)

        self.autocast = torch.bfloat16 if resolve_bf16(cfg.bf16, self.dist.device) else None  # precision.py
        if self.dist.is_main:
            logger.info("matmuls in %s", describe_precision(cfg.bf16, self.dist.device))

        checkpointing = checkpoint_mode(cfg.gradient_checkpointing, self.dist.device)  # memory.py
        self.tokenizer = policy_tokenizer(cfg)  # policy.py: `tokenizer`, else the model's
        schemas = [t.schema for t in self.tools.values()]  # what the chat template shows the model
        self.formatter = PromptFormatter(self.tokenizer, max_prompt_length=cfg.max_prompt_length, tools=schemas,
                                         template_kwargs=cfg.chat_template_kwargs, chat=ChatForm.of(cfg)
                                         ).checked(self.train_ds, self.eval_ds, prompt_column=cfg.prompt_column)
        self.teacher = load_teacher(cfg, self.tokenizer, self.dist, self.autocast)  # distillation.py; None without one
        self.model = load_policy(cfg.model, gguf_file=cfg.gguf_file, lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                                 lora_dropout=cfg.lora_dropout, lora_target_modules=cfg.lora_target_modules,
                                 gradient_checkpointing=checkpointing == "always", disable_dropout=cfg.disable_dropout)
        self.model.train()
        if self.dist.device.type == "cuda" and not (self.dist.enabled and cfg.distributed_strategy == "fsdp2"):
            self.model.to(self.dist.device)  # FSDP2's fully_shard moves each shard there itself, never the whole
        self.ref = Reference(self.model) if cfg.beta > 0 else None  # a copy (FSDP2: on the host until sharded)
        # `model`: generation, saving; `train_model`: the update (DDP's wrapper); FSDP2 shards both, the reference too
        self.train_model = D.wrap_model(self.model, self.dist, cfg.distributed_strategy)
        if D.is_sharded(self.model) and self.ref is not None and self.ref.model is not None:
            D.shard_model(self.ref.model)
        # memory.py: `auto` per device (CPU: checkpoint only over a 4k budget; CUDA: every pass), before the optimizer
        colocated = cfg.vllm_gpu_memory_utilization if cfg.use_vllm and cfg.vllm_mode == "colocate" else 0.0
        auto_budget = D.least_over_ranks(self.dist, token_budget(  # each rank's free memory: one budget for all
            "auto", self.model, self.dist.device, checkpointing == "always", vllm_share=colocated,
            autocast=self.autocast is not None) if cfg.max_tokens_per_micro_batch == "auto" else None,
            said="max_tokens_per_micro_batch=auto")
        over_budget = checkpointing == "over_budget"
        self.updater = make_policy_update(cfg, self.model, self.train_model, self.dist, autocast=self.autocast,
                                          auto_budget=auto_budget, checkpoint_over_budget=over_budget)  # update.py
        self.engine = make_engine(cfg, self.model, self.tokenizer, self.dist, self.autocast)
        self.turns = make_rollouts(cfg, self.model, self.tokenizer, self.formatter, self.tools, self.environment)
        self.weights_version = 0  # grows with every change of the policy's weights (engine sync)
        self.sampling = SamplingParams(cfg.max_completion_length, cfg.temperature, cfg.top_p, cfg.top_k, cfg.ignore_eos)

        self.optimizer, self.scheduler = make_optimizer(cfg, self.model, self.updater.value_head)  # optim.py
        self.sampler = PromptSampler(len(self.train_ds), cfg.seed)
        self.prompt_filter = (PromptFilter(len(self.train_ds), history=cfg.prompt_filter_history,
                                           revisit=cfg.prompt_filter_revisit, seed=cfg.seed)
                              if cfg.prompt_filter else None)  # prompt_filter.py: skip settled prompts
        self.generator = torch.Generator().manual_seed(cfg.seed + self.dist.rank)  # own samples per rank
        self.draw = PromptDraw(self.sampler, self.prompt_filter, self.formatter, self.train_ds, self.dist,
                               prompts_per_step=cfg.prompts_per_step, prompt_column=cfg.prompt_column)
        # inline with the `generate` stage (looked up at each call), or generated ahead (async_rollouts)
        self.rollouts = make_producer(cfg, self.engine, self.draw, lambda prompts: self.generate(prompts),
                                      model=self.model, tokenizer=self.tokenizer, tools=self.tools,
                                      environment=self.environment, sampling=self.sampling,
                                      generator=self.generator)  # rollout_source.py
        self.step = 0
        self.evals: dict[str, Any] = {}
        self.logger: RunLogger | None = None  # train() opens it; train_step alone writes nothing
        self._eval_pending = False  # a signal stopped the run before the eval due at this step
        self.best = BestModel(cfg.metric_for_best_model, cfg.greater_is_better, cfg.output_dir)  # evaluation.py

    @property
    def cfg(self) -> TrainConfig:
        return self._cfg

    @cfg.setter
    def cfg(self, cfg: TrainConfig) -> None:
        """The loss parameters follow the config: built (and validated) once per config."""
        self._cfg, self.loss_params = cfg, policy_loss_params(cfg)

    # ------------------------------------------------------------------ the loop
    def train(self, *, resume: bool | str = False) -> dict[str, Any]:
        """Train to max_steps (resume: continue the run in output_dir; "auto": if it has a checkpoint, else start
        it) and return the summary. The first SIGTERM or SIGINT ends the run after the current step, with a
        checkpoint, and raises `TrainingStopped`; a second stops at once (signals.py)."""
        cfg, out = self.cfg, Path(self.cfg.output_dir)
        resume = prepare_output_dir(cfg, self.dist, resume)  # a killed save's leftovers; --resume auto
        finished = resume and self._resume()  # nothing left to train or evaluate: only the summary
        main = self.dist.is_main  # only rank 0 writes
        if main:
            out.mkdir(parents=True, exist_ok=True)
            cfg.save_yaml(out / "config.yaml", absolute=True)  # local paths absolute: readable from anywhere
        again = self.eval_ds is not None and not finished and (self._eval_pending or self.step >= cfg.max_steps)
        self.logger = RunLogger(out, resume_step=self.step, eval_again=again,  # its step's eval: logged, not recorded
                                report_to=tuple(cfg.report_to), enabled=main,
                                config={**cfg.to_dict(), **run_metadata(self.dist)}, run_name=cfg.run_name)
        progress = Progress(cfg.max_steps, self.step, cfg.progress and main, silent=not main, every=cfg.logging_steps)
        saved = self.step if resume else None  # the step whose checkpoint is on disk
        signum, reason = None, None  # the signal all ranks agreed to stop on; an alarm set to stop the run
        with self.logger, progress:  # an error closes the bar first (its message starts a line) and frees output_dir
            with StopSignals() as stop:  # looked for (one tiny all-reduce) after each step, and after its eval/save
                if self.step == 0 and "eval_before" not in self.evals and self.eval_ds is not None:  # not resumed
                    self.evals["eval_before"] = self._log_eval(0, progress)
                if self._eval_pending:  # the run stopped before the eval due at its last step: made up here
                    self._eval_pending, saved = False, None  # the checkpoint on disk still says pending
                    saved, reason = self._periodic_eval(progress, saved)
                    if saved is None:  # not the best: the eval recorded beside the checkpoint resumed from
                        self.save(weights=False)
                self.guard.snapshot(self.step, self.updater.trainable, self.optimizer)  # rollback target at the start
                while not reason and self.step < cfg.max_steps and not (signum := stop.requested(self.dist)):
                    metrics = self.train_step()
                    reason = self.respond_to_alarms(metrics, progress)  # report; roll back; or the reason to stop
                    self.logger.log(self.step, metrics, trackers=self.step % cfg.logging_steps == 0)
                    progress.update(metrics)
                    if reason or (signum := stop.requested(self.dist)):  # before the eval: little time may be left
                        self._eval_pending = self._eval_due()
                        break
                    if self._eval_due():
                        saved, reason = self._periodic_eval(progress, saved)
                        if reason:
                            break
                    due = cfg.save_steps and self.step % cfg.save_steps == 0 and self.step < cfg.max_steps
                    if due and saved != self.step:  # not written twice: the best-model save may have come first
                        self.save()
                        saved = self.step
                    self.guard.snapshot(self.step, self.updater.trainable, self.optimizer)
                if signum or reason:
                    self._stop(signum, progress, saved, reason)
                if not finished and saved != self.step:  # before eval_after: a signal then finds the steps saved
                    self.save()
                if self.eval_ds is not None and not finished:  # a resumed run makes it up if it is cut short
                    self.evals["eval_after"] = self._log_eval(self.step, progress)
                    self.best.update(self.evals["eval_after"], self.step)  # its checkpoint: the one just written
                    self.respond_to_alarms({}, progress, final=True, log=True)  # the run is over: reported only
                    self.save(weights=False)  # eval_after, recorded beside that checkpoint
        progress.close()
        summary = D.broadcast_object(self.dist, {**self.logger.summary(self.step, self.evals),  # rank 0 reads
                                                 **self.best.summary()})  # the metrics: its summary, on every rank
        if self.best.record is not None and self.cfg.load_best_model_at_end:
            load_trainable_weights(self.best.checkpoint, self.model)  # training_state.py
            self.weights_version += 1
            self.sync_weights()
        self.logger.finish(summary)
        return summary

    def _periodic_eval(self, progress: Progress, saved: int | None) -> tuple[int | None, str | None]:
        """An eval between steps (or made up on resume): a checkpoint when it is the best so far (kept whatever
        save_total_limit says); returns the step saved last and the reason to stop its alarms give (eval_divergence)."""
        if self.best.update(self._log_eval(self.step, progress), self.step):
            self.save()
            saved = self.step
        return saved, self.respond_to_alarms({}, progress, log=True)

    def _eval_due(self) -> bool:
        """The periodic eval runs after this step (not after the last: eval_after does)."""
        return bool(self.cfg.eval_steps and self.step % self.cfg.eval_steps == 0 and self.step < self.cfg.max_steps
                    and self.eval_ds is not None)

    def _stop(self, signum: signal.Signals | None, progress: Progress, saved: int | None,
              reason: str | None = None) -> NoReturn:
        """The end of a run stopped by a signal (or by an alarm, `reason`): this step's checkpoint (unless written
        just before), summary.json (with `stopped_by`) and curves; then `TrainingStopped`. No eval_after: the run
        is not over, and a preempted run has little time."""
        progress.close()
        path = checkpoint_path(self.cfg.output_dir, self.step) if saved == self.step else self.save()
        self.logger.finish({**self.logger.summary(self.step, self.evals), **self.best.summary(),
                            "stopped_by": reason or signum.name})
        raise TrainingStopped(None if reason else signum, self.step, path, reason)

    def train_step(self) -> dict[str, Any]:
        """One GRPO step (`self.step` advances by one); returns its metrics (`train` writes them to
        metrics.jsonl; called alone, nothing is written)."""
        self.step += 1
        timings = Timings()
        with timings.stage("step"):
            batch, metrics = self.sample_batch(timings)  # completions and rewards of the global batch
            values = self.updater.values(batch.rollout, self.cfg)  # [N, T] PPO's V_old (value.py); else None
            advantages = self.advantages(batch, values, metrics)  # [N], or [N, T]: per token, GAE, distillation
            metrics.update(self.update(batch, advantages, timings, values))  # old/ref log-probs, optimizer steps
            with timings.stage("sync_weights"):
                self.sync_weights()  # the engine samples the new policy from the next step on
            if self.cfg.ref_update_steps and self.ref is not None and self.step % self.cfg.ref_update_steps == 0:
                self.ref.reset(self.model)
        metrics.update(self.guard.check(self.step, batch, metrics))  # audit scores, health/*; alarms wait in the guard
        self._log_samples(batch, advantages)
        return {**batch_metrics(batch, advantages), **metrics, "lr": self.scheduler.get_last_lr()[0], **timings}

    # ------------------------------------------------------------------ stages
    def prompts(self, rows: Dataset | list[Any]) -> PromptBatch:
        """Tokenised prompts from dataset rows (or a list of rows with the prompt column, or of
        prompts: strings or chat messages), formatted as in training."""
        return self.formatter.rows(rows, self.cfg.prompt_column)

    def generate(self, prompts: PromptBatch, *, num_generations: int | None = None, greedy: bool = False,
                 temperature: float | None = None, generator: torch.Generator | None = None) -> Trajectories:
        """Completions of the current policy: `num_generations` per prompt (default: the config's G), sampled with
        the config's sampling parameters (`temperature` and `generator`, the random stream, may be given), or one
        greedy completion each; with the configured tools or environment, whole multi-turn trajectories."""
        G = 1 if greedy else num_generations or self.cfg.num_generations
        params = replace(self.sampling, greedy=True) if greedy else self.sampling
        if temperature is not None and not greedy:
            params = replace(params, temperature=temperature)
        with D.full_weights(self.model) if self.engine.decodes_with_policy else contextlib.nullcontext():
            # FSDP2: an engine that decodes with the policy needs its weights whole; vLLM has its own copy
            return self.turns.generate(self.engine, prompts.prompt_ids, G, params,
                                       None if greedy else generator or self.generator, prompts=prompts.prompts,
                                       columns=prompts.columns)

    def decode(self, trajectories: Trajectories) -> list[str]:
        """The completions' text (tool and environment messages included, special tokens not)."""
        return self.tokenizer.batch_decode(trajectories.rollout.token_lists(), skip_special_tokens=True)

    def score(self, prompts: PromptBatch, trajectories: Trajectories) -> StepBatch:
        """The reward functions on `trajectories` of `prompts` (reward functions see a multi-turn
        rollout's messages and `env_reward`), weighted and shaped as configured; the audit functions
        beside them."""
        return score_trajectories(self.cfg, self.tokenizer, self.reward_funcs, self.audit_funcs, prompts,
                                  trajectories, self.reward_workers)  # scoring.py

    def sample_batch(self, timings: Timings | None = None) -> tuple[StepBatch, dict[str, float]]:
        """The step's scored completions, gathered over ranks, and the sampling metrics. With dynamic sampling
        (DAPO), groups whose rewards are all equal are dropped and more are sampled, up to max_sampling_rounds."""
        cfg, B, G = self.cfg, self.cfg.prompts_per_step, self.cfg.num_generations
        timings = Timings() if timings is None else timings
        tally, kept = SampleTally(), []
        while True:
            with timings.stage("generate"):  # async: the wait for a batch generated during the last update
                produced = self.rollouts.next()  # this rank's prompts and their trajectories
            timings.add("generate_engine", produced.seconds)  # the engine's own time on it
            with timings.stage("reward"):
                local = self.score(produced.prompts, produced.result)
                batch = StepBatch.gather(self.dist, local, self.tokenizer.pad_token_id)  # the global batch
            flat = batch.flat_groups(G)  # [B] judged before overlong shaping, as DAPO; process: on the steps
            self.draw.record(batch.prompt_index, flat, G)  # the prompt filter's memory
            tally.add_round(len(produced.result.rollout), produced.staleness, produced.result.counts,
                            int(flat.sum()), len(flat), produced.overlapped)
            if not cfg.dynamic_sampling:
                kept = [batch]
                break
            rows = (~flat).repeat_interleave(G).nonzero().squeeze(-1)
            kept.append(batch.select(rows[: (B - tally.kept_groups) * G]))
            tally.kept_groups += len(kept[-1].completions) // G
            if tally.kept_groups >= B or tally.rounds >= cfg.max_sampling_rounds:
                break
        if tally.kept_groups == 0 and cfg.dynamic_sampling:  # nothing carries signal: the last round (A = 0)
            kept = [batch]
        metrics = tally.metrics(D.all_reduce_sums(self.dist, tally.counts), cfg.dynamic_sampling,
                                partial=cfg.partial_rollouts)
        return StepBatch.cat(kept, self.tokenizer.pad_token_id), {**metrics, **self.draw.metrics(G)}

    def advantages(self, batch: StepBatch, values: torch.Tensor | None = None,
                   metrics: dict[str, float] | None = None) -> torch.Tensor:
        """The scored (global) batch's advantages [N], or [N, T] (process supervision; GAE on `values`; a teacher)."""
        adv = step_advantages(self.cfg, batch, values)  # [N], or [N, T]
        return adv if self.teacher is None else self.teacher.mix(adv, batch.rollout, self.updater, self.cfg, metrics)

    def logprobs(self, rollout: Rollout, *, reference: bool = False) -> torch.Tensor:
        """Log-probs [N, T] of the completion tokens under the policy (or the reference model, which
        exists when beta > 0), without gradient; this rank's micro-batch rows (others stay 0)."""
        if not reference:
            return self.updater.logprobs(self.model, rollout, self.cfg)
        if self.ref is None:
            raise ValueError("no reference model: it exists only when beta > 0")
        with self.ref.context():
            return self.updater.logprobs(self.ref.forward_model, rollout, self.cfg)

    def update(self, batch: StepBatch, advantages: torch.Tensor, timings: Timings | None = None,
               values: torch.Tensor | None = None) -> dict[str, float]:
        """Old/ref log-probs and the num_iterations optimizer steps on a scored batch (the global batch: every
        rank passes the same one; PPO: `values`, V_old); the update statistics, reduced over ranks."""
        cfg = self.cfg
        timings = Timings() if timings is None else timings
        correct = corrects_sampler(cfg, batch.rollout)
        with timings.stage("logprobs"):
            old_logp = self.logprobs(batch.rollout) if cfg.num_iterations > 1 or correct else None  # [N, T]
            ref_logp = self.logprobs(batch.rollout, reference=True) if self.ref is not None else None  # [N, T]
        is_weights, is_metrics = (sampler_weights(cfg, batch.rollout, D.all_reduce_tensor(self.dist, old_logp))
                                  if correct else (None, {}))  # old_logp summed over ranks: the whole batch
        update = UpdateBatch(batch.rollout, advantages, loss_mask(cfg, batch.rollout), old_logp, ref_logp, is_weights,
                             self.step, value_targets(cfg, batch.rewards, batch.rollout.action_mask, values))
        stats: dict[str, float] = {}
        skipped = 0  # optimizer steps skipped for a non-finite loss or gradient
        with timings.stage("update"):
            for it in range(cfg.num_iterations):  # the first pass's entropy is the one reported
                step = self.updater.optimizer_step(update, self.optimizer, self.scheduler, cfg, self.loss_params,
                                                   with_entropy=it == 0 or cfg.top_entropy_quantile < 1)
                stepped = not step.pop("skipped_nonfinite")
                skipped += not stepped
                self.weights_version += stepped  # the engine's copy is stale once the weights moved
                stats = step if it == 0 else {**stats, **{k: v for k, v in step.items() if k != "entropy"}}
        return {**stats, **is_metrics, "skipped_nonfinite": skipped}

    def sync_weights(self) -> None:
        """Send the policy's current weights to an engine that keeps its own copy (vLLM); async
        mode first waits for the batches being generated (rollout/producer.py)."""
        to = self.rollouts if self.rollouts.depth else self.engine  # inline: the engine `generate` uses
        to.sync_weights(self.model, self.weights_version)

    # ------------------------------------------------------------------ inside the stages
    def _log_samples(self, batch: StepBatch, advantages: torch.Tensor) -> None:
        """samples.jsonl every logging step; the trackers' completions table every log_completions_steps."""
        cfg = self.cfg
        if self.logger is None or not (cfg.num_logged_samples and self.step % cfg.logging_steps == 0):
            return
        rows = completion_rows(batch, advantages, cfg.num_logged_samples)
        self.logger.log_samples(self.step, rows)
        if cfg.log_completions_steps and self.step % cfg.log_completions_steps == 0:
            self.logger.log_table(self.step, "completions", rows)

    # ------------------------------------------------------------------ run health
    def respond_to_alarms(self, metrics: dict[str, Any], progress: Progress | None = None, *,
                          final: bool = False, log: bool = False) -> str | None:
        """Report the pending alarms (console, `alarms` in `metrics`, examples in samples.jsonl) and carry out what
        the guard decides from on_reward_hacking / on_collapse (guard.py): roll back here, or return why the run
        must stop. `log`: `metrics`, if the alarms filled it, is a row of its own in metrics.jsonl at this step
        (an eval's alarms)."""
        response = self.guard.respond(self.step, metrics, self.logger, progress, final=final)
        if response.rollback:
            metrics.update(self.rollback())
            self.guard.rolled_back(self.step, metrics, progress)
        if log and metrics:
            self.logger.log(self.step, metrics)
        return response.stop

    def rollback(self) -> dict[str, float]:
        """on_collapse: rollback: the policy and optimizer go back to a snapshot from before the collapse, the
        learning rate is scaled (guard.py); the engine samples the restored policy, and (async) the batches
        generated ahead by the collapsed one are dropped."""
        out = self.guard.restore(self.step, self.updater.trainable, self.optimizer, self.scheduler)
        if self.rollouts.depth:  # async: batches the collapsed policy sampled are not trained on
            out["rollback/discarded_batches"] = self.rollouts.discard()
        self.weights_version += 1
        self.sync_weights()
        return out

    # ------------------------------------------------------------------ eval
    def evaluate(self, dataset: Dataset | None = None, batch_size: int = 64) -> dict[str, float]:
        """The eval_metrics on `dataset` (default: the eval set; what load_prompts reads) from the accuracy reward (the
        first reward function by default): `accuracy`, `mean@k`, `pass@k`, `maj@k`, `reward_mean`, `rewards/NAME`
        (evaluation.py defines each). Under torchrun each rank evaluates every K-th prompt, and the sums are summed."""
        ds = self.eval_ds if dataset is None else self.formatter.chat.dataset(load_prompts(  # a file, rows, ...
            dataset, prompt_column=self.cfg.prompt_column, name="eval_data"), self.cfg.prompt_column)
        return run_evaluation(self, ds, batch_size)

    def preflight(self, num_prompts: int = 64, samples_per_prompt: int | None = None) -> dict[str, Any]:
        """What GRPO would learn from `num_prompts` training prompts, each sampled G times (or `samples_per_prompt`,
        a multiple of G) with the current policy; rank 0 writes preflight.json and preflight.png into output_dir.
        preflight.py explains every number."""
        return run_preflight(self, num_prompts, samples_per_prompt)

    def _log_eval(self, step: int, progress: Progress) -> dict[str, float]:
        t0 = time.perf_counter()
        result = self.evaluate()
        result["seconds"] = time.perf_counter() - t0
        self.guard.check_eval(step, result["accuracy"])
        self.logger.log(step, {f"eval/{k}": v for k, v in result.items()})
        progress.write(f"step {step}: eval accuracy {result['accuracy']:.3f}, "
                       f"reward {result['reward_mean']:.3f} ({result['num_samples']} prompts)")
        return result

    # ------------------------------------------------------------------ checkpoints
    def save(self, weights: bool = True) -> Path:
        """Rank 0 writes the checkpoint (FSDP2: gathered whole) with every rank's RNG states, complete before anyone
        goes on (training_state.py); weights=False: where the loop stands, beside this step's (record_loop_state)."""
        loop = LoopState(self.step, self.evals, self._eval_pending, self.best.record)
        if not weights:
            return record_loop_state(self.cfg, self.dist, self._checkpointed(), loop)
        return save_training_state(self.cfg, self.dist, self._checkpointed(), loop, self.tokenizer)

    def _resume(self) -> bool:
        """The newest checkpoint in output_dir back into this run (training_state.py); whether that run is over."""
        loop = restore_training_state(self.cfg, self.dist, self._checkpointed(), evaluates=self.eval_ds is not None)
        self.step, self.evals, self._eval_pending = loop.step, loop.evals, loop.eval_pending
        self.best.record = loop.best
        self.weights_version += 1  # the checkpoint's weights replaced the initial ones
        self.sync_weights()
        return loop.finished

    def _checkpointed(self) -> TrainingParts:
        """The parts of this run a checkpoint holds."""
        return TrainingParts(self.model, self.optimizer, self.scheduler, None if self.ref is None else self.ref.model,
                             self.generator, self.sampler, self.guard, self.prompt_filter, self.updater.value_head)

    def close(self) -> None:
        """Release the generation engine (a colocated vLLM engine's memory) and the reward workers; call once done."""
        self.rollouts.close()
        self.engine.close()
        if self.reward_workers is not None:
            self.reward_workers.close()
