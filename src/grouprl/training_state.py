"""A run's state in a checkpoint: captured from the parts of the run (`save_training_state`) and
put back into them (`restore_training_state`); checkpoint.py writes and reads the files, atomically.

What goes in: the trainable weights (the reference's too in DeepSeekMath's iterative mode), PPO's
value head (value.py), the optimizer and scheduler, every rank's random states, the prompt sampler,
the run guard, the prompt filter, and where the loop stands (`LoopState`: step, eval results, an
eval still due, the best eval). Under FSDP2 rank 0 writes whole state dicts gathered from every
rank, and on resume every rank reads the whole weights and keeps its shard.

On resume the config may have changed since the run last started (its config.yaml): the changes are
logged, and a new `learning_rate` scales the restored schedule (the schedule's shape stays, at the new rate).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.optim.lr_scheduler import LRScheduler

from grouprl import distributed as D
from grouprl.checkpoint import (CheckpointMismatch, DamagedCheckpoint, check_fits, checkpoint_path, latest_checkpoint,
                                list_checkpoints, load_checkpoint, read_checkpoint, read_loop_state,
                                recover_interrupted_saves, restore_rng_states, rng_states, save_checkpoint,
                                write_loop_state)
from grouprl.config import RUN_CONFIG_HEADER, ConfigError, TrainConfig, changed_settings
from grouprl.optim import check_group_layout, scale_learning_rate, value_learning_rate
from grouprl.runlog import OutputDirInUse, lock_output_dir, unlock_output_dir
from grouprl.value import optimized_modules

logger = logging.getLogger(__name__)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainingParts:
    """The parts of a run a checkpoint holds, as the trainer holds them."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    ref_model: torch.nn.Module | None  # the reference's own copy (None: beta = 0, or LoRA's adapter-disabled base)
    generator: torch.Generator         # this rank's sampling stream
    sampler: Stateful                  # the prompt order (data.PromptSampler)
    guard: Stateful                    # run health (guard.RunGuard)
    prompt_filter: Stateful | None     # prompt_filter.PromptFilter, when on
    value_head: torch.nn.Module | None = None  # PPO's value head (value.py), when on

    @property
    def optimized(self) -> torch.nn.Module:
        """Every module the optimizer steps, as one (its state is keyed by names in it under FSDP2)."""
        return optimized_modules(self.model, self.value_head)


@dataclass
class LoopState:
    """Where the loop stands."""

    step: int
    evals: dict[str, Any]         # eval_before, eval_after: the results so far
    eval_pending: bool            # a signal stopped the run before the eval due at `step`
    best: dict[str, Any] | None   # metric_for_best_model: {step, metric, value} (evaluation.BestModel)

    finished: bool = False        # restored: the run is over (restore_training_state)


def prepare_output_dir(cfg: TrainConfig, dist: D.DistContext, resume: bool | str) -> bool:
    """Before a run reads or writes a checkpoint: rank 0 recovers what a save killed midway left
    (checkpoint.recover_interrupted_saves), every rank waiting; a new run refuses a folder that holds a
    run: a checkpoint, or the metrics of one that stopped before its first save; --resume needs a
    checkpoint. `resume="auto"` (for a job a scheduler requeues with the same command) continues from
    the latest checkpoint if there is one, and otherwise starts the run; the metrics of one that stopped
    before its first save are moved aside (`*.jsonl.lost`). Returns whether the run resumes. `grouprl
    train` calls it before any model loads, and `Trainer.train` again."""
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir={str(cfg.output_dir)!r} is a file, not a folder: choose a folder for the run")
    if resume not in (True, False, "auto"):
        raise ConfigError(f"resume={resume!r}: pass True (continue the run in output_dir), False (a new run) or "
                          "'auto' (continue it if it has a checkpoint, else start it)")
    in_use = None
    if dist.is_main:
        try:  # before anything in the folder is touched: another run's unfinished save is no leftover
            lock_output_dir(out)
            recover_interrupted_saves(cfg.output_dir)
        except OutputDirInUse as e:
            in_use = str(e)
    if in_use := D.broadcast_object(dist, in_use):  # every rank raises it, none waits (and a barrier)
        raise ConfigError(in_use)
    try:
        return _checked_output_dir(cfg, dist, resume)
    except BaseException:
        unlock_output_dir(out)  # the run does not start: another may have the folder (a no-op off rank 0)
        raise


