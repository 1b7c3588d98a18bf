"""Sandbox harness: the process that runs an untrusted program, already isolated and unprivileged.

argv: STATUS_FD NONCE_FD PROGRAM_PATH TEST_PATH_OR_EMPTY BLOCK_FLAG. Standard library only, runs on any Python 3.8+.

Two private pipes, both closed before the program runs: the harness writes b"S" to STATUS_FD once it
is running (the caller's proof that the sandbox started the interpreter, which nothing the program does
can fake or hide), and reads a per-run nonce from NONCE_FD. Its verdict on how the program ended goes
to stdout (through a copy of the descriptor, so closing fd 1 does not lose it) after everything else,
as b"\\n" + nonce + VERDICT + b"\\n", one byte: o finished, s syntax error, c CPU limit, m MemoryError,
e raised or exited non-zero. The nonce keeps the ordinary ways of ending early (os._exit(0), a killed
interpreter) from passing as finished, and sys.exit(0) / exit() inside the program is caught so the
tests still run. It does not stop a program that goes looking for it: the program runs in this
interpreter, so `sys._getframe(1).f_locals["seal"]` hands it the nonce and the descriptor, and an
assert test can also be met by an object equal to anything. Assert tests are for programs that are
not trying to game them; input/output tests are not gameable this way (the expected output never
reaches the program, and the caller compares it). stdout and stderr are line-buffered, so what a program
printed before it was stopped reaches the caller.

Exit codes (for a reader without the verdict): 0 finished, 1 raised, 3 syntax error, 124 CPU limit.
"""

import os
import signal
import sys
import traceback

FINISHED, SYNTAX, CPU, MEMORY, ERROR = b"o", b"s", b"c", b"m", b"e"
EXIT_CODES = {FINISHED: 0, SYNTAX: 3, CPU: 124}

BLOCKED_EVENTS = {
    "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto",
    "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
    "os.forkpty", "pty.spawn", "ctypes.dlopen", "os.kill", "os.killpg",
}


def _block_hook(event, args):
    if event in BLOCKED_EVENTS:
        raise PermissionError(f"{event} is blocked in the sandbox (no network namespace available)")


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass


def _end(seal, verdict):
    """Write the verdict, sealed with the nonce, on our copy of stdout (`seal` = (fd, nonce)) and exit."""
    _flush()
    fd, nonce = seal
    try:
        os.write(fd, b"\n" + nonce + verdict + b"\n")
    except OSError:
        pass
    os._exit(EXIT_CODES.get(verdict, 1))


def _run(seal):
    with open(sys.argv[3], encoding="utf-8") as f:
        program = f.read()
    test = ""
    if sys.argv[4]:
        with open(sys.argv[4], encoding="utf-8") as f:
            test = f.read()
    expression = False  # a test that is one expression ("f(2) == 4"): its value must not be false
    try:
        program_code = compile(program, "solution.py", "exec")
        test_code = None
        if test:
            try:
                test_code, expression = compile(test, "test.py", "eval"), True
            except SyntaxError:
                test_code = compile(test, "test.py", "exec")
    except (SyntaxError, ValueError):
        traceback.print_exc(limit=0)
        return SYNTAX
    # CPU soft limit reached: a timeout; the hard limit kills 1 s later regardless.
    signal.signal(signal.SIGXCPU, lambda signum, frame: _end(seal, CPU))
    if sys.argv[5] == "1":
        sys.addaudithook(_block_hook)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        try:
            exec(program_code, namespace)
        except SystemExit as e:
            if e.code not in (None, 0):
                raise
        if test_code is not None:
            value = eval(test_code, namespace) if expression else exec(test_code, namespace)
            if value is not None and not value:  # None: a call for its effect (HumanEval's check(f)), not a claim
                raise AssertionError(f"the test {test.strip()!r} is {value!r}")
    except SystemExit as e:
        sys.stderr.write(f"SystemExit({e.code!r})\n")
        return ERROR
    except BaseException as e:  # the program's last frames, without the harness's own (`_run`)
        verdict = MEMORY if isinstance(e, MemoryError) else ERROR
        try:
            traceback.print_exception(type(e), e, e.__traceback__.tb_next, limit=-3)
        except BaseException:
            pass
        return verdict
    try:
        sys.stdout.flush()
    except BaseException:
        return ERROR
    return FINISHED


def _main():
    status_fd, nonce_fd = int(sys.argv[1]), int(sys.argv[2])
    os.write(status_fd, b"S")
    os.close(status_fd)
    nonce = os.read(nonce_fd, 64)
    os.close(nonce_fd)
    seal = (os.dup(1), nonce)  # a program that closes its stdout still gets its verdict written
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    try:
        verdict = _run(seal)
    except MemoryError:
        verdict = MEMORY
    _end(seal, verdict)


if __name__ == "__main__":
    _main()
