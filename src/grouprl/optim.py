"""The optimizer and its learning-rate schedule, built once from the config."""

from __future__ import annotations

import math
from typing import Callable

import torch

from grouprl.config import TrainConfig


def make_optimizer(cfg: TrainConfig, model: torch.nn.Module, value_head: torch.nn.Module | None = None
                   ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable parameters (and PPO's value head's, value.py, in a group of its own at
    value_learning_rate) and its LambdaLR schedule (one scheduler step per optimizer step:
    max_steps * num_iterations in all; both groups follow it)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": params}]
    if value_head is not None:
        value_lr = cfg.value_learning_rate or 10 * cfg.learning_rate  # null: verl's examples' critic/actor ratio
        groups.append({"params": list(value_head.parameters()), "lr": value_lr})
    # fused AdamW: one kernel over all parameters, same update (8x faster than the per-parameter
    # loop on CPU at 50M parameters); sharded (DTensor) parameters keep the default implementation
    fused = all(type(p) is torch.nn.Parameter for g in groups for p in g["params"]) or None
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2), fused=fused)
    total = cfg.max_steps * cfg.num_iterations
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg.lr_scheduler_type, cfg.warmup_steps,
                                                                         total))
    return optimizer, scheduler


def lr_schedule(kind: str, warmup: int, total: int) -> Callable[[int], float]:
    """LambdaLR factor: linear warmup over `warmup` steps, then constant, linear or cosine decay."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = (step - warmup) / max(1, total - warmup)
        if kind == "linear":
            return max(0.0, 1.0 - frac)
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))
        return 1.0

    return factor


def scale_learning_rate(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                        factor: float) -> None:
    """Multiply the learning rate by `factor` from now on: in the scheduler's base rates, so the
    schedule keeps its shape and a checkpoint keeps the new rate, and in the optimizer's groups at
    once (a rollback's lower rate; a resumed run given a new `learning_rate`)."""
    scheduler.base_lrs = [b * factor for b in scheduler.base_lrs]
    for group, base, schedule in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["initial_lr"], group["lr"] = base, base * schedule(scheduler.last_epoch)
    _set_last_lr(scheduler, [g["lr"] for g in optimizer.param_groups])


def _set_last_lr(scheduler: torch.optim.lr_scheduler.LRScheduler, lrs: list[float]) -> None:
    """What `scheduler.get_last_lr()` answers until its next `step()`. torch keeps it in the private
    `_last_lr` and has no setter, and a scheduler only writes it when it steps (checked on torch
    2.13.0, `torch/optim/lr_scheduler.py`): the one place grouprl writes it."""
    scheduler._last_lr = lrs
