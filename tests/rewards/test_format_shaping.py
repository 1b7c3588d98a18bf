"""Format, regex, length, repetition and overlong rewards: hand-worked values."""

import math

import pytest
import torch

from grouprl.rewards import (
    cosine_length, length_target, overlong_penalty, regex_match, repetition_penalty, think_format,
    think_format_soft,
)

GOOD = "<think>\n6*7=42\n</think>\n<answer>\n42\n</answer>"


@pytest.mark.parametrize(
    "text, strict, soft",
    [
        (GOOD, 1.0, 1.0),
        ("  <think>x</think><answer>y</answer>\n", 1.0, 1.0),
        ("<think></think><answer>42</answer>", 0.0, 1.0),  # empty reasoning fails strict only
        ("Sure! <think>x</think><answer>y</answer>", 0.0, 1.0),  # text outside the blocks
        ("<think>x</think><answer>y</answer><answer>z</answer>", 0.0, 0.5),
        ("<answer>y</answer><think>x</think>", 0.0, 0.75),  # all four tags, wrong order
        ("<think>x</think> 42", 0.0, 0.5),
        ("42", 0.0, 0.0),
    ],
)
def test_think_format(text, strict, soft):
    assert think_format([""], [text]) == [strict]
    assert think_format_soft([""], [text]) == [soft]
    assert think_format([[]], [[{"role": "assistant", "content": text}]]) == [strict]


def test_regex_match():
    f = regex_match(r"\d+ apples")
    assert f(["", ""], ["I have 3 apples", "no fruit"]) == [1.0, 0.0]
    full = regex_match(r"\d+", full=True)
    assert full(["", ""], [" 42\n", "42 apples"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="not a valid regular expression"):
        regex_match("(")


def test_length_target_tokens_and_character_fallback():
    f = length_target(target=10)
    # lengths 10, 5, 15, 25 tokens -> 1, 0.5, 0.5, 0 (scale = target = 10)
    assert f([""] * 4, ["a"] * 4, completion_lengths=[10, 5, 15, 25]) == [1.0, 0.5, 0.5, 0.0]
    assert f([""], ["x" * 8]) == [pytest.approx(0.8)]  # 8 characters without completion_lengths
    assert length_target(target=10, scale=20)([""], [""], completion_lengths=[20]) == [0.5]


def test_cosine_length_hand_worked():
    f = cosine_length(max_len=100)
    golds = ["7", "7", "7", "7", "7", None]
    # correct at L=0 -> max_value_correct 1.0; at L=50 -> 0.5 + 0.5*0.5*(1+cos(pi/2)) = 0.75;
    # correct beyond max_len -> clamped to min_value_correct 0.5; wrong at L=0 -> -1.0; at L=100 -> -0.5
    out = f([""] * 6, ["7", "7", "7", "8", "8", "7"], answer=golds, completion_lengths=[0, 50, 150, 0, 100, 10])
    assert out[:5] == pytest.approx([1.0, 0.75, 0.5, -1.0, -0.5])
    assert out[5] is None


def test_repetition_penalty():
    f = repetition_penalty(ngram_size=2, max_penalty=-1.0)
    # "a b a b a b": bigrams ab ba ab ba ab -> 2 distinct of 5 -> -(1 - 2/5) = -0.6
    assert f(["", "", ""], ["a b a b a b", "one two three", "short"]) == [pytest.approx(-0.6), 0.0, 0.0]
    with pytest.raises(ValueError, match="must be <= 0"):
        repetition_penalty(max_penalty=1.0)


def test_overlong_penalty_matches_dapo_worked_numbers():
    """docs/algorithms.md (DAPO soft overlong punishment): L_max 20480, L_cache 4096 -> 0 / -0.25 / -0.5 / -1 / -1."""
    f = overlong_penalty(max_len=20480, cache_len=4096)
    lengths = [16384, 17408, 18432, 20480, 20481]
    assert f([""] * 5, ["x"] * 5, completion_lengths=lengths) == pytest.approx([0.0, -0.25, -0.5, -1.0, -1.0])
    assert f([""], ["x"], completion_lengths=torch.tensor([17408])) == pytest.approx([-0.25])
    # without completion_lengths the character length is used
    g = overlong_penalty(max_len=10, cache_len=4)
    assert g(["", ""], ["x" * 6, "x" * 8]) == pytest.approx([0.0, -0.5])
    assert all(math.isfinite(v) for v in g([""], ["x" * 100]))
