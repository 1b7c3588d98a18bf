import json
from pathlib import Path

import pytest

from grouprl.config import TrainConfig
from grouprl.tasks.testing import save_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random-init 0.5 M-parameter Qwen2 with the character tokenizer, saved once per session."""
    return save_tiny_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def digits_data(tmp_path_factory) -> Path:
    """Prompts whose reward (below) is the fraction of digits in the completion."""
    path = tmp_path_factory.mktemp("data") / "digits.jsonl"
    rows = [{"prompt": f"Say numbers {i}: ", "answer": str(i)} for i in range(64)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def digit_fraction(prompts, completions, **kwargs):
    """A dense reward a random model can climb: the share of digit characters."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def always_one(prompts, completions, **kwargs):
    """Every completion right: every group flat."""
    return [1.0] * len(completions)


def short_reward(prompts, completions, **kwargs):
    return [1.0 - len(text) / 16 for text in completions]


@pytest.fixture
def make_cfg(tiny_model_dir, digits_data, tmp_path):
    def make(**overrides) -> TrainConfig:
        values = dict(
            model=str(tiny_model_dir), train_data=str(digits_data),
            reward_funcs=["tests.trainer.conftest:digit_fraction"], num_generations=4,
            prompts_per_step=4, micro_batch_size=8, max_completion_length=12, learning_rate=3e-3,
            max_steps=3, output_dir=str(tmp_path / "run"), progress=False, seed=0,
            report_to=[], beta=0.0,
            bf16=False,  # the same numbers on every CPU; bf16 auto is tested on its own
        )
        values.update(overrides)
        return TrainConfig(**values)

    return make


def read_metrics(output_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def no_model_loading(monkeypatch):
    """A config error must come before any model loads (the policy's or a teacher's): loading one
    fails the test."""
    import grouprl.distillation
    import grouprl.trainer

    def fail(*a, **k):
        raise AssertionError("a model was loaded before the config error was raised")

    for module in (grouprl.trainer, grouprl.distillation):
        monkeypatch.setattr(module, "load_policy", fail)
    return fail


@pytest.fixture
def no_tokenizer_loading(monkeypatch, no_model_loading):
    """Nor any tokenizer, for errors that need none."""
    import grouprl.trainer

    monkeypatch.setattr(grouprl.trainer, "policy_tokenizer", no_model_loading)
