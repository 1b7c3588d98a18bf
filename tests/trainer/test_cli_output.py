"""What the command line prints and what it reads: `grouprl eval --model CHECKPOINT` finds the run's
config by itself, preflight and train name what they wrote, and --help opens with the usage and
its examples."""

import json
from pathlib import Path

from grouprl.cli import main


def test_eval_of_a_checkpoint_without_a_config_uses_the_runs_config(make_cfg, digits_data, tmp_path,
                                                                     monkeypatch, capsys):
    """A 2-step run through the CLI saves step-000002 beside its config.yaml. `grouprl eval --model
    RUN/checkpoints/step-000002/model`, run from another folder with no config file, says it uses
    RUN/config.yaml, writes eval.json into RUN (not the working folder), names the accuracy reward
    (the run's only one, digit_fraction), and scores as the run's own eval of that same model at its
    end did (greedy: the same numbers)."""
    cfg = make_cfg(eval_data=str(digits_data), max_eval_samples=4, max_steps=2, save_steps=2)
    path = tmp_path / "run.yaml"
    cfg.save_yaml(path)
    assert main(["train", str(path)]) == 0
    run = Path(cfg.output_dir).resolve()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()

    assert main(["eval", "--model", str(run / "checkpoints" / "step-000002" / "model")]) == 0
    out = capsys.readouterr().out
    assert f"config: {run / 'config.yaml'} (the run that holds --model's checkpoint)" in out
    assert "4 prompts, accuracy reward digit_fraction (the first reward function" in out
    assert "the first reward function'" not in out  # the old placeholder instead of a name
    result = json.loads((run / "eval.json").read_text())
    at_end = json.loads((run / "summary.json").read_text())["eval_after"]
    assert result["num_samples"] == 4 and result["reward_mean"] == at_end["reward_mean"]
    assert list(elsewhere.iterdir()) == []


def test_eval_of_a_model_outside_a_run_speaks_of_evaluating(tiny_model_dir, capsys):
    assert main(["eval", "--model", str(tiny_model_dir)]) == 2
    err = capsys.readouterr().err
    assert ("--model without a config file evaluates on a task of your own, which also needs --eval_data, "
            "--reward_funcs") in err
    assert f"--model {tiny_model_dir} is not a checkpoint inside a run folder" in err
    assert "or leave out --model to evaluate on the embedded task" in err and "to train" not in err


