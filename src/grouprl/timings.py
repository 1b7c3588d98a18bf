"""Seconds per stage of a training step (`time/*` in metrics.jsonl), summed over the rounds of a step."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class Timings(dict):
    """`time/<stage>` -> seconds; `with timings.stage("update"):` adds the block's wall time."""

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        key = f"time/{name}"
        self[key] = self.get(key, 0.0) + seconds
