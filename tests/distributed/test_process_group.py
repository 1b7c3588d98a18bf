"""More ranks than GPUs on a node: the error names both numbers and both fixes, before torch's own
"invalid device ordinal" (issue seen with `torchrun --nproc-per-node 2` on a 1-GPU machine)."""

import pytest
import torch

from grouprl import distributed as D


def test_a_rank_without_a_gpu_is_refused_with_the_counts_and_the_fixes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    set_device = []
    monkeypatch.setattr(torch.cuda, "set_device", set_device.append)
    monkeypatch.setattr(D.dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError) as err:
        D.init_distributed()
    msg = str(err.value)
    assert "LOCAL_RANK=1" in msg and "1 visible GPU(s)" in msg
    assert "--nproc-per-node 1" in msg and "CUDA_VISIBLE_DEVICES=" in msg
    assert set_device == []  # refused before torch touches the device


@pytest.mark.parametrize("local_rank, gpus, ok", [(0, 1, True), (1, 2, True), (1, 1, False), (0, 0, False),
                                                  (7, 8, True), (8, 8, False)])
def test_each_local_rank_needs_a_gpu_of_its_own(local_rank, gpus, ok):
    if ok:
        D.check_rank_has_gpu(local_rank, gpus)
    else:
        with pytest.raises(RuntimeError, match=f"LOCAL_RANK={local_rank} but this node has {gpus} visible"):
            D.check_rank_has_gpu(local_rank, gpus)


def test_destroy_leaves_alone_a_group_another_library_made(tmp_path):
    """vLLM colocated initialises a one-process gloo world of its own; `grouprl train`/`eval` in the
    same process used to destroy it on the way out, and the next vLLM engine there failed to start
    ("Invalid process group specified": seen in the suite, a CLI test between two vLLM tests)."""
    D.dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert D.init_distributed().world_size == 1  # it joins what is there
        D.destroy_distributed()
        assert D.dist.is_initialized()
    finally:
        D.dist.destroy_process_group()


@pytest.fixture
def torchrun_like_group(tmp_path, monkeypatch):
    """init_distributed as under torchrun with 2 ranks on CPU, the group itself a one-process one."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    init = D.dist.init_process_group
    monkeypatch.setattr(D.dist, "init_process_group", lambda backend, timeout: init(
        backend, init_method=f"file://{tmp_path}/store", rank=0, world_size=1, timeout=timeout))
    D.init_distributed()
    assert D.dist.is_initialized()
    yield
    D.destroy_distributed()  # a no-op when the test destroyed it


def test_destroy_closes_the_group_it_made(torchrun_like_group):
    D.destroy_distributed()
    assert not D.dist.is_initialized()


def test_destroy_collects_a_finished_trainers_wrapper_before_the_group_goes(torchrun_like_group):
    """A finished Trainer sits in reference cycles and its DDP wrapper holds the group's C++ object:
    left to a later collection, at interpreter shutdown that teardown aborted a gloo rank once in CI
    ("terminate called without an active exception"). destroy_distributed collects it first."""
    import gc
    import weakref

    enabled = gc.isenabled()
    gc.disable()  # no collection but destroy_distributed's
    try:
        wrapper = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        wrapper.me = wrapper  # a cycle, as a trainer's callbacks make
        alive = weakref.ref(wrapper)
        del wrapper
        assert alive() is not None
        D.destroy_distributed()
        assert alive() is None and not D.dist.is_initialized()
    finally:
        if enabled:
            gc.enable()
