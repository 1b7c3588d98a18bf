"""Each bad input fails before any model loads, with a message that names the field and the fix."""

import errno
import json
import logging
import re
import subprocess
import sys

import pytest

from grouprl.cli import main
from grouprl.cli_args import build_config
from grouprl.config import ConfigError, TrainConfig
from grouprl.data import DataError
from grouprl.policy import check_model_source
from grouprl.sandbox import SandboxUnavailableError, sandbox_mechanism
from grouprl.sandbox import runner as sandbox_runner
from grouprl.trainer import Trainer


@pytest.fixture(autouse=True)
def _nothing_loads(no_tokenizer_loading):
    """Every error here must come before a model or a tokenizer is loaded (tests/trainer/conftest.py)."""


@pytest.mark.parametrize("overrides, message", [
    ({"num_generations": 1}, "num_generations=1: the trainer samples each prompt's completions as a group, of at "
                             "least 2"),
    ({"gamma": 0.9}, "gamma=0.9 shapes PPO's value head and GAE, and this run has none .value_head is false.: set "
                     "algorithm: ppo, or remove gamma"),
    ({"vf_coef": 0.5}, "vf_coef=0.5 shapes PPO's value head"),
    ({"cliprange_value": None}, "cliprange_value=None shapes PPO's value head"),
    ({"micro_batch_size": 5}, "micro_batch_size=5 does not divide the 16 completions"),
    ({"reward_funcs": ["no_such_reward"]}, "no_such_reward"),
    ({"reward_funcs": ["nomodule_xyz:f"]}, "nomodule_xyz"),
    ({"train_data": "missing/prompts.jsonl"}, "train_data='missing/prompts.jsonl' does not exist"),
    ({"model": "./no/such/model"}, "model='./no/such/model' does not exist: check the path"),
    ({"tokenizer": "./no/such/tokenizer"}, "tokenizer='./no/such/tokenizer' does not exist: check the path"),
    ({"eval_data": "missing/eval.jsonl"}, "eval_data='missing/eval.jsonl' does not exist: check the path"),
    ({"algorithm": "trpo"}, "algorithm='trpo' is unknown: choose one of bnpo, cispo, dapo, dr_grpo, gdpo, gmpo, grpo"),
    ({"loss_agg": "mean"}, "loss_agg='mean' is not one of"),
    ({"reward_weights": [1.0, 2.0]}, "reward_weights has 2 values but reward_funcs has 1"),
    ({"learning_rate": "fast"}, "learning_rate='fast' has the wrong type: expected float"),
    ({"max_grad_norm": -1.0}, "max_grad_norm=-1.0 must be positive, or null"),
    ({"adam_beta2": 1.0}, "adam_beta2=1.0 must be in .0, 1. .AdamW"),
    ({"weight_decay": -0.01}, "weight_decay=-0.01 must be 0 or more"),
    ({"ddp_timeout": 0}, "ddp_timeout=0 must be a positive number of seconds"),
    ({"lora_r": 8, "ref_update_steps": 2}, "ref_update_steps with LoRA is not supported"),
    ({"lora_r": 4, "lora_dropout": 1.5}, "lora_dropout=1.5 must be in [0, 1"),
    ({"lora_r": 4, "lora_target_modules": []}, "lora_target_modules is empty"),
    ({"lora_r": 4, "lora_target_modules": ["all-linear", "lm_head"]},
     "lora_target_modules=['all-linear', 'lm_head']: all-linear takes every linear module but the LM head; give it "
     "alone, or name the modules without it"),
    ({"reward_funcs": [1]}, "reward_funcs[0]=1: name a reward function as `math_accuracy`"),
    ({"audit_funcs": [None]}, "audit_funcs[0]=None: name a reward function"),
    ({"temperature": 1e-40}, "temperature=1e-40 must be at least 1e-06"),
    ({"eval_temperature": 1e-40}, "eval_temperature=1e-40 must be at least 1e-06"),
    ({"generation_batch_size": 2}, "generation_batch_size=2 is under num_generations=4: a prompt's group is "
                                   "decoded together"),
    ({"algorithm": "reinforce_pp", "dynamic_sampling": True}, "dynamic_sampling with advantage_estimator=reinforce_pp: "
     "dynamic sampling drops the groups whose rewards are all equal, and its baseline is the batch's mean"),
    ({"algorithm": "reinforce_pp", "prompt_filter": True}, "prompt_filter with advantage_estimator=reinforce_pp: "
     "the prompt filter stops drawing prompts .* set prompt_filter: false"),
    ({"vllm_importance_sampling_mode": "tis"}, "vllm_importance_sampling_mode='tis' is not one of"),
    ({"vllm_importance_sampling_cap": 0.5}, "vllm_importance_sampling_cap=0.5 must be at least 1"),
    ({"vllm_importance_sampling_min": 2.0}, "vllm_importance_sampling_min=2.0 must be in [0, 1]"),
    ({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_min": 0.5},
     "vllm_importance_sampling_min=0.5 has no effect with vllm_importance_sampling_mode=token_truncate"),
    ({"vllm_importance_sampling_correction": "yes"}, "vllm_importance_sampling_correction='yes' has the wrong type"),
    ({"vllm_importance_sampling_correction": True}, "vllm_importance_sampling_correction=true without use_vllm"),
    ({"vllm_mode": "server"}, "vllm_mode=server without use_vllm: set use_vllm: true"),
    ({"vllm_server_port": 0}, "vllm_server_port=0 must be a TCP port in 1..65535"),
    ({"vllm_server_timeout_s": 0}, "vllm_server_timeout_s=0 must be positive"),
    ({"max_staleness": -1}, "max_staleness=-1 must be 0 or more"),
    ({"async_rollouts": True}, "async_rollouts needs use_vllm: true with vllm_mode: server. The built-in engine"),
    ({"async_rollouts": True, "use_vllm": True}, "async_rollouts needs use_vllm: true with vllm_mode: server"),
    ({"partial_rollouts": True}, "partial_rollouts without async_rollouts: only batches generated ahead"),
    ({"vllm_lora_sync": "adapters"}, "vllm_lora_sync='adapters' is not one of: auto, adapter, merged"),
    ({"vllm_weight_transfer": "tcp"}, "vllm_weight_transfer='tcp' is not one of: auto, gloo, nccl, file"),
    ({"async_rollouts": True, "use_vllm": True, "vllm_mode": "server", "vllm_importance_sampling_correction": False},
     "async_rollouts with vllm_importance_sampling_correction=false: stale samples"),
    ({"delta": 1.2, "epsilon_high": 0.28}, r"delta=1.2 must be above 1 \+ epsilon_high = 1.28"),
    ({"dual_clip": 1.1}, r"dual_clip=1.1 must be above 1 \+ epsilon_high = 1.2: the cap"),
    ({"vllm_mode": "remote"}, "vllm_mode='remote' is not one of: colocate, server"),
    ({"vllm_gpu_memory_utilization": 1.5}, "vllm_gpu_memory_utilization=1.5 must be in (0, 1]"),
    ({"vllm_dtype": "fp8"}, "vllm_dtype='fp8' is not one of: float32, bfloat16, float16, auto"),
    ({"vllm_max_model_length": 10}, "vllm_max_model_length=10 is shorter than max_prompt_length"),
    ({"kl_estimator": "k1", "beta": 0.04}, "kl_estimator=k1 with beta=0.04: added to the loss, k1 = logp - "
                                           "ref_logp has a gradient of zero in expectation"),
    ({"use_vllm": True, "vllm_mode": "server", "async_rollouts": True, "partial_rollouts": True, "max_staleness": 0},
     "partial_rollouts with max_staleness=0: nothing is generated ahead"),
    ({"use_vllm": True, "temperature": 3.0},
     "temperature=3.0 with use_vllm: vLLM samples at temperatures in [0.01, 2]"),
])
def test_config_errors_name_the_field(make_cfg, overrides, message):
    with pytest.raises((ConfigError, ValueError), match=message.replace("(", r"\(").replace("[", r"\[")):
        Trainer(make_cfg(**overrides))


@pytest.mark.parametrize("overrides, message", [
    ({"vllm_enforce_eager": True}, "vllm_enforce_eager=True is a vLLM setting, and use_vllm is false: it is ignored"),
    ({"use_vllm": True, "vllm_mode": "server", "vllm_max_model_length": 4096},
     "vllm_max_model_length=4096 shapes the colocated engine, and vllm_mode is server, whose engine is set where it "
     "starts (grouprl vllm-serve MODEL --max-model-len ...): it is ignored here"),
    ({"use_vllm": True, "vllm_mode": "server", "vllm_dtype": "float32"}, "grouprl vllm-serve MODEL --dtype"),
    ({"use_vllm": True, "vllm_server_port": 8001}, "vllm_server_port=8001 applies to vllm_mode: server, and this "
                                                   "run colocates vLLM: it is ignored"),
])
def test_a_vllm_setting_the_run_will_not_read_is_said_once(make_cfg, caplog, overrides, message):
    """Said, not refused: a run's own config.yaml holds every setting it ran with, so it must still
    evaluate with --use_vllm false on a machine without vLLM (it was refused, with advice a command line
    could not follow), and a config written when a vLLM default differed must still resume."""
    import grouprl.config.validate as validate

    validate._warned.clear()
    cfg = make_cfg(**overrides)
    with caplog.at_level("WARNING", logger="grouprl.config.validate"):
        cfg.validate()
        cfg.validate()  # where the trainer starts, again
    assert caplog.text.count(message) == 1


@pytest.mark.parametrize("spelling", ["ALL-LINEAR", "all_linear", " All_Linear ", ["all-linear"]])
def test_all_linear_is_read_in_any_case_and_with_an_underscore(make_cfg, spelling):
    """PEFT knows `all-linear` only: another spelling was split into a module name that matched nothing."""
    assert make_cfg(lora_r=4, lora_target_modules=spelling).validate().lora_target_modules == "all-linear"


def test_lora_settings_without_lora_r_are_said_once(make_cfg, caplog):
    """lora_r=0 trains every weight: a run given lora_alpha or target modules without it trained them all,
    silently."""
    import grouprl.config.validate as validate

    validate._warned.clear()
    with caplog.at_level("WARNING", logger="grouprl.config.validate"):
        make_cfg(lora_alpha=32.0, lora_target_modules="q_proj,v_proj").validate().validate()
        make_cfg(lora_alpha=-1.0).validate()
        make_cfg(lora_alpha=16.0, lora_dropout=0.0, lora_target_modules="all-linear").validate()  # the defaults
        make_cfg(lora_r=4, lora_alpha=32.0).validate()
    assert caplog.messages == [
        "lora_alpha=32.0, lora_target_modules=['q_proj', 'v_proj'] have no effect with lora_r=0, which trains every "
        "weight: set lora_r (the adapter's rank, e.g. 16) to train a LoRA adapter",
        "lora_alpha=-1.0 has no effect with lora_r=0, which trains every weight: set lora_r (the adapter's rank, "
        "e.g. 16) to train a LoRA adapter"]


def test_a_vllm_runs_config_evaluates_without_vllm(make_cfg, tmp_path):
    """The case the refusal broke: a vLLM run's resolved config.yaml, with --use_vllm false."""
    cfg = make_cfg(use_vllm=True, vllm_gpu_memory_utilization=0.5, vllm_enable_sleep_mode=True)
    cfg.save_yaml(tmp_path / "config.yaml", absolute=True)
    got = build_config(str(tmp_path / "config.yaml"), ["--use_vllm", "false"], command="eval")
    assert not got.use_vllm and got.vllm_gpu_memory_utilization == 0.5


def test_missing_prompt_column(make_cfg, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "hi"}) + "\n")
    with pytest.raises(DataError, match="no 'prompt' column .* rename the prompt column"):
        Trainer(make_cfg(train_data=str(path)))
    # prompt_column set, to a column the data lacks: "or set prompt_column" told the user to do what they had done
    path.write_text(json.dumps({"prompt": "hi", "answer": "1"}) + "\n")
    with pytest.raises(DataError) as e:
        Trainer(make_cfg(train_data=str(path), prompt_column="question"))
    assert ("has no 'question' column, which prompt_column names; its columns are ['prompt', 'answer']: set "
            "prompt_column to the one that holds the prompts, or give the data a 'question' column") in str(e.value)
    with pytest.raises(DataError, match=r"its columns are \['prompt', 'answer'\] \(did you mean 'prompt'\?\)"):
        Trainer(make_cfg(train_data=str(path), prompt_column="promt"))


