"""Experiment trackers a run reports to (`report_to`, TRL's field): tensorboard, trackio, wandb, mlflow.

Each tracker is an optional extra (`pip install 'grouprl[trackio]'`, ...), imported only when
named. Every tracker gets the same things from `RunLogger` (runlog.py):
- at the start, the resolved config and the run's metadata (`start`);
- every logging step, every finite scalar of metrics.jsonl, eval results included (`log`);
- every `log_completions_steps`, a table of completions (`log_table`): the tracker's own table
  type in trackio and wandb (an artifact table in mlflow), a markdown table as text in TensorBoard.

Offline: trackio always writes its local store (`TRACKIO_DIR`, default
~/.cache/huggingface/trackio; `trackio show` reads it); wandb with `WANDB_MODE=offline` writes
`output_dir/wandb/offline-run-*`, which `wandb sync` uploads later; mlflow writes where
`MLFLOW_TRACKING_URI` points (MLflow 3 refuses its old `./mlruns` file store unless
`MLFLOW_ALLOW_FILE_STORE=true`; a `sqlite:///mlflow.db` URI needs the full `mlflow` package). The
mlflow tracker is written against mlflow's public API and not tested here.

Project names: `TRACKIO_PROJECT`, `WANDB_PROJECT`, `MLFLOW_EXPERIMENT_NAME`, default "grouprl";
the run's name is `run_name` (default: the output folder's name). A resumed run continues the
same tracker run (wandb's and mlflow's ids are kept in `output_dir`).

A tracker that fails (disk full, a bad key, a dead server) is RunLogger's business: it warns once,
drops the tracker, and training goes on; metrics.jsonl keeps every number.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from pathlib import Path
from typing import Any

TRACKERS = ("tensorboard", "trackio", "wandb", "mlflow")
_PACKAGE = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb", "mlflow": "mlflow"}


def missing_tracker_packages(names: list[str]) -> list[str]:
    """The trackers named whose package is not installed."""
    return [n for n in names if n in _PACKAGE and importlib.util.find_spec(_PACKAGE[n]) is None]


class Tracker:
    """One experiment tracker. Subclasses import their library in `__init__`."""

    name = ""

    def log(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def log_table(self, step: int, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError


class TensorBoard(Tracker):
    name = "tensorboard"

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


class Wandb(_RunTracker):
    name = "wandb"

    def __init__(self, out: Path, run_name: str, config: dict[str, Any], resume_step: int):
        import wandb

        self.table = wandb.Table
        id_file = out / "wandb_run_id"
        run_id = id_file.read_text().strip() if resume_step and id_file.is_file() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "grouprl"), name=run_name, id=run_id,
                              resume="allow", dir=str(out), config=config)


class Mlflow(Tracker):
    name = "mlflow"

    def __init__(self, out: Path, run_name: str, config: dict[str, Any], resume_step: int):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "grouprl"))
        id_file = out / "mlflow_run_id"
        run_id = id_file.read_text().strip() if resume_step and id_file.is_file() else None
        self.run = mlflow.start_run(run_id=run_id, run_name=None if run_id else run_name)
        id_file.write_text(self.run.info.run_id + "\n")
        if not resume_step:
            mlflow.log_params({k: str(v)[:500] for k, v in config.items()})

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in scalars.items()}, step=step)

    def log_table(self, step: int, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.mlflow.log_table({c: [r[i] for r in rows] for i, c in enumerate(columns)},
                              artifact_file=f"{key}/step-{step:06d}.json")

    def finish(self) -> None:
        self.mlflow.end_run()


OPENERS = {"tensorboard": TensorBoard, "trackio": Trackio, "wandb": Wandb, "mlflow": Mlflow}


def _markdown(columns: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        return (f"{v:.4g}" if isinstance(v, float) else str(v)).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows])
