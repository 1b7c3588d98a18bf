"""Step rewards: parsing, the character -> token mapping, and combining process with outcome rewards."""

import math

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from grouprl.core import process_advantages
from grouprl.rewards import (CharOffset, RewardFunctionError, process_rewards, score_completions, split_steps,
                             token_char_ends)
from grouprl.rewards.process import parse_steps, token_index
from grouprl.tasks.testing import build_char_tokenizer


# ---------------------------------------------------------------- steps in text
@pytest.mark.parametrize("text, delimiter, ends", [
    ("a\nb", "\n", [2, 3]),
    ("a\nb\n", "\n", [2, 4]),
    ("", "\n", []),
    ("abc", "\n", [3]),
    ("a\n\nb", "\n", [2, 3, 4]),
    ("a\n\nb\n\n", "\n\n", [3, 6]),
])
def test_split_steps(text, delimiter, ends):
    assert split_steps(text, delimiter) == ends


def test_parse_steps_index_and_offset_forms():
    text = "x=3\ny=4\nz"  # steps end at 4, 8, 9
    assert parse_steps([(1, 0.5), (0, 1), (2, -1.0)], text, "\n") == [(4, 1.0), (8, 0.5), (9, -1.0)]
    assert parse_steps([(CharOffset(3), 2.0)], text, "\n") == [(3, 2.0)]
    assert parse_steps([], text, "\n") == []


