"""Sandbox harness: the process that runs an untrusted program, already isolated and unprivileged.

argv: NONCE_FD PROGRAM_PATH TEST_PATH_OR_EMPTY BLOCK_FLAG. Standard library only, runs on any Python 3.8+.

The nonce arrives on a pipe that is read and closed before the program runs; it is written to stdout
only after the program and the assert test finished normally. A program that leaves early
(os._exit(0), a killed interpreter) therefore cannot pass an assert test by exit code alone.
sys.exit(0) / exit() inside the program is caught and the tests still run.

Exit codes: 0 ok, 1 the program or test raised, 3 syntax error in the program, 124 CPU limit.
"""

import os
import signal
import sys
import traceback

BLOCKED_EVENTS = {
    "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto",
    "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
    "os.forkpty", "pty.spawn", "ctypes.dlopen", "os.kill", "os.killpg",
}


def _block_hook(event, args):
    if event in BLOCKED_EVENTS:
        raise PermissionError(f"{event} is blocked in the sandbox (no network namespace available)")


def _run():
    nonce_fd = int(sys.argv[1])
    nonce = os.read(nonce_fd, 64)
    os.close(nonce_fd)
    with open(sys.argv[2], encoding="utf-8") as f:
        program = f.read()
    test = ""
    if sys.argv[3]:
        with open(sys.argv[3], encoding="utf-8") as f:
            test = f.read()
    try:
        program_code = compile(program, "solution.py", "exec")
        test_code = compile(test, "test.py", "exec") if test else None
    except (SyntaxError, ValueError):
        traceback.print_exc(limit=0)
        return 3
    # CPU soft limit reached: report it as a timeout (exit 124); the hard limit kills 1 s later regardless.
    signal.signal(signal.SIGXCPU, lambda signum, frame: os._exit(124))
    if sys.argv[4] == "1":
        sys.addaudithook(_block_hook)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        try:
            exec(program_code, namespace)
        except SystemExit as e:
            if e.code not in (None, 0):
                raise
        if test_code is not None:
            exec(test_code, namespace)
    except SystemExit as e:
        sys.stderr.write(f"SystemExit({e.code!r})\n")
        return 1
    except BaseException as e:  # the program's last frames, without the harness's own (`_run`)
        traceback.print_exception(type(e), e, e.__traceback__.tb_next, limit=-3)
        return 1
    try:
        sys.stdout.flush()
    except BaseException:
        return 1
    os.write(1, b"\n" + nonce + b"\n")
    return 0


def _main():
    code = _run()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(code)


if __name__ == "__main__":
    _main()
