"""Isolation for untrusted code: the `code_tests` reward and the `python` tool run programs here.

Standard library only, so it imports nothing else of grouprl. `run_code` runs a program against
tests in a fresh sandboxed process per test; `run_program` runs one once and returns its output;
`sandbox_mechanism()` says which walls are in force (docs/rewards.md has the table of threats and the
wall that stops each, per situation); `check_memory(memory_mb)` that a memory limit leaves the
interpreter room to start.
"""

from .runner import (CodeResult, ProgramResult, SandboxMechanism, SandboxUnavailableError, check_memory, run_code,
                     run_code_batch, run_program, sandbox_mechanism)

__all__ = ["CodeResult", "ProgramResult", "SandboxMechanism", "SandboxUnavailableError", "check_memory", "run_code",
           "run_code_batch", "run_program", "sandbox_mechanism"]
