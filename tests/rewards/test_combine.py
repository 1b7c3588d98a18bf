"""score_completions: weighted nansum, metrics, and every fault named (or a counted fallback)."""

import asyncio
import math
import signal
import threading
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
    with pytest.raises(ValueError, match=r"weights=\[1.0, nan\]: every weight must be a finite number"):
        score_completions([const("a", [1] * 4), const("b", [1] * 4)], [1.0, float("nan")], PROMPTS, COMPLETIONS, {})


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
     (0.5, "returned float"),
     # finite, but not as float32 (the rewards' dtype): inf later, in the advantages, naming no function
     ([0.0, 1e39, 0.0, 0.0], r"on row 1: returned 1e\+39; rewards must be finite numbers within float32's range"),
     ([0.0, 0.0, 10**400, 0.0], "on row 2: returned inf; rewards must be finite numbers within float32's range")],
)
def test_bad_outputs_are_named(values, match):
    with pytest.raises(RewardFunctionError, match=match):
        score_completions([const("bad", values) if isinstance(values, list) else (lambda **k: values)],
                          None, PROMPTS, COMPLETIONS, {})


def test_a_weighted_total_past_float32s_range_names_the_function_that_took_it_there():
    big = [3e38, 0.0, 0.0, 0.0]
    with pytest.raises(RewardFunctionError, match=r"reward function 'second' on row 0: weighted by 1 and added to the "
                                                  r"functions before it, gives a total reward of inf"):
        score_completions([const("first", big), const("second", big)], None, PROMPTS, COMPLETIONS, {})


def test_a_function_that_changes_its_inputs_changes_nothing_else():
    """A prompt is one object for its G completions, and every function got the same objects: a function
    extending each conversation in place changed the other rows, the next function's inputs and the
    samples logged. Each row's value is now the function's own copy."""
    prompt = [{"role": "user", "content": "q"}]
    prompts = [prompt] * 4  # as scoring.py repeats a prompt for its group
    completions = [[{"role": "assistant", "content": c}] for c in "abcd"]

    def extends(prompts, completions, **kw):
        for p, c in zip(prompts, completions):
            p.extend(c)
            c.append({"role": "user", "content": "more"})
        return [float(len(p)) for p in prompts]

    def counts(prompts, completions, **kw):
        return [float(len(p) + len(c)) for p, c in zip(prompts, completions)]

    res = score_completions([extends, counts], None, prompts, completions, {"tests": [[1, 2]] * 4})
    assert res.per_func["extends"].tolist() == [2.0] * 4  # each row extended once, not 2, 3, 4, 5
    assert res.per_func["counts"].tolist() == [2.0] * 4  # the next function sees the rows as they were
    assert prompt == [{"role": "user", "content": "q"}] and completions[0] == [{"role": "assistant", "content": "a"}]


def test_bad_outputs_with_fallback_are_counted():
    res = score_completions([const("nan", [1.0, float("nan"), 0.0, None])], None, PROMPTS, COMPLETIONS, {},
                            fallback=0.0)
    assert res.per_func["nan"].tolist()[:3] == [1.0, 0.0, 0.0] and math.isnan(res.per_func["nan"][3])
    assert res.metrics["rewards/nan/num_fallback"] == 1
    res = score_completions([const("short", [1.0])], None, PROMPTS, COMPLETIONS, {}, fallback=0.25)
    assert res.total.tolist() == [0.25] * 4 and res.metrics["rewards/short/num_fallback"] == 4


