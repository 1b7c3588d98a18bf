"""The `code_tests` reward: fraction of a row's tests that the completion's program passes.

The program is the last fenced code block (```python, ```py, ```python3 or an unlabelled ```) of the
completion; a completion without one scores 0.0. Tests come from the `tests` column (a list of
{"input", "output"} or {"assert"} dicts per row; a JSON string of that list is accepted too); a row
with no tests scores None (skipped). Programs run in the sandbox (`grouprl.sandbox`),
concurrently, one worker per core.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Callable

from .text import column, completion_text
from grouprl.sandbox import check_memory, run_code_batch, sandbox_mechanism

logger = logging.getLogger(__name__)
_ANY_FENCE = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str | None:
    """The last Python (or unlabelled) fenced block; None when there is none."""
    blocks = [body for lang, body in _ANY_FENCE.findall(text) if lang.lower() in ("", "python", "python3", "py")]
    return blocks[-1] if blocks else None


def _row_tests(value: Any) -> list[dict] | None:
    if isinstance(value, str):
        value = json.loads(value)
    return list(value) if value else None


def code_tests(
    timeout_s: float = 5.0, memory_mb: int = 512, max_workers: int | None = None, isolation: str = "strict"
) -> Callable[..., list[float | None]]:
    """Factory: the code reward with sandbox limits per test (`run_code`'s timeout_s and memory_mb).

    isolation="strict" refuses (SandboxUnavailableError) where no namespace sandbox works; "weak"
    accepts the rlimit fallback there. The choice, and that memory_mb leaves the interpreter room to
    start (ValueError), are checked when the reward is built, so a run fails before its first step,
    not in the middle of one.
    """
    sandbox_mechanism(isolation)
    check_memory(memory_mb, isolation)
    warned = []

    def code_tests(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        all_tests = [_row_tests(t) for t in column(kwargs, ("tests",), len(completions), "code_tests")]
        if not warned and any("assert" in test for tests in all_tests if tests for test in tests):
            warned.append(True)  # once per reward
            logger.warning("code_tests: the dataset has assert tests, which run in the program's own interpreter: a "
                           "policy can learn to pass them without solving the task (docs/rewards.md); "
                           "input/output tests cannot be gamed that way")
        programs = [extract_code(completion_text(c)) for c in completions]
        todo = [i for i, (p, t) in enumerate(zip(programs, all_tests)) if p is not None and t]
        results = run_code_batch(
            [programs[i] for i in todo], [all_tests[i] for i in todo],
            max_workers=max_workers, timeout_s=timeout_s, memory_mb=memory_mb, isolation=isolation,
        )
        scores: list[float | None] = [None if not t else 0.0 for t in all_tests]
        for i, res in zip(todo, results):
            if res.status == "sandbox_error":  # our failure, not the program's: never a silent 0
                raise RuntimeError(f"code_tests: the sandbox failed on row {i}: {res.detail}")
            scores[i] = res.passed / res.total
        return scores

    code_tests.sandbox_isolation = isolation  # the trainer logs the sandbox in force for such rewards
    code_tests.in_process = True  # its programs already run one per core: in N reward workers, N per core
    code_tests.needs_column = ("tests",)  # checked when the data loads
    return code_tests
