"""Data-parallel GRPO on 2 CPU processes (gloo), launched with torchrun as a user would.

- the update on 2 ranks equals the update on 1 rank for every loss_agg and scale_rewards, with DDP
  and with FSDP2 (gradients to 1e-6 relative, given the same rollouts);
- FSDP2 also generates, checkpoints (whole weights, optimizer state) and resumes;
- `grouprl train` on 2 processes writes metrics and checkpoints from rank 0 only, and resuming
  it reproduces the uninterrupted run;
- the pieces that need no second process: the micro-batch plan and the prompts_per_step check.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from grouprl import distributed as D
from grouprl.config import ConfigError
from grouprl.trainer import Trainer
from tests.distributed._worker import config, update_grads

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def torchrun(*args: str) -> subprocess.CompletedProcess:
    """2 processes on this machine; --standalone picks a free rendezvous port."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.fixture(scope="module")
def one_rank_grads(tiny_model_dir, digits_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("one_rank")
    return update_grads(config(str(tiny_model_dir), str(digits_data), str(out)))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_update_on_two_ranks_equals_one_rank(strategy, one_rank_grads, tiny_model_dir, digits_data, tmp_path):
    torchrun("-m", "tests.distributed._worker", str(tiny_model_dir), str(digits_data), str(tmp_path), strategy)
    result = torch.load(tmp_path / f"grads-{strategy}.pt", weights_only=False)
    assert result["world_size"] == 2
    assert result["grads"].keys() == one_rank_grads.keys() and len(one_rank_grads) == 12  # 4 aggs x 3 scales
    for case, (expected, loss1) in one_rank_grads.items():
        got, loss2 = result["grads"][case]
        assert got.keys() == expected.keys()
        for name, g in expected.items():
            assert g.norm() > 0, (case, name)
            assert relative_error(got[name], g) < 1e-6, (case, name, relative_error(got[name], g))
        assert abs(loss2 - loss1) <= 1e-6 * max(1.0, abs(loss1)), (case, loss1, loss2)
    if strategy == "fsdp2":  # one sampled step with the sharded model, its checkpoint, its resume
        train = result["train"]
        assert train["step"] == 1 and train["same_after_resume"] and train["num_state"] > 0
        ckpt = Path(train["checkpoint"])
        whole = AutoModelForCausalLM.from_pretrained(ckpt / "model")  # save_pretrained output, whole
        trained = load_file(ckpt / "trainable.safetensors")
        params = dict(whole.named_parameters())
        assert trained.keys() == params.keys()
        for name, w in trained.items():
            assert torch.equal(params[name], w), name
        assert (ckpt / "ref.safetensors").is_file()  # ref_update_steps: the sharded reference is saved whole


def test_two_process_train_checkpoints_and_resume_reproduces(tiny_model_dir, digits_data, tmp_path):
    run = tmp_path / "full"
    cfg = dict(model=str(tiny_model_dir), train_data=str(digits_data),
               reward_funcs=["tests.trainer.conftest:digit_fraction"], num_generations=4, prompts_per_step=4,
               micro_batch_size=4, max_completion_length=10, learning_rate=1e-2, beta=0.04,
               eval_fraction=0.1, max_steps=3, save_steps=2, save_total_limit=3, num_logged_samples=2,
               progress=False, report_to_tensorboard=False, num_threads=1)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = torchrun("-m", "grouprl", "train", str(path), "--output_dir", str(run))
    assert proc.stdout.count("done: 3 steps") == 1  # rank 0 alone prints the summary

    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3]  # one row per step: rank 0 writes
    assert sum(1 for r in rows if "eval/accuracy" in r) == 2
    assert all(r["eval/num_samples"] == 6 for r in rows if "eval/num_samples" in r)  # 10% of 64, over both ranks
    assert len((run / "samples.jsonl").read_text().splitlines()) == 3 * 2
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step-000002", "step-000003"]
    state = torch.load(run / "checkpoints/step-000003/state.pt", weights_only=False)
    streams = [r["sampling"] for r in state["rng_by_rank"]]
    assert len(streams) == 2 and not torch.equal(*streams)  # each rank samples its own completions
    assert state["sampler"]["pos"] == 3 * 4  # B prompts per step, whatever the number of ranks

    cut = tmp_path / "cut"  # the same run stopped after its step-2 checkpoint
    shutil.copytree(run, cut)
    shutil.rmtree(cut / "checkpoints/step-000003")
    torchrun("-m", "grouprl", "train", str(path), "--output_dir", str(cut), "--resume")

    def strip(p):
        return [{k: v for k, v in json.loads(x).items() if not k.startswith(("time/", "eval/seconds"))}
                for x in (p / "metrics.jsonl").read_text().splitlines()]

    assert strip(cut) == strip(run)
    a = load_file(run / "checkpoints/step-000003/trainable.safetensors")
    b = load_file(cut / "checkpoints/step-000003/trainable.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("num_micro_batches", [1, 2, 3, 5, 6])
def test_micro_batch_plan_covers_each_micro_batch_once_with_equal_pass_counts(num_micro_batches):
    micro = list(torch.arange(4 * num_micro_batches).split(4))
    plans = [D.micro_batch_plan(D.DistContext(rank=r, world_size=3), micro) for r in range(3)]
    assert len({len(p) for p in plans}) == 1  # every rank runs the same number of passes
    real = sorted(int(rows[0]) for plan in plans for rows, w in plan if w == 1.0)
    assert real == [int(m[0]) for m in micro]  # each micro-batch exactly once, with weight 1
    assert all(w in (0.0, 1.0) for plan in plans for _, w in plan)


def test_prompts_per_step_must_split_over_ranks(make_cfg, monkeypatch):
    monkeypatch.setattr(D, "init_distributed", lambda: D.DistContext(rank=0, world_size=3))
    with pytest.raises(ConfigError, match="prompts_per_step=4 does not split over 3 processes"):
        Trainer(make_cfg())


def test_single_process_helpers_are_no_ops():
    ctx = D.init_distributed()
    assert (ctx.rank, ctx.world_size, ctx.is_main, ctx.enabled) == (0, 1, True, False)
    assert D.gather_objects(ctx, {"a": 1}) == [{"a": 1}]
    assert D.all_reduce_sums(ctx, {"x": 2.5}) == {"x": 2.5}
    assert D.shard_prompts(ctx, [5, 3, 9]) == [5, 3, 9]
    model = torch.nn.Linear(2, 2)
    assert D.wrap_model(model, ctx, "fsdp2") is model
