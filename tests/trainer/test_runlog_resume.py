"""The run log on resume: rows after the checkpoint's step go, a last line torn by a kill in
mid-append goes, a damaged line elsewhere is an error that names the file and the line, and a
rewrite that fails loses no row."""

import errno
import json
from pathlib import Path

import pytest

from grouprl.runlog import RunLogger


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))


def test_rows_after_the_step_and_a_torn_last_line_are_dropped(tmp_path):
    rows = [json.dumps({"step": s, "loss": 0.1 * s}) for s in (1, 2, 3)]
    write(tmp_path / "metrics.jsonl", rows + ['{"step": 4, "lo'])
    RunLogger(tmp_path, resume_step=2, report_to=()).log(3, {"loss": 9.0})
    got = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert got == [{"step": 1, "loss": 0.1}, {"step": 2, "loss": 0.2}, {"step": 3, "loss": 9.0}]


def test_a_damaged_line_before_the_last_is_an_error_naming_it(tmp_path):
    write(tmp_path / "samples.jsonl", [json.dumps({"step": 1}), "{oops", json.dumps({"step": 2})])
    with pytest.raises(ValueError, match=r"samples.jsonl: line 2 is not JSON .*delete that line to resume"):
        RunLogger(tmp_path, resume_step=2, report_to=())


def test_a_failed_rewrite_on_resume_keeps_every_logged_row(tmp_path, monkeypatch):
    """The disk fills halfway through rewriting metrics.jsonl for a resume from step 1: the error comes
    through, and the file still holds the three rows logged before (rewritten in place, it held half a row)."""
    rows = [json.dumps({"step": s, "loss": 0.1 * s}) for s in (1, 2, 3)]
    write(tmp_path / "metrics.jsonl", rows)
    real = Path.write_text

    def disk_full(self, data, *args, **kwargs):
        real(self, data[: len(data) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(OSError, match="No space left"):
        RunLogger(tmp_path, resume_step=1, report_to=())
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == rows


def test_numbers_json_cannot_hold_are_written_null(tmp_path):
    """Python's json wrote bare NaN and Infinity, which strict readers (jq, JavaScript, pandas) refuse: a
    correlation on a step without usable groups, a loss on a skipped step, a reward a function left out."""
    def refuse(constant):
        raise ValueError(constant)

    log = RunLogger(tmp_path, report_to=())
    log.log(1, {"loss": float("nan"), "grad_norm": float("inf"), "alarms": [{"value": float("-inf")}], "kl": 0.5})
    log.log_samples(1, [{"rewards/f": float("nan"), "advantage": 1.0}])
    log.write_json("summary.json", {"eval_before": {"accuracy": float("nan")}})
    row = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=refuse)
    assert row == {"step": 1, "loss": None, "grad_norm": None, "alarms": [{"value": None}], "kl": 0.5}
    assert json.loads((tmp_path / "samples.jsonl").read_text(), parse_constant=refuse)["rewards/f"] is None
    assert json.loads((tmp_path / "summary.json").read_text(), parse_constant=refuse) == {
        "eval_before": {"accuracy": None}}



def test_an_eval_made_again_on_resume_drops_what_the_killed_run_logged_after_its_step(tmp_path):
    """Killed after an eval (and its alarms) was logged but before it was recorded beside the checkpoint of
    step 2: the resumed run evaluates step 2 again, so the eval's row and its alarms' row go, and the
    step's own row stays; without eval_again, the rows of step 2 all stay."""
    rows = [{"step": 1, "loss": 0.1}, {"step": 2, "loss": 0.2}, {"step": 2, "eval/accuracy": 0.5},
            {"step": 2, "alarms": [{"kind": "eval_divergence"}]}, {"step": 3, "loss": 0.3}]
    for again, kept in ((True, rows[:2]), (False, rows[:4])):
        write(tmp_path / "metrics.jsonl", [json.dumps(r) for r in rows])
        RunLogger(tmp_path, resume_step=2, eval_again=again, report_to=())
        assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == kept


def test_an_eval_made_again_on_resume_drops_its_alarm_examples_from_samples(tmp_path):
    """samples.jsonl at step 2 holds the step's own completions, a training alarm's examples and the
    killed eval's alarm examples: the resumed run evaluates step 2 again, so only the last go."""
    rows = [{"step": 2, "completion": "a"}, {"step": 2, "alarm": "length_hacking", "completion": "b"},
            {"step": 2, "alarm": "eval_divergence", "completion": "c"}, {"step": 3, "completion": "d"}]
    for again, kept in ((True, rows[:2]), (False, rows[:3])):
        write(tmp_path / "samples.jsonl", [json.dumps(r) for r in rows])
        RunLogger(tmp_path, resume_step=2, eval_again=again, report_to=())
        assert [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()] == kept


def test_a_resumed_run_does_not_report_again_the_steps_a_continued_tracker_kept(tmp_path, monkeypatch, caplog):
    """The interrupted run logged steps 1-5 and checkpointed at 3. A tracker that continued its run and
    keeps what it had (wandb, mlflow, trackio) is not sent steps 4-5 again, nor their tables; one that
    rewinds (TensorBoard's purge_step) and one new to the run (added on resume) get them."""
    import logging

    from grouprl import trackers

    got: dict[str, list] = {}

    def opener(name, rewinds=False, continued=True):
        class Fake(trackers.Tracker):
            def __init__(self, *args):
                self.name, self.rewinds, self.continued = name, rewinds, continued
                got[name] = []

            def log(self, step, scalars):
                got[name].append(step)

            def log_table(self, step, key, columns, rows):
                got[name].append(f"table {step}")

            def finish(self):
                pass

        return Fake

    for name, kw in {"kept": {}, "rewinds": {"rewinds": True}, "new": {"continued": False}}.items():
        monkeypatch.setitem(trackers.OPENERS, name, opener(name, **kw))
    write(tmp_path / "metrics.jsonl", [json.dumps({"step": s, "loss": 0.1 * s}) for s in range(1, 6)])
    with caplog.at_level(logging.INFO, logger="grouprl.runlog"):
        log = RunLogger(tmp_path, resume_step=3, report_to=("kept", "rewinds", "new"))
    assert "steps 4-5 were reported to kept by the interrupted run" in caplog.text
    for step in (4, 5, 6):
        log.log(step, {"loss": 0.1 * step})
        log.log_table(step, "completions", [{"completion": "x"}])
    assert got["kept"] == [6, "table 6"]
    assert got["rewinds"] == got["new"] == [4, "table 4", 5, "table 5", 6, "table 6"]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        1, 2, 3, 4, 5, 6]  # metrics.jsonl holds every step once, the resumed run's


def test_killed_twice_in_a_row_the_trackers_still_get_each_step_once(tmp_path, monkeypatch):
    """Steps 1-7 reported, checkpoint at 5; the first resume reports step 6 and is killed; the second finds
    step 6 alone past the checkpoint in metrics.jsonl, but the tracker has 7 too (a review's run sent it
    twice): the last step sent is kept beside the run, and step 7 is not sent again."""
    from grouprl import trackers

    got: list[int] = []

    class Kept(trackers.Tracker):
        name, continued = "kept", True

        def __init__(self, *args):
            pass

        def log(self, step, scalars):
            got.append(step)

        def finish(self):
            pass

    monkeypatch.setitem(trackers.OPENERS, "kept", Kept)
    log = RunLogger(tmp_path, report_to=("kept",))
    for step in range(1, 8):
        log.log(step, {"loss": 0.1 * step})
    log = RunLogger(tmp_path, resume_step=5, report_to=("kept",))  # first resume: logs step 6, then killed
    log.log(6, {"loss": 0.6})
    log = RunLogger(tmp_path, resume_step=5, report_to=("kept",))  # second resume
    for step in (6, 7, 8):
        log.log(step, {"loss": 0.1 * step})
    assert got == [1, 2, 3, 4, 5, 6, 7, 8]
