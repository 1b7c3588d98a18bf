"""Where a run's numbers go: metrics.jsonl, the trackers (TensorBoard, trackio, wandb, mlflow), samples.jsonl,
summary.json, curves.png, and the live progress bar."""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

from tqdm.auto import tqdm

from grouprl.health import EVAL_ALARMS
from grouprl.trackers import OPENERS, Tracker, TrackerError

logger = logging.getLogger(__name__)

LOCK_FILE = ".grouprl.lock"
TRACKED = ".grouprl.tracked"  # the last step sent to the trackers (RunLogger)
# How long a run waits for output_dir held by another process before it refuses: on NFS a lock of a node
# that died is released only when the server's lease runs out (NFSv4: 90 s by default), and a requeued job
# may start on another node before that
LOCK_WAIT_S = 120.0
# the lock files this process holds, by (device, inode): a folder renamed or moved while held (a run that
# crashed, then resumed from its new place in the same process) is still ours
_LOCKS: dict[tuple[int, int], int] = {}


class OutputDirInUse(RuntimeError):
    """Another process runs in the output_dir (lock_output_dir)."""


def lock_output_dir(output_dir: str | Path) -> None:
    """Hold output_dir for this process until the run's RunLogger closes (or the process ends): a second
    run there (a job submitted twice, a requeued one while the first still runs) would delete the
    first's unfinished checkpoint as a killed save's leftovers, and both would append to metrics.jsonl.
    An flock on output_dir/.grouprl.lock, which the kernel drops with the process; it works on local
    disks and on NFS (as a POSIX lock); where the filesystem has no locks, a warning and no lock. A
    folder held by another process is waited for up to LOCK_WAIT_S, then OutputDirInUse names that
    process. Rank 0 calls it; a process that holds the folder may call
    it again (a notebook's next run)."""
    out = Path(output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) in _LOCKS:  # ours already
            os.close(fd)
            return
        deadline, said = time.monotonic() + LOCK_WAIT_S, False
        while not _try_flock(fd):
            if time.monotonic() >= deadline:
                holder = _holder(fd)
                os.close(fd)
                raise OutputDirInUse(f"output_dir={str(output_dir)!r} is in use by another run ({holder}): two runs "
                                     "in one folder would delete each other's checkpoints and mix their logs. Wait "
                                     "for it to end (or stop it), or give this run another output_dir")
            if not said:
                logger.warning("output_dir=%r is held by another run (%s): waiting up to %.0f s for it to end",
                               str(output_dir), _holder(fd), LOCK_WAIT_S)
                said = True
            time.sleep(2.0)
    except OSError as e:  # a folder we may not write, a filesystem without locks (ENOLCK, EOPNOTSUPP): the
        # run's own writes will say what is wrong, on every rank
        logger.warning("output_dir=%r cannot be locked (%s): nothing stops a second run from using it at the same "
                       "time", str(output_dir), e)
        return
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}, since "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
    _LOCKS[(st.st_dev, st.st_ino)] = fd


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:  # held by another process
        return False


def _holder(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 512).decode("utf-8", "replace").strip() or "a process that wrote nothing"


def unlock_output_dir(output_dir: str | Path) -> None:
    """Let go of output_dir (lock_output_dir), if this process holds it."""
    try:
        st = os.stat(Path(output_dir) / LOCK_FILE)
    except OSError:
        return
    fd = _LOCKS.pop((st.st_dev, st.st_ino), None)
    if fd is not None:
        os.close(fd)  # closing the only descriptor drops the flock

CURVES = (("reward/mean", "reward (train)"), ("eval/accuracy", "eval accuracy (greedy)"),
          ("kl", "KL to reference"), ("completion/length_mean", "completion length"))


def _eval_curve(rows: list[dict[str, Any]]) -> tuple[str, str]:
    """The eval panel's metric: the greedy accuracy, or else the first sampled metric (`mean@k`, `pass@k`,
    `maj@k`) the run recorded, since `eval_metrics` may leave out `greedy`."""
    if not any(isinstance(r.get(CURVES[1][0]), (int, float)) for r in rows):
        for key in (k for r in rows for k in r):
            if re.fullmatch(r"eval/(mean|pass|maj)@\d+", key):
                return key, f"eval {key.removeprefix('eval/')} (sampled)"
    return CURVES[1]