def in_thread(fn):
    """fn() run in another thread (where a reward with a timeout runs in a worker thread); its result or error."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def hangs(prompts, completions, **kwargs):
    time.sleep(30)
    return [1.0] * len(completions)


@pytest.mark.parametrize("thread", [False, True])  # stopped by a signal in the main thread, abandoned elsewhere
def test_hung_function_times_out_with_a_clear_error_or_fallback(thread):
    def run(fn):
        return in_thread(fn) if thread else fn()

    with pytest.raises(RewardFunctionError, match="'hangs': did not return within timeout_s=0.2"):
        run(lambda: score_completions([hangs], None, PROMPTS, COMPLETIONS, {}, timeout_s=0.2))
    res = run(lambda: score_completions([hangs, const("ok", [1.0] * 4)], None, PROMPTS, COMPLETIONS, {},
                                        timeout_s=0.2, fallback=0.0))
    assert res.total.tolist() == [1.0] * 4 and res.metrics["rewards/hangs/num_fallback"] == 4


@pytest.mark.parametrize("timeout_s, exit_with, thread", [(None, SystemExit(3), False), (5.0, SystemExit(3), False),
                                                          (5.0, SystemExit(3), True),
                                                          (5.0, KeyboardInterrupt(), True)])
def test_a_function_that_exits_is_named_like_any_error(timeout_s, exit_with, thread):
    """`sys.exit(3)` inside a reward function would end the run with the run health's own exit code,
    and say nothing: it is the function's error, named with its row. (A KeyboardInterrupt in the main
    thread is the user's Ctrl-C, and passes: below.)"""
    def exits_on_c(prompts, completions, **kwargs):
        if "c" in completions:
            raise exit_with
        return [1.0] * len(completions)

    def score():
        return score_completions([exits_on_c], None, PROMPTS, COMPLETIONS, {}, timeout_s=timeout_s)

    with pytest.raises(RewardFunctionError, match=f"'exits_on_c' on row 2: raised {type(exit_with).__name__}\\("):
        in_thread(score) if thread else score()


@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_a_keyboard_interrupt_in_the_main_thread_passes(timeout_s):
    def interrupted(prompts, completions, **kwargs):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        score_completions([interrupted], None, PROMPTS, COMPLETIONS, {}, timeout_s=timeout_s)


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


@pytest.mark.parametrize("thread", [False, True])
def test_math_accuracy_under_a_timeout(thread):
    from grouprl.rewards import math_accuracy

    def score():
        return score_completions([math_accuracy], None, ["q"] * 3, ["\\boxed{\\frac{1}{2}}", "0.5", "2"],
                                 {"answer": ["0.5", "1/2", "0.5"]}, timeout_s=30)

    res = in_thread(score) if thread else score()
    assert res.per_func["math_accuracy"].tolist() == [1.0, 1.0, 0.0]


def trl_accuracy(completions, solution, **kwargs):
    """As TRL's and open-r1's accuracy_reward call math_verify: with its default, signal.alarm-based timeouts."""
    from math_verify import LatexExtractionConfig, parse, verify

    out = []
    for completion, sol in zip(completions, solution):
        answer = parse(completion, extraction_config=[LatexExtractionConfig()])
        try:
            out.append(float(verify(parse(sol), answer)))
        except Exception:  # noqa: BLE001 - as TRL's does
            out.append(None)
    return out


def test_a_reward_calling_math_verify_works_under_the_default_timeout():
    """The trainer scores with reward_timeout_s (60 s by default); in a worker thread math_verify's
    parse raised "doesn't support threaded environment" on every row. From the main thread the
    reward runs there; from another thread the error names the fix."""
    args = (None, ["q"] * 2, ["$\\boxed{42}$", "$\\boxed{41}$"], {"solution": ["$42$", "$42$"]})
    previous = signal.getsignal(signal.SIGALRM)
    res = score_completions([trl_accuracy], *args, timeout_s=60.0)
    assert res.per_func["trl_accuracy"].tolist() == [1.0, 0.0]
    assert signal.getsignal(signal.SIGALRM) is previous
    with pytest.raises(RewardFunctionError, match="works only in the main thread.*set reward_timeout_s: null"):
        in_thread(lambda: score_completions([trl_accuracy], *args, timeout_s=60.0))