def _checked_output_dir(cfg: TrainConfig, dist: D.DistContext, resume: bool | str) -> bool:
    """prepare_output_dir's checks, and --resume auto's start over, once the folder is this run's."""
    out = Path(cfg.output_dir)
    over = resume == "auto" and latest_checkpoint(cfg.output_dir) is None  # started (again) from its first step
    resume = not over if resume == "auto" else bool(resume)
    if not resume and latest_checkpoint(cfg.output_dir) is not None:
        raise ConfigError(f"output_dir={str(cfg.output_dir)!r} already holds a run with checkpoints: pass "
                          "--resume (from Python: train(resume=True)) to continue it, or choose a new output_dir")
    if resume and latest_checkpoint(cfg.output_dir) is None:
        raise ConfigError(f"--resume: output_dir={cfg.output_dir!r} holds no complete checkpoint; start without "
                          "--resume")
    own = out / "config.yaml"  # a run writes its resolved config there: one it did not write is the user's
    if not resume and own.is_file() and not own.read_text(errors="replace").startswith(RUN_CONFIG_HEADER):
        raise ConfigError(f"output_dir={str(cfg.output_dir)!r} holds a config.yaml that no grouprl run wrote (your "
                          "config file?), and a run writes its resolved config there: choose another output_dir "
                          f"(e.g. {str(out / 'run')!r}), or move the file")
    logged = out / "metrics.jsonl"
    if not resume and not over and logged.is_file() and logged.stat().st_size:  # stopped before its first save
        raise ConfigError(f"output_dir={str(cfg.output_dir)!r} already holds a run's metrics.jsonl but no checkpoint "
                          "(it stopped before its first save), which a new run would overwrite: choose a new "
                          "output_dir, move that run's files away (it cannot be resumed), or start it over with "
                          "--resume auto")
    if over:  # that run's rows kept aside, not lost: the new run appends to these files
        if dist.is_main and logged.is_file() and logged.stat().st_size:
            for name in ("metrics.jsonl", "samples.jsonl"):
                if (out / name).is_file():
                    _keep_aside(out / name, out / f"{name}.lost")
            logger.warning("--resume auto: %s holds no checkpoint (its run stopped before its first save): the run "
                           "starts over; the rows that run logged are kept aside in metrics.jsonl.lost and "
                           "samples.jsonl.lost", cfg.output_dir)
        D.barrier(dist)
    return resume


def _keep_aside(path: Path, lost: Path) -> None:
    """`path`'s rows at the end of `lost` (a requeued job may lose more than one start before its first
    save: each one's rows are kept), and `path` gone."""
    if not lost.is_file():
        os.replace(path, lost)
        return
    with open(lost, "a") as f:
        f.write(path.read_text())
    path.unlink()


def save_training_state(cfg: TrainConfig, dist: D.DistContext, parts: TrainingParts, loop: LoopState,
                        tokenizer: Any) -> Path:
    """Rank 0 writes the checkpoint of `loop.step` (FSDP2: whole state dicts gathered from every
    rank); every rank's RNG states go in; nobody continues before it is complete. The best
    checkpoint is kept whatever save_total_limit says (found by its step: the run folder may have moved)."""
    rng = D.gather_objects(dist, rng_states(parts.generator))  # every rank's
    ref_model = parts.ref_model if cfg.ref_update_steps else None  # the reference changes only then
    model_state, optimizer_state, ref_state = D.checkpoint_states(parts.model, parts.optimizer, ref_model,
                                                                  parts.optimized)
    state = {
        "step": loop.step, "sampler": parts.sampler.state_dict(), "evals": loop.evals,
        "optimizer": optimizer_state, "scheduler": parts.scheduler.state_dict(), "rng": rng[0],
        "rng_by_rank": rng, "sharded_optimizer": D.is_sharded(parts.model), "eval_pending": loop.eval_pending,
        "guard": parts.guard.state_dict(), "best": loop.best, "learning_rate": cfg.learning_rate,
        "value_learning_rate": value_learning_rate(cfg) if parts.value_head is not None else None,
        "prompt_filter": None if parts.prompt_filter is None else parts.prompt_filter.state_dict(),
        "value_head": None if parts.value_head is None else parts.value_head.state_dict(),
    }
    path = checkpoint_path(cfg.output_dir, loop.step)
    if dist.is_main:
        path = save_checkpoint(cfg.output_dir, loop.step, model=parts.model, tokenizer=tokenizer, state=state,
                               ref_model=ref_model, keep=cfg.save_total_limit, model_state=model_state,
                               ref_state=ref_state,
                               protect=checkpoint_path(cfg.output_dir, loop.best["step"]) if loop.best else None)
    D.barrier(dist)
    return path