class RunLogger:
    """Appends one JSON line per step to metrics.jsonl and reports the scalars to the trackers named
    in `report_to` (trackers.py). On resume from step S, lines after S (written by the interrupted
    run after its last checkpoint) are dropped, so the file reads as if the run had never stopped;
    with `eval_again`, so are step S's lines after its training step's (an eval the killed run logged
    but never recorded beside the checkpoint, and its alarms: this run makes it again), and the
    examples of that eval's alarm in samples.jsonl.

    A tracker that fails to start is a `TrackerError` (the trackers already started are closed): a
    run never trains untracked by surprise. One that raises mid-run is warned about once and dropped:
    training goes on, and metrics.jsonl keeps every number. In a distributed run only rank 0 writes:
    the other ranks pass `enabled=False`, which makes every method a no-op."""

    def __init__(self, output_dir: str | Path, *, resume_step: int = 0, eval_again: bool = False,
                 report_to: tuple[str, ...] = ("tensorboard",), enabled: bool = True,
                 config: dict[str, Any] | None = None, run_name: str | None = None):
        self.dir = Path(output_dir)
        self.enabled = enabled
        self.trackers: list[Tracker] = []
        self.metrics_path = self.dir / "metrics.jsonl"
        self.samples_path = self.dir / "samples.jsonl"
        self.tracked_through = 0  # on resume, the last step the interrupted run logged
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        if eval_again:  # of step S, metrics.jsonl keeps the training step's row (its first), samples.jsonl
            # all but the eval's alarm examples
            dropped = _truncate_after(self.metrics_path, resume_step, lambda row, earlier: earlier)
            _truncate_after(self.samples_path, resume_step, lambda row, earlier: row.get("alarm") in EVAL_ALARMS)
        else:
            dropped = _truncate_after(self.metrics_path, resume_step)
            _truncate_after(self.samples_path, resume_step)
        # the trackers had the dropped rows' steps from the interrupted run: those that keep them are not
        # sent them again (trackers.py, "A resumed run"); TRACKED holds the last step sent, which an earlier
        # resume's truncation may have dropped from metrics.jsonl (killed twice in a row)
        self.tracked_path = self.dir / TRACKED
        sent = _read_step(self.tracked_path) if resume_step else 0
        dropped = max(dropped, sent if sent > resume_step else 0)
        self.tracked_through = dropped
        for name in dict.fromkeys(report_to):
            if name != "none":
                self._start(name, run_name or self.dir.name, config or {}, resume_step)
        kept = [t.name for t in self.trackers if t.continued and not t.rewinds]
        if dropped and kept:
            logger.info("steps %d-%d were reported to %s by the interrupted run: the resumed run computes them "
                        "again into metrics.jsonl and does not report them twice", resume_step + (not eval_again),
                        dropped, ", ".join(kept))

    def _start(self, name: str, run_name: str, config: dict[str, Any], resume_step: int) -> None:
        """Open a tracker; one that cannot start stops the run before it trains, not untracked."""
        try:
            self.trackers.append(OPENERS[name](self.dir, run_name, config, resume_step))
        except Exception as e:  # noqa: BLE001 - whatever the library raises, the run stops here
            self.close()
            raise TrackerError(f"report_to {name} failed to start ({type(e).__name__}: {e}); fix that, or drop "
                               f"{name} from report_to to train without it") from e

    def _guard(self, name: str, call: Callable[[], None], what: str) -> None:
        """Run a tracker call; if it raises, warn once and drop the tracker."""
        try:
            call()
        except Exception as e:  # noqa: BLE001 - any failure of a tracker is contained
            logger.warning("report_to %s failed to %s (%s: %s): it is switched off for the rest of the run; "
                           "training goes on and metrics.jsonl keeps every number", name, what, type(e).__name__, e)
            self.trackers = [t for t in self.trackers if t.name != name]

    def log(self, step: int, metrics: dict[str, Any], *, trackers: bool = True) -> None:
        """A metrics.jsonl line; the finite scalars also go to the trackers unless `trackers` is False
        (a step between logging_steps)."""
        if not self.enabled:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with open(self.metrics_path, "a") as f:
            f.write(strict_json(row) + "\n")
        if trackers:
            scalars = {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float))
                       and not isinstance(v, bool) and math.isfinite(v)}
            for t in self._trackers_for(step):
                self._guard(t.name, lambda t=t: t.log(step, scalars), f"log step {step}")
            if self.trackers and step > self.tracked_through:
                self.tracked_path.write_text(f"{step}\n")  # the last step the trackers have (__init__)

    def _trackers_for(self, step: int) -> list[Tracker]:
        """The trackers a step goes to: on resume, not those that kept the interrupted run's copy of it."""
        return [t for t in self.trackers if step > self.tracked_through or t.rewinds or not t.continued]

    def log_table(self, step: int, key: str, rows: list[dict[str, Any]]) -> None:
        """A table of rows (dicts with the same keys) to the trackers: their table type, or text."""
        if not self.enabled or not rows or not self.trackers:
            return
        columns = list(rows[0])
        data = [[_cell(r.get(c)) for c in columns] for r in rows]
        for t in self._trackers_for(step):
            self._guard(t.name, lambda t=t: t.log_table(step, key, columns, data), f"log the {key} table")

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        if not self.enabled:
            return
        with open(self.samples_path, "a") as f:
            for s in samples:
                f.write(strict_json({"step": step, **{k: _plain(v) for k, v in s.items()}}) + "\n")

    def write_json(self, name: str, payload: dict[str, Any]) -> None:
        if not self.enabled:
            return
        tmp = self.dir / f".{name}.tmp"
        tmp.write_text(strict_json(payload, indent=2))
        tmp.replace(self.dir / name)

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.enabled or not self.metrics_path.is_file():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line]

    def summary(self, steps: int, evals: dict[str, Any]) -> dict[str, Any]:
        """summary.json: the evaluations, the training time, and the mean reward over the first and
        the last tenth of the steps."""
        train = [r for r in self.read_metrics() if "reward/mean" in r]
        summary: dict[str, Any] = {"steps": steps, **evals,
                                   "train_seconds": sum(r.get("time/step", 0.0) for r in train)}
        if train:
            k = max(1, len(train) // 10)
            summary["reward_first"] = sum(r["reward/mean"] for r in train[:k]) / k
            summary["reward_last"] = sum(r["reward/mean"] for r in train[-k:]) / k
        return summary

    def plot_curves(self, path: str | Path | None = None) -> Path | None:
        if not self.enabled:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = self.read_metrics()
        fig, axes = plt.subplots(2, 2, figsize=(10, 7))
        for ax, (key, title) in zip(axes.flat, [CURVES[0], _eval_curve(rows), *CURVES[2:]]):
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, markersize=3)
            else:
                ax.text(0.5, 0.5, "not recorded in this run", ha="center", va="center",
                        transform=ax.transAxes, color="gray")
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        out = Path(path) if path else self.dir / "curves.png"
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out

    def finish(self, summary: dict[str, Any]) -> None:
        """The end of a run: summary.json, the curves, and the trackers closed."""
        self.write_json("summary.json", summary)
        self.plot_curves()
        self.close()

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        """A run that raised lets go of output_dir (a notebook's kernel would hold it for good); its
        trackers stay open, as the process's end or the next run's resume finds them."""
        if exc_type is not None and self.enabled:
            unlock_output_dir(self.dir)

    def close(self) -> None:
        unlock_output_dir(self.dir)  # the run is over: another may have the folder
        for t in list(self.trackers):
            self._guard(t.name, t.finish, "finish")
        self.trackers = []


