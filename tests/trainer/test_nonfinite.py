"""A step whose loss or gradient norm is not finite skips the optimizer: the weights and the
optimizer state after it are those before it, one warning names the step and what was not finite,
the metrics count it, the learning-rate schedule keeps its place, and the next step trains."""

import copy
import logging
import math
from dataclasses import replace

import pytest
import torch

from grouprl.trainer import Trainer
from tests.trainer.conftest import read_metrics

BAD_STEP = 2


def _state(trainer: Trainer) -> tuple[dict[str, torch.Tensor], dict]:
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return weights, copy.deepcopy(trainer.optimizer.state_dict())


def _assert_same_state(a, b) -> None:
    (wa, oa), (wb, ob) = a, b
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert oa["state"].keys() == ob["state"].keys()
    for i in oa["state"]:  # Adam's step count and both moments
        for k, v in oa["state"][i].items():
            assert torch.equal(v, ob["state"][i][k]), (i, k)


def _run(trainer: Trainer) -> dict[int, tuple]:
    """train() with the weights and optimizer state recorded before and after each step."""
    states, original = {}, trainer.train_step

    def recorded():
        before = _state(trainer)
        metrics = original()
        states[trainer.step] = (before, _state(trainer))
        return metrics

    trainer.train_step = recorded
    trainer.train()
    return states


def _check_skipped_then_trains(cfg, states, caplog, what: str) -> list[dict]:
    rows = read_metrics(cfg.output_dir)
    assert [r["skipped_nonfinite"] for r in rows] == [0, 1, 0]
    before, after = states[BAD_STEP]
    _assert_same_state(before, after)
    before, after = states[BAD_STEP + 1]  # the next (finite) step moves the weights and Adam's count
    assert any(not torch.equal(before[0][k], after[0][k]) for k in before[0])
    steps = [int(s["step"]) for s in after[1]["state"].values()]
    assert steps and all(s == BAD_STEP for s in steps)  # two optimizer steps taken in three
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "non-finite" in r.message]
    assert len(warnings) == 1 and warnings[0].startswith(f"step {BAD_STEP}: non-finite {what} ("), warnings
    return rows


@pytest.fixture
def schedule_cfg(make_cfg):
    """A schedule whose learning rate changes every step, so a slot lost or gained shows."""
    return make_cfg(max_steps=3, warmup_steps=2, lr_scheduler_type="linear", learning_rate=1e-2)


def test_nan_advantages_skip_the_step_and_the_run_goes_on(schedule_cfg, tmp_path, caplog):
    trainer = Trainer(schedule_cfg)
    original = trainer.advantages

    def nan_at_bad_step(batch, *rest):
        adv = original(batch, *rest)  # [N]
        return torch.full_like(adv, math.nan) if trainer.step == BAD_STEP else adv

    trainer.advantages = nan_at_bad_step
    with caplog.at_level(logging.WARNING, logger="grouprl.update"):
        rows = _check_skipped_then_trains(schedule_cfg, _run(trainer), caplog, "loss and grad norm")
    bad = rows[BAD_STEP - 1]
    assert bad["loss"] is None and bad["grad_norm"] is None  # NaN, written as null: strict JSON readers refuse NaN
    assert all(math.isfinite(r["loss"]) for i, r in enumerate(rows) if i != BAD_STEP - 1)
    # the scheduler stepped through the skipped step: the same learning rates as a clean run
    clean = replace(schedule_cfg, output_dir=str(tmp_path / "clean"))
    Trainer(clean).train()
    assert [r["lr"] for r in rows] == [r["lr"] for r in read_metrics(clean.output_dir)]


def test_an_infinite_gradient_with_a_finite_loss_skips_the_step(schedule_cfg, caplog):
    trainer = Trainer(schedule_cfg)
    weight = next(p for p in trainer.model.parameters() if p.requires_grad)
    weight.register_hook(lambda g: torch.full_like(g, math.inf) if trainer.step == BAD_STEP else g)
    with caplog.at_level(logging.WARNING, logger="grouprl.update"):
        rows = _check_skipped_then_trains(schedule_cfg, _run(trainer), caplog, "grad norm")
    assert math.isfinite(rows[BAD_STEP - 1]["loss"]) and rows[BAD_STEP - 1]["grad_norm"] is None  # inf, written null
