"""Presets against the docs/algorithms.md table, and their values valid for the core functions."""

import pytest
import torch

from grouprl.core import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    LOSS_AGGREGATIONS,
    PRESET_KEYS,
    PRESETS,
    RATIO_LEVELS,
    aggregate_loss,
    compute_advantages,
    get_preset,
    policy_loss,
)

# transcribed from the "Named presets" table of docs/algorithms.md and the README's algorithm table
TABLE = {
    # name: (estimator, scale, agg, eps_low, eps_high, beta, ratio level, dynamic sampling, overlong,
    #        loss type, multi-objective aggregation, top-entropy quantile, off-policy mask δ,
    #        distillation λ, the verifier advantages' weight when distilling, value head)
    "grpo": ("grpo", "group", "seq-mean-token-mean", 0.2, 0.2, 0.04, "token", False, False),
    "dr_grpo": ("grpo", "none", "seq-mean-token-sum-norm", 0.2, 0.2, 0.0, "token", False, False),
    "dapo": ("grpo", "group", "token-mean", 0.2, 0.28, 0.0, "token", True, True),
    "gspo": ("grpo", "group", "seq-mean-token-mean", 3e-4, 4e-4, 0.0, "sequence", False, False),
    "gmpo": ("grpo", "group", "seq-mean-token-mean", 0.4, 0.4, 0.0, "token", False, False, "gmpo"),
    "rloo": ("rloo", "none", "seq-mean-token-sum", 0.2, 0.2, 0.0, "token", False, False),
    "cispo": ("grpo", "group", "token-mean", 1.0, 4.0, 0.0, "token", False, False, "cispo"),
    "sapo": ("grpo", "group", "seq-mean-token-mean", 0.2, 0.2, 0.0, "token", False, False, "sapo"),
    "bnpo": ("grpo", "group", "token-mean", 0.2, 0.2, 0.0, "token", False, False),
    "gdpo": ("grpo", "group", "seq-mean-token-mean", 0.2, 0.2, 0.0, "token", False, False, "clip",
             "normalize_then_sum"),
    "top_entropy": ("grpo", "group", "token-mean", 0.2, 0.28, 0.0, "token", True, True, "clip",
                    "sum_then_normalize", 0.2),
    "opsm": ("grpo", "group", "seq-mean-token-mean", 0.2, 0.2, 0.0, "token", False, False, "clip",
             "sum_then_normalize", 1.0, 0.5),
    "reinforce_pp": ("reinforce_pp", "batch", "token-mean", 0.2, 0.2, 0.0, "token", False, False),
    "reinforce_pp_baseline": ("reinforce_pp_baseline", "batch", "token-mean", 0.2, 0.2, 0.0, "token", False, False),
    "grpo_passk": ("grpo_passk", "none", "token-mean", 0.2, 0.2, 0.0, "token", False, False),
    "on_policy_distill": ("grpo", "group", "token-mean", 0.2, 0.2, 0.0, "token", False, False, "clip",
                          "sum_then_normalize", 1.0, None, 1.0, 0.0),
    "ppo": ("gae", "batch", "token-mean", 0.2, 0.2, 0.0, "token", False, False, "clip", "sum_then_normalize", 1.0,
            None, 0.0, 1.0, True),
}
DEFAULTS = ("clip", "sum_then_normalize", 1.0, None, 0.0, 1.0, False)  # loss type .. value head when not listed


def row(name):
    values = TABLE[name]
    return values + DEFAULTS[len(values) - 9:]


@pytest.mark.parametrize("name", sorted(TABLE))
def test_preset_matches_table(name):
    assert get_preset(name) == dict(zip(PRESET_KEYS, row(name)))


def test_exact_keys_and_names():
    assert set(PRESETS) == set(TABLE)
    assert PRESET_KEYS == ("estimator", "scale", "agg", "eps_low", "eps_high", "beta", "ratio_level",
                           "dynamic_sampling", "overlong_shaping", "loss_type", "multi_objective", "entropy_quantile",
                           "off_policy_threshold", "distill_coef", "distill_reward_coef", "value_head")
    for preset in PRESETS.values():
        assert tuple(preset) == PRESET_KEYS