def test_the_main_thread_timeout_stops_what_catches_exceptions_and_what_math_verify_holds():
    """In the main thread the deadline is a signal: a function whose `except Exception` goes on, or one
    inside math_verify (which holds SIGALRM for its own timeout), is stopped all the same."""
    returned = []

    def swallows(prompts, completions, **kwargs):
        for _ in range(300):
            try:
                time.sleep(0.1)
            except Exception:  # noqa: BLE001, S110 - what the timeout must get past
                pass
        returned.append("swallows")
        return [1.0] * len(completions)

    def verifies_then_hangs(prompts, completions, **kwargs):
        trl_accuracy(["$1$"], ["$1$"])  # sets and cancels math_verify's own alarm
        time.sleep(30)
        returned.append("verifies_then_hangs")
        return [1.0] * len(completions)

    for func in (swallows, verifies_then_hangs):
        with pytest.raises(RewardFunctionError, match=f"'{func.__name__}': did not return within timeout_s=0.3"):
            score_completions([func], None, PROMPTS, COMPLETIONS, {}, timeout_s=0.3)
    assert returned == []  # each was stopped inside its wait, not let run to its end


@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_async_rewards_are_awaited_and_0d_tensors_read(timeout_s):
    async def judge(prompts, completions, **kwargs):
        await asyncio.sleep(0)
        return [float(c == "a") for c in completions]

    def tensors(prompts, completions, **kwargs):
        return [torch.tensor(0.5)] * len(completions)

    res = score_completions([judge, tensors], None, PROMPTS, COMPLETIONS, {}, timeout_s=timeout_s)
    assert res.per_func["judge"].tolist() == [1.0, 0.0, 0.0, 0.0] and res.total.tolist() == [1.5, 0.5, 0.5, 0.5]


def test_an_async_reward_runs_under_a_running_event_loop():
    """A notebook runs an event loop in the main thread, where asyncio.run cannot start one."""
    async def judge(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    async def main():
        return score_completions([judge], None, PROMPTS, COMPLETIONS, {})

    assert asyncio.run(main()).total.tolist() == [1.0] * 4


def test_a_column_named_like_an_argument_is_refused():
    for key in ("prompts", "completions"):
        with pytest.raises(ValueError, match=f"a column is named '{key}', which would replace the {key} argument"):
            score_completions([const("a", [1] * 4)], None, PROMPTS, COMPLETIONS, {key: ["x"] * 4})


def test_reward_metrics_describe_the_rows_they_are_computed_on():
    """A batch cut to some rows (dynamic sampling keeps some groups) counts the Nones, fallbacks and
    all-None rows of those rows, as its means do; joined batches count the joined rows."""
    from grouprl.rewards import reward_metrics

    def half(prompts, completions, **kw):
        if completions == ["boom"]:
            raise ValueError("boom")
        if "boom" in completions:
            raise ValueError("batch")
        return [None if c == "skip" else float(len(c)) for c in completions]

    res = score_completions([half], None, ["p"] * 4, ["ab", "skip", "abcd", "boom"], fallback=0.0)
    assert res.fallback["half"].tolist() == [False, False, False, True]
    assert (res.metrics["rewards/half/num_none"], res.metrics["rewards/half/num_fallback"],
            res.metrics["rewards/num_all_none"]) == (1, 1, 1)
    kept = torch.tensor([0, 2])
    m = reward_metrics({"half": res.per_func["half"][kept]}, {"half": res.fallback["half"][kept]})
    assert m == {"rewards/half/mean": 3.0, "rewards/half/std": pytest.approx(math.sqrt(2)),
                 "rewards/half/num_none": 0.0, "rewards/half/num_fallback": 0.0, "rewards/num_all_none": 0.0}


def test_a_step_batch_cut_or_joined_reports_the_reward_metrics_of_its_rows():
    """Dynamic sampling keeps the groups whose rewards differ: the kept batch's None counts were those of
    every generated row while its means were those of the kept rows (here: 'judge' abstains only on the
    dropped group, and the kept rows had no None)."""
    from grouprl.batch import StepBatch
    from grouprl.rollout import Rollout

    def acc(prompts, completions, **kw):
        return [1.0 if p == "flat" else float(c == "a") for p, c in zip(prompts, completions)]

    def judge(prompts, completions, **kw):
        return [None if p == "flat" else 0.5 for p in prompts]

    prompts, completions = ["flat", "flat", "vary", "vary"], ["a", "b", "a", "b"]
    res = score_completions([acc, judge], None, prompts, completions, {})
    rollout = Rollout(torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1, dtype=torch.long),
                      torch.ones(4, 2, dtype=torch.long), torch.ones(4, 2, dtype=torch.bool),
                      torch.zeros(4, dtype=torch.bool))
    batch = StepBatch(rollout, prompts, completions, res.total, res.per_func, res.metrics, fallback=res.fallback)
    assert batch.reward_metrics["rewards/judge/num_none"] == 2
    kept = StepBatch.cat([batch.select(torch.tensor([2, 3])), batch.select(torch.tensor([], dtype=torch.long))], 0)
    m = kept.reward_metrics
    assert (m["rewards/judge/num_none"], m["rewards/num_all_none"], m["rewards/acc/mean"]) == (0, 0, 0.5)
    assert StepBatch.cat([batch, batch], 0).reward_metrics["rewards/judge/num_none"] == 4


