"""The optimizer and its learning-rate schedule, built once from the config."""

from __future__ import annotations

import math
from typing import Callable

import torch

from grouprl.config import ConfigError, TrainConfig


def make_optimizer(cfg: TrainConfig, model: torch.nn.Module, value_head: torch.nn.Module | None = None
                   ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable parameters (and PPO's value head's, value.py, at value_learning_rate)
    and its LambdaLR schedule (one scheduler step per optimizer step: max_steps * num_iterations in
    all; every group follows it).

    Weight decay skips parameters of fewer than 2 dimensions, biases and normalisation gains (HF
    Trainer's and TRL's rule): with weight_decay > 0 each module's parameters form two groups at its
    rate, decayed (2-D and up) and not decayed; with weight_decay 0 one group (the layout of runs
    checkpointed before the split, which still resume). Empty groups are left out (LoRA's adapters
    are all matrices: one group)."""
    groups = _decay_groups([p for p in model.parameters() if p.requires_grad], cfg.learning_rate, cfg.weight_decay)
    if value_head is not None:
        groups += _decay_groups(list(value_head.parameters()), value_learning_rate(cfg), cfg.weight_decay)
    # fused AdamW: one kernel over all parameters, same update (8x faster than the per-parameter
    # loop on CPU at 50M parameters); sharded (DTensor) parameters keep the default implementation
    fused = all(type(p) is torch.nn.Parameter for g in groups for p in g["params"]) or None
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2), fused=fused)
    optimizer.register_load_state_dict_pre_hook(check_group_layout)
    total = cfg.max_steps * cfg.num_iterations
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg.lr_scheduler_type, cfg.warmup_steps,
                                                                         total))
    return optimizer, scheduler


def value_learning_rate(cfg: TrainConfig) -> float:
    """The value head's rate: value_learning_rate, or for null 10 x learning_rate (verl's examples' critic/actor
    ratio)."""
    return cfg.value_learning_rate or 10 * cfg.learning_rate


def _decay_groups(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> list[dict]:
    """One module's parameter groups at `lr`: all of them at `weight_decay` when it is 0; otherwise
    the matrices (2-D and up) at `weight_decay` and the rest (biases, norm gains) at 0, empty ones left out."""
    if not weight_decay:
        return [{"params": params, "lr": lr}]
    decay, no_decay = [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]
    return [g for g in ({"params": decay, "lr": lr, "weight_decay": weight_decay},
                        {"params": no_decay, "lr": lr, "weight_decay": 0.0}) if g["params"]]


def check_group_layout(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Before a checkpoint's optimizer state loads (or is converted between by-index and by-name forms):
    its groups hold as many parameters each as this run's (torch would only say the lengths differ)."""
    saved, own = [len(g["params"]) for g in state["param_groups"]], [len(g["params"]) for g in optimizer.param_groups]
    if saved != own:
        raise ConfigError(f"the checkpoint's optimizer state has parameter groups of {saved} parameters, this run's "
                          f"optimizer {own}: with weight_decay > 0 grouprl now keeps biases and norm gains in "
                          "groups of their own (not decayed), and a checkpoint written before that, or with "
                          "another weight_decay or trainable set, cannot resume this run. Resume it with the "
                          "grouprl version and settings that wrote it, or start a new run from its model folder "
                          "(model: .../checkpoints/step-N/model; the optimizer state starts afresh)")


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
                        factor: float | list[float]) -> None:
    """Multiply the learning rate by `factor` (or each group's by its own) from now on: in the
    scheduler's base rates, so the schedule keeps its shape and a checkpoint keeps the new rate, and
    in the optimizer's groups at once (a rollback's lower rate; a resumed run given a new
    `learning_rate` or `value_learning_rate`)."""
    factors = factor if isinstance(factor, list) else [factor] * len(scheduler.base_lrs)
    scheduler.base_lrs = [b * f for b, f in zip(scheduler.base_lrs, factors, strict=True)]
    for group, base, schedule in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["initial_lr"], group["lr"] = base, base * schedule(scheduler.last_epoch)
    _set_last_lr(scheduler, [g["lr"] for g in optimizer.param_groups])


def _set_last_lr(scheduler: torch.optim.lr_scheduler.LRScheduler, lrs: list[float]) -> None:
    """What `scheduler.get_last_lr()` answers until its next `step()`. torch keeps it in the private
    `_last_lr` and has no setter, and a scheduler only writes it when it steps (checked on torch
    2.13.0, `torch/optim/lr_scheduler.py`): the one place grouprl writes it."""
    scheduler._last_lr = lrs