def _refuse_a_changed_adapter(cfg: TrainConfig, changed: dict[str, tuple[Any, Any]], ckpt: Path) -> None:
    """With LoRA the policy is the frozen base model plus the adapter's B·A scaled by lora_alpha / lora_r:
    another lora_alpha or base model on resume makes a model the checkpoint never held (a review's run
    resumed with lora_alpha 16 -> 64 only warned, and its logits moved by 0.85 from the saved model's).
    lora_r and the target modules change the adapter's shapes and names, which check_fits refuses."""
    moved = {k: changed[k] for k in ("lora_alpha", "model") if k in changed}
    if not cfg.lora_r or not moved:
        return
    was = ", ".join(f"{k} {a!r}" for k, (a, _) in moved.items())
    raise ConfigError(f"--resume: {', '.join(f'{k} {a!r} -> {b!r}' for k, (a, b) in moved.items())} would change "
                      f"the policy the checkpoint holds (the adapter's learned update is scaled by lora_alpha / "
                      f"lora_r over the frozen base model): resume with the run's {was}, or start a new run from "
                      f"the checkpoint's merged model (--model {ckpt / 'model'}) with an adapter of its own")


def restore_training_state(cfg: TrainConfig, dist: D.DistContext, parts: TrainingParts,
                           evaluates: bool = False) -> LoopState:
    """The newest complete checkpoint in output_dir back into `parts`; where the loop stood, and whether
    the run is over (`evaluates`: it has an eval set, so it ends evaluated; a warning then says so).
    Settings changed since the run last started are logged; a new learning_rate scales the restored schedule.
    A resume that fails lets go of output_dir (prepare_output_dir took it)."""
    try:
        return _restored(cfg, dist, parts, evaluates)
    except BaseException:
        unlock_output_dir(cfg.output_dir)
        raise


