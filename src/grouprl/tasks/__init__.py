"""Built-in tasks. The embedded default: a small shipped policy learning two-number addition.

`grouprl train` with no arguments trains `DEFAULT_POLICY_DIR` (built from scratch by
`scripts/build_default_policy.py`) on `builtin:arithmetic/train` and evaluates greedy
accuracy on the 200 held-out prompts of `builtin:arithmetic/eval`, before and after.
The policy starts out dropping carries on greedy decoding while sampling still finds the
right sum (see the script's docstring), so GRPO visibly lifts held-out accuracy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grouprl.tasks import arithmetic

DEFAULT_POLICY_DIR = Path(__file__).resolve().parent / "default_policy"

BUILTIN_DATASETS = {
    "arithmetic/train": arithmetic.train_rows,
    "arithmetic/eval": arithmetic.eval_rows,
}

DEFAULT_TASK: dict[str, Any] = dict(
    model=str(DEFAULT_POLICY_DIR),
    train_data="builtin:arithmetic/train",
    eval_data="builtin:arithmetic/eval",
    reward_funcs=["math_accuracy", "grouprl.tasks.arithmetic:format_reward"],
    reward_weights=[1.0, 0.2],
)


def builtin_dataset(name: str) -> list[dict[str, str]]:
    """Rows of a built-in dataset, by name with or without the `builtin:` prefix (e.g. "arithmetic/train")."""
    key = name.removeprefix("builtin:")
    if key not in BUILTIN_DATASETS:
        raise ValueError(f"unknown built-in dataset {name!r}: use one of {sorted(BUILTIN_DATASETS)}")
    return BUILTIN_DATASETS[key]()
