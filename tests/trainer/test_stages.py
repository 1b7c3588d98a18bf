"""The trainer's public stage methods: `train_step` is exactly prompts -> generate -> score ->
advantages -> update -> sync, and each stage can be used alone."""

import pytest
import torch

from grouprl.trainer import Trainer
from tests.trainer.conftest import digit_fraction


def _weights(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in trainer.model.parameters()])


def test_train_step_is_the_stages_called_in_order(make_cfg):
    """Two trainers from one seed: one runs train_step, the other the public stages by hand on the
    same prompts; the sampled completions, the advantages and the updated weights are identical."""
    cfg = make_cfg(beta=0.04, num_iterations=2)
    auto, manual = Trainer(cfg), Trainer(cfg)
    metrics = auto.train_step()

    prompts = manual.prompts(manual.train_ds.select(manual.sampler.next(cfg.prompts_per_step)))
    batch = manual.score(prompts, manual.generate(prompts))
    advantages = manual.advantages(batch)
    stats = manual.update(batch, advantages)
    manual.sync_weights()

    assert auto.step == 1 and metrics["reward/mean"] == pytest.approx(batch.rewards.mean().item(), abs=0)
    assert metrics["loss"] == pytest.approx(stats["loss"], abs=0)
    assert metrics["kl"] == pytest.approx(stats["kl"], abs=0)
    assert torch.equal(_weights(auto), _weights(manual))
    assert not torch.equal(_weights(manual), _weights(Trainer(cfg)))  # the update moved the weights


def test_generate_greedy_is_deterministic_and_score_matches_the_reward_function(make_cfg):
    trainer = Trainer(make_cfg())
    prompts = trainer.prompts(["Say numbers 1: ", "Say numbers 3: "])
    assert prompts.prompts == ["Say numbers 1: ", "Say numbers 3: "]
    a, b = trainer.generate(prompts, greedy=True), trainer.generate(prompts, greedy=True)
    assert len(a.rollout) == 2 and torch.equal(a.rollout.completion_ids, b.rollout.completion_ids)
    sampled = trainer.generate(prompts, num_generations=3)
    assert len(sampled.rollout) == 6
    batch = trainer.score(prompts, sampled)
    texts = trainer.decode(sampled)
    assert batch.completions == texts
    assert batch.prompts == ["Say numbers 1: "] * 3 + ["Say numbers 3: "] * 3
    assert batch.rewards.tolist() == pytest.approx(digit_fraction(batch.prompts, texts))


def test_evaluate_equals_greedy_generate_and_score(make_cfg):
    trainer = Trainer(make_cfg())
    rows = trainer.train_ds.select(range(5))
    result = trainer.evaluate(rows, batch_size=2)
    batch = trainer.score(trainer.prompts(rows), trainer.generate(trainer.prompts(rows), greedy=True))
    assert result["num_samples"] == 5
    assert result["accuracy"] == pytest.approx(batch.rewards.mean().item())
    assert result["length_mean"] == pytest.approx(batch.rollout.action_lengths.float().mean().item())


def test_logprobs_of_the_policy_and_the_reference(make_cfg):
    trainer = Trainer(make_cfg(beta=0.04))
    prompts = trainer.prompts(["Say numbers 4: "])
    rollout = trainer.generate(prompts, num_generations=2).rollout
    policy, ref = trainer.logprobs(rollout), trainer.logprobs(rollout, reference=True)
    assert policy.shape == rollout.completion_ids.shape
    assert torch.equal(policy, ref)  # before any update the reference is the policy
    assert (policy[rollout.completion_mask] < 0).all() and (policy[~rollout.completion_mask] == 0).all()
    with pytest.raises(ValueError, match="beta > 0"):
        Trainer(make_cfg(beta=0.0)).logprobs(rollout, reference=True)