def _restored(cfg: TrainConfig, dist: D.DistContext, parts: TrainingParts, evaluates: bool) -> LoopState:
    """restore_training_state's work."""
    ckpt = latest_checkpoint(cfg.output_dir)
    if ckpt is None:
        raise ConfigError(f"--resume: output_dir={cfg.output_dir!r} holds no complete "
                          "checkpoint; start without --resume")
    # the config's weight decay, betas and eps, before the load puts back the checkpoint's
    own = [{k: g[k] for k in ("weight_decay", "betas", "eps") if k in g} for g in parts.optimizer.param_groups]
    sharded = D.is_sharded(parts.model)
    try:
        if sharded:  # rank 0 reads the whole checkpoint; each rank takes its shard from it (D.load_full_state)
            weights, ref_weights, state, failed = {}, {}, {}, None
            if dist.is_main:
                try:
                    weights, ref_weights, state = read_checkpoint(ckpt)
                    check_fits(ckpt, weights, parts.model)
                    _check_value_head(ckpt, parts, state)
                    if not state.get("sharded_optimizer"):  # written unsharded: by index
                        check_group_layout(parts.optimizer, state["optimizer"])
                        state["optimizer"] = D.optimizer_state_by_name(parts.optimizer, parts.optimized,
                                                                       state["optimizer"])
                except Exception as e:  # noqa: BLE001 - every rank raises it, not rank 0 alone while the others wait
                    failed = e
            optimizer = state.pop("optimizer", {})  # the rest of the state, small, goes to every rank
            state = D.broadcast_object(dist, {**state, "has_ref": ref_weights is not None,
                                              "failed": None if failed is None else _portable(failed)})
            if state["failed"] is not None:
                raise failed or _rebuilt(state["failed"])
            state.pop("failed")
            has_ref = state.pop("has_ref")
            D.load_full_state(parts.model, weights, parts.optimizer, optimizer, parts.optimized)
            if parts.ref_model is not None and has_ref:
                D.load_full_state(parts.ref_model, ref_weights)
        else:
            state = load_checkpoint(ckpt, parts.model, parts.ref_model)
            _check_value_head(ckpt, parts, state)
    except CheckpointMismatch as e:
        raise ConfigError(f"--resume: {e}") from None
    except DamagedCheckpoint as e:  # never a silent fall back to an older one: the user decides
        earlier = list_checkpoints(cfg.output_dir)[:-1]
        raise ConfigError(f"--resume: {e}; " + (
            f"delete that folder to resume from the previous complete checkpoint, {earlier[-1]}" if earlier
            # a plain new run refuses the folder for its metrics.jsonl (prepare_output_dir); --resume auto starts over
            else "it is the run's only checkpoint: delete that folder and start the run over with --resume auto (from "
                 "Python: train(resume=\"auto\")), which keeps the rows it logged aside in metrics.jsonl.lost")) from e
    if parts.value_head is not None:
        parts.value_head.load_state_dict(state["value_head"])
    if not sharded:
        saved = state["optimizer"]
        if state.get("sharded_optimizer"):  # written by FSDP2 on several processes: by parameter name
            check_group_layout(parts.optimizer, saved)  # before the conversion reads the groups pairwise
            saved = D.optimizer_state_by_index(parts.optimizer, parts.optimized, saved)
        parts.optimizer.load_state_dict(saved)
    for group, hyper in zip(parts.optimizer.param_groups, own):
        group.update(hyper)  # changed settings apply, as the warning below says (the load kept the old ones)
    try:
        state.update(read_loop_state(ckpt))  # evals made after the save: their results and the guard's record
    except DamagedCheckpoint as e:  # not the folder's advice: the weights and optimizer state are whole
        raise ConfigError(f"--resume: {e}; delete that file to resume from the checkpoint as it was saved: it "
                          "holds only what the evals made after the save changed (their results, the best "
                          "checkpoint's record, the run guard's), and the resumed run makes those evals again") from e
    step = state["step"]
    parts.sampler.load_state_dict(state["sampler"])
    parts.scheduler.load_state_dict(state["scheduler"])
    parts.guard.load_state_dict(state.get("guard", {}))
    if parts.prompt_filter is not None and state.get("prompt_filter"):
        parts.prompt_filter.load_state_dict(state["prompt_filter"])
    by_rank = state.get("rng_by_rank", [state["rng"]])
    if len(by_rank) != dist.world_size and dist.is_main:
        logger.warning("resuming a run of %d process(es) in %d: each rank's sampling stream is seeded anew, so the "
                       "run goes on validly but not as the uninterrupted one would have; resume with %d process(es) "
                       "to continue it exactly", len(by_rank), dist.world_size, len(by_rank))
    restore_rng_states(by_rank, dist.rank, dist.world_size, parts.generator,
                       fresh_seed=cfg.seed + dist.rank + 1_000_003 * step)
    changed = changed_settings(Path(cfg.output_dir) / "config.yaml", cfg)
    _refuse_a_changed_adapter(cfg, changed, ckpt)
    factors = _rate_changes(cfg, state, changed, parts)
    if any(f != 1 for f in factors):  # the restored schedule (and a rollback's cut), at the new rates
        scale_learning_rate(parts.optimizer, parts.scheduler, factors)
    if changed and dist.is_main:
        logger.warning("resuming with settings changed since the run last started (they apply from step %d): %s",
                       step + 1, ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))
    best = state.get("best")  # older versions also kept the checkpoint's full path: stale once the folder moves
    best = None if best is None else {k: v for k, v in best.items() if k != "checkpoint"}
    evals = state["evals"]
    if step < cfg.max_steps:  # trained further than a finished run: its eval_after is no longer the run's last
        evals.pop("eval_after", None)
    # over: trained to max_steps and, with an eval set, evaluated after (eval_after kept only by the last save)
    finished = step >= cfg.max_steps and ("eval_after" in evals or not evaluates)
    if finished and dist.is_main:
        logger.warning("--resume: the run in %s is finished (step %d, max_steps=%d): nothing is trained, its summary "
                       "is written again; to train further, raise max_steps", cfg.output_dir, step, cfg.max_steps)
    return LoopState(step, evals, state.get("eval_pending", False), best, finished)


