"""The shipped default policy folder and the default task description."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grouprl.tasks import DEFAULT_POLICY_DIR, DEFAULT_TASK, builtin_dataset
from grouprl.tasks.arithmetic import eval_rows, train_rows


def test_shipped_policy_is_small_and_complete():
    files = {p.name: p.stat().st_size for p in DEFAULT_POLICY_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    assert sum(files.values()) <= 20 * 2**20


def test_shipped_policy_loads_and_answers_in_the_task_format(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(DEFAULT_POLICY_DIR)
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY_DIR)
    assert model.config.model_type == "qwen2"
    assert (tok.pad_token_id, tok.eos_token_id) == (model.config.pad_token_id, model.config.eos_token_id)
    prompts = [r["prompt"] for r in eval_rows()[:8]]
    enc = tok(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=6, do_sample=False)
    completions = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert all(c.isdigit() for c in completions), completions  # the warm-up taught the bare-number format
    assert (out[:, enc["input_ids"].shape[1] :] == tok.eos_token_id).any(1).all()  # and to stop


def test_build_stats_record_a_weak_greedy_start_with_reachable_answers():
    """What the demo relies on, as measured by scripts/build_default_policy.py when it built the folder."""
    stats = json.loads((DEFAULT_POLICY_DIR / "build_stats.json").read_text())
    assert stats["greedy_acc"] <= 60
    assert stats["pass@8"] >= stats["greedy_acc"] + 30


def test_default_task_names_its_pieces():
    assert DEFAULT_TASK["model"] == str(DEFAULT_POLICY_DIR)
    assert builtin_dataset(DEFAULT_TASK["train_data"]) == train_rows()
    assert builtin_dataset(DEFAULT_TASK["eval_data"]) == eval_rows()
    assert builtin_dataset("arithmetic/eval") == eval_rows()
    assert len(DEFAULT_TASK["reward_funcs"]) == len(DEFAULT_TASK["reward_weights"])
    with pytest.raises(ValueError, match="unknown built-in dataset"):
        builtin_dataset("builtin:arithmetic/test")


def test_format_reward_is_importable_by_its_spec():
    module, name = DEFAULT_TASK["reward_funcs"][1].split(":")
    func = getattr(__import__(module, fromlist=[name]), name)
    assert func(["1+1="], ["2"]) == [1.0]