class Progress:
    """A tqdm bar over training steps showing reward and KL, on a terminal. Where the bar is off
    (`enabled` False: `progress: false`) or would go to a file (a job's log, where its redraws pile up
    on one line), a line every `every` steps (logging_steps) says the same, and the last step's too.
    `silent` (ranks other than 0) drops the bar, the lines and the text lines."""

    def __init__(self, total: int, initial: int, enabled: bool, *, silent: bool = False, every: int = 1):
        self.silent, self.total, self.step, self.every = silent, total, initial, max(1, every)
        self.lines = not silent and not (enabled and sys.stderr.isatty())  # tqdm draws on stderr
        self.bar = tqdm(total=total, initial=initial, desc="grpo", disable=not enabled or self.lines,
                        dynamic_ncols=True, unit="step")

    def update(self, metrics: dict[str, Any]) -> None:
        post = {"reward": metrics.get("reward/mean"), "kl": metrics.get("kl"),
                "len": metrics.get("completion/length_mean")}
        shown = {k: f"{v:.3g}" for k, v in post.items() if isinstance(v, (int, float))}
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(1)
        self.step += 1
        if self.lines and (self.step % self.every == 0 or self.step == self.total):
            took = metrics.get("time/step")
            print(f"step {self.step}/{self.total}: " + ", ".join(f"{k} {v}" for k, v in shown.items())
                  + (f", {took:.3g} s" if isinstance(took, (int, float)) else ""), flush=True)

    def write(self, text: str) -> None:
        if not self.silent:
            self.bar.write(text)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None:  # the error's message must not land on the bar's line
            self.close()


