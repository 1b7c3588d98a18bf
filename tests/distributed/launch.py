"""Launching the 2-process tests the way users launch grouprl: torchrun (`torch.distributed.run`).

The 2-process tests check the data-parallel logic (sharding, gathers, gradient sums, checkpoints,
signals), not NCCL: their workers run on CPU with gloo on every machine. On a CUDA machine
`init_distributed` would give each rank the GPU of its LOCAL_RANK (one GPU: rank 1 has none), so the
workers are started with the GPUs hidden (CUDA_VISIBLE_DEVICES=""). A test that needs one GPU per
rank (NCCL) passes gpus=True and skips where torch.cuda.device_count() is below its ranks
(`need_gpus`)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300
RANKS = 2
HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": ""}  # torch.cuda.is_available() is False: CPU tensors, gloo


def torchrun_env(*, gpus: bool = False) -> dict[str, str]:
    """The environment of a torchrun the tests start: GPUs hidden unless `gpus`."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            **({} if gpus else HIDE_GPUS)}


def need_gpus(ranks: int = RANKS) -> None:
    """Skip (with the reason) a test whose ranks each need a GPU of their own."""
    have = torch.cuda.device_count()
    if have < ranks:
        pytest.skip(f"needs {ranks} GPUs (one per rank, NCCL); this machine has {have}")


def torchrun(*args: str, gpus: bool = False, timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """2 processes on this machine (CPU and gloo unless `gpus`); --standalone picks a free rendezvous port.
    A run past `timeout_s` fails the test (subprocess.TimeoutExpired)."""
    if gpus:
        need_gpus(RANKS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=torchrun_env(gpus=gpus), capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc
