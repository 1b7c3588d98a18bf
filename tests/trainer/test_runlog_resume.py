"""The run log on resume: rows after the checkpoint's step go, a last line torn by a kill in
mid-append goes, and a damaged line elsewhere is an error that names the file and the line."""

import json

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
