"""2 ranks whose work differs between collectives still meet in each one (tests/distributed/_lockstep_worker.py):

- DDP: a micro-batch runs one forward or two (the shared-prompt forward), chosen by its content. With
  DDP's default buffer broadcast in every synced forward, rank 0 (one forward) and rank 1 (two) waited in
  mismatched collectives; the update must finish and equal the 1-rank update.
- FSDP2 evaluation: every `generate` gathers the sharded weights (a collective). 3 prompts over 2 ranks
  at batch_size 1 gave rank 0 two batches and rank 1 one, and rank 0 gathered while rank 1 summed the
  results; every rank must generate equally often, and the metrics count each prompt once.

The workers' process group times out after 20 s, so a regression fails the test instead of hanging it.
"""

import pytest
import torch

from grouprl import distributed as D
from tests.distributed._lockstep_worker import ddp_paths_config, mixed_paths_update
from tests.distributed.launch import torchrun

RUN_LIMIT_S = 180  # start-up and the run on 2 shared CPU cores; the 20 s collective timeout fails a mismatch first


def test_ddp_ranks_on_different_forward_paths_finish_with_the_one_rank_update(tiny_model_dir, digits_data, tmp_path):
    torchrun("-m", "tests.distributed._lockstep_worker", "ddp_paths", str(tiny_model_dir), str(digits_data),
             str(tmp_path), timeout_s=RUN_LIMIT_S)
    got = torch.load(tmp_path / "ddp_paths.pt", weights_only=False)
    assert got["forwards"] == [1, 2]  # rank 0: group 0 in one pass; rank 1: group 1's prompts, then completions
    with pytest.MonkeyPatch.context() as mp:  # the 1-rank update on the CPU, as the 2 ranks run
        mp.setattr(D, "init_distributed", lambda *a, **k: D.DistContext(device=torch.device("cpu")))
        one = mixed_paths_update(ddp_paths_config(str(tiny_model_dir), str(digits_data), str(tmp_path / "one")))
    assert one["forwards"] == 3 and got["grads"].keys() == one["grads"].keys()
    for name, g in one["grads"].items():
        err = float((got["grads"][name] - g).norm() / g.norm())
        assert g.norm() > 0 and err < 1e-6, (name, err)


def test_fsdp2_eval_of_a_set_that_splits_unevenly_counts_each_prompt_once(tiny_model_dir, digits_data, tmp_path):
    """Prompts 0 and 2 on rank 0, prompt 1 on rank 1, one per batch: each rank generates greedily and
    sampled for 2 batches (rank 1's second on a prompt it does not score); the metrics are the scores'
    means by hand."""
    torchrun("-m", "tests.distributed._lockstep_worker", "fsdp2_eval", str(tiny_model_dir), str(digits_data),
             str(tmp_path), timeout_s=RUN_LIMIT_S)
    got = torch.load(tmp_path / "fsdp2_eval.pt", weights_only=False)
    assert got["generate_calls"] == [4, 4]  # 2 batches x (greedy, sampled) on each rank
    calls = [call for rank in got["scored"] for call in rank]
    greedy = [(p, s) for prompts, per_prompt, scores in calls if per_prompt == 1 for p, s in zip(prompts, scores)]
    sampled = [s for prompts, per_prompt, scores in calls if per_prompt == 2 for s in scores]
    assert [len(rank) for rank in got["scored"]] == [4, 2]  # rank 1 scored only its own prompt
    assert len(greedy) == 3 and len({p for p, _ in greedy}) == 3 and len(sampled) == 6
    result = got["result"]
    assert result["num_samples"] == 3
    assert result["accuracy"] == pytest.approx(sum(s for _, s in greedy) / 3, rel=1e-6)
    assert result["reward_mean"] == pytest.approx(sum(s for _, s in greedy) / 3, rel=1e-6)  # one function, weight 1
    assert result["mean@2"] == pytest.approx(sum(sampled) / 6, rel=1e-6)
