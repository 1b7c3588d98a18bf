"""Run a command where user namespaces cannot be created: `python no_userns.py CMD ARGS...`.

Enters a user namespace of its own (mapping only the caller's uid and gid), sets max_user_namespaces
to 0 there, and execs CMD. The exec as a non-zero uid drops the capabilities held in that namespace,
so CMD runs as the caller, unprivileged, and any user namespace it tries to make fails with ENOSPC:
the situation of a container whose seccomp profile forbids them. Standard library only.
"""

import ctypes
import os
import sys

CLONE_NEWUSER = 0x10000000

libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.getuid(), os.getgid()
if libc.unshare(CLONE_NEWUSER) != 0:
    sys.exit(f"no_userns: unshare(CLONE_NEWUSER) failed: {os.strerror(ctypes.get_errno())}")
for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
    with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
with open("/proc/sys/user/max_user_namespaces", "w") as f:
    f.write("0")
os.execvp(sys.argv[1], sys.argv[1:])
