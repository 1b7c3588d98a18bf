"""verify_math / math_accuracy against the bundled cases and the trainer's contract."""

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from importlib import resources

import pytest

from grouprl.rewards import extract_answer, math_accuracy, verify_math

CASES = [json.loads(line) for line in resources.files("grouprl.rewards").joinpath("data/math_cases.jsonl")
         .read_text().splitlines() if line.strip()]


def test_bundled_set_is_large_and_balanced():
    assert len(CASES) >= 200
    expected = [c["expected"] for c in CASES]
    assert expected.count(1) > 50 and expected.count(0) > 50 and expected.count(None) >= 5


@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{c['note']}" for i, c in enumerate(CASES)])
def test_bundled_case(case):
    assert verify_math(case["completion"], case["gold"]) == case["expected"]


def test_cases_agree_off_the_main_thread():
    """math-verify's signal-based timeouts only work on the main thread; in a pool we run without them."""
    sample = CASES[::7]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda c: verify_math(c["completion"], c["gold"]), sample))
    assert got == [c["expected"] for c in sample]
    assert threading.current_thread() is threading.main_thread()


@pytest.mark.parametrize(
    "text, answer",
    [("<think>a</think><answer> 7 </answer>", "7"), ("so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
     ("x\n#### 1,250\nmore", "1,250"), ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"), ("just text 3", "just text 3")],
)
def test_extract_answer(text, answer):
    assert extract_answer(text)[0] == answer


def test_math_accuracy_strings_messages_and_columns():
    completions = ["42", "41", [{"role": "assistant", "content": "The answer is \\boxed{42}"}], "42"]
    prompts = ["What is 12+30? Answer: "] * 3 + [[{"role": "user", "content": "12+30?"}]]
    assert math_accuracy(prompts, completions, answer=["42", "42", "42", None]) == [1.0, 0.0, 1.0, None]
    # TRL datasets name the gold column `solution`; unknown columns are ignored
    assert math_accuracy(prompts[:2], completions[:2], solution=["#### 42", "#### 42"], extra=[1, 2]) == [1.0, 0.0]


def test_math_accuracy_without_gold_column_names_the_columns():
    with pytest.raises(ValueError, match="'answer' or 'solution'"):
        math_accuracy(["p"], ["1"], question=["q"])


@pytest.mark.parametrize("garbage", ["E7170", "e5", "+E3", "-.e2", ".", "1,2,3e", "E7170 s14 o1111"])
def test_garbage_from_a_collapsed_policy_scores_0_and_never_raises(garbage):
    """Found by benchmarks/run_health.py: a policy wrecked by 100x its learning rate answered 'E7170',
    which the number pattern took for an exponent without a mantissa, and Fraction() raised; the run
    stopped in the reward function."""
    assert verify_math(garbage, "12") == 0.0
