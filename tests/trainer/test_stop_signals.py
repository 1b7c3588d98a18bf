"""SIGTERM / SIGINT during train(): the step in progress finishes, its checkpoint is written, train()
raises TrainingStopped, and resuming reproduces the uninterrupted run exactly; a second signal stops
at once; the handlers are put back; `grouprl train` exits 143 and prints the command that resumes."""

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grouprl.checkpoint import latest_checkpoint, list_checkpoints
from grouprl.distributed import DistContext
from grouprl.signals import REPEAT_WINDOW_S, StopNow, StopSignals, TrainingStopped
from grouprl.trainer import Trainer
from tests.distributed.launch import torchrun_env
from tests.trainer.conftest import digit_fraction, read_metrics

REPO = Path(__file__).resolve().parents[2]


def _strip_timing(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "eval/seconds"))} for r in rows]


def _send_at(trainer: Trainer, method: str, step: int, signum: int = signal.SIGTERM) -> None:
    """Wrap `trainer.<method>` (or `trainer.updater.<method>`, written "updater.<method>") so that
    its first call in `step` signals the process, inside that stage."""
    owner = trainer.updater if method.startswith("updater.") else trainer
    method = method.removeprefix("updater.")
    original, sent = getattr(owner, method), []

    def wrapped(*args, **kwargs):
        if trainer.step == step and not sent:
            sent.append(signum)
            os.kill(os.getpid(), signum)  # the handler runs here, before the stage goes on
        return original(*args, **kwargs)

    setattr(owner, method, wrapped)


# (stage the signal lands in, the step it lands in): the step it stops after, whatever the stage
POINTS = [("generate", 1), ("score", 2), ("updater.optimizer_step", 2), ("_log_eval", 2), ("updater.optimizer_step", 4)]


def test_a_signal_anywhere_in_a_step_stops_after_it_and_resume_reproduces(make_cfg, tmp_path):
    """eval_steps=2 and save_steps=2: a stop in step 2's update skips step 2's eval (made up on
    resume, where it counts for the best model as it would have); a stop in step 2's eval comes after
    the periodic checkpoint, which is not written twice."""
    kw = dict(max_steps=5, save_steps=2, eval_steps=2, eval_fraction=0.1, beta=0.04, num_iterations=2,
              warmup_steps=2, lr_scheduler_type="cosine", learning_rate=1e-2, metric_for_best_model="reward_mean")
    full = make_cfg(output_dir=str(tmp_path / "full"), **kw)
    best = Trainer(full).train()["best_checkpoint"]
    expected = _strip_timing(read_metrics(full.output_dir))
    final = load_file(f"{full.output_dir}/checkpoints/step-000005/trainable.safetensors")

    for method, step in POINTS:
        where = f"{method} at step {step}"
        cut = make_cfg(output_dir=str(tmp_path / f"cut-{method}-{step}"), **kw)
        trainer = Trainer(cut)
        _send_at(trainer, method, step)
        handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
        with pytest.raises(TrainingStopped) as stopped:
            trainer.train()
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers, where
        assert stopped.value.step == step and stopped.value.signum == signal.SIGTERM, where
        assert stopped.value.checkpoint == latest_checkpoint(cut.output_dir), where
        assert stopped.value.checkpoint.name == f"step-{step:06d}", where
        rows = read_metrics(cut.output_dir)
        assert [r["step"] for r in rows if "reward/mean" in r] == list(range(1, step + 1)), where
        evals = [0] + [s for s in (2, 4) if s < step or (s == step and method == "_log_eval")]
        assert [r["step"] for r in rows if "eval/accuracy" in r] == evals, where  # a stop in a step skips its eval
        summary = json.loads((Path(cut.output_dir) / "summary.json").read_text())
        assert summary["stopped_by"] == "SIGTERM" and summary["steps"] == step, where

        summary = Trainer(cut).train(resume=True)
        assert "stopped_by" not in summary, where
        assert {k: v for k, v in summary["best_checkpoint"].items() if k != "checkpoint"} == {
            k: v for k, v in best.items() if k != "checkpoint"}, where
        assert _strip_timing(read_metrics(cut.output_dir)) == expected, where
        resumed = load_file(f"{cut.output_dir}/checkpoints/step-000005/trainable.safetensors")
        assert all(torch.equal(final[k], resumed[k]) for k in final), where


