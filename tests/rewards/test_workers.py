"""Reward functions in worker processes (rewards/workers.py): the same scores as in the trainer's process,
slices of whole groups, and every fault contained and named as it would be in process."""

import logging
import os
import pathlib
import random
import signal
import subprocess
import sys
import textwrap
import time
import types

import pytest
import torch

from grouprl.config import ConfigError, TrainConfig
from grouprl.rewards import RewardFunctionError, math_accuracy, regex_match, score_completions
from grouprl.rewards import workers as W
from grouprl.rewards.workers import RewardWorkers

G = 4
ANSWERS = [r"\frac{3}{4}", r"\sqrt{2}", r"2^{10}", "42", r"(1, 2)", "7"]
PROMPTS = [f"p{i // G}" for i in range(6 * G)]
GOLDS = [ANSWERS[i // G] for i in range(6 * G)]
COMPLETIONS = [f"So the answer is $\\boxed{{{ANSWERS[(i * 5) % len(ANSWERS)]}}}$." for i in range(6 * G)]


def worker_pid(prompts, completions, **kwargs):
    """Where it ran, as a reward."""
    return [float(os.getpid())] * len(completions)


def group_share(prompts, completions, **kwargs):
    """How many rows of its call share each row's prompt: G when slices are whole groups."""
    return [float(prompts.count(p)) for p in prompts]


def group_share_by_row(prompts, completions, **kwargs):
    return group_share(prompts, completions)


group_share_by_row.rowwise = True  # says it scores each row on its own: it may be cut between a group's rows


def raises_on_bad(prompts, completions, **kwargs):
    if "bad" in completions:
        raise ValueError("cannot read 'bad'")
    return [1.0] * len(completions)


def dies_on_die(prompts, completions, **kwargs):
    if "die" in completions:
        os._exit(7)
    return [1.0] * len(completions)


def sleeps(prompts, completions, **kwargs):
    time.sleep(60)
    return [1.0] * len(completions)


def ignores_every_stop(prompts, completions, **kwargs):
    """Catches the timeout's stop every time, as native code that holds the interpreter would never see it."""
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            time.sleep(0.05)
        except BaseException:  # noqa: BLE001 -- on purpose
            pass
    return [1.0] * len(completions)


def returns_a_generator(prompts, completions, **kwargs):
    return (1.0 for _ in completions)


def dies_on_a_batch(prompts, completions, **kwargs):
    """As a worker the OOM killer ends when a call is large: alone, each row is fine."""
    if len(completions) > 1:
        os._exit(9)
    return [float(len(completions[0]))]


class _Unreadable(float):
    def __reduce__(self):  # pickles in the worker, cannot be unpickled in the trainer
        return (_refuse, ())


def _refuse():
    raise ValueError("this value cannot be read back")


def unreadable(prompts, completions, **kwargs):
    return [_Unreadable(1.0)] * len(completions)


def drawn(prompts, completions, **kwargs):
    return [random.random() for _ in completions]


def slow_build(seconds: float = 1.5):
    """A factory that takes a while (a tokenizer to load): its build is no call's time."""
    time.sleep(seconds)

    def built_slowly(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    return built_slowly


def waits_for_the_trainer(prompts, completions, marks, **kwargs):
    """Says it started, then waits (10 s at most) for the trainer's own function to say so too."""
    folder = pathlib.Path(marks[0])
    (folder / f"worker-{os.getpid()}").touch()
    end = time.monotonic() + 10
    while not (folder / "trainer").exists() and time.monotonic() < end:
        time.sleep(0.01)
    return [float((folder / "trainer").exists())] * len(completions)


class WaitsForAWorker:
    in_process = True
    __name__ = "waits_for_a_worker"

    def __call__(self, prompts, completions, marks, **kwargs):
        folder = pathlib.Path(marks[0])
        end = time.monotonic() + 10
        while not any(folder.glob("worker-*")) and time.monotonic() < end:
            time.sleep(0.01)
        (folder / "trainer").touch()
        return [float(any(folder.glob("worker-*")))] * len(completions)


class InTheTrainer:
    """Like a reward model: marked to stay in the trainer's process."""

    in_process = True
    __name__ = "in_the_trainer"

    def __call__(self, prompts, completions, **kwargs):
        return [float(os.getpid())] * len(completions)


@pytest.fixture(scope="module")
def pool():
    funcs = [math_accuracy, worker_pid, group_share, group_share_by_row, raises_on_bad, dies_on_die, sleeps,
             ignores_every_stop, returns_a_generator, dies_on_a_batch, unreadable, waits_for_the_trainer]
    workers = RewardWorkers(2, funcs)
    yield workers
    workers.close()


def test_scores_in_the_workers_equal_the_trainers_and_slices_are_whole_groups(pool):
    columns = {"answer": GOLDS}
    here = score_completions([math_accuracy, group_share], None, PROMPTS, COMPLETIONS, columns)
    there = score_completions([math_accuracy, group_share], None, PROMPTS, COMPLETIONS, columns, workers=pool,
                              group_size=G)
    assert torch.equal(here.per_func["math_accuracy"], there.per_func["math_accuracy"])
    assert torch.equal(here.total, there.total)
    assert 0 < here.per_func["math_accuracy"].sum() < len(COMPLETIONS)  # both outcomes occur
    five = score_completions([group_share], None, PROMPTS[:5 * G], COMPLETIONS[:5 * G], workers=pool, group_size=G)
    assert five.per_func["group_share"].tolist() == [float(G)] * 5 * G  # 3 + 2 groups: never one cut in two
    pids = score_completions([worker_pid], None, PROMPTS, COMPLETIONS, workers=pool, group_size=G).total.tolist()
    groups = [pids[g:g + G] for g in range(0, len(pids), G)]
    assert all(len(set(group)) == 1 for group in groups)  # a group in one process
    assert pids[0] != pids[G]  # the first two slices went to the two idle workers, joined in row order
    assert float(os.getpid()) not in pids


def test_a_rowwise_function_is_cut_by_rows_and_the_built_ins_are_rowwise(pool):
    out = score_completions([group_share_by_row], None, PROMPTS, COMPLETIONS, workers=pool, group_size=G)
    slices = [PROMPTS[a:a + 3] for a in range(0, len(PROMPTS), 3)]  # 24 rows in 8 slices of 3: groups of 4 cut
    assert out.total.tolist() == [float(part.count(p)) for part in slices for p in part]
    from grouprl.rewards import BUILTIN_REWARDS

    built = [BUILTIN_REWARDS.get(name) for name in ("math_accuracy", "think_format", "think_format_soft")]
    built += [regex_match(pattern="x"), *(BUILTIN_REWARDS.get(name)(**params) for name, params in [
        ("length_target", {"target": 8}), ("cosine_length", {"max_len": 8}), ("repetition_penalty", {}),
        ("overlong_penalty", {"max_len": 8, "cache_len": 2})])]
    assert all(getattr(f, "rowwise", False) for f in built)


def test_rows_that_are_not_whole_groups_go_in_slices_of_rows(pool):
    out = score_completions([group_share], None, PROMPTS[:7], COMPLETIONS[:7], workers=pool, group_size=G)
    assert out.per_func["group_share"].tolist() == [1.0] * 7  # 7 rows are no whole groups of 4: a row a slice


def test_a_marked_function_and_a_lambda_stay_in_the_trainer(caplog):
    lam = lambda prompts, completions, **kw: [float(os.getpid())] * len(completions)  # noqa: E731
    lam.__name__ = "a_lambda"
    with caplog.at_level(logging.WARNING, logger="grouprl.rewards.workers"):
        workers = RewardWorkers(1, [InTheTrainer(), lam])
    try:
        assert "a_lambda runs in the trainer's process" in caplog.text and "cannot be pickled" in caplog.text
        assert "reward function in_the_trainer" not in caplog.text  # marked: no warning
        assert "no worker was started" in caplog.text and not workers.runs(lam)
        out = score_completions([InTheTrainer(), lam], None, PROMPTS, COMPLETIONS, workers=workers, group_size=G)
        assert set(out.per_func["in_the_trainer"].tolist()) == {float(os.getpid())}
        assert set(out.per_func["a_lambda"].tolist()) == {float(os.getpid())}
    finally:
        workers.close()


def test_a_function_that_raises_is_named_with_its_row(pool):
    completions = ["ok"] * 5 + ["bad"] + ["ok"] * 2
    with pytest.raises(RewardFunctionError) as e:
        score_completions([raises_on_bad], None, PROMPTS[:8], completions, workers=pool, group_size=G)
    message = str(e.value)
    assert "raises_on_bad" in message and "row 5" in message and "ValueError: cannot read 'bad'" in message
    out = score_completions([raises_on_bad], None, PROMPTS[:8], completions, fallback=-1.0, workers=pool,
                            group_size=G)
    assert out.per_func["raises_on_bad"].tolist() == [1.0] * 5 + [-1.0] + [1.0] * 2


def test_a_worker_that_dies_is_replaced_and_the_row_that_killed_it_named(pool):
    completions = ["ok"] * 3 + ["die"] + ["ok"] * 4
    out = score_completions([dies_on_die], None, PROMPTS[:8], completions, fallback=0.5, workers=pool, group_size=G)
    assert out.per_func["dies_on_die"].tolist() == [1.0] * 3 + [0.5] + [1.0] * 4
    with pytest.raises(RewardFunctionError, match=r"row 3.*exit code 7"):
        score_completions([dies_on_die], None, PROMPTS[:8], completions, workers=pool, group_size=G)
    again = score_completions([worker_pid], None, PROMPTS, COMPLETIONS, workers=pool, group_size=G)
    assert float(os.getpid()) not in again.total.tolist()  # the workers serve again


def test_a_call_past_its_timeout_is_stopped_in_the_worker(pool, caplog):
    with caplog.at_level(logging.WARNING, logger="grouprl.rewards.workers"):
        with pytest.raises(RewardFunctionError, match="did not return within timeout_s=0.5"):
            score_completions([sleeps], None, PROMPTS[:8], COMPLETIONS[:8], timeout_s=0.5, workers=pool,
                              group_size=G)
    assert "killed" not in caplog.text  # its own stop, in the worker: no kill needed


def test_a_worker_no_stop_reaches_is_killed_at_the_deadline_and_replaced(pool, monkeypatch, caplog):
    monkeypatch.setattr(W, "KILL_GRACE_S", 0.5)
    with caplog.at_level(logging.WARNING, logger="grouprl.rewards.workers"):
        out = score_completions([ignores_every_stop], None, PROMPTS[:8], COMPLETIONS[:8], timeout_s=0.5,
                                fallback=0.0, workers=pool, group_size=G)
    assert out.per_func["ignores_every_stop"].tolist() == [0.0] * 8
    assert caplog.text.count("the worker was killed and replaced") == 2  # one a slice
    again = score_completions([math_accuracy], None, PROMPTS, COMPLETIONS, {"answer": GOLDS}, workers=pool,
                              group_size=G)
    assert len(again.per_func["math_accuracy"]) == len(COMPLETIONS)


def test_an_output_that_cannot_come_back_is_named(pool):
    with pytest.raises(RewardFunctionError, match="cannot be sent back from the reward worker"):
        score_completions([returns_a_generator], None, PROMPTS[:4], COMPLETIONS[:4], workers=pool, group_size=G)


def test_the_models_and_the_sandboxed_code_reward_stay_in_the_trainer():
    from grouprl.rewards import ProcessRewardModel, RewardModelScorer, code_tests

    assert RewardModelScorer.in_process and ProcessRewardModel.in_process  # built from a model: not here
    sandboxed = code_tests(isolation="weak")  # its programs run one per core already
    workers = RewardWorkers(1, [sandboxed, math_accuracy])
    try:
        assert not workers.runs(sandboxed) and workers.runs(math_accuracy)
    finally:
        workers.close()


def test_a_function_configured_by_name_is_built_again_in_the_worker():
    spec = {"name": "regex_match", "pattern": r"\\boxed\{42\}"}
    func = regex_match(pattern=r"\\boxed\{42\}")  # a factory's closure: it cannot be pickled
    workers = RewardWorkers(1, [func], [spec])
    try:
        assert workers.runs(func)
        here = score_completions([func], None, PROMPTS, COMPLETIONS)
        there = score_completions([func], None, PROMPTS, COMPLETIONS, workers=workers, group_size=G)
        assert torch.equal(here.total, there.total) and here.total.sum() > 0
    finally:
        workers.close()


def test_a_function_the_workers_cannot_import_fails_at_start():
    module = types.ModuleType("grouprl_test_only_here")  # in this process's sys.modules, in no file

    def only_here(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    only_here.__module__ = module.__name__
    only_here.__qualname__ = "only_here"
    module.only_here = only_here
    sys.modules[module.__name__] = module
    try:
        with pytest.raises(ValueError, match=r"only_here cannot be loaded in a reward worker.*ModuleNotFoundError"):
            RewardWorkers(1, [only_here])
    finally:
        del sys.modules[module.__name__]


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_reward_workers_must_be_a_whole_number(bad):
    with pytest.raises(ConfigError, match="reward_workers="):
        TrainConfig(model="m", train_data="rows.jsonl", reward_funcs=["math_accuracy"], reward_workers=bad).validate()


def test_a_script_without_a_main_guard_gets_the_fix(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        from grouprl.rewards import math_accuracy
        from grouprl.rewards.workers import RewardWorkers
        RewardWorkers(1, [math_accuracy])
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode != 0
    assert 'if __name__ == "__main__":' in out.stderr and "reward_workers: 0" in out.stderr


def test_a_worker_the_oom_killer_ends_mid_batch_costs_no_score(pool, caplog):
    completions = ["ab", "abc", "a", "abcd"]
    with caplog.at_level(logging.WARNING):
        out = score_completions([dies_on_a_batch], None, PROMPTS[:4], completions, workers=pool, group_size=G)
    assert out.per_func["dies_on_a_batch"].tolist() == [2.0, 3.0, 1.0, 4.0]  # each row alone, no fallback needed
    assert "exit code 9" in caplog.text and "each row alone then succeeded" in caplog.text


def test_workers_outlive_a_schedulers_sigterm_and_an_idle_one_killed_is_replaced(pool):
    from multiprocessing import forkserver

    server = forkserver._forkserver._forkserver_pid
    for pid in [w.process.pid for w in pool._workers] + [server]:
        os.kill(pid, signal.SIGTERM)  # a scheduler's notice to every process of the job: the trainer decides
    time.sleep(0.3)
    assert all(w.process.is_alive() for w in pool._workers)
    os.kill(pool._workers[0].process.pid, signal.SIGKILL)  # gone while idle
    out = score_completions([worker_pid], None, PROMPTS, COMPLETIONS, workers=pool, group_size=G)
    assert float(os.getpid()) not in out.total.tolist() and len(out.total) == len(COMPLETIONS)


def test_an_output_that_cannot_be_read_back_fails_the_call_and_does_not_hang(pool):
    with pytest.raises(RewardFunctionError, match="could not be read back from the reward worker"):
        score_completions([unreadable], None, PROMPTS[:4], COMPLETIONS[:4], timeout_s=None, workers=pool,
                          group_size=G)


def test_building_a_function_is_not_its_calls_time(monkeypatch):
    monkeypatch.setattr(W, "KILL_GRACE_S", 0.5)
    spec = {"name": f"{__name__}:slow_build", "seconds": 3.0}
    func = slow_build(0.0)
    workers = RewardWorkers(2, [func], [spec])
    try:  # every worker built it (3 s) before its first call: no call is killed 2.5 s after it was sent
        out = score_completions([func], None, PROMPTS, COMPLETIONS, timeout_s=2.0, workers=workers, group_size=G)
        assert out.total.tolist() == [1.0] * len(COMPLETIONS)
        for w in workers._workers:  # their replacements build it before they take a call, too
            os.kill(w.process.pid, signal.SIGKILL)
        out = score_completions([func], None, PROMPTS, COMPLETIONS, timeout_s=2.0, workers=workers, group_size=G)
        assert out.total.tolist() == [1.0] * len(COMPLETIONS)
    finally:
        workers.close()


def test_worker_i_is_seeded_seed_plus_i():
    draws = []
    for _ in range(2):
        workers = RewardWorkers(2, [drawn], seed=3)
        try:
            draws.append(score_completions([drawn], None, PROMPTS[:2 * G], COMPLETIONS[:2 * G], workers=workers,
                                           group_size=G).total.tolist())
        finally:
            workers.close()
    assert draws[0] == draws[1]  # the same seed, the same draws
    first, second = draws[0][:G], draws[0][G:]
    assert first != second  # the two slices' workers: seeds 3 and 4
    random.seed(3)
    assert first == pytest.approx([random.random() for _ in range(G)])


def test_a_workers_calls_draw_from_its_seed_whatever_its_imports_drew():
    """A module that draws at import (a lent GPU machine's packages did: the test above failed there):
    the calls still draw seed + i's numbers, and what the import drew is reproducible and not those."""
    from tests.rewards.draws_at_import import drawn_after_import, table_entry

    runs = []
    for _ in range(2):
        workers = RewardWorkers(2, [drawn_after_import, table_entry], seed=3)
        try:
            runs.append([score_completions([f], None, PROMPTS[:2 * G], COMPLETIONS[:2 * G], workers=workers,
                                           group_size=G).total.tolist() for f in (drawn_after_import, table_entry)])
        finally:
            workers.close()
    (draws, table), again = runs[0], runs[1]
    assert again == [draws, table]  # the same seed, the same draws, at import too
    random.seed(3)
    assert draws[:G] == pytest.approx([random.random() for _ in range(G)])
    random.seed(4)
    assert draws[G:] == pytest.approx([random.random() for _ in range(G)])
    assert table[0] not in draws and table[0] != table[G]  # the import's stream is its own, per worker


def test_the_trainers_own_functions_run_while_the_workers_run_theirs(pool, tmp_path):
    columns = {"marks": [str(tmp_path)] * 8}
    out = score_completions([waits_for_the_trainer, WaitsForAWorker()], None, PROMPTS[:8], COMPLETIONS[:8],
                            columns, workers=pool, group_size=G)
    assert out.per_func["waits_for_the_trainer"].tolist() == [1.0] * 8  # it saw the trainer's function start
    assert out.per_func["waits_for_a_worker"].tolist() == [1.0] * 8  # ... which saw a worker's start first


def test_a_script_that_never_closes_its_workers_still_ends(tmp_path):
    """multiprocessing's exit handler would SIGTERM the workers, who ignore it, and wait for them for ever."""
    script = tmp_path / "score.py"
    script.write_text(textwrap.dedent("""
        from grouprl.rewards import math_accuracy, score_completions
        from grouprl.rewards.workers import RewardWorkers

        if __name__ == "__main__":
            workers = RewardWorkers(2, [math_accuracy])
            out = score_completions([math_accuracy], None, ["p"] * 4, ["42", "41", "42", "x"], {"answer": ["42"] * 4},
                                    workers=workers, group_size=2)
            print("scored", out.total.tolist())
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "scored [1.0, 0.0, 1.0, 0.0]" in out.stdout


def test_workers_and_their_server_end_when_the_trainer_is_killed_mid_call(tmp_path):
    """A fork server's child holds the pipe by which the server learns that the trainer is gone: a worker
    that kept it would keep the server, and so itself, alive for ever after a SIGKILL."""
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
        from grouprl.rewards.workers import RewardWorkers
        from multiprocessing import forkserver
        import test_workers as t

        if __name__ == "__main__":
            workers = RewardWorkers(1, [t.sleeps])
            workers.submit(t.sleeps, {{"prompts": ["p"], "completions": ["c"]}}, 1, 1, None)
            time.sleep(1.0)  # the call is running
            print(workers._workers[0].process.pid, forkserver._forkserver._forkserver_pid, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """))
    printed = tmp_path / "pids.txt"  # a file, not a pipe: a pipe's reader would wait for every process holding it
    with open(printed, "w") as stdout:
        subprocess.run([sys.executable, str(script)], stdout=stdout, stderr=subprocess.DEVNULL, timeout=120,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    pids = [int(x) for x in printed.read_text().split()]
    assert len(pids) == 2
    end = time.monotonic() + 20  # the call sleeps 60 s: only the trainer's end can stop it in time
    while any(_alive(pid) for pid in pids) and time.monotonic() < end:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), "a worker or its fork server outlived the trainer"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = pathlib.Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"))  # a zombie has ended


def test_workers_that_keep_ending_outside_calls_break_the_pool_with_the_reason():
    workers = RewardWorkers(1, [worker_pid])
    try:
        for _ in range(W.MAX_FAILED_STARTS):  # each replacement killed before any call came back
            pid = workers._workers[0].process.pid
            os.kill(pid, signal.SIGKILL)
            end = time.monotonic() + 30
            while workers._workers and workers._workers[0].process.pid == pid and workers._broken is None \
                    and time.monotonic() < end:
                time.sleep(0.05)
        with pytest.raises(RewardFunctionError, match="keep ending before a call comes back"):
            score_completions([worker_pid], None, PROMPTS[:4], COMPLETIONS[:4], workers=workers, group_size=G)
        workers._thread.join(timeout=10)
        assert not workers._thread.is_alive()  # the broken pool's thread has stopped, not spinning
    finally:
        workers.close()


def test_a_build_that_hangs_fails_the_start_with_the_reason(monkeypatch):
    monkeypatch.setattr(W, "BUILD_TIMEOUT_S", 0.5)
    with pytest.raises(ValueError, match="did not build the reward functions within 0 s"):
        RewardWorkers(1, [slow_build(0.0)], [{"name": f"{__name__}:slow_build", "seconds": 30.0}])