def test_preflight_prints_the_paths_of_the_files_it_wrote(make_cfg, tmp_path, capsys):
    cfg = make_cfg()
    path = tmp_path / "run.yaml"
    cfg.save_yaml(path)
    assert main(["preflight", str(path), "--prompts", "2"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("written to ")]
    report, plot = line.removeprefix("written to ").split(" and ")
    assert json.loads(Path(report).read_text())["num_prompts"] == 2
    assert Path(plot).suffix == ".png" and Path(plot).stat().st_size > 0


def test_the_last_line_of_a_run_lists_what_its_folder_holds(make_cfg, tmp_path, capsys):
    """Files first, then folders with a slash: config.yaml, samples.jsonl and tensorboard/ included
    (the line used to name four fixed entries)."""
    cfg = make_cfg(max_steps=2, save_steps=2, report_to=["tensorboard"])
    path = tmp_path / "run.yaml"
    cfg.save_yaml(path)
    assert main(["train", str(path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    held = sorted(p.name + "/" * p.is_dir() for p in Path(cfg.output_dir).iterdir() if not p.name.startswith("."))
    assert last.startswith(f"written to {cfg.output_dir}: ")
    named = last.removeprefix(f"written to {cfg.output_dir}: ").split(", ")
    assert sorted(named) == held
    assert {"config.yaml", "samples.jsonl", "tensorboard/", "checkpoints/"} <= set(named)
    assert [n.endswith("/") for n in named] == sorted(n.endswith("/") for n in named)  # files, then folders


def test_help_opens_with_the_usage_and_then_the_examples(capsys):
    """The module docstring's title line ("`grouprl train | eval | preflight`.") was printed as if
    it were part of the help."""
    assert main(["train", "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert not [line for line in lines if "grouprl train | eval" in line]
    assert lines[0].startswith("usage: grouprl train") and lines[4] == ""
    assert lines[5].split()[:2] == ["grouprl", "train"]


def test_a_ctrl_c_before_any_checkpoint_does_not_suggest_resuming(make_cfg, tmp_path, capsys, monkeypatch):
    """Ctrl-C while the models load: the run wrote no checkpoint, so the message says to run the command
    again, not `--resume` (which would fail with 'holds no complete checkpoint'); once a checkpoint
    exists, a Ctrl-C of the resumed run names the resume command."""
    import grouprl.trainer

    cfg = make_cfg(max_steps=1)
    cfg.save_yaml(tmp_path / "run.yaml")

    def interrupted(self, *a, **k):
        raise KeyboardInterrupt

    real = grouprl.trainer.Trainer.__init__
    monkeypatch.setattr(grouprl.trainer.Trainer, "__init__", interrupted)
    assert main(["train", str(tmp_path / "run.yaml")]) == 130
    err = capsys.readouterr().err
    assert "the run wrote no checkpoint: run the same command again" in err and "--resume" not in err
    monkeypatch.setattr(grouprl.trainer.Trainer, "__init__", real)
    assert main(["train", str(tmp_path / "run.yaml")]) == 0
    monkeypatch.setattr(grouprl.trainer.Trainer, "__init__", interrupted)
    assert main(["train", str(tmp_path / "run.yaml"), "--resume"]) == 130
    assert f"continues from the latest:\n  grouprl train {tmp_path / 'run.yaml'} --resume" in capsys.readouterr().err


def test_a_runs_config_names_its_files_absolutely_so_eval_works_from_anywhere(make_cfg, digits_data, tmp_path,
                                                                              monkeypatch, capsys):
    """A run started in its folder with relative data paths: config.yaml writes them absolute, so
    `grouprl eval --model RUN/checkpoints/step-N/model` from another folder finds the eval data; and
    resuming with the same relative paths is no change of settings."""
    import shutil

    from grouprl.config import TrainConfig, changed_settings

    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    shutil.copy(digits_data, work / "data" / "digits.jsonl")
    monkeypatch.chdir(work)
    cfg = make_cfg(train_data="data/digits.jsonl", eval_data="data/digits.jsonl", max_eval_samples=4, max_steps=2,
                   save_steps=2, output_dir="run")
    cfg.save_yaml(work / "run.yaml")
    assert main(["train", "run.yaml"]) == 0
    saved = TrainConfig.load(work / "run" / "config.yaml")
    assert saved.eval_data == saved.train_data == str(work / "data" / "digits.jsonl")
    assert changed_settings(work / "run" / "config.yaml", cfg.resolved()) == {}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["eval", "--model", "../work/run/checkpoints/step-000002/model"]) == 0
    assert "4 prompts" in capsys.readouterr().out
    (scored,) = [json.loads(line) for line in (work / "run" / "evals.jsonl").read_text().splitlines()]
    assert scored["model"] == str(work / "run" / "checkpoints" / "step-000002" / "model")  # not as typed, relative
    assert scored["eval_data"] == str(work / "data" / "digits.jsonl")


def test_under_torchrun_notices_come_from_rank_0_and_other_ranks_warn_with_their_rank(capsys):
    """8 ranks printed each notice 8 times; a warning of rank 3 says it is rank 3's."""
    import logging

    from grouprl.cli import _StderrHandler

    log = logging.getLogger("grouprl.test_notices")
    log.propagate = False  # the handler main() put on "grouprl" in earlier tests would print them again
    for rank in (0, 3):
        handler = _StderrHandler(rank)
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        try:
            log.info("generation_compile: auto stays eager")
            log.warning("the sandbox is weak here")
        finally:
            log.removeHandler(handler)
    assert capsys.readouterr().err.splitlines() == [
        "grouprl: generation_compile: auto stays eager", "grouprl: the sandbox is weak here",
        "grouprl (rank 3): the sandbox is weak here"]


def test_without_a_live_bar_a_line_every_logging_steps_says_how_the_run_goes(capsys, monkeypatch):
    """`progress: false`, or output to a file (a job's log: a bar's redraws pile up on one line there):
    logging_steps said "print every this many steps" and nothing was printed. Now a line every k steps,
    and the last step's; on a terminal the bar alone; other ranks nothing."""
    import sys

    from grouprl.runlog import Progress

    def run(enabled, tty=False, silent=False, every=2, initial=0, total=5):
        monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
        with Progress(total, initial, enabled, silent=silent, every=every) as progress:
            for _ in range(total - initial):
                progress.update({"reward/mean": 0.5, "kl": 0.01, "completion/length_mean": 12.0, "time/step": 0.25})
            progress.close()
        return [line for line in capsys.readouterr().out.splitlines() if line]

    assert run(False) == ["step 2/5: reward 0.5, kl 0.01, len 12, 0.25 s", "step 4/5: reward 0.5, kl 0.01, len 12, "
                          "0.25 s", "step 5/5: reward 0.5, kl 0.01, len 12, 0.25 s"]
    assert [line[:8] for line in run(True)] == ["step 2/5", "step 4/5", "step 5/5"]  # a file: lines, no bar
    assert [line[:8] for line in run(False, initial=3)] == ["step 4/5", "step 5/5"]  # resumed at step 3
    assert run(True, tty=True) == [] and run(False, silent=True) == []


def test_without_a_live_bar_the_libraries_draw_none_either(make_cfg, tmp_path, capsys, monkeypatch):
    """transformers' "Loading weights" and "Writing model shards" bars were a line of carriage returns in a
    job's log, beside the run's own lines; on a terminal with the bar on they stay."""
    import sys

    import transformers

    monkeypatch.setattr(transformers.utils.logging, "_tqdm_active", True)  # as in a fresh process
    path = tmp_path / "run.yaml"
    make_cfg(max_steps=1, output_dir=str(tmp_path / "run")).save_yaml(path)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert main(["train", str(path)]) == 0
    assert "Loading weights" not in capsys.readouterr().err
    assert not transformers.utils.logging.is_progress_bar_enabled()
