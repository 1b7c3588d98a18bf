"""Named algorithm presets (ALGORITHMS.md, "Named presets"), as plain data.

Keys are the trainer's config field names; every value stays overridable by the user.

| preset  | advantage        | aggregation             | ε_low / ε_high | β    | extras                              |
|---------|------------------|-------------------------|----------------|------|-------------------------------------|
| grpo    | group std        | seq-mean-token-mean     | 0.2 / 0.2      | 0.04 | —                                   |
| dr_grpo | none (mean only) | seq-mean-token-sum-norm | 0.2 / 0.2      | 0    | —                                   |
| dapo    | group std        | token-mean              | 0.2 / 0.28     | 0    | dynamic sampling, overlong shaping  |
| gspo    | group std        | seq-mean-token-mean     | 3e-4 / 4e-4    | 0    | sequence-level ratio                |
| rloo    | leave-one-out    | token-mean              | 0.2 / 0.2      | 0    | —                                   |

Sources: DeepSeekMath (grpo), arXiv 2503.20783 (dr_grpo), arXiv 2503.14476 (dapo),
arXiv 2507.18071 (gspo), Ahmadian et al. 2024 (rloo). rloo uses scale_rewards="none": the
leave-one-out advantage unscaled, as in the paper.
"""

from __future__ import annotations

from typing import Any

PRESET_KEYS = ("advantage_estimator", "scale_rewards", "loss_agg", "epsilon", "epsilon_high", "beta",
               "importance_sampling_level", "dynamic_sampling", "overlong_shaping")


def _preset(advantage_estimator: str, scale_rewards: str, loss_agg: str, epsilon: float,
            epsilon_high: float, beta: float, importance_sampling_level: str = "token",
            dynamic_sampling: bool = False, overlong_shaping: bool = False) -> dict[str, Any]:
    return dict(advantage_estimator=advantage_estimator, scale_rewards=scale_rewards,
                loss_agg=loss_agg, epsilon=epsilon, epsilon_high=epsilon_high, beta=beta,
                importance_sampling_level=importance_sampling_level,
                dynamic_sampling=dynamic_sampling, overlong_shaping=overlong_shaping)


PRESETS: dict[str, dict[str, Any]] = {
    "grpo": _preset("grpo", "group", "seq-mean-token-mean", 0.2, 0.2, 0.04),
    "dr_grpo": _preset("grpo", "none", "seq-mean-token-sum-norm", 0.2, 0.2, 0.0),
    "dapo": _preset("grpo", "group", "token-mean", 0.2, 0.28, 0.0,
                    dynamic_sampling=True, overlong_shaping=True),
    "gspo": _preset("grpo", "group", "seq-mean-token-mean", 3e-4, 4e-4, 0.0,
                    importance_sampling_level="sequence"),
    "rloo": _preset("rloo", "none", "token-mean", 0.2, 0.2, 0.0),
}


def get_preset(name: str) -> dict[str, Any]:
    """A copy of preset ``name`` (mutating it leaves ``PRESETS`` intact)."""
    if name not in PRESETS:
        raise ValueError(f"unknown algorithm preset {name!r}; known presets: {', '.join(PRESETS)}")
    return dict(PRESETS[name])