def test_a_stopped_runs_summary_names_its_best_checkpoint(make_cfg):
    """summary.json of a run stopped by a signal (or an alarm, which is not resumed) names the best checkpoint
    on disk, as a finished run's does; it was left out."""
    cfg = make_cfg(max_steps=4, eval_steps=1, eval_fraction=0.1, max_eval_samples=4,
                   metric_for_best_model="reward_mean")
    trainer = Trainer(cfg)
    _send_at(trainer, "updater.optimizer_step", 2)
    with pytest.raises(TrainingStopped):
        trainer.train()
    summary = json.loads((Path(cfg.output_dir) / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and summary["best_checkpoint"]["step"] == 1
    assert Path(summary["best_checkpoint"]["checkpoint"]).name == "step-000001"


class KilledInEval(Exception):
    pass


def test_a_signal_during_eval_after_finds_the_last_step_saved(make_cfg, tmp_path):
    """The last step is saved before eval_after, which runs under the stop handlers: a SIGTERM there
    (a long eval, a scheduler's notice) lets the eval finish and kills nothing. It used to come after
    the handlers were put back, so the signal killed the run and every step since the last periodic
    checkpoint was lost. A run cut short during eval_after resumes to that eval alone, once."""
    kw = dict(max_steps=3, save_steps=2, eval_fraction=0.1, max_eval_samples=4)
    cfg = make_cfg(output_dir=str(tmp_path / "signal"), **kw)
    trainer = Trainer(cfg)
    seen, outside = [], signal.getsignal(signal.SIGTERM)
    original = trainer._log_eval

    def eval_after_signalled(step, progress):
        if step == 3:
            ours = signal.getsignal(signal.SIGTERM) is not outside  # the stop handlers are in place
            seen.append((latest_checkpoint(cfg.output_dir).name, ours))
            if ours:  # (outside them, the signal would end pytest itself)
                os.kill(os.getpid(), signal.SIGTERM)
        return original(step, progress)

    trainer._log_eval = eval_after_signalled
    summary = trainer.train()
    assert seen == [("step-000003", True)] and "eval_after" in summary and "stopped_by" not in summary
    assert [r["step"] for r in read_metrics(cfg.output_dir) if "eval/accuracy" in r] == [0, 3]

    cut = make_cfg(output_dir=str(tmp_path / "cut"), **kw)
    trainer = Trainer(cut)

    def killed_in_eval_after(step, progress, original=trainer._log_eval):
        if step == 3:
            raise KilledInEval  # as a SIGKILL after the scheduler's grace period would end it
        return original(step, progress)

    trainer._log_eval = killed_in_eval_after
    with pytest.raises(KilledInEval):
        trainer.train()
    assert latest_checkpoint(cut.output_dir).name == "step-000003"  # saved before the eval that was cut
    resumed = Trainer(cut).train(resume=True)
    assert resumed["eval_after"]["accuracy"] == summary["eval_after"]["accuracy"]
    rows = read_metrics(cut.output_dir)
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3]  # nothing trained again
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 3]
    assert Trainer(cut).train(resume=True) == resumed  # finished: eval_after is recorded beside step 3


class KilledInRecord(Exception):
    pass