@pytest.mark.parametrize("name", sorted(TABLE))
def test_preset_values_drive_the_core(name):
    p = get_preset(name)
    assert p["estimator"] in ADVANTAGE_ESTIMATORS
    assert p["agg"] in LOSS_AGGREGATIONS and p["ratio_level"] in RATIO_LEVELS
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    if p["value_head"]:  # GAE reads a value function's estimates: here V = 0.5 on every token
        inputs = AdvantageInputs(rewards, 3, values=torch.full((6, 4), 0.5), token_mask=torch.ones(6, 4, dtype=bool))
        adv = ADVANTAGE_ESTIMATORS.get(p["estimator"])(inputs, scale=p["scale"], eps=1e-4, unbiased=True)  # [N, T]
    else:
        adv = compute_advantages(p["estimator"], rewards, 3, scale=p["scale"])  # [N]
    logp = -torch.rand(6, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    loss, stats = policy_loss(logp, logp.detach(), adv, torch.ones(6, 4), eps_low=p["eps_low"],
                              eps_high=p["eps_high"], ratio_level=p["ratio_level"],
                              agg=p["agg"], max_tokens=4, beta=p["beta"], ref_logp=logp.detach(),
                              loss_type=p["loss_type"])
    assert torch.isfinite(loss) and stats["clip_frac"] == 0.0


def test_get_preset_returns_a_copy():
    p = get_preset("dapo")
    p["beta"] = 1.0
    assert PRESETS["dapo"]["beta"] == 0.0


def test_unknown_preset_lists_known():
    with pytest.raises(ValueError, match="unknown algorithm preset 'trpo'.*grpo, dr_grpo, dapo, gspo, rloo"):
        get_preset("trpo")


def test_bnpo_is_token_mean_over_the_whole_batch():
    """BNPO's batch-token normaliser is grouprl's token-mean: the normaliser counts the whole optimizer
    batch. Per-token losses, micro-batch A: [1] (1 token), B: [2, 2, 2] (3 tokens). The batch: (1 + 6)/4
    = 1.75, and the micro-batches with normalizer = 4 give 1/4 + 6/4 = 1.75 too. TRL's bnpo divides each
    micro-batch by its own count and averages over the accumulation steps: (1/1 + 6/3)/2 = 1.5."""
    p = get_preset("bnpo")
    assert p["agg"] == "token-mean" and p["loss_type"] == "clip"
    loss = torch.tensor([[1.0, 0, 0], [2, 2, 2]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    full = aggregate_loss(loss, mask, p["agg"]).item()
    micro = sum(aggregate_loss(loss[i:i + 1], mask[i:i + 1], p["agg"], normalizer=4).item() for i in (0, 1))
    assert full == micro == 1.75
    local = sum(aggregate_loss(loss[i:i + 1], mask[i:i + 1], p["agg"]).item() for i in (0, 1)) / 2
    assert local == 1.5


def test_rloo_takes_the_papers_gradient_each_completion_one_action():
    """RLOO (Ahmadian et al. 2024; TRL's RLOOTrainer) treats a completion as one action: the loss is
    the mean over completions of the clipped A_i·exp(Σ_t log π − Σ_t log π_old). On-policy its gradient
    is (1/N)·A_i on every token of completion i, whatever the lengths; the preset's loss has that
    gradient exactly (token-mean's would be scaled by N/Σ|o_i|, which changes from batch to batch)."""
    p = get_preset("rloo")
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]]).bool()
    old = -torch.rand(4, 6, generator=gen)
    adv = compute_advantages("rloo", torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, scale=p["scale"])  # [2/3, -2/3, ...]

    def rloo_reference(logp):
        ratio = torch.exp(((logp - old) * mask).sum(-1))  # [N] the whole completion's ratio
        return -torch.min(ratio * adv, ratio.clamp(1 - p["eps_low"], 1 + p["eps_high"]) * adv).mean()

    grads = []
    for loss_of in (rloo_reference, lambda logp: policy_loss(
            logp, old, adv, mask, eps_low=p["eps_low"], eps_high=p["eps_high"], ratio_level=p["ratio_level"],
            agg=p["agg"], beta=p["beta"], loss_type=p["loss_type"])[0]):
        logp = old.clone().requires_grad_(True)
        loss_of(logp).backward()
        grads.append(logp.grad * mask)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-7)
    torch.testing.assert_close(grads[1][mask], (-adv[:, None] / 4).expand(4, 6)[mask])
