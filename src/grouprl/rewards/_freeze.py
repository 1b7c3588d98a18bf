"""Imported last by the reward workers' fork server (workers.py), after the modules it preloads: they
are frozen out of the garbage collector, so that a worker's collections do not write to, and so copy,
the pages it shares with the server (measured: 5 MiB a worker kept to itself, against ~200 unfrozen)."""

import atexit
import gc

gc.freeze()
atexit.register(gc.unfreeze)  # the server's own exit finalizes them as usual (else nanobind reports "leaks")
