"""Isolation for untrusted code: the `code_tests` reward runs programs here.

Standard library only, so it imports nothing else of grouprl. `run_code` runs a program against
tests in a fresh sandboxed process per test; `sandbox_mechanism()` says which walls are in force.
"""

from .runner import CodeResult, run_code, run_code_batch, sandbox_mechanism

__all__ = ["CodeResult", "run_code", "run_code_batch", "sandbox_mechanism"]
