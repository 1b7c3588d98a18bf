"""The embedded tool-use task (tasks/products.py): its pieces, its shipped policy, and a short GRPO
run through the Trainer that raises held-out accuracy and the rate of correct tool use."""

import json

from grouprl.config import TrainConfig
from grouprl.tasks import TOOL_POLICY_DIR, TOOL_TASK, builtin_dataset
from grouprl.tasks.products import correct_tool_use, estimate, eval_rows, mul, product_accuracy, train_rows
from grouprl.trainer import Trainer


def call(a, b, name="mul"):
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {"a": a, "b": b}}}]}


def test_rewards_read_the_trajectory():
    tool = [call(347, 86), {"role": "tool", "name": "mul", "content": "29842"},
            {"role": "assistant", "content": "29842"}]
    wrong_call = [call(347, 68), {"role": "tool", "name": "mul", "content": "23596"},
                  {"role": "assistant", "content": "23596"}]
    guess = [{"role": "assistant", "content": estimate(347, 86)}]
    lucky = [{"role": "assistant", "content": "29842"}]
    completions = [tool, wrong_call, guess, lucky]
    cols = {"answer": ["29842"] * 4, "a": [347] * 4, "b": [86] * 4}
    assert product_accuracy(None, completions, **cols) == [1.0, 0.0, 0.0, 1.0]
    assert correct_tool_use(None, completions, **cols) == [1.0, 0.0, 0.0, 0.0]
    assert estimate(347, 86) == "~24000" and mul(347, 86) == 29842


def test_datasets_are_disjoint_and_named():
    held_out = {(r["a"], r["b"]) for r in eval_rows()}
    assert len(held_out) == 200 and not held_out & {(r["a"], r["b"]) for r in train_rows()[:5000]}
    assert builtin_dataset(TOOL_TASK["eval_data"]) == eval_rows()
    row = eval_rows()[0]
    assert row["answer"] == str(row["a"] * row["b"]) and row["prompt"][0]["content"] == f"{row['a']}*{row['b']}"


def test_shipped_tool_policy_is_small_and_starts_by_estimating():
    files = {p.name: p.stat().st_size for p in TOOL_POLICY_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    assert sum(files.values()) <= 5 * 2**20
    stats = json.loads((TOOL_POLICY_DIR / "build_stats.json").read_text())
    assert stats["greedy_acc"] <= 10  # greedy decoding estimates ...
    assert stats["sampled_tool_use"] >= 15  # ... while sampling finds the tool


def test_grpo_raises_accuracy_and_correct_tool_use(tmp_path):
    cfg = TrainConfig(**{**TOOL_TASK, "output_dir": str(tmp_path / "run"), "max_steps": 8, "eval_steps": 0,
                         "max_eval_samples": 64, "prompts_per_step": 8, "micro_batch_size": 64,
                         "learning_rate": 1e-3, "progress": False, "report_to": []})
    trainer = Trainer(cfg)
    summary = trainer.train()
    before, after = summary["eval_before"], summary["eval_after"]
    assert after["accuracy"] >= before["accuracy"] + 0.3
    tool_use = [r["rewards/correct_tool_use/mean"] for r in trainer.logger.read_metrics() if "reward/mean" in r]
    # measured with the per-row draws of rollout/sampling.py, seeds 0, 1, 2 (this test runs seed 0):
    # 0.31 0.44 0.47 0.53 0.41 0.33 0.59 0.81 (accuracy 0 -> 0.89); 0.23 0.38 0.62 0.50 0.59 0.69 0.73 0.75
    # (0 -> 0.81); 0.27 0.41 0.44 0.58 0.67 0.62 0.64 0.78 (0 -> 0.89): the last two steps end 0.33-0.44 above
    # the first two, while the middle of a run may dip (seed 0's steps 5-6)
    assert sum(tool_use[-2:]) / 2 >= sum(tool_use[:2]) / 2 + 0.2
