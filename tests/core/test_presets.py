"""Presets against the ALGORITHMS.md table, and their values valid for the core functions."""

import pytest
import torch

from grouprl.core import (
    ADVANTAGE_ESTIMATORS,
    LOSS_AGGREGATIONS,
    PRESET_KEYS,
    PRESETS,
    RATIO_LEVELS,
    compute_advantages,
    get_preset,
    policy_loss,
)

# transcribed from the "Named presets" table of ALGORITHMS.md
TABLE = {
    # name: (estimator, scale, agg, eps_low, eps_high, beta, ratio level, dynamic sampling, overlong)
    "grpo": ("grpo", "group", "seq-mean-token-mean", 0.2, 0.2, 0.04, "token", False, False),
    "dr_grpo": ("grpo", "none", "seq-mean-token-sum-norm", 0.2, 0.2, 0.0, "token", False, False),
    "dapo": ("grpo", "group", "token-mean", 0.2, 0.28, 0.0, "token", True, True),
    "gspo": ("grpo", "group", "seq-mean-token-mean", 3e-4, 4e-4, 0.0, "sequence", False, False),
    "rloo": ("rloo", "none", "token-mean", 0.2, 0.2, 0.0, "token", False, False),
}


@pytest.mark.parametrize("name", sorted(TABLE))
def test_preset_matches_table(name):
    assert get_preset(name) == dict(zip(PRESET_KEYS, TABLE[name]))


def test_exact_keys_and_names():
    assert set(PRESETS) == set(TABLE)
    assert PRESET_KEYS == ("advantage_estimator", "scale_rewards", "loss_agg", "epsilon", "epsilon_high", "beta",
                           "importance_sampling_level", "dynamic_sampling", "overlong_shaping")
    for preset in PRESETS.values():
        assert tuple(preset) == PRESET_KEYS


@pytest.mark.parametrize("name", sorted(TABLE))
def test_preset_values_drive_the_core(name):
    p = get_preset(name)
    assert p["advantage_estimator"] in ADVANTAGE_ESTIMATORS
    assert p["loss_agg"] in LOSS_AGGREGATIONS and p["importance_sampling_level"] in RATIO_LEVELS
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    adv = compute_advantages(p["advantage_estimator"], rewards, 3, scale=p["scale_rewards"])  # [N]
    logp = -torch.rand(6, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    loss, stats = policy_loss(logp, logp.detach(), adv, torch.ones(6, 4), eps_low=p["epsilon"],
                              eps_high=p["epsilon_high"], ratio_level=p["importance_sampling_level"],
                              agg=p["loss_agg"], max_tokens=4, beta=p["beta"], ref_logp=logp.detach())
    assert torch.isfinite(loss) and stats["clip_frac"] == 0.0


def test_get_preset_returns_a_copy():
    p = get_preset("dapo")
    p["beta"] = 1.0
    assert PRESETS["dapo"]["beta"] == 0.0


def test_unknown_preset_lists_known():
    with pytest.raises(ValueError, match="unknown algorithm preset 'ppo'.*grpo, dr_grpo, dapo, gspo, rloo"):
        get_preset("ppo")
