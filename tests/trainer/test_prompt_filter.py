import io
import logging
import math
import pickle

import pytest
import torch

from grouprl.data import PromptSampler
from grouprl.prompt_filter import PromptFilter


def settle(f: PromptFilter, index: int, times: int) -> None:
    f.record([index] * times, [True] * times)


def test_no_history_skips_nothing():
    f = PromptFilter(10, history=2, revisit=0.0, seed=0)
    sampler, reference = PromptSampler(10, seed=3), PromptSampler(10, seed=3)
    for k in (3, 4, 7, 10, 1):
        assert f.draw(sampler, k) == reference.next(k)
    assert f.skipped == 0 and f.num_settled == 0


def test_settled_prompt_is_skipped_and_replaced():
    f = PromptFilter(10, history=3, revisit=0.0, seed=0)
    order = PromptSampler(10, seed=1).next(10)
    target = order[1]
    settle(f, target, 2)
    assert not f.is_settled(target)  # only 2 of 3
    settle(f, target, 1)
    assert f.is_settled(target) and f.num_settled == 1
    got = f.draw(PromptSampler(10, seed=1), 4)
    assert got == [order[0], order[2], order[3], order[4]]
    assert f.skipped == 1


def test_a_teaching_group_unsettles_and_history_is_a_window():
    f = PromptFilter(5, history=3, revisit=0.0, seed=0)
    f.record([2, 2, 2], [True, False, True])
    assert not f.is_settled(2)  # a non-zero-variance group among its last 3
    f.record([2, 2], [True, True])  # last 3: flat, flat, flat -> the teaching group fell out
    assert f.is_settled(2)
    f.record([2], [False])  # settled -> teaching
    assert not f.is_settled(2)
    settle(f, 2, 2)
    assert not f.is_settled(2)  # needs `history` more flat groups
    settle(f, 2, 1)
    assert f.is_settled(2)
    settle(f, 2, 10)  # long flat runs stay settled
    assert f.is_settled(2) and f.num_settled == 1


def test_revisit_one_never_skips():
    f = PromptFilter(8, history=1, revisit=1.0, seed=0)
    settle(f, 0, 1), settle(f, 5, 1)
    sampler, reference = PromptSampler(8, seed=0), PromptSampler(8, seed=0)
    for _ in range(20):
        assert f.draw(sampler, 5) == reference.next(5)
    assert f.skipped == 0


def test_revisit_rate_matches_probability():
    n, p = 500, 0.25  # 0.75**500: the starvation guard never fires
    f = PromptFilter(n, history=1, revisit=p, seed=7)
    f.record(list(range(n)), [True] * n)  # every prompt settled
    sampler = PromptSampler(n, seed=0)
    taken = 0
    while f.skipped + taken < 4000:
        taken += len(f.draw(sampler, 10))
    decisions = f.skipped + taken
    se = math.sqrt(p * (1 - p) / decisions)
    assert abs(taken / decisions - p) < 4 * se


def test_same_seed_same_decisions():
    def run(seed: int) -> list[int]:
        f, sampler = PromptFilter(100, history=1, revisit=0.5, seed=seed), PromptSampler(100, seed=0)
        f.record(list(range(100)), [True] * 100)
        return f.draw(sampler, 30)
    assert run(3) == run(3)
    assert run(3) != run(4)


