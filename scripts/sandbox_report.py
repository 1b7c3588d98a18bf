"""What each hostile program gets from the sandbox here, as a Markdown table (docs/rewards.md quotes it).

    python scripts/sandbox_report.py                      # as you are (root: "namespace")
    setpriv --reuid=65534 --regid=65534 --clear-groups prlimit --nproc=512 \\
        env PYTHONPATH=src /usr/bin/python3 scripts/sandbox_report.py      # unprivileged: "userns"
    ... /usr/bin/python3 tests/sandbox/no_userns.py /usr/bin/python3 scripts/sandbox_report.py  # refused

Standard library and grouprl.sandbox only, so any interpreter the uid can run will do. After each
hostile program a normal one is scored, and its status is the last column.
"""

import os
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from grouprl.sandbox import SandboxUnavailableError, run_code, sandbox_mechanism  # noqa: E402

LIMITS = dict(timeout_s=1.5, memory_mb=128)
NONE = [{"input": "", "output": "(contained)"}]


def hostile(secret_path: str, port: int) -> dict[str, str]:
    return {
        "read /etc/passwd, a 0600 secret of the caller under /tmp, this script, ~/.bashrc": f"""
found = []
for p in ["/etc/passwd", {secret_path!r}, {os.path.abspath(__file__)!r}, {os.path.expanduser('~/.bashrc')!r}]:
    try:
        text = open(p).read()
        found.append(p.rsplit("/", 1)[-1] + ("(root entry)" if "root:" in text else "") + \
("(SECRET)" if "s3cret" in text else ""))
    except OSError as e:
        found.append(type(e).__name__)
print(" ".join(found))""",
        "write /tmp, /var/tmp, /dev/shm, /etc, /usr, the sandbox's own files": """
out = []
for p in ["/tmp/x", "/var/tmp/x", "/dev/shm/x", "/etc/x", "/usr/x", "/sandbox/program.py"]:
    try:
        open(p, "w").write("x"); out.append("wrote")
    except OSError as e:
        out.append(type(e).__name__)
print(" ".join(out))""",
        "connect to a listener on the host's 127.0.0.1": f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=0.5); print("connected")
except OSError as e:
    print(e)""",
        "read a secret from the environment and /proc/*/environ": """
import os
text, unread = str(dict(os.environ)), []
for p in ("/proc/self/environ", "/proc/1/environ"):
    try:
        text += open(p, "rb").read().decode()
    except OSError as e:
        unread.append(f"{p}: {type(e).__name__}")
print("leaked" if "hunter2" in text else "clean: " + " ".join(sorted(os.environ) + unread))""",
        "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        "count the processes it can hold": """
import os, time
n = 0
while True:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30); os._exit(0)
    n += 1
print(n, "children")""",
        "memory bomb": "a = []\nwhile True:\n    a.append(bytearray(10**7))\n",
        "infinite loop": "while True:\n    pass\n",
        "gigabytes of output": "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
        "kill the parent, the host's test process, pid 1": f"""
import os, signal
out = []
for pid in (os.getppid(), {os.getpid()}, 1):
    try:
        os.kill(pid, signal.SIGTERM); out.append(f"{{pid}}:sent")
    except OSError as e:
        out.append(f"{{pid}}:{{type(e).__name__}}")
print(" ".join(out))""",
        "a double-forked setsid daemon sleeping 60 s": """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(60)
    os._exit(0)
print("parent done")""",
        "create a nested user namespace": "import ctypes, os\nl = ctypes.CDLL(None, use_errno=True)\n"
                                          "print(l.unshare(0x10000000), os.strerror(ctypes.get_errno()))",
        "fill the disk (1 MiB files, disk_mb=8)": "i = 0\nwhile True:\n"
                                                  "    open(f'f{i}', 'wb').write(b'x' * (1 << 20))\n    i += 1\n",
    }


def main() -> None:
    os.environ["GROUPRL_REPORT_SECRET"] = "hunter2"
    with tempfile.TemporaryDirectory() as tmp:
        secret = os.path.join(tmp, "secret.txt")
        with open(secret, "w") as f:
            f.write("s3cret")
        os.chmod(secret, 0o600)
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.setblocking(False)
        try:
            mech = sandbox_mechanism().describe()
        except SandboxUnavailableError as e:
            mech = f"refused: {str(e)[:160]}..."
        print(f"uid {os.geteuid()}, sandbox: {mech}\n")
        print("| hostile program | status | what it got | time | normal program after |\n|---|---|---|---|---|")
        for name, prog in hostile(secret, server.getsockname()[1]).items():
            start = time.monotonic()
            try:
                res = run_code(prog, NONE, disk_mb=8, max_output_bytes=1 << 20, **LIMITS)
                status, got = res.status, res.detail.split("got " if "got " in res.detail else ": ", 1)[-1]
            except SandboxUnavailableError:
                status, got = "refused", "SandboxUnavailableError before anything ran"
            took = time.monotonic() - start
            try:
                after = run_code("print(2 * int(input()))", [{"input": "21", "output": "42"}], **LIMITS).status
            except SandboxUnavailableError:
                after = "refused"
            print(f"| {name} | {status} | {got[:110]} | {took:.2f} s | {after} |")
        try:
            server.accept()
            print("\nTHE LISTENER GOT A CONNECTION")
        except BlockingIOError:
            print("\nthe host listener saw no connection")


if __name__ == "__main__":
    main()
