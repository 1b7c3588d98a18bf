"""The errors a failing reward function raises through the rewards stage."""


class RewardFunctionError(RuntimeError):
    """A reward function failed; `func` names it, `row` is the row index when known."""

    def __init__(self, func: str, message: str, row: int | None = None):
        where = f"reward function {func!r}" + (f" on row {row}" if row is not None else "")
        super().__init__(f"{where}: {message}")
        self.func, self.row = func, row


class WorkerDied(RuntimeError):
    """The reward worker process running a function ended during the call (a crash, os._exit, the OOM
    killer): its rows are retried one by one, and used when each succeeds alone (rewards/workers.py)."""
