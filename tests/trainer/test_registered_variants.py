"""A variant registered in a core registry is a first-class config value: validation accepts it, the
trainer reaches it, and an unknown name is answered with the registered ones. Each test registers its
variants in a fixture that unregisters them, so the registries are left as they were found."""

import pytest
import torch

from grouprl import objective
from grouprl.config import PRESET_FIELDS, ConfigError, TrainConfig
from grouprl.core import (ADVANTAGE_ESTIMATORS, LOSS_TYPES, PRESET_KEYS, PRESETS, group_advantages,
                          register_advantage_estimator)
from grouprl.trainer import Trainer


@pytest.fixture
def sign_estimator():
    """An outcome estimator: the sign of the group-centred reward. Yields the rewards it was called with."""
    calls = []

    def sign(rewards, group_size, *, scale, eps, unbiased):
        calls.append(rewards.clone())
        return torch.sign(group_advantages(rewards, group_size, scale="none"))  # [N]

    register_advantage_estimator("test_sign")(sign)
    yield calls
    ADVANTAGE_ESTIMATORS.unregister("test_sign")


@pytest.fixture
def reinforce_term():
    """A policy term: plain REINFORCE, −A·log π. Yields the advantages it was called with."""
    calls = []

    def reinforce(logp, ratio, adv, params):
        calls.append(adv.detach().clone())
        return -adv * logp, {"test_reinforce_frac": adv != 0}

    with LOSS_TYPES.registered("test_reinforce", reinforce):
        yield calls


def test_validation_accepts_registered_variants_and_the_trainer_reaches_them(make_cfg, sign_estimator,
                                                                              reinforce_term):
    cfg = make_cfg(advantage_estimator="test_sign", loss_type="test_reinforce", max_steps=1)
    resolved = cfg.validate()
    assert (resolved.advantage_estimator, resolved.loss_type) == ("test_sign", "test_reinforce")
    assert objective.policy_loss_params(resolved).loss_type == "test_reinforce"
    Trainer(cfg).train()
    n = cfg.prompts_per_step * cfg.num_generations
    assert len(sign_estimator) == 1 and sign_estimator[0].shape == (n,)
    assert reinforce_term and all(((a == 0) | (a.abs() == 1)).all() for a in reinforce_term)  # the signs


def test_step_advantages_looks_the_estimator_up(make_cfg, sign_estimator):
    from types import SimpleNamespace

    rewards = torch.tensor([2.0, 0.0, 1.0, 1.0, 3.0, 3.0, 0.0, 5.0])
    batch = SimpleNamespace(rewards=rewards, per_func={"digit_fraction": rewards}, steps=None)
    got = objective.step_advantages(make_cfg(advantage_estimator="test_sign").validate(), batch)
    assert got.tolist() == [1.0, -1.0, 0.0, 0.0, 1.0, 1.0, -1.0, 1.0]
    assert torch.equal(sign_estimator[0], rewards)


def test_unknown_names_list_the_registered_ones_and_how_to_register(make_cfg, reinforce_term):
    with pytest.raises(ConfigError, match=r"advantage_estimator='ppo' is not one of: grpo, rloo, reinforce_pp, "
                                          r"reinforce_pp_baseline, grpo_passk, process, gae; register a new one with "
                                          r"@grouprl.core.register_advantage_estimator\(name\)"):
        make_cfg(advantage_estimator="ppo").validate()
    with pytest.raises(ConfigError, match="loss_type='ppo' is not one of: clip, cispo, sapo, gmpo, test_reinforce; "
                                          "register a new one with @grouprl.core.register_loss_type"):
        make_cfg(loss_type="ppo").validate()
    for field, registry in [("kl_estimator", "KL_ESTIMATORS"), ("loss_agg", "register_loss_agg"),
                            ("importance_sampling_level", "register_ratio_level"),
                            ("vllm_importance_sampling_mode", "register_is_mode"),
                            ("multi_objective_aggregation", "MULTI_OBJECTIVE_AGGREGATIONS")]:
        with pytest.raises(ConfigError, match=f"{field}='nope' is not one of: .*grouprl.core.{registry}"):
            make_cfg(**{field: "nope"}).validate()


def test_an_unregistered_variant_is_refused_again(make_cfg):
    with ADVANTAGE_ESTIMATORS.registered("test_tmp", lambda inputs, **kw: inputs.rewards):
        make_cfg(advantage_estimator="test_tmp").validate()
    with pytest.raises(ConfigError, match="advantage_estimator='test_tmp' is not one of"):
        make_cfg(advantage_estimator="test_tmp").validate()


def test_presets_in_core_names_fill_the_config_fields(make_cfg):
    """core/presets.py speaks core's parameter names; config.PRESET_FIELDS maps each onto a field."""
    fields = {f.name for f in TrainConfig.__dataclass_fields__.values()}
    assert set(PRESET_FIELDS) == set(PRESET_KEYS) and set(PRESET_FIELDS.values()) <= fields
    for name, preset in PRESETS.items():
        cfg = make_cfg(algorithm=name, beta=None).resolved()
        assert {PRESET_FIELDS[k]: getattr(cfg, PRESET_FIELDS[k]) for k in preset} == {
            PRESET_FIELDS[k]: v for k, v in preset.items()}, name
