"""Every shipped example config parses, validates, and names reward functions that exist; each says
in its opening comments what a fresh clone lacks for it, and a run started without that says so;
the GSM8K sample rows are in the format the GSM8K config reads; the tool-task example is the
embedded task the README's figures were measured with."""

import dataclasses
from pathlib import Path

import pytest

from grouprl.cli import main
from grouprl.cli_args import build_config
from grouprl.config import TrainConfig
from grouprl.data import load_prompts
from grouprl.rewards import resolve_reward_func
from grouprl.rewards.format import think_format_soft
from grouprl.rewards.math import math_accuracy
from grouprl.tasks import TOOL_POLICY_DIR, TOOL_TASK

ROOT = Path(__file__).parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
GSM8K_SAMPLE = ROOT / "examples" / "data" / "gsm8k_sample.jsonl"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_is_valid(path):
    cfg = TrainConfig.load(path).validate()  # values only: the loaders probe the paths
    for spec in cfg.reward_funcs:
        params = dict(spec) if isinstance(spec, dict) else {"name": spec}
        assert callable(resolve_reward_func(params.pop("name"), **params))


def test_there_are_examples():
    assert len(EXAMPLES) >= 2


def opening_comments(path: Path) -> str:
    """The comment lines before the first setting."""
    lines = path.read_text().splitlines()
    return "\n".join(line for line in lines[:next(i for i, line in enumerate(lines) if not line.startswith("#"))])


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_an_example_names_what_a_fresh_clone_lacks_before_its_settings(path):
    """A model or data source that is not built in (`builtin:`) is not in the clone: the opening
    comments name it under "Needs"."""
    cfg = TrainConfig.load(path)
    sources = (cfg.model, cfg.tokenizer, cfg.train_data, cfg.eval_data)
    lacking = [v for v in sources if v and not v.startswith("builtin:")]
    header = opening_comments(path)
    if lacking:
        assert "Needs" in header
    for value in lacking:
        assert value in header, f"{path.name} needs {value} and its opening comments do not say so"


@pytest.mark.parametrize("name, offline, message", [
    ("gsm8k.yaml", "1", "model='Qwen/Qwen2.5-0.5B-Instruct' is not a local folder, and the hub is offline "
                        "(HF_HUB_OFFLINE=1) with no copy of Qwen/Qwen2.5-0.5B-Instruct in the Hugging Face cache: "
                        "download it once where the hub is reachable (hf download Qwen/Qwen2.5-0.5B-Instruct"),
    ("gsm8k.yaml", "0", "train_data='data/gsm8k_train.jsonl' does not exist: check the path"),
    ("dapo_code.yaml", "1", "model='path/to/your/coder-model' does not exist: check the path"),
    ("smollm2_chat_arithmetic.yaml", "1", "model='models/smollm2' is not a local folder"),  # (or a hub name)
])
def test_an_example_run_without_what_it_needs_says_what_is_missing(name, offline, message, tmp_path, monkeypatch,
                                                                   capsys):
    """From a folder holding none of it (the clone's data/ and models/ are not in git), before any
    model loads; online, the GSM8K config gets past its hub model to its data, and the error says
    what the file holds and which reward functions read it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert main(["train", str(ROOT / "examples" / name), "--output_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert message in err
    if offline == "0":
        assert ("with a 'prompt' column (a string, or chat messages [{\"role\": \"user\", \"content\": \"...\"}]) "
                "and the columns the reward functions (math_accuracy, think_format_soft) read") in err


def test_the_gsm8k_sample_is_in_the_format_the_gsm8k_config_reads():
    """Each row is a chat prompt with an `answer` that math_accuracy reads: a completion in the asked
    format with that answer scores 1 (and full format marks), one with another number 0; the
    config's documented try-out command is a valid config."""
    rows = load_prompts(str(GSM8K_SAMPLE)).to_list()
    assert len(rows) == 8 and all([m["role"] for m in r["prompt"]] == ["system", "user"] for r in rows)
    right = [f"<think>working</think>\n<answer>{r['answer']}</answer>" for r in rows]
    wrong = [f"<think>working</think>\n<answer>{int(r['answer']) + 1}</answer>" for r in rows]
    answers = [r["answer"] for r in rows]
    assert math_accuracy(None, right, answer=answers) == [1.0] * 8
    assert math_accuracy(None, wrong, answer=answers) == [0.0] * 8
    assert think_format_soft(None, right) == [1.0] * 8
    example = ROOT / "examples" / "gsm8k.yaml"
    assert f"--train_data examples/data/{GSM8K_SAMPLE.name}" in opening_comments(example)
    cfg = build_config(str(example), ["--train_data", str(GSM8K_SAMPLE), "--eval_data", str(GSM8K_SAMPLE),
                                      "--max_steps", "2", "--output_dir", "runs/gsm8k-try"]).validate()
    assert cfg.prompts_per_step <= len(rows)


def test_the_tool_task_example_is_the_embedded_task_the_readme_measured():
    """Field for field TOOL_TASK (fp32 everywhere: bf16 false), but for naming the shipped policy
    by its builtin: name and its own output_dir."""
    example = TrainConfig.load(ROOT / "examples" / "tool_task.yaml")
    assert example.model == "builtin:tool_policy" and TOOL_TASK["model"] == str(TOOL_POLICY_DIR)
    assert example.bf16 is False
    embedded = TrainConfig(**{**TOOL_TASK, "model": example.model, "output_dir": example.output_dir})
    assert dataclasses.asdict(example) == dataclasses.asdict(embedded)