@pytest.mark.parametrize("where", ["eval_after", "made_up"])
def test_a_kill_between_an_eval_and_its_record_logs_it_once(make_cfg, tmp_path, where):
    """An eval after the checkpoint of its step (eval_after, or one made up on resume) is logged, then
    recorded beside that checkpoint (loop.pt). Killed between the two, the resumed run evaluates again:
    the first row of that eval goes, as the rows of steps after a checkpoint do, so it is logged once."""
    kw = dict(max_steps=4, save_steps=4, eval_steps=2, eval_fraction=0.1, max_eval_samples=4)
    cut = make_cfg(output_dir=str(tmp_path / "cut"), **kw)
    trainer = Trainer(cut)
    if where == "made_up":  # stopped in step 2 with its eval pending; the resumed run makes it up, then is killed
        _send_at(trainer, "updater.optimizer_step", 2)
        with pytest.raises(TrainingStopped):
            trainer.train()
        trainer = Trainer(cut)

    def killed_in_record(weights=True, original=trainer.save):
        if not weights:
            raise KilledInRecord  # the eval's row is in metrics.jsonl, loop.pt not yet written
        return original(weights)

    trainer.save = killed_in_record
    with pytest.raises(KilledInRecord):
        trainer.train(resume=where == "made_up")
    eval_step = 4 if where == "eval_after" else 2
    assert [r["step"] for r in read_metrics(cut.output_dir) if "eval/accuracy" in r][-1] == eval_step
    Trainer(cut).train(resume=True)
    evals = [r["step"] for r in read_metrics(cut.output_dir) if "eval/accuracy" in r]
    assert evals == [0, 2, 4]


def test_an_eval_made_up_on_resume_is_logged_once_if_the_run_crashes_before_its_next_save(make_cfg, tmp_path):
    """Stopped in step 2 (its eval left pending), resumed (the eval made up, not a best, so no new
    checkpoint), crashed in step 3, resumed again: the made-up eval is recorded beside step 2's
    checkpoint, so the second resume does not log it twice."""
    kw = dict(max_steps=4, save_steps=4, eval_steps=2, eval_fraction=0.1, max_eval_samples=4)
    full = make_cfg(output_dir=str(tmp_path / "full"), **kw)
    Trainer(full).train()
    cut = make_cfg(output_dir=str(tmp_path / "cut"), **kw)
    trainer = Trainer(cut)
    _send_at(trainer, "updater.optimizer_step", 2)
    with pytest.raises(TrainingStopped):
        trainer.train()
    trainer = Trainer(cut)
    trainer.train_step = lambda original=trainer.train_step: original() if trainer.step < 2 else 1 / 0
    with pytest.raises(ZeroDivisionError):
        trainer.train(resume=True)
    Trainer(cut).train(resume=True)
    assert _strip_timing(read_metrics(cut.output_dir)) == _strip_timing(read_metrics(full.output_dir))


def test_a_second_signal_stops_at_once_without_a_checkpoint(make_cfg):
    before = signal.getsignal(signal.SIGINT)  # Python's default_int_handler, or SIG_IGN in a job started with &
    cfg = make_cfg(max_steps=4, save_steps=1)
    trainer = Trainer(cfg)
    _send_at(trainer, "generate", 3, signal.SIGINT)
    _send_at(trainer, "updater.optimizer_step", 3, signal.SIGINT)  # the second, later in the same step ...
    original = trainer.updater.optimizer_step

    def later(*args, **kwargs):  # ... late enough not to be taken for the first delivered twice
        if trainer.step == 3:
            time.sleep(REPEAT_WINDOW_S)
        return original(*args, **kwargs)

    trainer.updater.optimizer_step = later
    with pytest.raises(StopNow) as stopped:
        trainer.train()
    assert stopped.value.signum == signal.SIGINT and isinstance(stopped.value, KeyboardInterrupt)
    assert [p.name for p in list_checkpoints(cfg.output_dir)] == ["step-000001", "step-000002"]
    assert signal.getsignal(signal.SIGINT) is before  # the handler the run found is put back


