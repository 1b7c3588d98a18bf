"""`grouprl train` under torchrun on 2 CPU processes (gloo), as a user launches it: DAPO dynamic
sampling, mu = 2, KL and eval; metrics and checkpoints come from rank 0 only, and resuming from the
step-2 checkpoint reproduces the uninterrupted run exactly (every rank's RNG state is restored)."""

import json
import shutil

import torch
import yaml
from safetensors.torch import load_file

from tests.distributed.launch import torchrun


def test_two_process_train_checkpoints_and_resume_reproduces(tiny_model_dir, digits_data, tmp_path):
    run = tmp_path / "full"
    cfg = dict(model=str(tiny_model_dir), train_data=str(digits_data),
               reward_funcs=["tests.trainer.conftest:digit_fraction"], num_generations=4, prompts_per_step=4,
               micro_batch_size=4, max_completion_length=10, learning_rate=1e-2, beta=0.04,
               eval_fraction=0.1, max_steps=3, save_steps=2, save_total_limit=3, num_logged_samples=2,
               dynamic_sampling=True, loss_agg="token-mean", num_iterations=2,
               progress=False, report_to=[], num_threads=1)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = torchrun("-m", "grouprl", "train", str(path), "--output_dir", str(run))
    assert proc.stdout.count("done: 3 steps") == 1  # rank 0 alone prints the summary
    assert "broadcast_buffers` is deprecated" not in proc.stderr  # torch 2.13 warned so at every DDP run

    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3]  # one row per step: rank 0 writes
    assert sum(1 for r in rows if "eval/accuracy" in r) == 2
    assert all(r["eval/num_samples"] == 6 for r in rows if "eval/num_samples" in r)  # 10% of 64, over both ranks
    assert len((run / "samples.jsonl").read_text().splitlines()) == 3 * 2
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step-000002", "step-000003"]
    state = torch.load(run / "checkpoints/step-000003/state.pt", weights_only=False)
    streams = [r["sampling"] for r in state["rng_by_rank"]]
    assert len(streams) == 2 and not torch.equal(*streams)  # each rank samples its own completions
    rounds = sum(r["dynamic_sampling/rounds"] for r in rows if "reward/mean" in r)
    assert state["sampler"]["pos"] == 4 * rounds  # B prompts per round, whatever the number of ranks

    # eval draws no training prompts: a prompts_per_step that does not split over the ranks is no error there
    torchrun("-m", "grouprl", "eval", "--model", str(run / "checkpoints/step-000003/model"), "--prompts_per_step", "3")
    scored = json.loads((run / "eval.json").read_text())
    assert scored["num_samples"] == 6 and scored["model"].endswith("step-000003/model")

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
