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

from grouprl.tasks import arithmetic, chain, chat_arithmetic, products

DEFAULT_POLICY_DIR = Path(__file__).resolve().parent / "default_policy"
TOOL_POLICY_DIR = Path(__file__).resolve().parent / "tool_policy"

BUILTIN_DATASETS = {
    "arithmetic/train": arithmetic.train_rows,
    "arithmetic/eval": arithmetic.eval_rows,
    "products/train": products.train_rows,
    "products/eval": products.eval_rows,
    "chat_arithmetic/train": chat_arithmetic.train_rows,  # chat prompts for a pretrained instruct model
    "chat_arithmetic/eval": chat_arithmetic.eval_rows,
    "chain/train": chain.train_rows,  # process supervision: one step per partial sum (chain.py)
    "chain/eval": chain.eval_rows,
}

DEFAULT_TASK: dict[str, Any] = dict(
    model=str(DEFAULT_POLICY_DIR),
    train_data="builtin:arithmetic/train",
    eval_data="builtin:arithmetic/eval",
    reward_funcs=["math_accuracy", "grouprl.tasks.arithmetic:format_reward"],
    reward_weights=[1.0, 0.2],
    # Measured with `scripts/build_default_policy.py --skip-build --check-rl --rl-lr 1e-4`
    # (on-policy GRPO, group-std advantages, seq-mean-token-mean, no KL): held-out greedy
    # accuracy 24.5 % -> 49.5 % after 10 steps, 84 % after 20, 98.5 % after 100, in 85 s of
    # wall time on a shared 2-core machine (one torch thread). lr 2e-4 gets there in 25 steps;
    # 1e-3 collapses the policy. Answers are at most 3 digits + EOS, hence 6 tokens.
    # Through the trainer (`grouprl train`, beta 0.04): 24.5 % -> 99.0 % in 28 s of wall time.
    num_generations=8,
    prompts_per_step=16,
    max_completion_length=6,
    learning_rate=1e-4,
    temperature=1.0,
    max_steps=100,
    beta=0.04,  # GRPO's KL penalty: the demo shows the KL curve; measured no slower to learn
    eval_steps=10,  # an eval of the 200 held-out prompts costs ~0.15 s: draw the accuracy curve
    micro_batch_size=128,  # the whole step (16 x 8 short completions) in one forward/backward
    # One thread: a 0.5 M-parameter model gains little from a second one, and when another
    # process shares the 2 cores, two threads made a warm-up step 10x slower (4.4 s vs 0.44 s).
    num_threads=1,
    # fp32 on every machine, so the README's curve is the one `make demo` prints anywhere; on a CPU
    # with native bf16 `--bf16 auto` took 0.8x the time for 98.5 % instead of 99.5 % (the same seed).
    bf16=False,
)


# The embedded tool-use task (tasks/products.py): products the policy cannot compute, a calculator
# tool it can call. Measured figures: README, "Tools and multi-turn rollouts".
TOOL_TASK: dict[str, Any] = dict(
    model=str(TOOL_POLICY_DIR),
    train_data="builtin:products/train",
    eval_data="builtin:products/eval",
    tools=["grouprl.tasks.products:mul"],
    reward_funcs=["grouprl.tasks.products:product_accuracy", "grouprl.tasks.products:correct_tool_use"],
    reward_weights=[1.0, 0.0],  # correct_tool_use is logged (rewards/correct_tool_use/mean), not rewarded
    max_turns=2,
    max_tool_calls=1,
    tool_timeout_s=5.0,
    num_generations=8,
    prompts_per_step=16,
    max_completion_length=80,  # the call (~52 tokens), the result (~7) and the answer (~6)
    learning_rate=3e-4,
    temperature=1.0,
    max_steps=30,
    beta=0.0,
    eval_steps=10,
    micro_batch_size=64,
    num_threads=1,
    bf16=False,  # fp32 on every machine: the documented figures, as for DEFAULT_TASK
)


def builtin_dataset(name: str) -> list[dict[str, str]]:
    """Rows of a built-in dataset, by name with or without the `builtin:` prefix (e.g. "arithmetic/train")."""
    key = name.removeprefix("builtin:")
    if key not in BUILTIN_DATASETS:
        raise ValueError(f"unknown built-in dataset {name!r}: use one of {sorted(BUILTIN_DATASETS)}")
    return BUILTIN_DATASETS[key]()
