"""The GRPO-family presets end to end on the tiny model (each runs and the reward rises), and the
config combinations that make no sense fail before any model loads."""

import math

import pytest
import torch

from grouprl.config import ConfigError
from grouprl.core import LossParams
from grouprl.trainer import Trainer
from tests.trainer.conftest import read_metrics

# preset -> overrides. On-policy (μ = 1) CISPO and SAPO have the REINFORCE gradient of their base
# (tests/core/test_policy_terms.py); the off-policy mask only acts off-policy, so opsm takes two
# updates per rollout (the ratio leaves 1 on the second). Budget: a few seconds per preset.
PRESET_RUNS = {
    "cispo": {},
    "sapo": {},
    "opsm": {"num_iterations": 2},
    "bnpo": {},
    "gdpo": {"reward_funcs": ["tests.trainer.conftest:digit_fraction", "tests.trainer.conftest:short_reward"]},
    "top_entropy": {},
    "reinforce_pp": {},
    "reinforce_pp_baseline": {},
    "grpo_passk": {},
    "gmpo": {"num_iterations": 2},
}


@pytest.mark.parametrize("algorithm", sorted(PRESET_RUNS))
def test_preset_runs_and_the_reward_rises(make_cfg, algorithm):
    cfg = make_cfg(algorithm=algorithm, beta=None, max_steps=5, learning_rate=2e-2, num_generations=8,
                   prompts_per_step=2, micro_batch_size=16, **PRESET_RUNS[algorithm])
    Trainer(cfg).train()
    rows = read_metrics(cfg.output_dir)
    digits = [r["rewards/digit_fraction/mean"] for r in rows]
    assert (digits[-1] + digits[-2]) / 2 > (digits[0] + digits[1]) / 2 + 0.05, digits
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    if algorithm == "top_entropy":  # about 80 % of each micro-batch's tokens carry no gradient
        assert all(0.7 < r["entropy_mask/dropped_frac"] < 0.9 for r in rows)
    if algorithm == "opsm":
        assert all(0 <= r["off_policy_mask/dropped_frac"] <= 1 for r in rows)
    if algorithm == "cispo":
        assert all(r["is_clip_frac"] == 0.0 for r in rows)  # μ = 1: ρ = 1 sits inside [0, 5]
    if algorithm == "gmpo":  # the second update is off-policy: GMPO's own log-space clip fractions
        assert all(r["clip_frac_low"] + r["clip_frac_high"] == pytest.approx(r["clip_frac"]) for r in rows)
        assert any(r["clip_frac_low"] > 0 for r in rows) and any(r["clip_frac_high"] > 0 for r in rows)


