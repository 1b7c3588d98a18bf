"""`pytest -p tests.as_cuda`: the CPU suite with the choices grouprl makes on CUDA (`make test-as-cuda`).

The CPU suite runs most passes without gradient checkpointing, decodes in the plain eager loop and
attends packed rows with SDPA, while on a GPU grouprl checkpoints every pass (`gradient_checkpointing:
auto`), replays the decode step as CUDA graphs (`generation_cuda_graphs`) and attends packed rows with
the varlen flash kernel. Bugs that live where those meet (a probe inside a checkpointed layer, a
fallback that changed paths between a layer's forward and its recomputation, a second graph capture
into a freed pool) passed every CPU test and failed on the first GPU. Here, on CPU:
- `auto` checkpointing decides as for CUDA: every pass;
- the decode loop replays its steps through the real CudaGraphs over test_compiled_decode's stand-in
  for torch's graphs (nothing runs at capture; a replay runs the captured step over the same
  tensors), which counts each memory pool's users as torch's allocator does; a capture that fails
  fails the test (grouprl would warn and decode without graphs);
- packed attention goes through the varlen path, with test_packing's reference kernel (exact on
  CPU, in any dtype), probed once a test as on a fresh process;
- a sampled token is drawn as on CUDA: the vocabulary's running sum in blocks, its entries below
  the target counted (`sampling.SCAN_BLOCK`, `sampling.COUNTED_DRAWS`);
- the slot loop reads its rows' finished flags as often as on CUDA (`engine.CHECK_EVERY`).
Tests marked `cpu_rules` assert a choice that is CPU's by design (checkpointing only over the budget,
the eager loop's own instrumentation, the masked attention path) and are left out.
"""

import warnings

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    kept = [item for item in items if item.get_closest_marker("cpu_rules") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


@pytest.fixture(autouse=True)
def _as_cuda(monkeypatch):
    from grouprl import memory, packing
    from grouprl.rollout import engine, sampling
    from tests.rollout.test_compiled_decode import pool_counting_graphs
    from tests.trainer.test_packing import reference_varlen

    import grouprl.preflight
    import grouprl.trainer

    real_mode = memory.checkpoint_mode

    def cuda_mode(setting, device):
        return real_mode(setting, torch.device("cuda") if device.type == "cpu" else device)

    for module in (memory, grouprl.trainer, grouprl.preflight):  # each holds its own name for it
        monkeypatch.setattr(module, "checkpoint_mode", cuda_mode)
    pool_counting_graphs(monkeypatch)

    monkeypatch.setattr(packing, "_varlen_kernel", reference_varlen)
    monkeypatch.setattr(packing, "uses_varlen", lambda device, dtype, head_dim, dropout: (
        packing.VARLEN["enabled"] and head_dim % 8 == 0 and head_dim <= 256 and dropout == 0.0))
    monkeypatch.setattr(packing, "_PROBED", {})
    monkeypatch.setitem(packing.VARLEN, "enabled", True)
    monkeypatch.setitem(sampling.SCAN_BLOCK, "cpu", sampling.SCAN_BLOCK["cuda"])
    monkeypatch.setattr(sampling, "COUNTED_DRAWS", sampling.COUNTED_DRAWS | {"cpu"})
    monkeypatch.setitem(engine.CHECK_EVERY, "cpu", engine.CHECK_EVERY["cuda"])
    with warnings.catch_warnings():  # (a test that expects the warning records it with pytest.warns)
        warnings.filterwarnings("error", message="generation_cuda_graphs: capturing the decode step")
        yield
