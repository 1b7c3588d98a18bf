"""score_completions: weighted nansum, metrics, and every fault named (or a counted fallback)."""

import math
import time

import pytest
import torch

from grouprl.rewards import RewardFunctionError, RewardScores, score_completions


def const(name, values):
    def f(prompts, completions, **kwargs):
        return list(values)

    f.__name__ = name
    return f


PROMPTS = ["p"] * 4
COMPLETIONS = ["a", "b", "c", "d"]


def test_weighted_nansum_per_func_and_metrics():
    acc = const("acc", [1.0, 0.0, None, None])
    fmt = const("fmt", [0.5, 0.5, 1.0, None])
    res = score_completions([acc, fmt], [2.0, 1.0], PROMPTS, COMPLETIONS, {})
    assert isinstance(res, RewardScores)
    # row 0: 2*1 + 0.5; row 1: 0 + 0.5; row 2: acc missing -> 1.0; row 3: nothing scored -> 0
    assert res.total.dtype == torch.float32 and res.total.shape == (4,)
    assert res.total.tolist() == [2.5, 0.5, 1.0, 0.0]
    assert torch.isnan(res.per_func["acc"][2:]).all() and res.per_func["acc"][:2].tolist() == [1.0, 0.0]
    assert res.all_none.tolist() == [False, False, False, True]
    m = res.metrics
    assert m["rewards/acc/mean"] == 0.5 and m["rewards/acc/std"] == pytest.approx(math.sqrt(0.5))
    assert m["rewards/fmt/mean"] == pytest.approx(2 / 3)
    assert (m["rewards/acc/num_none"], m["rewards/fmt/num_none"], m["rewards/num_all_none"]) == (2, 1, 1)
    assert m["rewards/acc/num_fallback"] == 0


def test_functions_get_keyword_arguments_and_columns():
    seen = {}

    def spy(prompts, completions, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions, answer=answer, **kwargs)
        return [1.0] * len(completions)

    score_completions([spy], None, PROMPTS, COMPLETIONS, {"answer": [1, 2, 3, 4], "completion_lengths": [1] * 4})
    assert seen["answer"] == [1, 2, 3, 4] and seen["completion_lengths"] == [1] * 4 and seen["prompts"] == PROMPTS


def test_weights_and_inputs_are_checked():
    with pytest.raises(ValueError, match="2 reward functions but 1 weights"):
        score_completions([const("a", [1] * 4), const("b", [1] * 4)], [1.0], PROMPTS, COMPLETIONS, {})
    with pytest.raises(ValueError, match="column 'answer' has 2 values for 4"):
        score_completions([const("a", [1] * 4)], None, PROMPTS, COMPLETIONS, {"answer": [1, 2]})


def test_duplicate_names_are_disambiguated():
    res = score_completions([const("r", [1] * 4), const("r", [0] * 4)], None, PROMPTS, COMPLETIONS, {})
    assert set(res.per_func) == {"r", "r_2"}


def boom_on_c(prompts, completions, **kwargs):
    if "c" in completions:
        raise KeyError("no gold for c")
    return [1.0] * len(completions)


def test_raising_function_is_named_with_its_row():
    with pytest.raises(RewardFunctionError, match=r"'boom_on_c' on row 2: raised KeyError") as info:
        score_completions([boom_on_c], None, PROMPTS, COMPLETIONS, {})
    assert (info.value.func, info.value.row) == ("boom_on_c", 2)


def test_raising_function_with_fallback_only_replaces_the_bad_row(caplog):
    res = score_completions([boom_on_c], None, PROMPTS, COMPLETIONS, {}, fallback=-1.0)
    assert res.total.tolist() == [1.0, 1.0, -1.0, 1.0]
    assert res.metrics["rewards/boom_on_c/num_fallback"] == 1
    assert "row 2" in caplog.text  # logged, not silent


@pytest.mark.parametrize(
    "values, match",
    [([1.0, 2.0], "returned 2 values for 4 completions"), ([1.0, float("nan"), 0.0, 0.0], "on row 1: returned nan"),
     ([1.0, 0.0, float("inf"), 0.0], "on row 2: returned inf"), ([1.0, "1", 0.0, 0.0], "on row 1: returned '1'"),
     (0.5, "returned float")],
)
def test_bad_outputs_are_named(values, match):
    with pytest.raises(RewardFunctionError, match=match):
        score_completions([const("bad", values) if isinstance(values, list) else (lambda **k: values)],
                          None, PROMPTS, COMPLETIONS, {})


