"""Seconds per stage of a training step (`time/*` in metrics.jsonl), summed over the rounds of a step."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class Timings(dict):
    """`time/<stage>` -> seconds; `with timings.stage("update"):` adds the block's wall time. An error
    leaving a stage carries the innermost stage's name as `grouprl_stage`, so that its report can say
    where it happened (an out-of-memory error: what to lower, memory.out_of_memory_advice)."""

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        except Exception as e:
            if getattr(e, "grouprl_stage", None) is None:
                try:
                    e.grouprl_stage = name  # type: ignore[attr-defined]
                except AttributeError:  # an exception type without instance attributes
                    pass
            raise
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        key = f"time/{name}"
        self[key] = self.get(key, 0.0) + seconds
