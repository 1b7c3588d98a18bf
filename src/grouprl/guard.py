"""What a run does about its alarms (health.py computes them): report, stop, or roll back.

`RunGuard` sits beside the trainer's loop. After each step (`check`) and each eval (`check_eval`)
it holds the alarms raised; `respond` prints each with example completions, records it in the
step's metrics (`alarms`) and in samples.jsonl, and then decides what the run does as the config
says, as a `Response` that the trainer carries out (the guard never calls the trainer):
- `on_reward_hacking: warn | stop`, `on_collapse: warn | stop | rollback` (`off`: never raised);
- `stop`: the response says why, and the trainer ends the run after this step with a checkpoint;
- `rollback`: the trainer calls `restore`, which puts back the newest in-memory snapshot taken at
  least 3 steps before the alarm's step s, or the oldest kept if none is that old (step s samples
  with the weights after update s-1 and `reward_crash` judges steps s-1 and s, so the snapshots of
  steps s-1 and s-2 are the policies that sampled the crash, and that of s-3 the newest that did
  not), and multiplies the learning rate by `rollback_lr_factor` (in the scheduler's base rates,
  so the schedule's shape stays and a checkpoint keeps the scaled rate);
  the run goes on. The step count, the data order and the random streams go on too: the steps
  since the snapshot are spent, not replayed. After `max_rollbacks` rollbacks the next collapse stops the run.

Snapshots (`snapshot`, only with `on_collapse: rollback`): the trainable weights and the optimizer
state in host memory, at the start and then every `window` steps, two kept (three at window 1, so
that one is 3 steps old). They cost three times the trainable parameters each (weights and Adam's
two moments): 1.6 GB for a 135 M model in fp32, a few MB for a LoRA adapter. Departure: they are not
in the checkpoint (it would triple in size), so a resumed run's first rollback target is the state
it resumed from, and from a rollback after a resume on, the run differs from an uninterrupted one.
That state may already hold the collapse (resumed from a checkpoint written just after it): where a
resumed run stops after rollbacks that all went back there, it says so and names the older
checkpoints kept (the uninterrupted run would have gone back further).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from grouprl.batch import StepBatch
from grouprl.checkpoint import checkpoint_dir, list_checkpoints, memory_snapshot, restore_snapshot
from grouprl.config import ConfigError, TrainConfig
from grouprl.health import Alarm, HealthMonitor, HealthThresholds
from grouprl.optim import scale_learning_rate
from grouprl.runlog import Progress, RunLogger

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Response:
    """What the run does about the alarms just reported: go on, stop (`stop`: why), or roll back."""

    stop: str | None = None
    rollback: bool = False


class RunGuard:
    def __init__(self, cfg: TrainConfig, reward_names: list[str], audit_names: list[str], *, is_main: bool):
        self.cfg, self.is_main = cfg, is_main
        try:
            thresholds = HealthThresholds.from_overrides(cfg.health_thresholds)
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e)) from None
        watch = cfg.on_reward_hacking != "off" or cfg.on_collapse != "off"
        self.monitor = HealthMonitor(thresholds, reward_names, list(cfg.reward_weights or [1.0] * len(reward_names)),
                                     audit_names) if watch else None
        self.alarms: list[Alarm] = []  # raised by the latest step (or eval), not yet responded to
        self.rollbacks = 0
        self.snapshots: list[tuple[int, dict[str, Any]]] = []  # (step, memory_snapshot)
        self.targets: list[int] = []  # the steps this process's rollbacks went back to
        self.resumed = False  # the run resumed from a checkpoint (load_state_dict)

    # ------------------------------------------------------------------ alarms
    def check(self, step: int, batch: StepBatch, metrics: dict[str, float]) -> dict[str, float]:
        """The audit functions' means and the health statistics of a step just trained; its alarms
        are kept for `respond`."""
        out = {f"audit/{n}/mean": float(v[~v.isnan()].mean()) if (~v.isnan()).any() else math.nan
               for n, v in batch.audit.items()}
        if self.monitor is None:
            return out
        stats, alarms = self.monitor.observe(
            step, rewards=batch.rewards, per_func=batch.per_func, audit=batch.audit, texts=batch.completions,
            token_lists=batch.rollout.token_lists(), lengths=batch.rollout.action_lengths,
            G=self.cfg.num_generations, entropy=metrics.get("entropy"), kl=metrics.get("kl"), prompts=batch.prompts)
        self.alarms = self._enabled(alarms)
        return {**out, **stats}

    def check_eval(self, step: int, accuracy: float) -> None:
        if self.monitor is not None:
            self.alarms = self._enabled(self.monitor.observe_eval(step, accuracy))

    def _enabled(self, alarms: list[Alarm]) -> list[Alarm]:
        mode = {"reward_hacking": self.cfg.on_reward_hacking, "collapse": self.cfg.on_collapse}
        return [a for a in alarms if mode[a.family] != "off"]

    def respond(self, step: int, metrics: dict[str, Any], run_logger: RunLogger | None, progress: Progress | None,
                *, final: bool = False) -> Response:
        """Report the pending alarms and decide what the run does about them. `final`: the run is
        over (eval_after), so alarms are reported only."""
        cfg, alarms, self.alarms = self.cfg, self.alarms, []
        if not alarms:
            return Response()
        metrics["alarms"] = [{k: v for k, v in a.record().items() if k != "examples"} for a in alarms]
        for a in alarms:
            self._say("\n".join([a.describe()] + [f"    e.g. {ex['completion']!r} (reward {ex['reward']:.3g})"
                                                  for ex in a.examples]), progress)
            if run_logger is not None:
                run_logger.log_samples(step, [{"alarm": a.kind, "function": a.function, **ex} for ex in a.examples])
        hacking = [a.kind for a in alarms if a.family == "reward_hacking"]
        collapse = [a.kind for a in alarms if a.family == "collapse"]
        if final:
            return Response()
        if hacking and cfg.on_reward_hacking == "stop":
            return Response(stop=f"reward-hacking alarm {hacking[0]} (on_reward_hacking: stop)")
        if collapse and cfg.on_collapse == "stop":
            return Response(stop=f"collapse alarm {collapse[0]} (on_collapse: stop)")
        if collapse and cfg.on_collapse == "rollback":
            if self.rollbacks >= cfg.max_rollbacks:
                reason = f"collapse alarm {collapse[0]} after max_rollbacks={cfg.max_rollbacks} rollbacks"
                if advice := self._resume_point_advice():
                    self._say(advice, progress)
                    reason += f" (each back to step {self.snapshots[0][0]}, where this run resumed)"
                return Response(stop=reason)
            return Response(rollback=True)
        return Response()

    def _resume_point_advice(self) -> str:
        """Where every rollback of a resumed run went back to the state it resumed from (the only target
        a resume has until its next snapshot: module docstring), that state may be past the collapse
        (a review's run resumed one step after it and spent its rollbacks there): say so, and name the
        older checkpoints a rerun can go back to."""
        if not (self.resumed and self.snapshots and self.targets and set(self.targets) == {self.snapshots[0][0]}):
            return ""
        at = self.snapshots[0][0]
        older = [p.name for p in list_checkpoints(self.cfg.output_dir) if int(p.name.split("-")[-1]) < at]
        where = (f"the kept checkpoints before it: {', '.join(older)}; move the later ones out of "
                 f"{checkpoint_dir(self.cfg.output_dir)} and resume with a lower learning_rate" if older else
                 "no earlier checkpoint is kept (save_total_limit); start over with a lower learning_rate")
        return (f"every rollback went back to step {at}, the checkpoint this run resumed from, which may already "
                f"hold the collapse (rollback snapshots are not saved in checkpoints), and a resume goes back there "
                f"too. To go back further: {where}")

    def rolled_back(self, step: int, metrics: dict[str, Any], progress: Progress | None) -> None:
        """Say that the trainer carried out a rollback (`metrics` holds what `restore` returned)."""
        self._say(f"step {step}: rolled back to the weights of step {metrics['rollback/to_step']}, learning rate "
                  f"x{self.cfg.rollback_lr_factor:g} (rollback {self.rollbacks} of at most {self.cfg.max_rollbacks})",
                  progress)

    def _say(self, text: str, progress: Progress | None) -> None:
        if progress is not None:
            progress.write(text)
        elif self.is_main:
            logger.warning("%s", text)

    # ------------------------------------------------------------------ rollback
    def snapshot(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Keep the state after `step` as a rollback target (on_collapse: rollback; every window steps)."""
        if self.cfg.on_collapse != "rollback" or self.monitor is None:
            return
        window = self.monitor.t.window
        if self.snapshots and step - self.snapshots[-1][0] < window:
            return
        keep = 1 + math.ceil(2 / window)  # one of them at least 3 steps before any later alarm's step
        self.snapshots = self.snapshots[-(keep - 1):] + [(step, memory_snapshot(model, optimizer))]

    def restore(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                scheduler: torch.optim.lr_scheduler.LambdaLR) -> dict[str, float]:
        """Put back the newest snapshot taken at least 3 steps before `step` (module docstring); scale
        the learning rate."""
        older = [sn for sn in self.snapshots if sn[0] <= step - 3] or self.snapshots[:1]
        to_step, snap = older[-1]
        restore_snapshot(model, optimizer, snap)
        self.snapshots = [sn for sn in self.snapshots if sn[0] <= to_step]
        scale_learning_rate(optimizer, scheduler, self.cfg.rollback_lr_factor)
        self.rollbacks += 1
        self.targets.append(to_step)
        if self.monitor is not None:
            self.monitor.reset_after_rollback(to_step)
        return {"rollback/to_step": to_step, "rollback/count": self.rollbacks, "lr": scheduler.get_last_lr()[0]}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"monitor": None if self.monitor is None else self.monitor.state_dict(), "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.resumed = True
        self.rollbacks = state.get("rollbacks", 0)
        if self.monitor is not None and state.get("monitor"):
            self.monitor.load_state_dict(state["monitor"])
