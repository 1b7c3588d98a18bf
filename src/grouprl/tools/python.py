"""The built-in `python` tool: run the model's code in the sandbox, answer with what it printed.

The program runs once in `grouprl.sandbox` (the walls of docs/rewards.md: no network, no host files,
bounded time, memory, processes and disk), with stdin empty and the standard library only. The answer
is its stdout, then its stderr under a "stderr:" line, each cut to `max_output_chars` (head and tail
kept), then one bracketed line when it did not end normally, e.g. "[timeout: stopped after 10 s]".
"""

from __future__ import annotations

from grouprl.sandbox import check_memory, run_program, sandbox_mechanism

from .base import Tool, truncate


def python_tool(timeout_s: float = 10.0, memory_mb: int = 512, max_output_chars: int = 2000,
                isolation: str = "strict") -> Tool:
    """Factory: the `python` tool with these sandbox limits (`run_program`'s timeout_s and memory_mb).

    isolation="strict" refuses (SandboxUnavailableError) where no namespace sandbox works; "weak"
    accepts the rlimit fallback there. Checked here, with memory_mb (ValueError when the interpreter
    cannot start within it), so a run fails before its first step.
    """
    if max_output_chars < 1:
        raise ValueError(f"max_output_chars={max_output_chars}: the model must see at least one character")
    sandbox_mechanism(isolation)
    check_memory(memory_mb, isolation)
    ending = {
        "timeout": f"[timeout: stopped after {timeout_s:g} s]",
        "memory_limit": f"[memory limit: the program used more than its {memory_mb} MiB]",
        "output_limit": "[output limit: the program printed too much and was stopped]",
    }

    def python(code: str) -> str:
        """Run a Python program in a sandbox and return what it printed.

        Each call is a fresh process: no state is kept between calls. There is no network, no input on
        stdin, and only the standard library. Print the values you need to see.

        Args:
            code: The complete Python program to run.
        """
        res = run_program(code, timeout_s=timeout_s, memory_mb=memory_mb, isolation=isolation)
        if res.status == "sandbox_error":  # ours, not the model's: an error of the tool, counted as such
            raise RuntimeError(f"the sandbox failed: {res.detail}")
        stdout, stderr = res.stdout.rstrip("\n"), res.stderr.rstrip("\n")
        parts = [truncate(stdout, max_output_chars)] if stdout else []
        if stderr:
            parts.append("stderr:\n" + truncate(stderr, max_output_chars))
        if res.status in ending:
            parts.append(ending[res.status])
        elif res.status == "error" and not stderr:  # killed by a signal, or a silent non-zero exit
            parts.append(f"[error: {res.detail}]")
        return "\n".join(parts) or "[no output]"

    return Tool.from_function(python)
