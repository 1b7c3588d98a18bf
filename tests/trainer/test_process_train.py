"""Process supervision through the Trainer: the per-token advantages it hands to the loss are
DeepSeekMath's process advantages of the step rewards (worked out here from the completions
themselves), outcome and process rewards mix with their weights, and a short run climbs.

The tiny model's tokenizer has one token per character, and special tokens (which decode to
nothing) may appear mid-completion; a step ending at character offset e (exclusive) ends at the
first token whose decoded text reaches e (the last token when the step ends the text), and the
outcome (a final step) sits on the last token.
"""

import torch

import grouprl.trainer as trainer_module
import grouprl.update as update_module
from grouprl.core import process_advantages
from grouprl.rewards import CharOffset
from grouprl.trainer import Trainer
from tests.trainer.conftest import read_metrics

CHUNK = 3


def chunk_digits(prompts, completions, **kwargs):
    """Step rewards: every CHUNK characters a step, rewarded with its share of digits."""
    out = []
    for text in completions:
        ends = list(range(CHUNK, len(text), CHUNK)) + ([len(text)] if text else [])
        starts = [0] + ends[:-1]
        out.append([(CharOffset(e), sum(c.isdigit() for c in text[s:e]) / (e - s)) for s, e in zip(starts, ends)])
    return out


def by_hand(completions, completion_ids, tokenizer, G, T, weights):
    """process_advantages of the steps of `chunk_digits` (weight w0) plus `digit_fraction` as the
    outcome on the last token (weight w1), computed without the trainer's mapping code. The outcome
    is a step of its own, also where a process step ends on the same (last) token."""
    w0, w1 = weights
    rewards, ends = [], []
    for text, ids in zip(completions, completion_ids):
        steps = chunk_digits(None, [text])[0]
        r = [w0 * x for _, x in steps] + [w1 * sum(c.isdigit() for c in text) / max(len(text), 1)]
        reach = torch.tensor([len(tokenizer.decode([t], skip_special_tokens=True)) for t in ids]).cumsum(0)
        last = len(ids) - 1  # a step that ends the text also owns the tokens after it (EOS)
        e = [last if off.offset >= len(text) else int((reach >= off.offset).nonzero()[0]) for off, _ in steps]
        e.append(last)
        rewards.append(r)
        ends.append(e)
    return process_advantages(rewards, ends, G, T)


def test_the_loss_gets_process_advantages_of_the_step_and_outcome_rewards(make_cfg, monkeypatch):
    seen, to_loss = [], []
    real_step_advantages, real_policy_loss = trainer_module.step_advantages, update_module.policy_loss

    def spy_advantages(cfg, batch, values=None):
        adv = real_step_advantages(cfg, batch, values)
        seen.append((batch, adv.cpu()))
        return adv

    def spy_loss(logp, old_logp, advantages, mask, **kwargs):
        to_loss.append(advantages.detach().cpu().clone())  # on the trainer's device (cuda:0 where there is one)
        return real_policy_loss(logp, old_logp, advantages, mask, **kwargs)

    monkeypatch.setattr(trainer_module, "step_advantages", spy_advantages)
    monkeypatch.setattr(update_module, "policy_loss", spy_loss)
    cfg = make_cfg(advantage_estimator="process", max_steps=2, temperature=1.5,
                   reward_funcs=["tests.trainer.test_process_train:chunk_digits",
                                 "tests.trainer.conftest:digit_fraction"], reward_weights=[1.0, 0.5])
    trainer = Trainer(cfg)
    tokenizer = trainer.tokenizer
    trainer.train()

    assert len(seen) == 2
    for batch, adv in seen:
        N, T = batch.rollout.completion_ids.shape
        ids = batch.rollout.token_lists()
        want = by_hand(batch.completions, ids, tokenizer, cfg.num_generations, T, (1.0, 0.5))  # [N, T]
        assert adv.shape == (N, T)
        torch.testing.assert_close(adv, want, rtol=0, atol=1e-6)
        assert adv.abs().sum() > 0  # the completions differ: some step carries signal
    # every micro-batch's advantages are rows of the batch's [N, T] advantages, cut to its width
    batch_rows = torch.cat([adv for _, adv in seen])
    for part in to_loss:
        assert part.dim() == 2
        for row in part:
            assert (batch_rows[:, : len(row)] == row).all(-1).any()


def test_a_process_run_logs_step_metrics_and_the_step_reward_rises(make_cfg):
    cfg = make_cfg(advantage_estimator="process", max_steps=8, prompts_per_step=8, micro_batch_size=32,
                   reward_funcs=["tests.trainer.test_process_train:chunk_digits"])
    Trainer(cfg).train()
    rows = read_metrics(cfg.output_dir)
    assert all(r["process/steps_per_completion"] >= 1 for r in rows)
    assert all(r["process/step_reward_min"] <= r["process/step_reward_mean"] for r in rows)
    first = sum(r["process/step_reward_mean"] for r in rows[:2]) / 2
    last = sum(r["process/step_reward_mean"] for r in rows[-2:]) / 2
    assert last > first + 0.05, (first, last)


def crossed_halves(prompts, completions, **kwargs):
    """Two steps per completion, rewards (a, 1 − a) with a alternating by row: every completion's mean
    step reward is 0.5, but the steps differ, so the process advantages are not 0."""
    return [[(CharOffset(1), float(i % 2)), (CharOffset(len(c)), float(1 - i % 2))] if len(c) > 1 else None
            for i, c in enumerate(completions)]


def test_a_group_of_equal_step_means_but_unequal_steps_is_not_flat(make_cfg):
    """Dynamic sampling and the prompt filter judge a process group by its steps, as process_advantages
    does: equal per-completion means of unequal steps still carry signal, so nothing is dropped."""
    cfg = make_cfg(advantage_estimator="process", prompts_per_step=2, max_completion_length=8, dynamic_sampling=True,
                   max_sampling_rounds=2, prompt_filter=True, prompt_filter_history=1,
                   reward_funcs=["tests.trainer.test_process_train:crossed_halves"])
    trainer = Trainer(cfg)
    batch, metrics = trainer.sample_batch()
    assert all(len(r) == 2 for r in batch.steps.rewards) and set(batch.rewards.tolist()) == {0.5}
    assert metrics["zero_std_frac"] == 0.0 and metrics["dynamic_sampling/rounds"] == 1
    assert metrics["prompt_filter/settled"] == 0
    assert trainer.advantages(batch)[batch.rollout.action_mask].abs().max() > 0


def test_preflight_judges_a_process_group_by_its_steps_as_training_does(make_cfg):
    """Equal step means, unequal steps (crossed_halves): training keeps every group, so preflight's share
    of groups without signal is 0, not the 1 the per-completion totals alone would say."""
    from grouprl import preflight as P

    cfg = make_cfg(advantage_estimator="process", prompts_per_step=2, max_completion_length=8,
                   reward_funcs=["tests.trainer.test_process_train:crossed_halves"])
    s = P.sample(Trainer(cfg), 4)
    assert set(s.total.flatten().tolist()) == {0.5}  # every completion's mean
    report = P.summarize(s, cfg)
    assert report["total"]["zero_variance_share"] == 0.0
    assert set(report["total"]["predicted_zero_variance_share"].values()) == {0.0}  # by steps too (means: 1.0)