def test_bad_outputs_with_fallback_are_counted():
    res = score_completions([const("nan", [1.0, float("nan"), 0.0, None])], None, PROMPTS, COMPLETIONS, {},
                            fallback=0.0)
    assert res.per_func["nan"].tolist()[:3] == [1.0, 0.0, 0.0] and math.isnan(res.per_func["nan"][3])
    assert res.metrics["rewards/nan/num_fallback"] == 1
    res = score_completions([const("short", [1.0])], None, PROMPTS, COMPLETIONS, {}, fallback=0.25)
    assert res.total.tolist() == [0.25] * 4 and res.metrics["rewards/short/num_fallback"] == 4


def hangs(prompts, completions, **kwargs):
    time.sleep(30)
    return [1.0] * len(completions)


def test_hung_function_times_out_with_a_clear_error_or_fallback():
    with pytest.raises(RewardFunctionError, match="'hangs': did not return within timeout_s=0.2"):
        score_completions([hangs], None, PROMPTS, COMPLETIONS, {}, timeout_s=0.2)
    res = score_completions([hangs, const("ok", [1.0] * 4)], None, PROMPTS, COMPLETIONS, {}, timeout_s=0.2,
                            fallback=0.0)
    assert res.total.tolist() == [1.0] * 4 and res.metrics["rewards/hangs/num_fallback"] == 4


@pytest.mark.parametrize("timeout_s, exit_with", [(None, SystemExit(3)), (5.0, SystemExit(3)),
                                                  (5.0, KeyboardInterrupt())])
def test_a_function_that_exits_is_named_like_any_error(timeout_s, exit_with):
    """`sys.exit(3)` inside a reward function would end the run with the run health's own exit code,
    and say nothing: it is the function's error, named with its row. (A KeyboardInterrupt in the main
    thread, without a timeout, is the user's Ctrl-C, and passes.)"""
    def exits_on_c(prompts, completions, **kwargs):
        if "c" in completions:
            raise exit_with
        return [1.0] * len(completions)

    with pytest.raises(RewardFunctionError, match=f"'exits_on_c' on row 2: raised {type(exit_with).__name__}\\("):
        score_completions([exits_on_c], None, PROMPTS, COMPLETIONS, {}, timeout_s=timeout_s)


def test_a_column_array_is_named_by_its_shape():
    import numpy as np

    for out in (torch.ones(4, 1), np.ones((4, 1))):
        with pytest.raises(RewardFunctionError, match=r"returned an array of shape \(4, 1\); .* flatten it"):
            score_completions([lambda out=out, **k: out], None, PROMPTS, COMPLETIONS, {})


def test_tensor_and_numpy_outputs_are_accepted():
    import numpy as np

    res = score_completions([lambda **k: torch.tensor([1.0, 0.0, 1.0, 0.0]), lambda **k: np.ones(4)],
                            [1.0, 0.5], PROMPTS, COMPLETIONS, {})
    assert res.total.tolist() == [1.5, 0.5, 1.5, 0.5]


def test_math_accuracy_under_a_timeout_runs_off_the_main_thread():
    from grouprl.rewards import math_accuracy

    res = score_completions([math_accuracy], None, ["q"] * 3, ["\\boxed{\\frac{1}{2}}", "0.5", "2"],
                            {"answer": ["0.5", "1/2", "0.5"]}, timeout_s=30)
    assert res.per_func["math_accuracy"].tolist() == [1.0, 1.0, 0.0]


def test_merge_reward_metrics_sums_counts_and_recomputes_means():
    import torch

    from grouprl.rewards import merge_reward_metrics, score_completions

    def half(prompts, completions, **kw):
        return [None if c == "skip" else float(len(c)) for c in completions]

    a = score_completions([half], None, ["p"] * 2, ["ab", "skip"])
    b = score_completions([half], None, ["p"] * 3, ["a", "abcd", "skip"])
    per_func = {"half": torch.cat([a.per_func["half"], b.per_func["half"]])}
    merged = merge_reward_metrics([a.metrics, b.metrics], per_func)
    assert merged["rewards/half/num_none"] == 2.0
    assert merged["rewards/half/mean"] == pytest.approx((2 + 1 + 4) / 3)
    assert merged["rewards/half/std"] == pytest.approx(torch.tensor([2.0, 1.0, 4.0]).std().item())