@pytest.mark.parametrize("overrides, message", [
    ({"loss_type": "ppo"}, "loss_type='ppo' is not one of: "),
    ({"loss_type": "cispo", "dual_clip": 3.0}, "dual_clip=3.0 with loss_type=cispo: it shapes the PPO clip"),
    ({"algorithm": "sapo", "importance_sampling_level": "sequence"},
     "importance_sampling_level='sequence' with loss_type=sapo"),
    ({"algorithm": "sapo", "sapo_temperature_neg": 0.0}, "sapo_temperature_neg=0.0 must be positive"),
    ({"epsilon": 1.0}, r"epsilon below 1 \(at most 1 with loss_type cispo"),
    ({"beta": -0.1}, r"beta=-0.1 must be >= 0 \(0 disables the KL penalty\)"),
    ({"dual_clip": 1.0}, r"dual_clip=1.0 must be greater than 1 \(typically 3\), or null"),
    ({"delta": 0.5}, r"delta=0.5 must be greater than 1"),
    ({"algorithm": "reinforce_pp", "scale_rewards": "group"},
     "advantage_estimator=reinforce_pp normalises over the whole batch: set scale_rewards: batch"),
    ({"algorithm": "gdpo", "advantage_estimator": "rloo"},
     "advantage_estimator=rloo has no meaning there: set advantage_estimator: grpo"),
    ({"algorithm": "gdpo", "overlong_shaping": True}, "overlong_shaping with multi_objective_aggregation"),
    ({"multi_objective_aggregation": "mean"}, "multi_objective_aggregation='mean' is not one of"),
    ({"top_entropy_quantile": 0.0}, r"top_entropy_quantile=0.0 must be in \(0, 1\]"),
    ({"off_policy_mask_threshold": -0.5}, "off_policy_mask_threshold=-0.5 must be >= 0"),
    ({"advantage_estimator": "ppo"}, "advantage_estimator='ppo' is not one of: grpo"),
    ({"algorithm": "gmpo", "importance_sampling_level": "sequence"},
     "importance_sampling_level='sequence' with loss_type=gmpo: it shapes the PPO clip"),
    ({"entropy_coef": -0.01}, r"entropy_coef=-0.01 must be a finite number >= 0 \(0 disables the entropy bonus"),
    ({"entropy_coef": float("inf")}, "entropy_coef=inf must be a finite number"),
])
def test_variant_config_errors(make_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_cfg(**overrides).validate()


def test_config_and_loss_params_report_a_loss_setting_in_the_same_words(make_cfg):
    """One check (core's check_loss_settings) for both; the config's field names in both."""
    for overrides, knobs in [({"algorithm": "sapo", "sapo_temperature_neg": 0.0},
                              {"loss_type": "sapo", "sapo_tau_neg": 0.0}),
                             ({"loss_type": "cispo", "delta": 4.0}, {"loss_type": "cispo", "delta": 4.0}),
                             ({"beta": -1.0}, {"beta": -1.0})]:
        with pytest.raises(ConfigError) as from_config:
            make_cfg(**overrides).validate()
        with pytest.raises(ValueError) as from_core:
            LossParams(**knobs)
        assert str(from_config.value) == str(from_core.value)


def test_cispo_accepts_epsilon_one_as_no_lower_bound(make_cfg):
    cfg = make_cfg(algorithm="cispo", beta=None).validate()
    assert (cfg.epsilon, cfg.epsilon_high, cfg.loss_type) == (1.0, 4.0, "cispo")


def test_gmpo_takes_log_space_bounds_of_any_size(make_cfg):
    """GMPO clips log ρ to [−ε_low, ε_high]: ε = 1.5 is the ratio range [0.22, 4.48], not a negative
    lower bound, so it passes where the ratio-space clip refuses it (gmpo's range is symmetric: epsilon_high
    follows)."""
    cfg = make_cfg(algorithm="gmpo", beta=None, epsilon=1.5).validate()
    assert (cfg.loss_type, cfg.epsilon, cfg.epsilon_high) == ("gmpo", 1.5, 1.5)
    with pytest.raises(ConfigError, match="epsilon below 1"):
        make_cfg(algorithm="gspo", epsilon=1.5).validate()


@pytest.mark.parametrize("overrides", [
    {"algorithm": "opsm", "loss_type": "cispo", "epsilon": 1.0, "epsilon_high": 0.05, "num_iterations": 2,
     "off_policy_mask_threshold": 0.0},
    {"algorithm": "gdpo", "loss_type": "sapo", "sapo_temperature_neg": 2.0, "num_iterations": 2,
     "reward_funcs": ["tests.trainer.conftest:digit_fraction", "tests.trainer.conftest:short_reward"]},
    {"algorithm": "gmpo", "epsilon": 0.02, "epsilon_high": 0.02, "num_iterations": 2, "entropy_coef": 0.05},
    {"algorithm": "ppo", "num_iterations": 2, "entropy_coef": 0.05, "epsilon": 0.02, "epsilon_high": 0.02},
])
def test_off_policy_variants_give_the_full_batch_gradient_in_micro_batches(make_cfg, overrides):
    """Same seed, same rollout; micro_batch_size 16 vs 4 over two updates per rollout (the second is
    off-policy: CISPO clips, SAPO gates, the sequence mask drops with δ = 0, GMPO clips in log space;
    its run and PPO's add the entropy bonus, whose gradient every pass carries; PPO's gradients include
    its value head's): the accumulated gradients
    agree. After each update the micro-batched run takes the full run's weights, so that the second
    update starts from the same policy (Adam's first step turns float noise in near-zero gradients
    into lr-sized differences). (top_entropy_quantile is the exception, tests/core/test_token_masks.py.)"""
    grads, weights, stats = [], [], []
    for run, mbs in enumerate((16, 4)):
        trainer = Trainer(make_cfg(micro_batch_size=mbs, max_grad_norm=None, beta=0.05, learning_rate=3e-2,
                                   **overrides))
        params = list(trainer.updater.trainable.parameters())  # PPO: the value head's too
        step = trainer.optimizer.step

        def record_and_step(params=params, step=step, run=run):
            grads.append(torch.cat([p.grad.flatten() for p in params]))
            step()
            with torch.no_grad():
                if run == 0:
                    weights.append([p.detach().clone() for p in params])
                else:
                    for p, w in zip(params, weights[len(grads) - 3]):
                        p.copy_(w)

        trainer.optimizer.step = record_and_step
        stats.append(trainer.train_step())
    full, micro = grads[:2], grads[2:]
    for f, m in zip(full, micro):
        assert f.abs().max() > 1e-4
        assert torch.allclose(f, m, rtol=1e-4, atol=1e-6 * float(f.abs().max()))
    assert stats[0]["ratio_mean"] != 1.0  # the second update really was off-policy
    for key in ("off_policy_mask/dropped_frac", "is_clip_frac", "entropy_bonus"):
        if key in stats[0]:
            assert stats[0][key] == pytest.approx(stats[1][key]) and stats[0][key] > 0, key


def test_step_advantages_follows_multi_objective_aggregation(make_cfg):
    """sum_then_normalize feeds the weighted total to the estimator; normalize_then_sum (GDPO) reads
    each reward function's scores, in reward_funcs order, with reward_weights."""
    from types import SimpleNamespace

    from grouprl.core import compute_advantages, normalize_then_sum
    from grouprl.objective import step_advantages

    funcs = ["tests.trainer.conftest:digit_fraction", "tests.trainer.conftest:short_reward"]
    f1, f2 = torch.tensor([10.0, 0, 0, 0]), torch.tensor([0.0, 1, 1, float("nan")])
    batch = SimpleNamespace(per_func={"digit_fraction": f1, "short_reward": f2}, rewards=f1 + 2 * f2.nan_to_num(),
                            steps=None)  # outcome rewards only
    summed = step_advantages(make_cfg(reward_funcs=funcs, reward_weights=[1.0, 2.0], num_generations=4).validate(),
                             batch)
    assert torch.equal(summed, compute_advantages("grpo", batch.rewards, 4))
    gdpo = make_cfg(algorithm="gdpo", beta=None, reward_funcs=funcs, reward_weights=[1.0, 2.0], num_generations=4)
    got = step_advantages(gdpo.validate(), batch)
    assert torch.equal(got, normalize_then_sum(torch.stack([f1, f2], -1), [1.0, 2.0], 4))
    assert not torch.allclose(got, summed)


def test_the_entropy_bonus_is_logged_and_raises_the_entropy(make_cfg):
    """entropy_coef c: `entropy_bonus` is c times the mean entropy of the loss's tokens, which here are
    every action token (nothing masked), so c·`entropy` of the same (first) update. Same seed, with
    c = 0.5 against c = 0: after a few steps the policy's entropy is higher with the bonus; at c = 0
    nothing is logged for it."""
    entropies = {}
    for c in (0.0, 0.5):
        cfg = make_cfg(entropy_coef=c, max_steps=4, learning_rate=3e-2, prompts_per_step=2, num_generations=8,
                       micro_batch_size=16, output_dir=make_cfg().output_dir + f"-{c}")
        Trainer(cfg).train()
        rows = read_metrics(cfg.output_dir)
        if c:
            assert all(r["entropy_bonus"] == pytest.approx(c * r["entropy"], rel=1e-5) for r in rows)
        else:
            assert all("entropy_bonus" not in r for r in rows)
        entropies[c] = [r["entropy"] for r in rows]
    assert entropies[0.5][0] == pytest.approx(entropies[0.0][0], rel=1e-5)  # the same first rollout
    assert entropies[0.5][-1] > entropies[0.0][-1] + 0.05, entropies
