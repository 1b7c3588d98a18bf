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


@pytest.mark.parametrize("completion, gold, expected", [
    ("It is 42", "42", 1.0), ("x is 7", "7", 1.0), ("So 42", "42", 1.0), ("It is 0.5", "0.5", 1.0),
    ("It is 42", "4", 0.0),
    # a short word only prose uses, not a product of variables or a segment: these stay one expression
    ("\\boxed{xy}", "x*y", 1.0), ("\\boxed{AB}", "AB", 1.0), ("no", "no", 1.0),
])
def test_short_sentence_is_read_by_its_final_answer(completion, gold, expected):
    """Audit set A: with no word of 3+ letters, "It is 42" was parsed as one expression, I*t*i*s*42,
    and scored 0 against 42. "It", "is", "So" are prose; the text is read by its last number, 42."""
    assert verify_math(completion, gold) == expected


@pytest.mark.parametrize("completion, gold, expected", [
    ("The answer is \\frac{3}{4}.", "3/4", 1.0), ("The answer is \\frac{3}{4}.", "3", 0.0),
    ("The answer is \\frac{3}{4}.", "4", 0.0), ("The answer is \\sqrt{2}.", "\\sqrt{2}", 1.0),
    ("The answer is \\sqrt{2}.", "2", 0.0), ("The answer is 10^{3}", "1000", 1.0), ("The answer is 10^{3}", "10", 0.0),
    ("The answer is x^2 + 1", "x^2 + 1", 1.0), ("The answer is x^2 + 1", "2", 0.0),
    ("Therefore the result is \\frac{3}{4}", "3/4", 1.0), ("Therefore the result is \\frac{3}{4}", "4", 0.0),
    ("So x = \\frac{3}{4}", "4", 0.0), ("After 3 days she has 10^{3} coins", "1000", 1.0),
    ("The answer is \\frac{3}{4} \\text{ cups}.", "3/4", 1.0), ("The answer is \\frac{3}{4} \\text{ cups}.", "3", 0.0),
    # plain numbers keep their reading: the final one, words and units around it left out
    ("I first tried 12, then found the total is 15.", "15", 1.0),
    ("I first tried 12, then found the total is 15.", "12", 0.0),
    ("The answer is 15, not 12.", "15", 1.0), ("The answer is 15, not 12.", "12", 0.0),
    ("The answer is 3 \\text{cm}.", "3", 1.0), ("The answer is \\text{3 apples}", "3", 1.0),
])
def test_bare_latex_in_free_text_is_read_whole(completion, gold, expected):
    """Audit set B: bare LaTeX in free text was read by a number inside it, "\\frac{3}{4}" by its 3
    (after "answer is") or its 4 (as the last number), "10^{3}" by 10: wrong answers scored 1. The
    number is now read with the bare math around it, up to a prose word, "=" or a sentence break,
    and math-verify parses that whole: 3/4, 1000, sqrt(2)."""
    assert verify_math(completion, gold) == expected


@pytest.mark.parametrize("completion, gold, expected", [
    ("The answer is 83 + 26 = 109.", "109", 1.0), ("The answer is 83 + 26 = 109.", "83", 0.0),
    ("The answer is 2 + 3 = 5 = 5.", "5", 1.0), ("The answer is 12 \u00d7 3 = 36 apples.", "36", 1.0),
    ("The answer is 5. Check: 2 + 3 = 5", "5", 1.0),  # a plain number after the phrase is the answer
    ("The answer is 7 + 1. Then = 9", "8", 0.0),  # a sentence ends the computation: no "= 9" read into it
])
def test_a_computation_after_answer_is_is_read_by_what_it_comes_to(completion, gold, expected):
    """After "the answer is", "83 + 26 = 109" is 109, not its first number 83; the chain of "=" is
    followed within the sentence only, and only from arithmetic (a plain number is the answer)."""
    assert verify_math(completion, gold) == expected


@pytest.mark.parametrize("completion, gold, expected", [
    ("the answer is \u22125", "-5", 1.0), ("the answer is \u22125", "5", 0.0), ("Final: \u221212", "12", 0.0),
    ("\uff0d5", "-5", 1.0), ("\ufe635", "-5", 1.0), ("\\boxed{-5}", "\u22125", 1.0),
])
def test_unicode_minus_is_a_minus(completion, gold, expected):
    """Audit set C: U+2212 (and the small / full-width hyphen-minus U+FE63, U+FF0D) was dropped in free
    text, so "the answer is \u22125" read 5. They are read as "-" on both sides: -5."""
    assert verify_math(completion, gold) == expected


@pytest.mark.parametrize("completion, gold, expected", [
    ("\\boxed{1\\,000}", "1000", 1.0), ("\\boxed{1\\,000}", "0", 0.0), ("\\boxed{1\\ 000}", "1000", 1.0),
    ("\\boxed{12\\,345\\,678}", "12345678", 1.0), ("The answer is 1\\,000 apples", "1000", 1.0),
    ("\\boxed{1\\,2}", "12", 0.0),  # not a thousands group: left to math-verify
])
def test_latex_space_as_thousands_separator(completion, gold, expected):
    """Audit set D: "1\\,000" (thin space between thousands) went to math-verify as 1*0 = 0. "\\," and
    "\\ " between digits are read like "," and the grouping is checked: 1,000 = 1000."""
    assert verify_math(completion, gold) == expected


@pytest.mark.parametrize("completion, gold, expected", [
    ("The answer is 5%", "0.05", 1.0), ("The answer is 5%", "5", 1.0), ("So we get 50%", "0.5", 1.0),
    ("The answer is 50 percent.", "0.5", 1.0), ("The answer is 5\\%.", "0.05", 1.0), ("The answer is 5%", "0.5", 0.0),
])
def test_percentage_in_free_text_matches_both_readings(completion, gold, expected):
    """Audit set E: "5%" in free text was read as 5 only (the "%" was cut before the text was read),
    so it missed gold 0.05. As in \\boxed{5\\%}, it matches 5 and 5/100 = 0.05, not 0.5."""
    assert verify_math(completion, gold) == expected


def test_a_remembered_parse_is_the_same_answer_and_a_fresh_list():
    """math-verify's parse is remembered per text (a group's completions and a prompt's gold recur):
    the second reading equals the first, and a caller changing its list changes nothing remembered."""
    from grouprl.rewards import math as m

    m._mv_parse_cached.cache_clear()
    first = m._mv_parse("\\frac{3}{4}", anchored=True)
    first.append("changed by a caller")
    again = m._mv_parse("\\frac{3}{4}", anchored=True)
    assert m._mv_parse_cached.cache_info().hits == 1 and "changed by a caller" not in again
    assert verify_math("The answer is $\\frac{3}{4}$.", "\\frac{3}{4}") == 1.0
    assert verify_math("The answer is $\\frac{1}{4}$.", "\\frac{3}{4}") == 0.0
