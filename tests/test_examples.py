"""Every shipped example config parses, validates, and names reward functions that exist."""

from pathlib import Path

import pytest

from grouprl.config import TrainConfig
from grouprl.rewards import resolve_reward_func

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_is_valid(path):
    cfg = TrainConfig.load(path).validate()  # values only: the loaders probe the paths
    for spec in cfg.reward_funcs:
        params = dict(spec) if isinstance(spec, dict) else {"name": spec}
        assert callable(resolve_reward_func(params.pop("name"), **params))


def test_there_are_examples():
    assert len(EXAMPLES) >= 2