def test_all_settled_still_draws_and_warns_once(caplog):
    n = 6
    f = PromptFilter(n, history=2, revisit=0.0, seed=0)
    f.record(list(range(n)) * 2, [True] * (2 * n))
    assert f.num_settled == n
    sampler, reference = PromptSampler(n, seed=4), PromptSampler(n, seed=4)
    with caplog.at_level(logging.WARNING, logger="grouprl.prompt_filter"):
        first = f.draw(sampler, 4)
        second = f.draw(sampler, 9)
    reference.next(n)  # the first call skipped one epoch, then took the next 4
    assert first == reference.next(4)
    assert len(second) == 9
    assert f.skipped == 2 * n  # each call skips a whole epoch's worth, then stops skipping
    warnings = [r for r in caplog.records if r.name == "grouprl.prompt_filter" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "exhausted" in warnings[0].getMessage()


@pytest.mark.parametrize("via", ["pickle", "torch"])
def test_state_round_trip_reproduces_draws(via):
    n = 30
    f = PromptFilter(n, history=2, revisit=0.3, seed=11)
    sampler = PromptSampler(n, seed=5)
    for step in range(6):
        idx = f.draw(sampler, 7)
        f.record(idx, [(i + step) % 3 != 0 for i in idx])
    state = {"filter": f.state_dict(), "sampler": sampler.state_dict()}
    buf = io.BytesIO()
    if via == "pickle":
        pickle.dump(state, buf)
        buf.seek(0)
        state = pickle.load(buf)
    else:
        torch.save(state, buf)
        buf.seek(0)
        state = torch.load(buf, weights_only=True)

    g, resumed = PromptFilter(n, history=2, revisit=0.3, seed=999), PromptSampler(n, seed=5)
    g.load_state_dict(state["filter"])
    resumed.load_state_dict(state["sampler"])
    assert g.skipped == f.skipped and g.num_settled == f.num_settled
    for step in range(10):
        a, b = f.draw(sampler, 7), g.draw(resumed, 7)
        assert a == b
        flags = [i % 2 == 0 for i in a]
        f.record(a, flags), g.record(b, flags)
    assert f.skipped == g.skipped > 0


def test_load_rejects_other_dataset():
    f = PromptFilter(5, history=1, revisit=0.0, seed=0)
    with pytest.raises(ValueError, match="same train_data"):
        PromptFilter(6, history=1, revisit=0.0, seed=0).load_state_dict(f.state_dict())


@pytest.mark.parametrize("kwargs, message", [
    (dict(history=0, revisit=0.1), r"history=0: prompt_filter_history must be >= 1"),
    (dict(history=-2, revisit=0.1), r"history=-2: prompt_filter_history must be >= 1"),
    (dict(history=2, revisit=1.5), r"revisit=1.5: .*must be in \[0, 1\]"),
    (dict(history=2, revisit=-0.1), r"revisit=-0.1: .*must be in \[0, 1\]"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PromptFilter(10, seed=0, **kwargs)


def test_record_rejects_mismatched_or_out_of_range():
    f = PromptFilter(4, history=1, revisit=0.0, seed=0)
    with pytest.raises(ValueError, match="one flag per group"):
        f.record([0, 1], [True])
    with pytest.raises(ValueError, match="outside the dataset"):
        f.record([4], [True])


# ---------------------------------------------------------------------------- through the trainer
def half_settled_reward(prompts, completions, answer, **kwargs):
    """Prompts with an even answer score 1 whatever the completion (zero variance: they settle); the
    others score the completion's position in its group of 4 (always varied: they never settle)."""
    return [1.0 if int(a) % 2 == 0 else float(i % 4) for i, a in enumerate(answer)]


def test_the_trainer_skips_settled_prompts_and_resume_reproduces(make_cfg, tmp_path):
    """64 prompts, 4 per step: the first epoch (16 steps) sees each once and settles the 32 even ones
    (history 1); in the second epoch (revisit 0) only odd prompts are drawn and every even one met is
    skipped, counted G times in `prompt_filter/rollouts_saved`. A run resumed at step 17 draws exactly
    the prompts of the uninterrupted one."""
    from grouprl.trainer import Trainer
    from tests.trainer.conftest import read_metrics

    kw = dict(reward_funcs=["tests.trainer.test_prompt_filter:half_settled_reward"], prompt_filter=True,
              prompt_filter_history=1, prompt_filter_revisit=0.0, max_steps=20, max_completion_length=2)
    full = make_cfg(output_dir=str(tmp_path / "full"), **kw)
    trainer = Trainer(full)
    drawn = []
    original = trainer.formatter.batch

    def spy(ds, indices, col):
        drawn.append(list(indices))
        return original(ds, indices, col)

    trainer.formatter.batch = spy
    trainer.train()
    first, second = [i for s in drawn[:16] for i in s], [i for s in drawn[16:] for i in s]
    assert sorted(first) == list(range(64))  # nothing settled yet: the sampler's whole first epoch
    assert len(second) == 16 and all(i % 2 == 1 for i in second)  # row i's answer is i
    rows = read_metrics(full.output_dir)
    assert [r["prompt_filter/skipped"] for r in rows[:16]] == [0] * 16
    assert rows[-1]["prompt_filter/settled"] == 32
    assert rows[-1]["prompt_filter/skipped"] >= 12  # the evens met on the way to 16 odd prompts
    assert rows[-1]["prompt_filter/rollouts_saved"] == rows[-1]["prompt_filter/skipped"] * 4

    part = make_cfg(output_dir=str(tmp_path / "part"), **{**kw, "max_steps": 17})
    Trainer(part).train()
    resumed = Trainer(make_cfg(output_dir=str(tmp_path / "part"), **kw))
    drawn_after = []
    original2 = resumed.formatter.batch
    resumed.formatter.batch = lambda ds, idx, col: (drawn_after.append(list(idx)), original2(ds, idx, col))[1]
    resumed.train(resume=True)
    assert drawn_after == drawn[17:]
