"""Stopping a run cleanly on SIGTERM (a cluster preempting it) or SIGINT (Ctrl-C): run safety from
outside the run (health.py raises alarms from inside it, guard.py decides what to do about them), and
`TrainingStopped`, which ends any stopped run, the guard's stop included.

`Trainer.train()` runs inside `StopSignals`. The first SIGTERM or SIGINT only sets a flag and logs
one line; the step in progress runs to its end, whatever stage it is in (generation, rewards,
update); then the run writes that step's checkpoint, its summary.json and curves, and `train()`
raises `TrainingStopped` (an eval due after that step is left to the resumed run, which runs it
first, so metrics.jsonl reads as if the run had never stopped). `grouprl train` prints the command
that continues the run and exits with 128 + the signal's number (143 for SIGTERM, 130 for
SIGINT): the status a shell reports for a process the signal ended, so a scheduler or wrapper
reads "stopped by the signal", neither success nor a crash.

Why the step finishes rather than being abandoned: a checkpoint can only hold a step boundary.
Abandoning a step half-way would mean rewinding the prompt sampler and every RNG stream it used,
and under torchrun the ranks cannot agree in the middle of generation without a collective inside
the engine. A step takes seconds to minutes; where the scheduler's grace period is shorter, ask it to
signal earlier (SLURM: `--signal=TERM@300`, which signals the job's steps).

A second signal stops at once: the handlers that were there before come back and `StopNow` (a
KeyboardInterrupt) is raised wherever the program is. Nothing is saved beyond the last checkpoint,
which stays intact (checkpoints are written atomically). A repeat within `REPEAT_WINDOW_S` of the
first is the same request delivered twice, not a second one: a terminal's Ctrl-C reaches torchrun
and its workers, and torchrun passes on what it receives; SLURM signals every process of a step.

Under torchrun every rank must stop after the same step: `requested` sums each rank's flags with one
all-reduce of two numbers at a step boundary, so a signal seen by any rank stops them all. torchrun,
once signalled itself, kills its workers 30 s after passing the signal on: a step (with its
checkpoint) longer than that is lost, so signal the workers rather than torchrun where the scheduler
allows. Python runs handlers in the main thread only, so they are installed only when `train()` runs
there; elsewhere the process's own handlers stay.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from grouprl import distributed as D

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)  # in this order: a preemption wins when both arrive
REPEAT_WINDOW_S = 2.0  # a signal this soon after the first repeats it (see above)
HEALTH_EXIT_CODE = 3  # a run stopped by a run-health alarm (on_reward_hacking / on_collapse: stop)


def exit_code(signum: int) -> int:
    """128 + signal number: what a shell reports for a process that the signal ended."""
    return 128 + int(signum)


class TrainingStopped(Exception):
    """`train()` stopped after a SIGTERM/SIGINT, or after a run-health alarm set to stop the run
    (`reason`), once `checkpoint` (of `step`) was written. `code`: the exit status `grouprl train`
    returns (128 + the signal's number; `HEALTH_EXIT_CODE` for an alarm)."""

    def __init__(self, signum: int | None, step: int, checkpoint: Path, reason: str | None = None):
        self.signum = signal.Signals(signum) if signum is not None else None
        self.step, self.checkpoint = step, checkpoint
        self.reason = reason or self.signum.name
        self.code = exit_code(self.signum) if self.signum is not None else HEALTH_EXIT_CODE
        super().__init__(f"stopped by {self.reason} after step {step}, checkpoint {checkpoint}: "
                         "train(resume=True) with the same config continues the run")


class StopNow(KeyboardInterrupt):
    """A second SIGTERM/SIGINT: the run stops where it is, without a checkpoint."""

    def __init__(self, signum: int):
        self.signum = signal.Signals(signum)
        super().__init__(f"second {self.signum.name}: stopped at once, nothing saved since the last checkpoint")


class StopSignals:
    """`with StopSignals() as stop:` installs the handlers (main thread only) and restores the
    previous ones on exit; `stop.requested(ctx)` at a step boundary says whether to stop there."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None  # this process's first signal
        self._received_at = 0.0  # time.monotonic() of the first signal
        self._repeat_said = False  # a repeat within REPEAT_WINDOW_S was logged
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _restore(self) -> None:
        for s, previous in self._previous.items():
            # None: a handler installed outside Python, which cannot be put back; the default is closest
            signal.signal(s, signal.SIG_DFL if previous is None else previous)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            if time.monotonic() - self._received_at < REPEAT_WINDOW_S:
                if not self._repeat_said:  # say so once: a user who pressed twice waits for the step
                    self._repeat_said = True
                    logger.warning("%s again within %.0f s is taken as the same request (torchrun passes a "
                                   "Ctrl-C on); press again later to stop at once", signal.Signals(signum).name,
                                   REPEAT_WINDOW_S)
                return
            self._restore()  # a third signal meets the process's own handling
            raise StopNow(signum)
        self.received, self._received_at, self._repeat_said = signal.Signals(signum), time.monotonic(), False
        logger.warning("received %s: the run stops after the current step, with a checkpoint (%s again "
                       "stops at once, without one)", self.received.name, self.received.name)

    def requested(self, ctx: D.DistContext) -> signal.Signals | None:
        """The signal to stop on after this step, the same on every rank (a collective under
        torchrun: every rank calls it at the same point), or None."""
        flags = D.all_reduce_sums(ctx, {s.name: float(self.received == s) for s in SIGNALS})
        return next((s for s in SIGNALS if flags[s.name] > 0), None)