def _read_step(path: Path) -> int:
    try:
        return int(path.read_text().strip() or 0)
    except (OSError, ValueError):  # none yet, or a write a kill cut short
        return 0


def _truncate_after(path: Path, step: int, drop_at_step: Callable[[dict[str, Any], bool], bool] | None = None) -> None:
    """Keep the rows of steps <= `step` (a resumed run writes the later ones again), less the rows of
    `step` itself that `drop_at_step(row, earlier)` picks (`earlier`: a row of that step came before it;
    an eval logged again, RunLogger). A last line
    that is not JSON was cut off by a kill in mid-append and is dropped with its step; a damaged
    line anywhere else is an error that names it. The kept rows go to a new file that replaces the
    old one whole, so a failed write (a full disk) loses no row already logged. Returns the last step
    of the rows dropped, 0 if none."""
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    keep, seen_step, dropped = [], False, 0
    for i, line in enumerate(lines):
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON ({e.msg}); the run log is damaged there: "
                             "delete that line to resume") from None
        at = row.get("step", 0)
        if at < step or at == step and not (drop_at_step is not None and drop_at_step(row, seen_step)):
            keep.append(line)
        else:
            dropped = max(dropped, at)
        seen_step = seen_step or at == step
    tmp = path.with_name(f".{path.name}.tmp")  # the same folder: the rename stays on one filesystem
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)
    return dropped


def _cell(v: Any) -> Any:
    """A table cell: numbers and strings as they are, anything else (chat messages, lists) as JSON."""
    v = _plain(v)
    if v is None or isinstance(v, (int, float, str, bool)):
        return v
    return json.dumps(v, default=str)


def _plain(v: Any) -> Any:
    if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
        return v.item()
    return v


def strict_json(payload: Any, **kwargs: Any) -> str:
    """JSON that strict readers take (jq, JavaScript, pandas): a NaN or infinite number is written as null
    (Python's json writes bare NaN and Infinity, which they refuse). A metric is NaN where it has nothing
    to be computed on, e.g. a correlation on a step without usable groups, or a loss on a skipped step."""
    return json.dumps(_finite(payload), allow_nan=False, **kwargs)


def _finite(v: Any) -> Any:
    v = _plain(v)
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def run_metadata(dist: Any) -> dict[str, Any]:
    """What the trackers record about the run beside its config: versions, device, processes."""
    import platform

    import torch
    import transformers

    from grouprl import __version__

    return {"meta/grouprl": __version__, "meta/torch": torch.__version__, "meta/transformers": transformers.__version__,
            "meta/python": platform.python_version(), "meta/device": str(dist.device),
            "meta/world_size": dist.world_size, "meta/host": platform.node()}
