"""Shared test setup: offline Hugging Face hub, no tokenizer thread pools.

Running the suite on a GPU: the same tests run on CPU and on a CUDA machine, where a single-process
Trainer trains on cuda:0 (grouprl/distributed.py init_distributed). So:
- the multi-rank tests test the data-parallel logic, not NCCL: every torchrun a test starts hides
  the GPUs from its workers (CUDA_VISIBLE_DEVICES="", tests/distributed/launch.py torchrun_env), so
  2 ranks run on CPU with gloo on any machine, a 1-GPU one included; a variant that needs one GPU per
  rank passes gpus=True and skips below that many GPUs. A 1-rank reference they are compared with
  runs on the CPU too (tests/distributed/test_distributed.py);
- a test comparing a trainer's weights or outputs with tensors it made or loaded (on the CPU) moves
  one side: `.cpu()`, or the other model and its inputs `.to(trainer.dist.device)`;
- what bf16 does depends on the device (grouprl/precision.py): tests/test_precision.py says what it
  expects per device; trainer tests set bf16=False (tests/trainer/conftest.py make_cfg).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_runtest_logreport(report):
    """With GROUPRL_FAILURE_LOG set, each failure and error is appended to that file with its
    traceback as it happens: a run stopped by a time limit (scripts/gpu_check.sh on a lent GPU) ends
    before pytest's summary, which is where tracebacks are printed otherwise."""
    path = os.environ.get("GROUPRL_FAILURE_LOG")
    if not path or not report.failed or hasattr(report, "node"):  # (node: xdist's controller, which the worker
        return                                                        # that ran the test has written for)
    text = f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode(errors="replace"))  # one write per report: workers append whole reports
    finally:
        os.close(fd)
