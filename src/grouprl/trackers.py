"""Experiment trackers a run reports to (`report_to`, TRL's field): tensorboard, trackio, wandb, mlflow.

Each tracker is an optional extra (`pip install 'grouprl[trackio]'`, ...), imported only when
named. Every tracker gets the same things from `RunLogger` (runlog.py):
- at the start, the resolved config and the run's metadata (`start`);
- every logging step, every finite scalar of metrics.jsonl, eval results included (`log`);
- every `log_completions_steps`, a table of completions (`log_table`): the tracker's own table
  type in trackio and wandb (an artifact table in mlflow), a markdown table as text in TensorBoard.

Offline: trackio always writes its local store (`TRACKIO_DIR`, default
~/.cache/huggingface/trackio; `trackio show` reads it); wandb with `WANDB_MODE=offline` writes
`output_dir/wandb/offline-run-*`, which `wandb sync` uploads later (wandb's service writes the
run file's last block moments after `run.finish()` returns, at the latest when the process exits); mlflow writes where
`MLFLOW_TRACKING_URI` points (MLflow 3 refuses its old `./mlruns` file store unless
`MLFLOW_ALLOW_FILE_STORE=true`; its default, `sqlite:///mlflow.db`, needs the full `mlflow`
package, not `mlflow-skinny`). mlflow metric names are mapped to the characters it accepts
(`eval/pass@4` -> `eval/pass_at_4`, `rewards/<lambda>/mean` -> `rewards/_lambda_/mean`).

Tested (tests/trainer/test_trackers.py) by reading back what a tiny run wrote, offline: wandb's
offline run file, trackio's local database, TensorBoard's events, and mlflow's file store through
`MlflowClient` (mlflow-skinny 3.17: config as params, every scalar at its step, the completions
table artifact, a resume, after a finish or a crash, continuing the same run).

Project names: `TRACKIO_PROJECT`, `WANDB_PROJECT`, `MLFLOW_EXPERIMENT_NAME`, default "grouprl";
the run's name is `run_name` (default: the output folder's name). A resumed run continues the
same tracker run (wandb's and mlflow's ids are kept in `output_dir`). Steps the interrupted run
logged after its last checkpoint are computed again; TensorBoard drops its copies and takes the new
ones, while trackio, wandb and mlflow keep theirs and are not sent those steps again (wandb refuses a
step below its last, and mlflow and trackio would show two points a step). A resume replays the same
batches and draws, so on one machine the values match; metrics.jsonl holds the resumed run's.

A tracker named in `report_to` that cannot start is an error, never a run that trains untracked:
what can be checked without starting it (`tracker_problems`: the package, mlflow's sqlite store
without SQLAlchemy, a TensorBoard folder that cannot be written, a `WANDB_MODE` that wandb's
settings refuse) is a ConfigError before any model loads; any other failure to start (a dead
server, a resumed mlflow run the store lacks) is a `TrackerError` from RunLogger before the first
step. A tracker that fails mid-run (disk full, a dropped connection) is RunLogger's business: it
warns once, drops the tracker, and training goes on; metrics.jsonl keeps every number.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

TRACKERS = ("tensorboard", "trackio", "wandb", "mlflow")
_PACKAGE = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb", "mlflow": "mlflow"}


class TrackerError(RuntimeError):
    """A tracker named in `report_to` failed to start; the message names it, the reason and the fix."""


def missing_tracker_packages(names: list[str]) -> list[str]:
    """The trackers named whose package is not installed."""
    return [n for n in names if n in _PACKAGE and importlib.util.find_spec(_PACKAGE[n]) is None]


def tracker_problems(names: list[str], output_dir: str | Path) -> list[str]:
    """Why the trackers named would fail to start, as far as can be told without starting them (the
    trainer raises these before any model loads); each message names the fix. Empty: no problem seen."""
    missing = missing_tracker_packages(names)
    if missing:
        return [f"report_to: {', '.join(missing)} is not installed: pip install "
                + " ".join(f"'grouprl[{m}]'" for m in missing) + " (or drop it from report_to)"]
    problems = []
    if "tensorboard" in names and (why := _unwritable(Path(output_dir) / "tensorboard")):
        problems.append(f"report_to: tensorboard writes {Path(output_dir) / 'tensorboard'}, but {why}: free that "
                        "path, pick another output_dir, or drop tensorboard from report_to")
    if "mlflow" in names and (why := _mlflow_store_problem()):
        problems.append(f"report_to: mlflow: {why}")
    if "wandb" in names and (why := _wandb_mode_problem()):
        problems.append(f"report_to: wandb: {why}")
    return problems


def _wandb_mode_problem() -> str | None:
    """A `WANDB_MODE` that wandb refuses, as wandb's own settings model judges it (which modes it
    takes changes between versions); wandb itself would refuse it only at `wandb.init`."""
    mode = os.environ.get("WANDB_MODE")
    if mode is None:
        return None
    import wandb

    try:
        wandb.Settings(mode=mode)
        return None
    except Exception as e:  # pydantic's ValidationError lists its errors; anything else, wandb.init names
        errors = [err for err in getattr(e, "errors", list)() if tuple(err.get("loc", ())) == ("mode",)]
    if not errors:
        return None
    expected = errors[0].get("ctx", {}).get("expected")
    return (f"WANDB_MODE={mode!r} is not a mode wandb takes" + (f" ({expected})" if expected else "")
            + ": set it to offline (written to output_dir/wandb, `wandb sync` uploads it), online or "
            "disabled, or unset it")


def _unwritable(folder: Path) -> str | None:
    """Why `folder` cannot be created or written (its nearest existing ancestor decides), or None."""
    probe = folder
    while not probe.exists():
        probe = probe.parent  # ends at the root or ".", which exist
    if not probe.is_dir():
        return f"{probe} is not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None


def _mlflow_store_problem() -> str | None:
    """mlflow 3's default store, sqlite, needs SQLAlchemy, which mlflow-skinny lacks (mlflow's own
    error there speaks of the "model registry", naming no fix)."""
    import mlflow

    uri = mlflow.get_tracking_uri()
    if uri.startswith("sqlite:") and importlib.util.find_spec("sqlalchemy") is None:
        return (f"the tracking URI {uri} (mlflow 3's default) needs the full mlflow package: pip install "
                "'grouprl[mlflow]', or set MLFLOW_TRACKING_URI (a server, or a folder with "
                "MLFLOW_ALLOW_FILE_STORE=true)")
    return None


class Tracker:
    """One experiment tracker. Subclasses import their library in `__init__`. `rewinds`: on resume from
    step S it drops what the interrupted run logged after S (TensorBoard's purge_step), so the resumed
    run logs those steps again; the others keep them, and RunLogger does not log them twice where the
    tracker `continued` the interrupted run's tracker run (a new one, e.g. a tracker added on resume,
    gets every step)."""

    name = ""
    rewinds = False
    continued = False

    def log(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def log_table(self, step: int, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError


class TensorBoard(Tracker):
    name = "tensorboard"
    rewinds = True

    def __init__(self, out: Path, run_name: str, config: dict[str, Any], resume_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=resume_step + 1)
        if not resume_step:
            self.writer.add_text("config", _markdown(["field", "value"], [[k, repr(v)] for k, v in config.items()]))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)

    def log_table(self, step: int, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.writer.add_text(key, _markdown(columns, rows), step)

    def finish(self) -> None:
        self.writer.close()


class _RunTracker(Tracker):
    """A tracker with a run object that logs dicts by step and has a table type (trackio, wandb:
    trackio follows wandb's API)."""

    run: Any
    table: Any  # the library's Table class

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def log_table(self, step: int, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({key: self.table(columns=columns, data=rows)}, step=step)

    def finish(self) -> None:
        self.run.finish()


class Trackio(_RunTracker):
    name = "trackio"

    def __init__(self, out: Path, run_name: str, config: dict[str, Any], resume_step: int):
        import trackio

        self.table = trackio.Table
        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "grouprl"), name=run_name, config=config,
                                resume="allow" if resume_step else "never", embed=False)
        self.continued = bool(resume_step)  # the project's run of that name, if it has one


def _write_id(path: Path, run_id: str) -> None:
    """The tracker run's id beside the run, through a temporary file renamed into place (a kill mid-write
    left an empty file, and the next --resume failed); not written again when it holds that id already."""
    if path.is_file() and path.read_text().strip() == run_id:
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(run_id + "\n")
    tmp.replace(path)


class Wandb(_RunTracker):
    name = "wandb"

    def __init__(self, out: Path, run_name: str, config: dict[str, Any], resume_step: int):
        import wandb

        self.table = wandb.Table
        id_file = out / "wandb_run_id"
        run_id = (id_file.read_text().strip() if resume_step and id_file.is_file() else "") or uuid.uuid4().hex[:8]
        self.continued = bool(resume_step) and id_file.is_file() and id_file.read_text().strip() == run_id
        _write_id(id_file, run_id)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "grouprl"), name=run_name, id=run_id,
                              resume="allow", dir=str(out), config=config)


class Mlflow(Tracker):
    """Through `MlflowClient` and the run's id, not mlflow's fluent API (`mlflow.start_run`,
    `log_metrics`): the fluent API keeps one active run per process, which a run that raised (no
    `finish`) or a tracker RunLogger dropped left open, so the next run's tracker (a resume in the
    same process) failed to start; and it would clash with a user's own active run."""

    name = "mlflow"

    def __init__(self, out: Path, run_name: str, config: dict[str, Any], resume_step: int):
        import mlflow
        from mlflow.entities import Metric, Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        if problem := _mlflow_store_problem():
            raise RuntimeError(problem)
        self.client, self.metric = MlflowClient(), Metric
        id_file = out / "mlflow_run_id"
        run_id = id_file.read_text().strip() if resume_step and id_file.is_file() else None
        new = run_id is None
        if not new:  # resumed: the same run goes on (an id the store lacks is an error, not a new run)
            try:
                self.client.get_run(run_id)
            except MlflowException as e:
                raise RuntimeError(f"the resumed run's mlflow run {run_id} ({id_file}) is not in the tracking "
                                   f"store {mlflow.get_tracking_uri()} ({e.message}): set MLFLOW_TRACKING_URI to "
                                   f"the store it was logged to, or delete {id_file} to log the rest of the run "
                                   "as a new mlflow run") from None
            self.client.update_run(run_id, status="RUNNING")
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "grouprl")
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
            run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        _write_id(id_file, run_id)
        self.run_id, self.continued = run_id, not new
        if new:  # a resume without an id file (it opens a new run) logs them too
            # mlflow takes at most 100 params a batch, and the config has more: split here, not by the client
            params = [Param(_mlflow_key(k), str(v)[:500]) for k, v in config.items()]
            for i in range(0, len(params), 100):
                self.client.log_batch(run_id, params=params[i:i + 100])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self.metric(_mlflow_key(k), v, now, step)
                                                    for k, v in scalars.items()])

    def log_table(self, step: int, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.client.log_table(self.run_id, {c: [r[i] for r in rows] for i, c in enumerate(columns)},
                              artifact_file=f"{_mlflow_key(key)}/step-{step:06d}.json")

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


def _mlflow_key(key: str) -> str:
    """A metric or param name mlflow accepts. It refuses any character but alphanumerics and `_-. /`
    (and `:` off Windows), and one bad name fails the whole batch: a reward function named
    `<lambda>` (`rewards/<lambda>/mean`) switched the tracker off at its first log. '@' -> '_at_'
    (`eval/pass@4` -> `eval/pass_at_4`); any other refused character -> '_'."""
    return re.sub(r"[^\w./\- ]", "_", key.replace("@", "_at_"))


OPENERS = {"tensorboard": TensorBoard, "trackio": Trackio, "wandb": Wandb, "mlflow": Mlflow}


def _markdown(columns: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        return (f"{v:.4g}" if isinstance(v, float) else str(v)).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows])