@pytest.mark.parametrize("steps, message", [
    ([(3, 1.0)], "step index 3 is out of range: the completion has 3 steps"),
    ([(CharOffset(0), 1.0)], "outside the completion's text"),
    ([(CharOffset(10), 1.0)], "outside the completion's text"),
    ([(True, 1.0)], "ends at True"),
    ([(0.0, 1.0)], "ends at 0.0"),
    ([(0, math.nan)], "finite float"),
    ([(0, "1")], "finite float"),
    ([0.5], "(end, reward) pairs"),
])
def test_parse_steps_errors_name_the_problem(steps, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_steps(steps, "x=3\ny=4\nz", "\n")


# ---------------------------------------------------------------- characters -> tokens
def merging_tokenizer(merges: list[tuple[str, str]]) -> PreTrainedTokenizerFast:
    """Byte-level BPE over the whole text (no pre-tokenizer split), so merges cross step boundaries:
    "3\\n" and "\\n\\n" can be single tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(alphabet)}}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<eos>",
                                   clean_up_tokenization_spaces=False)


def test_token_char_ends_on_tokens_that_merge_across_step_boundaries():
    tok = merging_tokenizer([("3", "Ċ"), ("Ċ", "Ċ")])
    text = "x=3\ny=4\n\nz"
    ids = tok(text)["input_ids"] + [tok.eos_token_id]
    pieces = [tok.decode([i], skip_special_tokens=True) for i in ids]
    assert pieces == ["x", "=", "3\n", "y", "=", "4", "\n\n", "z", ""]  # the merges happened
    ends = token_char_ends(tok, ids, text)
    assert ends == [1, 2, 4, 5, 6, 7, 9, 10, 10]
    steps = split_steps(text, "\n")  # "x=3\n" "y=4\n" "\n" "z"
    assert steps == [4, 8, 9, 10]
    # "3\n" holds step 0's end; "\n\n" holds the ends of steps 1 and 2; the last step runs to EOS
    assert [token_index(ends, e, len(ids), len(text)) for e in steps] == [2, 6, 6, 8]
    # an offset inside a token: "x=3" ends in the token "3\n"
    assert token_index(ends, 3, len(ids), len(text)) == 2


def test_token_char_ends_on_a_non_canonical_tokenisation():
    tok = merging_tokenizer([("3", "Ċ"), ("Ċ", "Ċ")])
    # sampled ids need not be what tokenising the text gives: "3" and "\n" apart, "\n\n" as one
    ids = [tok.convert_tokens_to_ids(t) for t in ["3", "Ċ", "ĊĊ", "3Ċ"]]
    text = tok.decode(ids, skip_special_tokens=True)
    assert text == "3\n\n\n3\n"
    assert token_char_ends(tok, ids, text) == [1, 2, 4, 6]


def test_token_char_ends_when_a_character_spans_tokens():
    tok = merging_tokenizer([])  # "é" is two bytes, two tokens; decoding one alone gives "\ufffd"
    text = "aé\nb"
    ids = tok(text)["input_ids"]
    assert len(ids) == 5
    ends = token_char_ends(tok, ids, text)
    assert ends == [1, 1, 2, 3, 4]  # "é" is reached at its second byte, not before
    assert token_index(ends, 3, len(ids), len(text)) == 3  # step "aé\n" ends at the newline token


def test_token_char_ends_on_the_character_tokenizer():
    tok = build_char_tokenizer()
    text = "12\n7 x"
    ids = tok(text)["input_ids"] + [tok.eos_token_id]
    assert token_char_ends(tok, ids, text) == [1, 2, 3, 4, 5, 6, 6]


# ---------------------------------------------------------------- combining
def test_process_rewards_weights_merges_and_outcome_as_final_step():
    """Two step functions (weights 2 and 0.5) and an outcome function (weight 3) on the character
    tokenizer, where the token of character c is c. Row 0 "ab\\ncd" + EOS (6 tokens):
    f gives steps (0 -> end 3, r 1), (1 -> end 5, r 0); g gives (CharOffset(3), r 4): both end at
    token 2 -> 2·1 + 0.5·4 = 4; step 1 ends the text, so at the last token (5, EOS) -> 0; the
    outcome 3·1 = 3 is one more step at token 5. Row 1 "z" + EOS: f abstains (None), g gives no steps,
    outcome 3·0 + shaping −0.5."""
    tok = build_char_tokenizer()
    texts = ["ab\ncd", "z"]
    ids = [tok(t)["input_ids"] + [tok.eos_token_id] for t in texts]
    steps = {"f": [[(3, 1.0), (5, 0.0)], None], "g": [[(3, 4.0)], []]}
    per_func = {"f": torch.tensor([0.5, math.nan]), "g": torch.tensor([4.0, math.nan]),
                "h": torch.tensor([1.0, 0.0])}
    pr = process_rewards(steps, per_func, [2.0, 0.5, 3.0], ids, texts, tok, torch.tensor([0.0, -0.5]))
    assert pr.ends == [[2, 5], []]
    assert pr.rewards == [[4.0, 0.0], []]
    assert pr.outcome == [3.0, 0.0] and pr.shaping == [0.0, -0.5]
    assert pr.last == [5, 1]
    assert pr.metrics() == {"process/steps_per_completion": 1.0, "process/step_reward_mean": 2.0,
                            "process/step_reward_min": 0.0}
    expected = process_advantages([[4.0, 0.0, 3.0], [-0.5]], [[2, 5, 5], [1]], 2, 7)
    assert torch.equal(process_advantages(*pr.with_outcome(), 2, 7), expected)


def test_a_functions_steps_that_end_in_one_token_stay_apart():
    """A blank line is a step of its own, and "\\n\\n" one token: "a\\n\\n\\nb\\nc" has 5 steps, of which two end
    in the token "ĊĊ". Every step of both completions scores 1: the group is flat, so every advantage is 0.
    Summed into one step of 2, the steps were not flat, and the advantages reached ±1.13."""
    from grouprl.core import process_advantages

    tok = merging_tokenizer([("Ċ", "Ċ")])
    texts = ["a\n\n\nb\nc", "a\nb\nc"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    steps = {"lines": [[(i, 1.0) for i in range(5)], [(i, 1.0) for i in range(3)]]}
    per_func = {"lines": torch.tensor([1.0, 1.0])}
    pr = process_rewards(steps, per_func, None, ids, texts, tok, estimator="process")
    assert [len(r) for r in pr.rewards] == [5, 3] and pr.rewards[0] == [1.0] * 5
    assert len(set(pr.ends[0])) < 5  # some of the five steps end in one token
    rewards, ends = pr.with_outcome()
    assert not process_advantages(rewards, ends, 2, max(map(len, ids))).any()


def test_shaping_without_an_outcome_is_a_step_only_where_it_is_not_zero():
    """Only step functions and overlong shaping: a penalty of 0 adds no step (a step of 0 would enter
    the group's mean and std and change every advantage); a non-zero one is a step at the last token.
    Before shaping (what judges a group flat) there is no final step at all."""
    tok = build_char_tokenizer()
    texts = ["a\nb\n", "a\nb\n"]
    ids = [tok(t)["input_ids"] for t in texts]
    steps = {"f": [[(2, 1.0), (4, 1.0)], [(2, 0.0), (4, 0.0)]]}  # (character end, reward)
    per_func = {"f": torch.tensor([1.0, 0.0])}
    unshaped = process_rewards(steps, per_func, None, ids, texts, tok)
    zero = process_rewards(steps, per_func, None, ids, texts, tok, torch.tensor([0.0, 0.0]))
    assert zero.with_outcome() == unshaped.with_outcome() == ([[1.0, 1.0], [0.0, 0.0]], [[1, 3], [1, 3]])
    assert torch.equal(process_advantages(*zero.with_outcome(), 2, 4),
                       process_advantages(*unshaped.with_outcome(), 2, 4))
    penalised = process_rewards(steps, per_func, None, ids, texts, tok, torch.tensor([0.0, -0.5]))
    assert penalised.with_outcome() == ([[1.0, 1.0], [0.0, 0.0, -0.5]], [[1, 3], [1, 3, 3]])
    assert penalised.with_outcome(shaped=False) == unshaped.with_outcome()


def test_outcome_only_process_rewards_are_grpo_advantages():
    tok = build_char_tokenizer()
    texts = ["a", "bb", "ccc", "d"]
    ids = [tok(t)["input_ids"] + [tok.eos_token_id] for t in texts]
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])
    pr = process_rewards({}, {"acc": rewards}, None, ids, texts, tok)
    adv = process_advantages(*pr.with_outcome(), 4, 5)  # [N, T]
    from grouprl.core import group_advantages

    want = group_advantages(rewards, 4)  # [N]
    for i, t in enumerate(texts):
        n = len(t) + 1
        torch.testing.assert_close(adv[i, :n], want[i].expand(n), rtol=0, atol=1e-6)
        assert (adv[i, n:] == 0).all()


def test_step_rewards_under_an_outcome_estimator_are_an_error():
    tok = build_char_tokenizer()
    with pytest.raises(RewardFunctionError, match="advantage_estimator: process") as e:
        process_rewards({"prm": [None, [(0, 1.0)]]}, {"prm": torch.tensor([math.nan, 1.0])}, None,
                        [[5], [6]], ["a", "b"], tok, estimator="grpo")
    assert e.value.func == "prm" and e.value.row == 1
    assert process_rewards({}, {"acc": torch.tensor([1.0])}, None, [[5]], ["a"], tok, estimator="grpo") is None


def test_score_completions_keeps_steps_and_scores_their_mean():
    def lines(prompts, completions, **kw):
        return [[(k, float(len(line))) for k, line in enumerate(c.split("\n"))] if c else None for c in completions]

    scores = score_completions([lines], None, ["p"] * 3, ["ab\nc", "", "xyz"])
    assert scores.steps == {"lines": [[(3, 2.0), (4, 1.0)], None, [(3, 3.0)]]}
    torch.testing.assert_close(scores.per_func["lines"], torch.tensor([1.5, math.nan, 3.0]), equal_nan=True)
    assert scores.total.tolist() == [1.5, 0.0, 3.0]


def test_score_completions_bad_steps_name_the_row_or_use_the_fallback():
    def bad(prompts, completions, **kw):
        return [[(0, 1.0)], [(7, 1.0)]]

    with pytest.raises(RewardFunctionError, match="on row 1: step index 7 is out of range"):
        score_completions([bad], None, ["p", "p"], ["a", "b"])
    scores = score_completions([bad], None, ["p", "p"], ["a", "b"], fallback=-1.0)
    assert scores.steps["bad"] == [[(1, 1.0)], None]
    assert scores.per_func["bad"].tolist() == [1.0, -1.0]
    assert scores.metrics["rewards/bad/num_fallback"] == 1.0


def test_score_completions_step_delimiter():
    def second(prompts, completions, **kw):
        return [[(1, 1.0)] for _ in completions]

    scores = score_completions([second], None, ["p"], ["a. b. c"], step_delimiter=". ")
    assert scores.steps["second"] == [[(6, 1.0)]]