def _rate_changes(cfg: TrainConfig, state: dict[str, Any], changed: dict[str, tuple[Any, Any]],
                  parts: TrainingParts) -> list[float]:
    """Each optimizer group's configured rate over the one its checkpoint was saved at: the policy's
    by learning_rate, the value head's by its own rate (a new learning_rate moves it only where
    value_learning_rate is null)."""
    old_lr = state.get("learning_rate", changed.get("learning_rate", (cfg.learning_rate,))[0])
    if not (isinstance(old_lr, (int, float)) and old_lr > 0):
        old_lr = cfg.learning_rate
    factors = [cfg.learning_rate / old_lr] * len(parts.optimizer.param_groups)
    if parts.value_head is None:
        return factors
    old_value = state.get("value_learning_rate")  # saved since 2026-11-27; before, from the config's change
    if old_value is None:
        old_value = changed.get("value_learning_rate", (cfg.value_learning_rate,))[0] or 10 * old_lr
    value = {id(p) for p in parts.value_head.parameters()}
    return [value_learning_rate(cfg) / old_value if any(id(p) in value for p in g["params"]) else f
            for g, f in zip(parts.optimizer.param_groups, factors)]


def record_loop_state(cfg: TrainConfig, dist: D.DistContext, parts: TrainingParts, loop: LoopState) -> Path:
    """An eval after the checkpoint of `loop.step` was written (eval_after; one made up on resume):
    where the loop now stands, beside that checkpoint (checkpoint.write_loop_state), instead of
    writing the same weights again. Returns the checkpoint's path."""
    path = checkpoint_path(cfg.output_dir, loop.step)
    if dist.is_main:
        write_loop_state(path, {"evals": loop.evals, "eval_pending": loop.eval_pending, "best": loop.best,
                                "guard": parts.guard.state_dict()})
    D.barrier(dist)
    return path


_PORTABLE = (ConfigError, CheckpointMismatch, DamagedCheckpoint)  # raised again on every rank as themselves


def _portable(error: Exception) -> tuple[str, str]:
    """An error rank 0 met reading a checkpoint, as every rank can take it by broadcast (any exception's
    pickling is not assured): its kind and message."""
    kind = next((t.__name__ for t in _PORTABLE if isinstance(error, t)), type(error).__name__)
    return kind, str(error)


def _rebuilt(error: tuple[str, str]) -> Exception:
    """`_portable`'s error on a rank that did not meet it: the same class where the handlers below know
    it, else a RuntimeError that says where it came from."""
    kind, message = error
    known = {t.__name__: t for t in _PORTABLE}
    return known[kind](message) if kind in known else RuntimeError(f"rank 0 failed to read the checkpoint: "
                                                                   f"{kind}: {message}")


def _check_value_head(ckpt: Path, parts: TrainingParts, state: dict[str, Any]) -> None:
    """Before any optimizer state loads: a checkpoint with a value head resumes only a run with one."""
    if (parts.value_head is not None) != (state.get("value_head") is not None):
        raise ConfigError(f"checkpoint {ckpt} was written " + ("without" if parts.value_head else "with")
                          + " a value head (value_head): resume with the run's own algorithm, or start a new run "
                          "from its model folder (model: .../checkpoints/step-N/model)")


def load_trainable_weights(checkpoint: str | Path, model: torch.nn.Module) -> None:
    """The trainable weights of a checkpoint into `model` (sharded or not): load_best_model_at_end."""
    if D.is_sharded(model):  # rank 0 reads it, the others take their shards from it
        D.load_full_state(model, read_checkpoint(checkpoint)[0] if D.dist.get_rank() == 0 else {})
    else:
        load_checkpoint(checkpoint, model)
