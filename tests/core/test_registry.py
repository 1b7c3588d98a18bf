"""The one registry mechanism (core/registry.py): register, get, names, unregister, and the registries
core builds on it."""

import pytest

from grouprl import core
from grouprl.core import Registry


def double(x):
    return 2 * x


def test_register_get_names_and_mapping_behaviour():
    r = Registry("widget", "grouprl.core.register_widget")
    assert r.register("double")(double) is double  # the decorator returns the function unchanged
    r.register("neg")(lambda x: -x)
    assert r.get("double") is double and r["double"] is double
    assert r.names() == ("double", "neg") and sorted(r) == ["double", "neg"] and len(r) == 2
    assert "neg" in r and "triple" not in r
    assert dict(r)["neg"](3) == -3
    with pytest.raises(KeyError):
        r["triple"]


def test_duplicates_are_refused_and_unknown_names_list_the_registered_ones():
    r = Registry("widget", "grouprl.core.register_widget")
    r.register("double")(double)
    with pytest.raises(ValueError, match="widget 'double' is already registered; pick another name"):
        r.register("double")(double)
    message = (r"widget 'triple' is unknown; use one of \['double'\] \(the registered widgets\), "
               r"or register one with @grouprl.core.register_widget\(name\)")
    with pytest.raises(ValueError, match=message):
        r.get("triple")
    with pytest.raises(ValueError, match=r"kind='triple' is unknown; use one of \['double'\]"):
        r.get("triple", "kind")
    with pytest.raises(ValueError, match="non-empty string"):
        r.register("")


def test_unregister_and_the_registered_context_manager_restore_the_registry():
    r = Registry("widget", "grouprl.core.register_widget")
    r.register("double")(double)
    with r.registered("neg", abs) as fn:
        assert fn is abs and r.get("neg") is abs
    assert r.names() == ("double",)
    with pytest.raises(RuntimeError), r.registered("neg", abs):
        raise RuntimeError("a failing test body still unregisters")
    assert "neg" not in r
    assert r.unregister("double") is double and len(r) == 0
    with pytest.raises(KeyError, match="'double' is not registered"):
        r.unregister("double")
    r.register("double")(double)
    del r["double"]
    assert r.names() == ()


def test_factories_are_marked_at_registration_and_unmarked_with_their_entry():
    r = Registry("widget", "grouprl.core.register_widget")
    r.register("double")(double)
    r.register("scaled", factory=True)(lambda k: lambda x: k * x)
    assert [r.is_factory(n) for n in ("double", "scaled", "triple")] == [False, True, False]
    r.unregister("scaled")
    r.register("scaled")(double)  # the name again, now as a plain entry
    assert not r.is_factory("scaled")
    with r.registered("tmp", double, factory=True):
        assert r.is_factory("tmp")
    assert not r.is_factory("tmp")


@pytest.mark.parametrize("registry, names", [
    (core.ADVANTAGE_ESTIMATORS, ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "grpo_passk", "process",
                                 "gae")),
    (core.MULTI_OBJECTIVE_AGGREGATIONS, ("sum_then_normalize", "normalize_then_sum")),
    (core.LOSS_TYPES, ("clip", "cispo", "sapo", "gmpo")),
    (core.RATIO_LEVELS, ("token", "sequence")),
    (core.LOSS_AGGREGATIONS, ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")),
    (core.KL_ESTIMATORS, ("k1", "k2", "k3")),
    (core.IS_MODES, ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")),
    (core.TOKEN_MASKS, ("entropy_mask", "off_policy_mask")),
    (core.DISTILL_SIGNALS, ("reverse_kl",)),
])
def test_core_registries_hold_the_built_in_variants(registry, names):
    assert isinstance(registry, Registry) and registry.names() == names


@pytest.mark.parametrize("register, registry", [
    (core.register_loss_type, core.LOSS_TYPES),
    (core.register_ratio_level, core.RATIO_LEVELS),
    (core.register_loss_agg, core.LOSS_AGGREGATIONS),
    (core.register_is_mode, core.IS_MODES),
])
def test_the_public_register_functions_are_the_registries_register(register, registry):
    try:
        assert register("test_only")(double) is double and registry.get("test_only") is double
    finally:
        registry.unregister("test_only")
