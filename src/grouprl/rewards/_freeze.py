"""Imported last by the reward workers' fork server (workers.py), after the modules it preloads: they
are frozen out of the garbage collector, so that a worker's collections do not write to, and so copy,
the pages it shares with the server (measured: 5 MiB a worker kept to itself, against ~200 unfrozen).
The server ignores SIGTERM, as the workers do: a scheduler's notice goes to every process of the job,
and the trainer, which finishes its step first, needs the server to replace a worker until it ends;
the server leaves when the trainer's process does."""

import atexit
import gc
import signal
import sys

if sys.argv[:1] == ["-c"] and "multiprocessing.forkserver" in sys.modules:  # the server, not another importer
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    gc.freeze()
    atexit.register(gc.unfreeze)  # the server's own exit finalizes them as usual (else nanobind reports "leaks")