def test_malformed_row_names_the_row(make_cfg, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"prompt": ""}) + "\n")
    with pytest.raises(DataError, match="bad.jsonl' line 2: 'prompt' is an empty string"):
        Trainer(make_cfg(train_data=str(path)))


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "fine"}', '{"prompt": "cut', '{"prompt": "after"}'],
     r"line 2 is not valid JSON \(Unterminated string starting at column 12\): '\{\"prompt\": \"cut'"),
    (['{"prompt": "fine"}', '', '["a", "list"]'], "line 3 is a JSON list, not an object"),
])
def test_malformed_jsonl_line_names_the_file_and_line(make_cfg, tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=f"train_data='{path}': {message}"):
        Trainer(make_cfg(train_data=str(path)))


def test_an_unknown_field_in_python_suggests_the_right_one():
    with pytest.raises(ConfigError, match=r"unknown config field\(s\): 'num_generation' \(did you mean "
                                          r"'num_generations'\?\)"):
        TrainConfig(num_generation=4)


def test_unknown_yaml_field_suggests_the_right_one(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("num_generation: 4\n")
    with pytest.raises(ConfigError, match="did you mean 'num_generations'"):
        TrainConfig.load(path)


def test_cli_reports_errors_with_exit_code_2(capsys, tmp_path):
    code = main(["train", "--num_generations", "1", "--output_dir", str(tmp_path / "x")])
    assert code == 2
    assert "num_generations=1" in capsys.readouterr().err


def test_cli_accepts_dashes_and_lists_every_field_in_help():
    out = subprocess.run([sys.executable, "-m", "grouprl", "train", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for name in ("num_generations", "max_completion_length", "beta", "epsilon_high", "scale_rewards",
                 "reward_weights", "mask_truncated_completions", "ignore_eos", "prompts_per_step"):
        assert f"--{name} " in out
    cfg = build_config(None, ["--max-completion-length", "7", "--scale_rewards=batch"])
    assert cfg.max_completion_length == 7 and cfg.scale_rewards == "batch"
    assert "--num_generations (int, default 8)\n      Completions per prompt (G, the group size)." in out


def test_cli_overrides_go_over_the_yaml_file_and_unknown_ones_suggest_a_field(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("model: some/model\nbeta: 0.1\n")
    cfg = build_config(str(path), ["--beta", "0.04", "--ignore-eos"])
    assert (cfg.model, cfg.beta, cfg.ignore_eos) == ("some/model", 0.04, True)
    code = main(["train", "--num_generation", "4"])
    assert code == 2
    assert "unknown option --num_generation (did you mean 'num_generations'?)" in capsys.readouterr().err
    # a flag with no value (an unset shell variable: `--output_dir $OUT --max_steps 2`) is an error for a
    # field that is not true/false; it trained into a folder named "true" before
    for args in (["--output_dir", "--max_steps", "2"], ["--max_steps", "2", "--run_name"]):
        assert main(["train", *args]) == 2
        assert f"--{args[0 if args[0] == '--output_dir' else 2][2:]} needs a value" in capsys.readouterr().err


def test_exponent_floats_without_a_dot_are_floats_in_yaml_files_and_on_the_command_line(tmp_path):
    # PyYAML reads YAML 1.1, where 1e-6 is the string '1e-6': `--learning_rate 3e-2` failed with
    # "has the wrong type: expected float", and so did `learning_rate: 1e-6` in a config file.
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 1e-6\nreward_weights: [1, 2E-1]\nweight_decay: .5e-1\nmodel: '1e-3'\n")
    cfg = TrainConfig.load(path)
    assert (cfg.learning_rate, cfg.reward_weights, cfg.weight_decay, cfg.model) == (1e-6, [1, 0.2], 0.05, "1e-3")
    cfg = build_config(str(path), ["--learning_rate", "3e-2", "--beta=4E+1", "--max_grad_norm=1e-1",
                                   "--output_dir", "1e5", "--model", "2024", "--train_data", "2.5",
                                   "--eval_data", "null", "--reward_funcs", "[math_accuracy, format_reward]"])
    assert (cfg.learning_rate, cfg.beta, cfg.max_grad_norm) == (0.03, 40.0, 0.1)
    # a text field keeps the text as typed; null still clears an optional one
    assert (cfg.output_dir, cfg.model, cfg.train_data, cfg.eval_data) == ("1e5", "2024", "2.5", None)
    cfg.validate()
    cfg.save_yaml(tmp_path / "written.yaml")  # written as a run writes its config.yaml, and read back
    assert "output_dir: '1e5'" in (tmp_path / "written.yaml").read_text()  # bare, it read back as 100000.0
    assert TrainConfig.load(tmp_path / "written.yaml") == cfg


def test_a_config_file_after_options_is_read_or_named(tmp_path, monkeypatch, capsys):
    """argparse fills the config positional before the options: `grouprl train --resume run.yaml` left the
    file over as an "unexpected argument", and `--progress run.yaml` took it as --progress's value."""
    import grouprl.cli as cli

    seen = []
    monkeypatch.setattr(cli, "_train", lambda cfg, **kw: seen.append((cfg.beta, kw["resume"])) or 0)
    (tmp_path / "run.yaml").write_text("beta: 0.5\n")
    assert cli.main(["train", "--resume", str(tmp_path / "run.yaml")]) == 0 and seen == [(0.5, True)]
    for args in (["--beta", "0.1", str(tmp_path / "run.yaml")], ["--progress", str(tmp_path / "run.yaml")]):
        assert cli.main(["train", *args]) == 2
        assert "(a config file comes right after the command: grouprl train CONFIG" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["eval", "preflight"])
def test_eval_and_preflight_open_no_tracker(make_cfg, digits_data, tmp_path, monkeypatch, command):
    """A run's config.yaml names its trackers; evaluating its checkpoint (or a preflight) logs to none, so
    a machine without wandb refused `grouprl eval` over a wandb run ("wandb is not installed")."""
    import grouprl.trainer
    from grouprl.cli import main

    built = []

    class Built(Exception):
        pass

    def trainer(cfg, **kwargs):
        built.append(cfg.report_to)
        raise Built

    monkeypatch.setattr(grouprl.trainer, "Trainer", trainer)
    make_cfg(report_to=["wandb"], eval_data=str(digits_data)).save_yaml(tmp_path / "run.yaml")
    with pytest.raises(Built):
        main([command, str(tmp_path / "run.yaml")])
    assert built == [[]]


def test_a_runs_config_with_a_new_model_or_length_drops_what_followed_from_the_old_ones(tmp_path):
    """Over a run's config.yaml: a new --model drops the GGUF file name of the model the run started from (a
    checkpoint's model/ folder holds none, so `grouprl eval --model RUN/checkpoints/step-N/model` failed for a
    run trained from a GGUF file), and a new --max_completion_length the window derived from the old length."""
    run = TrainConfig(model="gg", gguf_file="tiny.gguf", train_data="d", reward_funcs=["f"],
                      max_completion_length=256).validate()
    assert run.overlong_cache_len == 51
    run.save_yaml(tmp_path / "config.yaml")
    cfg = build_config(str(tmp_path / "config.yaml"), ["--model", "ckpt/model", "--max_completion_length", "2048"])
    assert (cfg.gguf_file, cfg.validate().overlong_cache_len) == (None, 409)
    kept = build_config(str(tmp_path / "config.yaml"), ["--max_completion_length", "2048", "--overlong_cache_len",
                                                        "100", "--gguf_file", "other.gguf", "--model", "x"])
    assert (kept.gguf_file, kept.overlong_cache_len) == ("other.gguf", 100)  # given: kept


def test_a_list_field_takes_one_value_or_commas_and_micro_batch_size_stops_at_the_step(tmp_path):
    # `--report_to wandb` (as in TRL) was "has the wrong type: expected list[str]"
    cfg = build_config(None, ["--report_to", "wandb", "--eval_metrics", "greedy,pass@4", "--num_generations_eval",
                              "4", "--reward_weights", "1, 2e-1", "--audit_funcs", "math_accuracy,format_reward"])
    assert (cfg.report_to, cfg.eval_metrics, cfg.reward_weights) == (["wandb"], ["greedy", "pass@4"], [1, 0.2])
    assert cfg.audit_funcs == ["math_accuracy", "format_reward"]
    assert build_config(None, ["--report_to", "[]", "--reward_weights", "null"]).report_to == []
    assert build_config(None, ["--lora_target_modules", "all-linear"]).lora_target_modules == "all-linear"  # str too
    path = tmp_path / "c.yaml"
    path.write_text("report_to: trackio\naudit_funcs: math_accuracy\n")
    assert (TrainConfig.load(path).report_to, TrainConfig.load(path).audit_funcs) == (["trackio"], ["math_accuracy"])
    # the embedded task's micro_batch_size 128 over a 15-completion step: the whole step per pass
    cfg = build_config(None, ["--num_generations", "3", "--prompts_per_step", "5"])
    assert (cfg.micro_batch_size, cfg.validate().micro_batch_size) == (128, 15)


def test_a_list_in_brackets_that_is_not_yaml_is_named_not_split_on_its_commas(tmp_path, capsys):
    # split on its commas, it failed on a piece: "reward_funcs[3]={'full': 'true}]'}: name a reward function as"
    value = '[math_accuracy, {name: regex_match, pattern: "^\\d+$", full: true}]'  # "\d": no escape in YAML
    assert main(["train", "--model", "m", "--train_data", "t.jsonl", "--reward_funcs", value, "--output_dir",
                 str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert f"--reward_funcs {value} is not valid YAML: while scanning a double-quoted scalar" in err
    assert "found unknown escape character 'd'" in err and "reward_funcs[3]" not in err
    assert "single quotes keep backslashes as typed ('^\\d+$')" in err
    fixed = build_config(None, ["--model", "m", "--train_data", "t.jsonl", "--reward_funcs",
                                "[math_accuracy, {name: regex_match, pattern: '^\\d+$', full: true}]"])
    assert fixed.reward_funcs == ["math_accuracy", {"name": "regex_match", "pattern": "^\\d+$", "full": True}]
    with pytest.raises(ConfigError, match=r"(?s)--chat_template_kwargs \{a: 1 is not valid YAML: .*brackets closed"):
        build_config(None, ["--chat_template_kwargs", "{a: 1"])
    # commas without brackets are still a list, and a text field keeps brackets as typed
    assert build_config(None, ["--lora_target_modules", "q_proj,v_proj"]).validate().lora_target_modules == [
        "q_proj", "v_proj"]
    assert build_config(None, ["--system_prompt", "[INST] a, b: [c"]).system_prompt == "[INST] a, b: [c"


def test_a_task_field_alone_says_what_else_a_task_needs(capsys):
    # --eval_data alone left the embedded task for an empty config: "model is empty"
    assert main(["train", "--eval_data", "builtin:arithmetic/eval"]) == 2
    assert ("--eval_data without a config file starts a task of your own, which also needs --model, --train_data, "
            "--reward_funcs; give them (or a config file), or leave out --eval_data to train on the embedded "
            "task") in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--reward_funcs without a config file .* also needs --model, --train_data;"):
        build_config(None, ["--reward_funcs", "math_accuracy"])
    # eval reads eval_data alone (or eval_fraction of train_data), and its message speaks of evaluating
    with pytest.raises(ConfigError, match="--reward_funcs without a config file evaluates on a task of your own, "
                                          "which also needs --model, --eval_data; .* to evaluate on the embedded"):
        build_config(None, ["--reward_funcs", "r"], command="eval")
    cfg = build_config(None, ["--model", "m", "--eval_data", "e.jsonl", "--reward_funcs", "r"], command="eval")
    assert (cfg.model, cfg.train_data, cfg.eval_data) == ("m", "", "e.jsonl")
    cfg = build_config(None, ["--model", "m", "--train_data", "t.jsonl", "--eval_fraction", "0.1", "--reward_funcs",
                              "r"], command="eval")
    assert (cfg.train_data, cfg.eval_fraction) == ("t.jsonl", 0.1)


def test_validation_reads_no_file_and_the_loaders_probe_paths_before_any_model_loads(make_cfg, digits_data,
                                                                                        monkeypatch, capsys, tmp_path):
    make_cfg(model="./no/such/model", train_data="./no/such.jsonl").validate()  # values only
    code = main(["train", "--model", "./no/such/model", "--train_data", str(digits_data), "--reward_funcs",
                 "[tests.trainer.conftest:digit_fraction]", "--output_dir", str(tmp_path / "x")])
    assert code == 2 and "model='./no/such/model' does not exist: check the path" in capsys.readouterr().err
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert check_model_source("org/name", None, None) == ("org/name", None)  # a hub id, downloaded when loaded
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: a hub name is neither a folder nor downloadable ...
    with pytest.raises(ConfigError) as err:
        check_model_source("org/name", None, None)
    assert str(err.value).startswith(
        "model='org/name' is not a local folder, and the hub is offline (HF_HUB_OFFLINE=1) with no copy of "
        "org/name in the Hugging Face cache: download it once where the hub is reachable (hf download org/name; "
        "then offline runs find it in the cache), or set model to a local folder that holds it")
    # ... unless the cache holds a snapshot of it, which an offline load reads
    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--name" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--name" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    assert check_model_source("org/name", None, None) == ("org/name", None)


def test_a_hub_model_that_cannot_be_fetched_is_an_error_naming_the_fixes(monkeypatch, make_cfg, tmp_path):
    """Online (HF_HUB_OFFLINE unset) with no network, transformers raises OSError after its retries, for
    the tokenizer and the model alike: an error that names the model and what to do, not a traceback."""
    import transformers

    from grouprl.policy import load_policy, load_tokenizer

    def unreachable(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them "
                      "in the cached files.\nCheck your internet connection")

    for auto in (transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(auto, "from_pretrained", unreachable)
    fix = (r"the Hugging Face hub did not give it \(We couldn't connect to 'https://huggingface.co' to load the "
           r"files, and couldn't find them in the cached files.\): check the name and the network; or download it "
           r"once where the hub is reachable \(hf download org/name\) and run with HF_HUB_OFFLINE=1, or set {} to a "
           "local folder that holds it")
    with pytest.raises(ConfigError, match="tokenizer='org/name' is not a local folder, and " + fix.format("tokenizer")):
        load_tokenizer("org/name")
    with pytest.raises(ConfigError, match="model='org/name' is not a local folder, and " + fix.format("model")):
        load_policy("org/name")
    with pytest.raises(OSError, match="We couldn't connect"):  # a local folder's error is its own
        load_policy(str(tmp_path))

    def disk_full(*args, **kwargs):  # while the download writes into the cache: not the hub's fault
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", disk_full)
    with pytest.raises(OSError, match="No space left on device") as raised:
        load_tokenizer("org/name")
    assert not isinstance(raised.value, ConfigError)


def test_a_model_folder_without_a_model_names_the_one_inside(tmp_path):
    """`model: RUN/checkpoints/step-N` (without /model), the run folder itself, or an empty folder: an
    error before anything loads, naming the model folder inside where there is one (it was a tokenizer
    error about sentencepiece)."""
    step = tmp_path / "run" / "checkpoints" / "step-000002"
    (step / "model").mkdir(parents=True)
    (step / "model" / "config.json").write_text("{}")
    for folder, hint in ((step, f"use model: {step / 'model'}"), (tmp_path / "run", f"use model: {step / 'model'}"),
                         (tmp_path / "run" / "checkpoints", "point model at the folder that holds")):
        with pytest.raises(ConfigError, match=f"model='{folder}' is a folder without config.json, so it holds "
                                              f"no model: {hint}"):
            check_model_source(str(folder), None, None)


def test_tool_parser_and_scale_rewards_take_the_names_their_modules_define(make_cfg):
    from grouprl.core.advantages import SCALES
    from grouprl.tools import FORMATS

    for name in FORMATS:
        make_cfg(tools=["python"], tool_parser=name).validate()
    with pytest.raises(ConfigError, match=f"tool_parser='xml' is not one of: {', '.join(FORMATS)}$"):
        make_cfg(tools=["python"], tool_parser="xml").validate()
    for name in SCALES:
        make_cfg(scale_rewards=name).validate()
    with pytest.raises(ConfigError, match=f"scale_rewards='std' is not one of: {', '.join(SCALES)}$"):
        make_cfg(scale_rewards="std").validate()


def test_cli_reports_a_failing_reward_function_and_how_to_continue(tmp_path, tiny_model_dir, digits_data,
                                                                    monkeypatch, capsys):
    monkeypatch.undo()  # this one loads the model: the failure comes from the first reward call
    mod = tmp_path / "broken_reward.py"
    mod.write_text("def broken(prompts, completions, **kw):\n    raise KeyError('answer_text')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a terminal: the live bar is drawn
    code = main(["train", "--model", str(tiny_model_dir), "--train_data", str(digits_data),
                 "--reward_funcs", "[broken_reward:broken]", "--num_generations", "2",
                 "--prompts_per_step", "2", "--micro_batch_size", "4", "--max_completion_length", "4",
                 "--output_dir", str(tmp_path / "run"), "--progress", "true"])
    err = capsys.readouterr().err
    assert code == 1
    assert "broken" in err and "answer_text" in err
    assert "the run wrote no checkpoint: run the same command again" in err and "--resume" not in err  # none yet
    # the progress bar (on stderr too) is closed first: the error starts a line of its own
    assert "grpo:" in err and any(line.startswith("grouprl train: error: reward function") for line in err.splitlines())


@pytest.fixture
def no_isolating_sandbox(monkeypatch):
    """This host as if namespaces were unavailable (the real thing runs in tests/sandbox/test_unprivileged.py)."""
    monkeypatch.delenv("GROUPRL_SANDBOX_MODE", raising=False)
    refusal = SandboxUnavailableError("no isolating sandbox works here: user namespaces are refused")
    monkeypatch.setattr(sandbox_runner, "_probed", {"strict:auto": refusal})
    monkeypatch.setattr(sandbox_runner, "_warned_weak", False)


def test_a_code_reward_without_an_isolating_sandbox_stops_the_run_at_start(make_cfg, no_isolating_sandbox, capsys,
                                                                           tmp_path, tiny_model_dir, digits_data):
    with pytest.raises(SandboxUnavailableError, match="user namespaces are refused"):
        Trainer(make_cfg(reward_funcs=["code_tests"]))
    code = main(["train", "--model", str(tiny_model_dir), "--train_data", str(digits_data),
                 "--reward_funcs", "[code_tests]", "--output_dir", str(tmp_path / "x")])
    assert code == 2 and "user namespaces are refused" in capsys.readouterr().err


def test_the_trainer_logs_the_sandbox_in_force_once(make_cfg, no_isolating_sandbox, monkeypatch, caplog, tmp_path):
    monkeypatch.undo()  # loads the model; the sandbox is this host's own
    monkeypatch.setattr(sandbox_runner, "_warned_weak", False)
    tasks = tmp_path / "tasks.jsonl"  # code_tests reads the `tests` column
    tasks.write_text("".join(json.dumps({"prompt": f"Print {i}.", "tests": [{"input": "", "output": str(i)}]}) + "\n"
                             for i in range(8)))
    with caplog.at_level(logging.INFO, logger="grouprl"):
        Trainer(make_cfg(train_data=str(tasks), reward_funcs=[
            "tests.trainer.conftest:digit_fraction", {"name": "code_tests", "isolation": "weak"}, "code_tests"]))
    lines = [r.getMessage() for r in caplog.records if r.name == "grouprl.trainer"]
    lines = [line for line in lines if "sandbox" in line]  # the trainer also logs its precision
    mech = sandbox_mechanism()
    assert lines == [f"sandbox for untrusted code: {mech.describe()}"] and not mech.weak


def test_the_cli_reaches_gmpo_and_the_entropy_bonus():
    """`--algorithm gmpo` fills the paper's log-space clip (0.4) and the gmpo term; `--entropy_coef` is
    a float field like any other, and reaches the loss knobs."""
    from grouprl.objective import policy_loss_params

    cfg = build_config(None, ["--algorithm", "gmpo", "--entropy-coef", "1e-3"]).validate()
    assert (cfg.loss_type, cfg.epsilon, cfg.epsilon_high, cfg.entropy_coef) == ("gmpo", 0.4, 0.4, 1e-3)
    params = policy_loss_params(cfg)
    assert (params.loss_type, params.entropy_coef, params.agg) == ("gmpo", 1e-3, "seq-mean-token-mean")
    assert build_config(None, []).entropy_coef == 0.0


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("overrides, message", [
    ({"save_total_limit": -1}, "save_total_limit=-1 must be at least 1; null keeps every checkpoint"),
    ({"save_total_limit": 0}, "save_total_limit=0 must be at least 1; null keeps every checkpoint"),
    ({"max_prompt_length": -5}, "max_prompt_length=-5 must be at least 1; null keeps prompts whole"),
    ({"max_prompt_length": 0}, "max_prompt_length=0 must be at least 1; null keeps prompts whole"),
    ({"max_eval_samples": -1}, "max_eval_samples=-1 must be at least 1; null evaluates on every eval prompt"),
    ({"num_threads": -1}, "num_threads=-1 must be at least 1; null leaves the thread count to torch"),
    ({"seed": -1}, "seed=-1 must be in 0..4294967295 (numpy's seed range)"),
    ({"seed": 2**32}, "seed=4294967296 must be in 0..4294967295"),
    ({"advantage_eps": -1.0}, "advantage_eps=-1.0 must be 0 or more"),
    ({"reward_timeout_s": 0}, "reward_timeout_s=0 must be a positive number of seconds, or null for no timeout"),
    ({"env_timeout_s": 0}, "env_timeout_s=0 must be a positive number of seconds, or null for no limit"),
    ({"max_tool_output_chars": 0}, "max_tool_output_chars=0 must be at least 1"),
    ({"output_dir": ""}, "output_dir is empty: name the folder the run writes to"),
    ({"max_completion_length": "64"}, "max_completion_length='64' has the wrong type: expected int"),
    ({"algorithm": ["grpo"]}, "algorithm=['grpo'] has the wrong type: expected str"),
    ({"reward_weights": [NAN]}, "reward_weights=[nan] must hold finite numbers: NaN and infinity are not settings; "
                                "null gives its default"),
    ({"advantage_eps": NAN}, "advantage_eps=nan must be a finite number: NaN and infinity are not settings"),
    ({"beta": NAN}, "beta=nan must be a finite number"),
    ({"reward_timeout_s": NAN}, "reward_timeout_s=nan must be a finite number"),
    ({"max_grad_norm": INF}, "max_grad_norm=inf must be a finite number"),
    ({"health_thresholds": {"kl_spike_min": NAN}}, "health_thresholds={'kl_spike_min': nan} must hold finite numbers"),
    ({"metric_for_best_model": "pass@4"}, "metric_for_best_model='pass@4' is not an eval result: with "
     "eval_metrics=['greedy'] the eval reports accuracy, reward_mean, length_mean and rewards/NAME for each reward "
     "function; add pass@4 to eval_metrics"),
    ({"metric_for_best_model": "greedy"}, "greedy decoding's result is reported as accuracy: name accuracy"),
    ({"metric_for_best_model": "acc", "eval_metrics": ["maj@2"], "num_generations_eval": 2},
     "metric_for_best_model='acc' is not an eval result: with eval_metrics=['maj@2'] the eval reports accuracy, "
     "reward_mean, length_mean, maj@2 and rewards/NAME for each reward function; name one of these"),
])
def test_values_that_would_fail_mid_run_or_silently_are_refused_by_validation(overrides, message):
    """Each passed validation and then failed late (a negative seed in torch, num_threads -1), did the
    wrong thing (save_total_limit -1 deleted every checkpoint, max_prompt_length -5 dropped the first 5
    tokens, a NaN advantage_eps skipped every step) or raised a TypeError instead of a ConfigError."""
    cfg = TrainConfig(model="m", train_data="t.jsonl", reward_funcs=["r"], **overrides)
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg.validate()


def test_wrong_types_in_a_yaml_file_are_config_errors_before_the_preset_is_read(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text('model: m\ntrain_data: t.jsonl\nreward_funcs: [r]\nmax_completion_length: "64"\n')
    with pytest.raises(ConfigError, match="max_completion_length='64' has the wrong type: expected int"):
        TrainConfig.load(path).validate()
    with pytest.raises(ConfigError, match=r"algorithm=\['grpo'\] has the wrong type: expected str"):
        TrainConfig(algorithm=["grpo"]).resolved()
    path.write_text("model: m\ntrain_data: t.jsonl\nreward_funcs: [r]\nreward_weights: [.nan]\n")
    with pytest.raises(ConfigError, match=r"reward_weights=\[nan\] must hold finite numbers"):
        TrainConfig.load(path).validate()


def test_metric_for_best_model_takes_what_the_eval_reports():
    """metric_for_best_model was checked only at the first eval, after training steps. rewards/NAME passes:
    its names come with the reward functions (the first eval names a wrong one)."""
    for metric in ("accuracy", "reward_mean", "length_mean", "pass@4", "mean@2", "rewards/anything"):
        TrainConfig(model="m", train_data="t.jsonl", reward_funcs=["r"], eval_metrics=["greedy", "pass@4", "mean@2"],
                    num_generations_eval=4, metric_for_best_model=metric).validate()


def test_the_smallest_and_null_values_of_the_bounded_fields_pass():
    for values in ({"save_total_limit": 1, "max_prompt_length": 1, "max_eval_samples": 1, "num_threads": 1,
                    "seed": 2**32 - 1, "advantage_eps": 0.0},
                   {"save_total_limit": None, "max_prompt_length": None, "max_eval_samples": None,
                    "num_threads": None, "reward_timeout_s": None}):
        TrainConfig(model="m", train_data="t.jsonl", reward_funcs=["r"], **values).validate()


@pytest.mark.parametrize("how", ["cli", "file", "python"])
def test_trls_names_say_what_to_use_here_not_a_close_spelling(how, tmp_path):
    """num_train_epochs was answered "did you mean 'num_iterations'?" (PPO's epochs per batch: following
    it changes the algorithm), per_device_train_batch_size "'generation_batch_size'"; a name of TRL's
    GRPOConfig gets what the README's "Coming from TRL" table says instead."""
    if how == "cli":
        make = lambda: build_config(None, ["--num_train_epochs", "3"])  # noqa: E731
    elif how == "file":
        path = tmp_path / "run.yaml"
        path.write_text("num_train_epochs: 3\n")
        make = lambda: build_config(str(path), [])  # noqa: E731
    else:
        make = lambda: TrainConfig(num_train_epochs=3)  # noqa: E731
    with pytest.raises(ConfigError) as e:
        make()
    assert re.search(r"num_train_epochs'?: TRL's name; here, runs are counted in steps: max_steps", str(e.value))
    assert "did you mean" not in str(e.value)


@pytest.mark.parametrize("name, hint", [
    ("lora_modules_to_save", "no modules trained whole beside the adapter"),  # was: did you mean lora_target_modules
    ("use_dora", "no DoRA: plain LoRA (lora_r, lora_alpha)"),
    ("use_rslora", "no rsLoRA: the update is scaled by lora_alpha / lora_r; for rsLoRA's alpha / sqrt(r), set "
                   "lora_alpha to alpha·sqrt(lora_r)"),
])
def test_trls_lora_names_say_what_grouprl_has_instead(name, hint):
    with pytest.raises(ConfigError, match=re.escape(f"--{name}: TRL's name; here, {hint}")):
        build_config(None, [f"--{name}", "x"])


def test_every_trl_name_is_not_a_field_and_its_advice_names_real_fields():
    """The table stays true: a name that became a field would never be met, and advice naming a field
    that is gone would send a user nowhere."""
    import dataclasses

    from grouprl.config.errors import TRL_NAMES, TRL_VALUES
    from grouprl.config.schema import TrainFields

    fields = {f.name for f in dataclasses.fields(TrainFields)}
    assert not set(TRL_NAMES) & fields
    named = {w for text in [*TRL_NAMES.values(), *TRL_VALUES.values()]
             for w in re.findall(r"\b[a-z]+(?:_[a-z0-9]+)+\b", text)}
    assert named - {"dr_grpo"} <= fields, named - fields  # dr_grpo: a preset's name


@pytest.mark.parametrize("args, hint", [
    (["--loss_type", "dr_grpo"], "TRL's loss_type dr_grpo is algorithm: dr_grpo here"),
    (["--scale_rewards", "false"], "TRL's scale_rewards false is scale_rewards: none here"),
    (["--scale_rewards", "True"], "TRL's scale_rewards true is scale_rewards: group here"),
])
def test_trls_values_say_what_to_write_here(args, hint):
    with pytest.raises(ConfigError, match=re.escape(hint)):
        build_config(None, args).validate()


def test_trls_bool_scale_rewards_in_a_file_or_in_python_says_what_to_write_here(tmp_path):
    """A TRL config writes `scale_rewards: false` as a bool: "has the wrong type: expected str | None" alone."""
    path = tmp_path / "run.yaml"
    path.write_text("scale_rewards: false\n")
    for make in (lambda: build_config(str(path), []), lambda: TrainConfig(scale_rewards=True)):
        with pytest.raises(ConfigError, match="scale_rewards=(False|True) has the wrong type: TRL's scale_rewards "
                                              "(false is scale_rewards: none|true is scale_rewards: group) here"):
            make().validate()
