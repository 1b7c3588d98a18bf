"""The built-in addition task: splits, answers, format reward."""

import pytest

from grouprl.tasks import arithmetic
from grouprl.tasks.arithmetic import EVAL_SIZE, eval_rows, format_reward, make_dataset, operands, train_rows


def test_split_sizes_and_no_overlap():
    train, held_out = train_rows(), eval_rows()
    assert len(held_out) == EVAL_SIZE == 200
    assert len(train) == 100 * 100 - 200
    train_prompts = {r["prompt"] for r in train}
    assert len(train_prompts) == len(train)  # no duplicates
    assert not train_prompts & {r["prompt"] for r in held_out}


def test_rows_are_deterministic():
    assert train_rows() == train_rows()
    assert eval_rows() == eval_rows()
    assert make_dataset(50, seed=7) == make_dataset(50, seed=7)
    assert make_dataset(50, seed=7) != make_dataset(50, seed=8)


def test_answers_are_the_sums():
    for row in train_rows()[:500] + eval_rows() + make_dataset(100, seed=0):
        a, b = operands(row["prompt"])
        assert 0 <= a <= 99 and 0 <= b <= 99
        assert row["answer"] == str(a + b)
        assert row["prompt"] == f"{a:02d}+{b:02d}="


def test_make_dataset_draws_only_training_problems():
    held_out = {r["prompt"] for r in eval_rows()}
    rows = make_dataset(2000, seed=1)
    assert len(rows) == 2000 and set(rows[0]) == {"prompt", "answer"}
    assert not held_out & {r["prompt"] for r in rows}
    with pytest.raises(ValueError, match="n=-1"):
        make_dataset(-1, seed=0)


def test_eval_set_mixes_carry_and_no_carry_problems():
    """The default demo needs both: carries are where the shipped policy starts wrong."""
    carries = sum((a % 10 + b % 10) >= 10 or (a // 10 + b // 10) >= 10
                  for a, b in (operands(r["prompt"]) for r in eval_rows()))
    assert 0.5 < carries / EVAL_SIZE < 0.85  # about 70 % of all pairs carry somewhere


def test_format_reward_on_strings():
    completions = ["125", " 42\n", "12a", "", "1 2", "-3", "answer: 4"]
    assert format_reward(["1+2="] * len(completions), completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_format_reward_on_messages_and_extra_columns():
    completions = [
        [{"role": "assistant", "content": "17"}],
        [{"role": "assistant", "content": "seventeen"}],
    ]
    assert format_reward(prompts=[[{"role": "user", "content": "8+9="}]] * 2, completions=completions,
                         answer=["17", "17"]) == [1.0, 0.0]


def test_format_reward_rejects_unknown_completion_types():
    with pytest.raises(TypeError, match="expected a string"):
        format_reward(["1+1="], [42])


def test_prompt_template_is_the_one_operands_parses():
    assert operands(arithmetic.PROMPT_TEMPLATE.format(a=7, b=93)) == (7, 93)
