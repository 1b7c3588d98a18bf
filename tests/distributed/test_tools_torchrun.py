"""`grouprl train` with tools under torchrun on 2 CPU processes (gloo): each rank runs its own
trajectories' tool calls, the scored batch is gathered, and the multi-turn metrics are summed over
both ranks (rank 0 writes them)."""

import json

import yaml

from grouprl.tasks import TOOL_TASK
from tests.distributed.launch import torchrun


def test_two_process_train_with_tools(tmp_path):
    run = tmp_path / "run"
    cfg = {**TOOL_TASK, "prompts_per_step": 4, "num_generations": 4, "micro_batch_size": 4, "max_steps": 2,
           "eval_steps": 0, "max_eval_samples": 16, "progress": False, "report_to": [],
           "output_dir": str(run), "learning_rate": 1e-3}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = torchrun("-m", "grouprl", "train", str(path))
    assert proc.stdout.count("done: 2 steps") == 1

    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        # the 16 trajectories of both ranks: fractions are multiples of 1/16 and the stops add up to 1
        stops = [r[f"multiturn/stop_{s}_frac"] for s in ("answer", "env_done", "max_length", "max_turns",
                                                          "max_tool_calls")]
        assert sum(stops) == 1.0 and all((16 * f) % 1 == 0 for f in stops)
        # one call at most per trajectory: the share of correct calls (gathered rewards) cannot exceed
        # the calls counted (all-reduced tool counts)
        assert r["rewards/correct_tool_use/mean"] <= r["multiturn/tool_calls_per_trajectory"] <= 1.0
    assert sum(r["multiturn/tool_calls_per_trajectory"] for r in steps) > 0  # the shipped policy does call
    evals = [r for r in rows if "eval/num_samples" in r]
    assert [r["eval/num_samples"] for r in evals] == [16, 16]  # before and after, over both ranks