def test_the_same_signal_delivered_twice_at_once_is_one_request(make_cfg, caplog):
    """Ctrl-C under torchrun: the terminal signals the worker, and torchrun passes it on. The repeat is
    said once, so that a user who pressed twice knows why the step goes on."""
    cfg = make_cfg(max_steps=4)
    trainer = Trainer(cfg)
    _send_at(trainer, "generate", 2, signal.SIGINT)
    _send_at(trainer, "score", 2, signal.SIGINT)
    with caplog.at_level("WARNING", logger="grouprl.signals"), pytest.raises(TrainingStopped) as stopped:
        trainer.train()
    assert stopped.value.step == 2 and stopped.value.signum == signal.SIGINT
    assert latest_checkpoint(cfg.output_dir).name == "step-000002"
    said = [r.getMessage() for r in caplog.records if "taken as the same request" in r.getMessage()]
    assert said == ["SIGINT again within 2 s is taken as the same request (torchrun passes a Ctrl-C on); press "
                    "again later to stop at once"]


def test_handlers_are_installed_only_in_the_main_thread():
    seen = []

    def in_a_thread():
        with StopSignals() as stop:
            seen.append(signal.getsignal(signal.SIGTERM) == stop._handle)

    previous = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert seen == [False] and signal.getsignal(signal.SIGTERM) == previous
    with StopSignals() as stop:
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        assert stop.requested(DistContext()) is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested(DistContext()) == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == previous


def test_cli_exits_143_with_the_resume_command_and_a_checkpoint(make_cfg, tmp_path):
    """A real SIGTERM from outside, once the first step is logged: the run stops after the step in
    progress, prints the exact command that resumes it, and exits 128 + 15."""
    cfg = make_cfg(max_steps=40)  # far more steps than the signal lets run
    out = tmp_path / "cli run"  # a space: the printed command must quote it
    path = tmp_path / "run.yaml"
    cfg.save_yaml(path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    argv = ["train", str(path), "--output_dir", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "grouprl", *argv], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-3000:]
    steps = [r["step"] for r in read_metrics(out)]
    assert 1 <= steps[-1] < 40 and steps == list(range(1, steps[-1] + 1))
    assert latest_checkpoint(out).name == f"step-{steps[-1]:06d}"
    assert f"stopped by SIGTERM after step {steps[-1]}" in stderr
    command = stderr.split("continue with:\n")[1].splitlines()[0].strip()
    assert shlex.split(command) == ["grouprl", *argv, "--resume"]
    assert "done:" not in stdout


_calls = []


def digits_then_term_on_rank_1(prompts, completions, **kwargs):
    """digit_fraction; rank 1 alone sends itself SIGTERM when scoring its second step."""
    _calls.append(1)
    if os.environ.get("RANK") == "1" and len(_calls) == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    return digit_fraction(prompts, completions)


def test_under_torchrun_a_signal_to_one_rank_stops_every_rank_after_the_same_step(make_cfg, tmp_path):
    cfg = make_cfg(max_steps=6, num_threads=1,
                   reward_funcs=["tests.trainer.test_stop_signals:digits_then_term_on_rank_1"])
    path, out = tmp_path / "run.yaml", tmp_path / "run"
    cfg.save_yaml(path)
    env = torchrun_env()  # GPUs hidden: 2 CPU ranks on gloo on any machine (tests/distributed/launch.py)
    argv = ["train", str(path), "--output_dir", str(out)]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "grouprl", *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0  # torchrun reports its workers' 143 as a failure
    assert proc.stderr.count("stopped by SIGTERM after step 2;") == 1, proc.stderr[-4000:]  # rank 0 prints it
    assert proc.stderr.count("received SIGTERM") == 1  # rank 1 alone was signalled
    assert f"continue with:\n  torchrun --nproc-per-node 2 -m grouprl {shlex.join(argv)} --resume" in proc.stderr
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert [p.name for p in list_checkpoints(out)] == ["step-000002"]
    state = torch.load(out / "checkpoints/step-000002/state.pt", weights_only=False)
    assert len(state["rng_by_rank"]) == 2  # both ranks took part in the save