def test_an_alarm_the_program_had_set_still_reaches_its_handler():
    """The reward timeout borrows SIGALRM in the main thread; an alarm set before the call is not eaten."""
    rang = []

    def slow(prompts, completions, **kwargs):
        time.sleep(0.3)
        return [1.0] * len(completions)

    previous = signal.signal(signal.SIGALRM, lambda signum, frame: rang.append(signum))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        assert score_completions([slow], None, PROMPTS, COMPLETIONS, {}, timeout_s=5.0).total.tolist() == [1.0] * 4
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert rang == [signal.SIGALRM]


def test_a_reward_out_of_memory_is_raised_as_it_is_not_given_the_fallback():
    """Not the rows' fault: no per-row retry, no fallback for every row; the run's own error then says
    what to lower (grouprl.memory)."""
    def oom(prompts, completions, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")

    with pytest.raises(torch.OutOfMemoryError):
        score_completions([oom], None, PROMPTS, COMPLETIONS, {}, fallback=0.0)


def test_an_infinite_timeout_is_refused():
    with pytest.raises(ValueError, match="timeout_s=inf must be a positive finite number of seconds"):
        score_completions([const("a", [1] * 4)], None, PROMPTS, COMPLETIONS, {}, timeout_s=float("inf"))


def test_a_reward_stopped_at_its_deadline_finishes_its_cleanup():
    """The stop is sent again only after the function had a while to unwind: a `finally` that takes a
    moment (releasing a lock, a child process's wait) runs to its end, and the row still timed out."""
    import time

    cleaned = []

    def slow(prompts, completions, **kw):
        try:
            time.sleep(30)
        finally:
            time.sleep(0.2)
            cleaned.append(len(completions))
        return [1.0] * len(completions)

    res = score_completions([slow], None, PROMPTS[:1], COMPLETIONS[:1], {}, timeout_s=0.2, fallback=0.0)
    assert cleaned == [1] and res.fallback["slow"].tolist() == [True]


def test_a_reward_that_catches_the_stop_row_by_row_is_stopped_at_each_row():
    """A judge that scores each row inside a bare `except:` swallows one stop per row: it is stopped
    again at each row (200 ms apart after a grace of 1 s), not left to its natural end while other ranks
    wait for it: (nearly) every row of 1 s is cut short, where stops backed off to seconds let most run
    to their end; the call ends as a timeout."""
    import time

    rows_done = []

    def judge(prompts, completions, **kw):
        out = []
        for _ in range(20):
            try:
                time.sleep(1.0)
                out.append(1.0)
            except BaseException:  # noqa: BLE001 -- what such judges do
                out.append(0.0)
            rows_done.append(out[-1])
        return out[:len(completions)]

    res = score_completions([judge], None, PROMPTS[:1], COMPLETIONS[:1], {}, timeout_s=0.1, fallback=0.0)
    assert res.fallback["judge"].tolist() == [True] and len(rows_done) == 20
    assert rows_done.count(0.0) >= 15  # cut short
