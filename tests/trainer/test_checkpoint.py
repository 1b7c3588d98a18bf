"""Checkpoints: resume reproduces the uninterrupted run exactly; a kill while writing a checkpoint
leaves the previous one usable and its leftovers are cleared on resume; a step is written once; a
damaged checkpoint is named; a finished run resumed stays finished; the saved model loads with
transformers and trains again."""

import math
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from grouprl import distributed as D
from grouprl.checkpoint import latest_checkpoint, list_checkpoints
from grouprl.config import ConfigError
from grouprl.trainer import Trainer
from tests.trainer.conftest import read_metrics


def _strip_timing(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "eval/seconds"))} for r in rows]


class Crash(Exception):
    pass


def full_then_cut(make_cfg, tmp_path, resume: bool | str = False, **kw):
    """The configs of an uninterrupted run ("full", trained here) and of the same run ("cut") crashed
    where it would run step 4, trained with `resume`."""
    full = make_cfg(output_dir=str(tmp_path / "full"), **kw)
    Trainer(full).train()
    cut = make_cfg(output_dir=str(tmp_path / "cut"), **kw)
    trainer = Trainer(cut)
    original = trainer.train_step

    def crash_at_step_4():
        if trainer.step == 3:  # train_step is about to run step 4
            raise Crash
        return original()

    trainer.train_step = crash_at_step_4
    with pytest.raises(Crash):
        trainer.train(resume=resume)
    return full, cut


def test_resume_reproduces_the_uninterrupted_run(make_cfg, tmp_path):
    full, cut = full_then_cut(make_cfg, tmp_path, max_steps=5, save_steps=2, beta=0.04, num_iterations=2,
                              warmup_steps=2, lr_scheduler_type="cosine", learning_rate=1e-2)
    assert latest_checkpoint(cut.output_dir).name == "step-000002"
    assert [r["step"] for r in read_metrics(cut.output_dir)] == [1, 2, 3]  # step 3 is past the checkpoint

    Trainer(cut).train(resume=True)
    assert _strip_timing(read_metrics(cut.output_dir)) == _strip_timing(read_metrics(full.output_dir))
    a = AutoModelForCausalLM.from_pretrained(f"{full.output_dir}/checkpoints/step-000005/model")
    b = AutoModelForCausalLM.from_pretrained(f"{cut.output_dir}/checkpoints/step-000005/model")
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n


def test_an_fsdp2_checkpoint_of_several_processes_resumes_in_one(make_cfg):
    """FSDP2 on several processes writes the optimizer state by parameter name ("sharded_optimizer");
    one process (FSDP2 there shards nothing) or DDP reads it back by index: the same moments. It was a
    refusal naming the wrong strategy (tests/distributed: the conversion against torch's own)."""
    cfg = make_cfg(max_steps=1, distributed_strategy="fsdp2")
    trained = Trainer(cfg)
    trained.train()
    ckpt = latest_checkpoint(cfg.output_dir)
    state = torch.load(ckpt / "state.pt", weights_only=False)
    parts = trained._checkpointed()
    by_name = D.optimizer_state_by_name(parts.optimizer, parts.optimized, state["optimizer"])
    assert set(by_name["state"]) <= {n for n, _ in trained.model.named_parameters()}
    torch.save({**state, "optimizer": by_name, "sharded_optimizer": True}, ckpt / "state.pt")  # as 2 ranks write it
    resumed = Trainer(replace(cfg, max_steps=1))
    resumed.train(resume=True)
    want, got = trained.optimizer.state_dict(), resumed.optimizer.state_dict()
    assert want["state"].keys() == got["state"].keys() and len(want["state"]) > 0
    for i, moments in want["state"].items():
        assert all(torch.equal(v, got["state"][i][k]) for k, v in moments.items()), i


def test_starting_over_an_existing_run_needs_resume(make_cfg):
    cfg = make_cfg(max_steps=1)
    Trainer(cfg).train()
    with pytest.raises(ConfigError, match="--resume"):
        Trainer(cfg).train()


def test_a_resumed_run_says_what_changed_and_takes_a_new_learning_rate(make_cfg, caplog):
    """A 2-step cosine run resumed to 4 steps at 10x the rate: the schedule follows the new length and
    the new rate (the restored optimizer and scheduler had kept the old rate, silently)."""
    kw = dict(max_steps=2, save_steps=2, lr_scheduler_type="cosine", learning_rate=1e-3)
    Trainer(make_cfg(**kw)).train()
    with caplog.at_level("WARNING", logger="grouprl.training_state"):
        Trainer(make_cfg(**{**kw, "max_steps": 4, "learning_rate": 1e-2})).train(resume=True)
    assert "learning_rate 0.001 -> 0.01" in caplog.text and "max_steps 2 -> 4" in caplog.text
    lrs = [r["lr"] for r in read_metrics(make_cfg().output_dir) if "lr" in r]  # the rate for the next step

    def cosine(step, total):
        return 0.5 * (1 + math.cos(math.pi * step / total))

    assert lrs == pytest.approx([1e-3 * cosine(1, 2), 1e-3 * cosine(2, 2), 1e-2 * cosine(3, 4), 1e-2 * cosine(4, 4)])
    assert lrs[2] == pytest.approx(1.46447e-3, rel=1e-5)  # not 1.46e-4: the old rate


def test_changed_optimizer_settings_apply_on_resume(make_cfg, caplog):
    """weight_decay and adam_beta2 changed between runs: the resumed optimizer uses the
    new ones, as the warning says (loading the checkpoint's optimizer state put back the old ones),
    in each group (the decayed matrices at the new decay, the rest still at 0)."""
    kw = dict(max_steps=1, save_steps=1, weight_decay=0.01, adam_beta2=0.999)
    Trainer(make_cfg(**kw)).train()
    trainer = Trainer(make_cfg(**{**kw, "max_steps": 2, "weight_decay": 0.5, "adam_beta2": 0.9}))
    with caplog.at_level("WARNING", logger="grouprl.training_state"):
        trainer._resume()
    assert "weight_decay 0.01 -> 0.5" in caplog.text and "adam_beta2 0.999 -> 0.9" in caplog.text
    groups = trainer.optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0]
    assert all(g["betas"] == (0.9, 0.9) for g in groups)
    assert trainer.optimizer.state  # the moments themselves were restored


@pytest.mark.parametrize("change, rates", [({"learning_rate": 2e-3}, [2e-3, 1e-2]),
                                           ({"value_learning_rate": 5e-2}, [1e-3, 5e-2]),
                                           ({"value_learning_rate": None}, [1e-3, 1e-2])])
def test_a_value_heads_rate_follows_its_own_setting_on_resume(make_cfg, change, rates):
    """PPO's value head has its own rate: a new learning_rate leaves an explicit value_learning_rate
    alone (it was scaled with the policy's), and a new value_learning_rate applies (it was ignored);
    null means 10 x learning_rate, here the same 1e-2."""
    kw = dict(algorithm="ppo", max_steps=1, save_steps=1, learning_rate=1e-3, value_learning_rate=1e-2,
              lr_scheduler_type="constant", warmup_steps=0)
    Trainer(make_cfg(**kw)).train()
    trainer = Trainer(make_cfg(**{**kw, "max_steps": 2, **change}))
    trainer._resume()
    assert [g["lr"] for g in trainer.optimizer.param_groups] == pytest.approx(rates)


def test_a_run_resumed_with_an_eval_set_added_has_no_eval_before(make_cfg, digits_data):
    """eval_before is the starting model's: a run resumed at step 2 with eval_data added does not
    evaluate its step-2 weights as "before" (logged as step 0 after steps 1-2)."""
    Trainer(make_cfg(max_steps=2, save_steps=2)).train()
    summary = Trainer(make_cfg(max_steps=3, eval_data=str(digits_data), max_eval_samples=4)).train(resume=True)
    assert "eval_before" not in summary and "eval_after" in summary
    assert [r["step"] for r in read_metrics(make_cfg().output_dir)] == [1, 2, 3, 3]  # step 3, then its eval


def test_resuming_in_another_number_of_processes_says_the_streams_are_new(make_cfg, caplog):
    from grouprl.distributed import DistContext
    from grouprl.training_state import restore_training_state

    Trainer(make_cfg(max_steps=1, save_steps=1)).train()
    trainer = Trainer(make_cfg(max_steps=2))
    with caplog.at_level("WARNING", logger="grouprl.training_state"):
        restore_training_state(trainer.cfg, DistContext(rank=0, world_size=2), trainer._checkpointed())
    assert "resuming a run of 1 process(es) in 2: each rank's sampling stream is seeded anew" in caplog.text
    assert "resume with 1 process(es) to continue it exactly" in caplog.text


def test_resume_without_checkpoint_is_a_clear_error(make_cfg):
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        Trainer(make_cfg()).train(resume=True)


def test_sigkill_while_writing_a_checkpoint_keeps_the_previous_one(make_cfg, tmp_path):
    """A real SIGKILL in the middle of the second checkpoint's files; then resume deletes the killed process's
    temporary folder and finishes the run."""
    cfg = make_cfg(max_steps=4, save_steps=2, output_dir=str(tmp_path / "run"))
    cfg.save_yaml(tmp_path / "cfg.yaml")
    script = textwrap.dedent(f"""
        import os, signal
        import grouprl.checkpoint as ck
        from grouprl.config import TrainConfig
        from grouprl.trainer import Trainer
        real = ck.save_file
        calls = []
        def dying_save_file(tensors, path):
            calls.append(path)
            if len(calls) == 2:  # second checkpoint: half its files are on disk
                real(tensors, path)
                os.kill(os.getpid(), signal.SIGKILL)
            real(tensors, path)
        ck.save_file = dying_save_file
        Trainer(TrainConfig.load({str(tmp_path / 'cfg.yaml')!r})).train()
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=os.getcwd(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    ckpts = list_checkpoints(cfg.output_dir)
    assert [p.name for p in ckpts] == ["step-000002"]
    leftovers = [p.name for p in (tmp_path / "run/checkpoints").iterdir() if p.name.startswith(".tmp")]
    assert leftovers  # the half-written checkpoint is there, but never taken for a checkpoint
    AutoModelForCausalLM.from_pretrained(ckpts[0] / "model")  # the previous one is whole
    Trainer(cfg).train(resume=True)
    assert [p.name for p in list_checkpoints(cfg.output_dir)] == ["step-000002", "step-000004"]
    assert [r["step"] for r in read_metrics(cfg.output_dir) if "reward/mean" in r] == [1, 2, 3, 4]
    assert sorted(p.name for p in (tmp_path / "run/checkpoints").iterdir()) == ["step-000002", "step-000004"]


def test_saved_model_is_a_model_for_a_new_run(make_cfg, tmp_path):
    first = make_cfg(max_steps=1, output_dir=str(tmp_path / "a"))
    Trainer(first).train()
    model_dir = latest_checkpoint(first.output_dir) / "model"
    second = make_cfg(max_steps=1, model=str(model_dir), output_dir=str(tmp_path / "b"))
    trainer = Trainer(second)
    ref = AutoModelForCausalLM.from_pretrained(model_dir)
    for p, q in zip(trainer.model.parameters(), ref.parameters()):
        assert torch.equal(p.detach().cpu(), q)  # the trainer's weights are on cuda:0 where there is one
    trainer.train()


def test_save_total_limit_keeps_the_newest(make_cfg):
    cfg = make_cfg(max_steps=4, save_steps=1, save_total_limit=2)
    Trainer(cfg).train()
    assert [p.name for p in list_checkpoints(cfg.output_dir)] == ["step-000003", "step-000004"]


def test_a_kill_while_save_total_limit_deletes_a_checkpoint_leaves_no_checkpoint_half_deleted(make_cfg,
                                                                                                 monkeypatch):
    """save_total_limit 1: step 2's save deletes step 1's checkpoint, and the process dies once the deletion has
    removed state.pt. rmtree removes files in the directory's order, which on ext4 listed COMPLETE last (a real
    SIGKILL left step-000001 holding COMPLETE alone, taken for a complete checkpoint and named as the one to
    resume from). No folder that lost a file is taken for a checkpoint, and recovery deletes what is left."""
    import shutil

    from grouprl.checkpoint import recover_interrupted_saves

    real_rmtree = shutil.rmtree

    def killed_after_state_pt(path, *args, **kwargs):
        if (Path(path) / "state.pt").is_file():  # a checkpoint's folder: COMPLETE left for last
            (Path(path) / "state.pt").unlink()
            raise Crash
        return real_rmtree(path, *args, **kwargs)

    cfg = make_cfg(max_steps=2, save_steps=1, save_total_limit=1)
    monkeypatch.setattr(shutil, "rmtree", killed_after_state_pt)
    with pytest.raises(Crash):
        Trainer(cfg).train()
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    assert [p.name for p in list_checkpoints(cfg.output_dir)] == ["step-000002"]
    recover_interrupted_saves(cfg.output_dir)
    assert sorted(p.name for p in (Path(cfg.output_dir) / "checkpoints").iterdir()) == ["step-000002"]


def test_a_loop_state_that_cannot_be_written_leaves_no_temporary_file(tmp_path):
    """write_loop_state writes loop.pt beside a checkpoint through a temporary file: a write that fails (a full
    disk; here an object pickle refuses) removes it, and one a kill cut short is removed by recovery."""
    from grouprl.checkpoint import recover_interrupted_saves, write_loop_state

    with pytest.raises(Exception, match="lambda"):
        write_loop_state(tmp_path, {"evals": {}, "guard": lambda: None})
    assert list(tmp_path.iterdir()) == []
    ckpt = tmp_path / "run" / "checkpoints" / "step-000003"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text("3\n")
    (ckpt / ".loop.pt.tmp-12345").write_bytes(b"cut short")  # a kill inside write_loop_state
    recover_interrupted_saves(tmp_path / "run")
    assert [p.name for p in ckpt.iterdir()] == ["COMPLETE"]


def test_a_step_is_saved_once_when_the_best_model_and_save_steps_fall_on_it(make_cfg, monkeypatch):
    """Eval and save_steps every 2 steps of 4: step 2's eval is the first, so the best so far, and its
    checkpoint is the one save_steps asks for; step 4 is the final save. Steps written: 2, 4 (not 2, 2, 4)."""
    import grouprl.training_state

    saved = []
    real = grouprl.training_state.save_checkpoint

    def spy(output_dir, step, **kwargs):
        saved.append(step)
        return real(output_dir, step, **kwargs)

    monkeypatch.setattr(grouprl.training_state, "save_checkpoint", spy)
    Trainer(make_cfg(max_steps=4, save_steps=2, eval_steps=2, eval_fraction=0.1, max_eval_samples=4,
                     metric_for_best_model="reward_mean")).train()
    assert saved == [2, 4]


def test_a_kill_while_replacing_a_checkpoint_of_the_same_step_keeps_a_whole_one(make_cfg, monkeypatch):
    """save_total_limit 1 keeps only step 2's checkpoint; step 2 is saved again (as a run resumed at its last step
    does) and the process dies just before the new folder is renamed into place. The old checkpoint had not been
    deleted, only moved aside: a resume finds it, whole, and no leftover folder stays in checkpoints/."""
    cfg = make_cfg(max_steps=2, save_steps=1, save_total_limit=1)
    trainer = Trainer(cfg)
    trainer.train()
    (only,) = list_checkpoints(cfg.output_dir)
    before = (only / "trainable.safetensors").read_bytes()
    real_replace = os.replace

    def killed_at_the_rename(src, dst):
        if os.path.basename(src).startswith(".tmp-step-"):
            raise Crash  # SIGKILL, OOM, node loss: nothing after this line runs
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_at_the_rename)
    with pytest.raises(Crash):
        trainer.save()
    monkeypatch.setattr(os, "replace", real_replace)

    Trainer(cfg).train(resume=True)
    assert list_checkpoints(cfg.output_dir) == [only]
    assert (only / "trainable.safetensors").read_bytes() == before
    assert sorted(p.name for p in only.parent.iterdir()) == ["step-000002"]


def test_resuming_a_finished_run_says_so_and_trains_evaluates_and_saves_nothing(make_cfg, caplog):
    """A 2-step run with an eval set, resumed as it is: the same summary, metrics.jsonl unchanged (no second
    eval_after row) and its last checkpoint not written again."""
    cfg = make_cfg(max_steps=2, eval_fraction=0.1, max_eval_samples=4)
    summary = Trainer(cfg).train()
    rows = read_metrics(cfg.output_dir)
    state = latest_checkpoint(cfg.output_dir) / "state.pt"
    written = state.stat().st_mtime_ns
    with caplog.at_level("WARNING", logger="grouprl.trainer"):
        assert Trainer(cfg).train(resume=True) == summary
    assert "is finished (step 2, max_steps=2)" in caplog.text and "raise max_steps" in caplog.text
    assert read_metrics(cfg.output_dir) == rows
    assert state.stat().st_mtime_ns == written


def test_a_finished_run_trained_further_is_finished_only_once_evaluated_at_its_new_end(make_cfg):
    """Finished at step 2 (eval_after there), resumed towards 4 and crashed before step 4: the step-3 checkpoint
    must not pass for a finished run with step 2's eval_after, so resumed with max_steps 3 it is evaluated at 3."""
    kw = dict(eval_fraction=0.1, max_eval_samples=4, save_steps=1)
    Trainer(make_cfg(max_steps=2, **kw)).train()
    trainer = Trainer(make_cfg(max_steps=4, **kw))
    trainer.train_step = lambda original=trainer.train_step: original() if trainer.step < 3 else 1 / 0
    with pytest.raises(ZeroDivisionError):
        trainer.train(resume=True)
    Trainer(make_cfg(max_steps=3, **kw)).train(resume=True)
    assert [r["step"] for r in read_metrics(make_cfg().output_dir) if "eval/accuracy" in r] == [0, 2, 3]


@pytest.mark.parametrize("damaged, save_total_limit, fix, then", [
    ("state.pt", None, r"delete that folder to resume from the previous complete checkpoint, .*step-000001$", True),
    ("trainable.safetensors", 1, r"it is the run's only checkpoint: delete that folder and start the run over "
                                 r"with --resume auto \(from Python: train\(resume=\"auto\"\)\), which keeps the "
                                 r"rows", "auto"),
])
def test_a_damaged_latest_checkpoint_is_an_error_naming_it_and_the_fix(make_cfg, damaged, save_total_limit, fix,
                                                                        then):
    """A file of the newest checkpoint cut in half after it was written (a copy that stopped, a full disk under a
    sync): resume names the folder, the file, and what to do; it never falls back to an older one by itself. The
    advice works when followed (`then`: the resume it names). For the only checkpoint it used to say to start
    again without --resume, which a new run refuses: the folder holds the run's metrics.jsonl."""
    import shutil

    cfg = make_cfg(max_steps=2, save_steps=1, save_total_limit=save_total_limit)
    Trainer(cfg).train()
    path = latest_checkpoint(cfg.output_dir) / damaged
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    more = make_cfg(max_steps=3, save_steps=1, save_total_limit=save_total_limit)
    with pytest.raises(ConfigError, match=rf"step-000002 is damaged: {damaged} cannot be read .*; {fix}"):
        Trainer(more).train(resume=True)
    shutil.rmtree(path.parent)
    assert Trainer(more).train(resume=then)["steps"] == 3
    assert [r["step"] for r in read_metrics(cfg.output_dir) if "reward/mean" in r] == [1, 2, 3]
    assert (Path(cfg.output_dir) / "metrics.jsonl.lost").is_file() == (then == "auto")  # the first start's rows


def test_a_checkpoint_written_with_a_reference_is_damaged_without_it(make_cfg):
    """ref_update_steps 1: the reference is the policy of the last step, in ref.safetensors. Deleted from
    the newest checkpoint, the resume took the starting model as the reference, silently (with
    ref_update_steps 2 and learning_rate 3e-2, a KL of 1.13 at step 3 where the uninterrupted run had 0.0):
    it is an error naming the file. A checkpoint written before state.pt recorded the reference is read
    as before: its reference where the file is there, none where it is not."""
    from grouprl.checkpoint import read_checkpoint

    kw = dict(max_steps=2, save_steps=1, beta=0.04, ref_update_steps=1)
    Trainer(make_cfg(**kw)).train()
    newest = latest_checkpoint(make_cfg().output_dir)
    (newest / "ref.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"step-000002 is damaged: ref.safetensors cannot be read .*; delete that "
                                          r"folder to resume from the previous complete checkpoint, .*step-000001$"):
        Trainer(make_cfg(**{**kw, "max_steps": 3})).train(resume=True)
    state = torch.load(newest / "state.pt", weights_only=False)
    del state["ref_written"]  # as written before the record
    torch.save(state, newest / "state.pt")
    assert read_checkpoint(newest)[1] is None


def test_a_damaged_loop_state_is_an_error_whose_advice_resumes_with_the_eval_made_again(make_cfg):
    """loop.pt records the eval_after of a finished run (made after its last checkpoint). Cut in half, the
    resume raised DamagedCheckpoint from outside the handler that gives advice (a traceback from grouprl train).
    Now an error naming it; deleting it, as the advice says, resumes: eval_after is made again."""
    cfg = make_cfg(max_steps=2, eval_fraction=0.1, max_eval_samples=4)
    summary = Trainer(cfg).train()
    rows = _strip_timing(read_metrics(cfg.output_dir))
    loop = latest_checkpoint(cfg.output_dir) / "loop.pt"
    loop.write_bytes(loop.read_bytes()[: loop.stat().st_size // 2])
    with pytest.raises(ConfigError, match=r"step-000002 is damaged: loop.pt cannot be read .*; delete that file to "
                                          r"resume from the checkpoint as it was saved"):
        Trainer(cfg).train(resume=True)
    loop.unlink()
    again = Trainer(cfg).train(resume=True)
    assert again["steps"] == 2 and again["eval_after"]["accuracy"] == summary["eval_after"]["accuracy"]
    assert _strip_timing(read_metrics(cfg.output_dir)) == rows  # step 2's eval row replaced, not doubled
    assert loop.is_file()


@pytest.mark.parametrize("change, says", [
    (dict(lora_r=8), r"other shapes \(.*lora_A.* \(4, \d+\) -> \(8, \d+\)"),
    (dict(lora_target_modules=["q_proj", "v_proj"]), r"no weights for 4 trainable parameter\(s\) \(.*v_proj"),
    (dict(lora_r=0), r"weights the model lacks \(.*lora_A"),
])
def test_resuming_with_another_lora_shape_names_what_differs(make_cfg, change, says):
    """A run written with lora_r=4 on q_proj, resumed with another rank, more target modules, or
    none: an error naming what does not fit and the settings to resume with, not torch's."""
    cfg = make_cfg(lora_r=4, lora_alpha=8, lora_target_modules=["q_proj"], max_steps=1)
    Trainer(cfg).train()
    with pytest.raises(ConfigError, match=f"--resume: checkpoint .*step-000001 does not fit this model: it has {says}"
                                          r".*Resume with the model and LoRA settings \(lora_r, lora_target_modules\)"):
        Trainer(replace(cfg, max_steps=2, **change)).train(resume=True)


def test_resuming_a_lora_run_with_another_alpha_or_base_model_is_refused(make_cfg, tmp_path):
    """The adapter's B·A is scaled by lora_alpha / r over the frozen base: another alpha or base model on
    resume would train a model the checkpoint never held (a review's run only warned, and its logits
    moved by 0.85). Refused, naming the run's values and the way to start anew from the merged model;
    the same change without LoRA (full weights in the checkpoint) goes on."""
    from grouprl.tasks.testing import save_tiny_model

    cfg = make_cfg(lora_r=4, lora_alpha=8, max_steps=1)
    Trainer(cfg).train()
    with pytest.raises(ConfigError, match=r"--resume: lora_alpha 8(\.0)? -> 64(\.0)? would change the policy the "
                                          r"checkpoint holds .* resume with the run's lora_alpha 8(\.0)?, or start a "
                                          r"new run from the checkpoint's merged model \(--model .*/model\)"):
        Trainer(replace(cfg, max_steps=2, lora_alpha=64)).train(resume=True)
    other = tmp_path / "other-base"
    save_tiny_model(other, "tiny", seed=1)
    with pytest.raises(ConfigError, match=r"--resume: model .* -> .*other-base.* would change the policy"):
        Trainer(replace(cfg, max_steps=2, model=str(other))).train(resume=True)
    full = make_cfg(max_steps=1, output_dir=str(tmp_path / "full"))
    Trainer(full).train()
    Trainer(replace(full, max_steps=2, lora_alpha=64)).train(resume=True)  # no LoRA: alpha does nothing


def test_a_folder_of_a_run_that_stopped_before_its_first_save_is_not_overwritten(make_cfg, no_model_loading,
                                                                                   tmp_path, capsys):
    """A run killed before its first checkpoint left its metrics: a new run in that folder would overwrite
    them (and mix two runs in one TensorBoard run), so `grouprl train` refuses it before any model loads;
    and --resume of it says there is nothing to resume, before any model loads too."""
    from grouprl.cli import main

    cfg = make_cfg()
    out = Path(cfg.output_dir)
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    cfg.save_yaml(tmp_path / "run.yaml")
    assert main(["train", str(tmp_path / "run.yaml")]) == 2
    assert "already holds a run's metrics.jsonl but no checkpoint" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "run.yaml"), "--resume"]) == 2
    assert "--resume: output_dir=" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "reward/mean": 0.5}\n'


def test_a_users_config_file_in_output_dir_is_not_overwritten(make_cfg, no_model_loading, tmp_path, capsys):
    """`grouprl train runs/exp/config.yaml` with output_dir runs/exp: the run would replace the user's file
    (comments and all) by its resolved config, so it is refused before any model loads; a config.yaml
    that a run wrote (its header) is its own. An output_dir that is a file is refused too."""
    from grouprl.cli import main

    out = tmp_path / "exp"
    out.mkdir()
    mine = out / "config.yaml"
    make_cfg(output_dir=str(out)).save_yaml(mine)
    text = "# my experiment: keep this comment\n" + mine.read_text()
    mine.write_text(text)
    assert main(["train", str(mine)]) == 2
    assert "holds a config.yaml that no grouprl run wrote (your config file?)" in capsys.readouterr().err
    assert mine.read_text() == text
    make_cfg(output_dir=str(out)).save_yaml(mine, absolute=True)  # as a run writes it: its own, no error here
    assert mine.read_text().startswith("# grouprl: this run's resolved config")
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    assert main(["train", str(mine), "--output_dir", str(notes)]) == 2
    assert "output_dir=" + repr(str(notes)) + " is a file, not a folder" in capsys.readouterr().err
    assert notes.read_text() == "mine\n"


@pytest.mark.parametrize("umask, want", [(0o022, 0o644), (0o077, 0o600)])
def test_checkpoint_files_are_as_readable_as_the_umask_says(make_cfg, umask, want):
    """safetensors creates its files 0600: a teammate's, or a vLLM server's, process could not read
    model/model.safetensors. Every file of a checkpoint takes the mode the umask gives a new file."""
    old = os.umask(umask)
    try:
        path = Trainer(make_cfg()).save()
    finally:
        os.umask(old)
    modes = {p.relative_to(path).as_posix(): p.stat().st_mode & 0o777 for p in path.rglob("*") if p.is_file()}
    assert "model/model.safetensors" in modes and "trainable.safetensors" in modes
    assert set(modes.values()) == {want}, modes


def test_a_gpu_runs_state_resumes_on_the_cpu_and_its_cuda_rng_comes_back(tmp_path, monkeypatch):
    """state.pt written on a GPU holds the optimizer state on cuda:0: read on a machine without CUDA
    it was a DamagedCheckpoint telling the user to delete an intact folder. It is read onto the CPU.
    And the GPU's random state (dropout on CUDA) is saved and restored, on this rank's device only."""
    import torch.serialization as ser
    from safetensors.torch import save_file

    from grouprl.checkpoint import read_checkpoint, restore_rng_states, rng_states

    path = tmp_path / "step-000001"
    path.mkdir()
    state = {"optimizer": {"state": {0: {"exp_avg": torch.ones(3), "step": torch.tensor(1.0)}}}}
    monkeypatch.setattr(ser, "location_tag", lambda storage: "cuda:0")  # what a CUDA tensor's storage says
    torch.save(state, path / "state.pt")
    monkeypatch.undo()
    save_file({"w": torch.zeros(3)}, path / "trainable.safetensors")
    (path / "COMPLETE").write_text("1\n")
    _, _, loaded = read_checkpoint(path)
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], torch.ones(3))

    cuda_rng = {"state": torch.arange(8, dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": cuda_rng["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": cuda_rng.update(state=s))
    saved = rng_states(torch.Generator())
    cuda_rng["state"] = torch.zeros(8, dtype=torch.uint8)  # the resumed process: reseeded
    restore_rng_states([saved], 0, 1, torch.Generator(), fresh_seed=0)
    assert torch.equal(cuda_rng["state"], torch.arange(8, dtype=torch.uint8))


def test_a_rollback_snapshot_is_a_copy_in_host_memory(make_cfg):
    from grouprl.checkpoint import memory_snapshot

    trainer = Trainer(make_cfg())
    snap = memory_snapshot(trainer.model, trainer.optimizer)
    name, param = next((n, p) for n, p in trainer.model.named_parameters() if p.requires_grad)
    with torch.no_grad():
        param.add_(1.0)
    assert snap["weights"][name].device.type == "cpu" and not torch.equal(snap["weights"][name], param.cpu())


@pytest.mark.parametrize("fused", [False, True])
def test_a_second_rollback_to_the_same_snapshot_puts_back_the_same_state(fused):
    """The guard keeps a snapshot after rolling back to it, so a later collapse can roll back to it
    again. load_state_dict had adopted the snapshot's own tensors (Adam's step, and on CPU the
    moments), so the steps after the first rollback changed the snapshot in place."""
    from grouprl.checkpoint import memory_snapshot, restore_snapshot

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)

    def step() -> None:
        optimizer.zero_grad()
        model(torch.randn(4, 3, generator=gen)).square().sum().backward()
        optimizer.step()

    def state() -> list[torch.Tensor]:
        return [t.clone() for t in [*model.parameters(), *(v for s in optimizer.state.values() for v in s.values())]]

    gen = torch.Generator().manual_seed(0)
    step()
    snap, taken = memory_snapshot(model, optimizer), state()
    for _ in range(2):
        step()
        step()
        restore_snapshot(model, optimizer, snap)
        assert all(torch.equal(a, b) for a, b in zip(state(), taken, strict=True))


def test_a_snapshot_of_cuda_training_goes_back_without_handing_over_its_own_tensors():
    """On a GPU the snapshot's moments sit in host memory, and load_state_dict copies them to the
    device; Adam's step, a 0-dim host tensor that the load keeps where it is, would be adopted as it
    is (the snapshot's own, counted up by later steps): it goes in as a copy, the moments as they are."""
    from grouprl.checkpoint import _loadable

    moment, step = torch.zeros(4, 3), torch.tensor(3.0)
    state = {"state": {0: {"exp_avg": moment, "step": step}}, "param_groups": [{"params": [0], "lr": 0.1}]}
    on_gpu = _loadable(state, {torch.device("cuda", 0)})
    assert on_gpu["state"][0]["exp_avg"] is moment  # the load copies it to the GPU
    assert on_gpu["state"][0]["step"] is not step and torch.equal(on_gpu["state"][0]["step"], step)
    on_cpu = _loadable(state, {torch.device("cpu")})  # where the load would adopt both
    assert on_cpu["state"][0]["exp_avg"] is not moment and on_cpu["state"][0]["step"] is not step
    assert on_cpu["param_groups"] == state["param_groups"]


def test_a_rollback_snapshot_of_cuda_weights_is_made_in_host_memory():
    """Weights and optimizer state on CUDA (fake tensors: shapes and devices, no data, no GPU) are
    copied to host memory, not cloned beside the originals (on an H100 the snapshot had stayed on the
    GPU: 3x the trainable parameters of GPU memory)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from grouprl.checkpoint import memory_snapshot

    with FakeTensorMode():
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.empty(4, 3, device="cuda"))
        model.frozen = torch.nn.Parameter(torch.empty(3, device="cuda"), requires_grad=False)
        optimizer = torch.optim.AdamW([model.w])
        optimizer.state[model.w] = {"exp_avg": torch.empty(4, 3, device="cuda"),
                                    "exp_avg_sq": torch.empty(4, 3, device="cuda"), "step": torch.tensor(3.0)}
        snap = memory_snapshot(model, optimizer)
    assert list(snap["weights"]) == ["w"] and snap["weights"]["w"].device.type == "cpu"
    state = snap["optimizer"]["state"][0]
    assert {k: v.device.type for k, v in state.items()} == {"exp_avg": "cpu", "exp_avg_sq": "cpu", "step": "cpu"}


def test_resume_auto_starts_a_run_then_continues_it_then_leaves_it_finished(make_cfg, tmp_path):
    """`--resume auto`, for a job a scheduler requeues with the same command: a new run starts, one cut
    short continues from its checkpoint exactly as the uninterrupted run, and a finished one stays finished."""
    full, cut = full_then_cut(make_cfg, tmp_path, "auto", max_steps=4, save_steps=2, beta=0.04)  # a new run at first
    assert [p.name for p in list_checkpoints(cut.output_dir)] == ["step-000002"]
    summary = Trainer(cut).train(resume="auto")
    assert summary["steps"] == 4
    assert _strip_timing(read_metrics(cut.output_dir)) == _strip_timing(read_metrics(full.output_dir))
    again = Trainer(cut)
    again.train_step = lambda: pytest.fail("a finished run trained again")
    assert again.train(resume="auto")["steps"] == 4
    with pytest.raises(ConfigError, match="resume='yes': pass True .* or 'auto'"):
        Trainer(cut).train(resume="yes")


def test_resume_auto_starts_over_a_run_that_stopped_before_its_first_save(make_cfg, tmp_path, capsys, caplog):
    """A run killed before its first checkpoint cannot be resumed, and a plain new run refuses its folder
    (naming --resume auto); `--resume auto` starts it over and keeps the lost run's rows aside."""
    from grouprl.cli import main, resume_command

    cfg = make_cfg(max_steps=2)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True)
    lost = '{"step": 1, "reward/mean": 0.5}\n'
    (out / "metrics.jsonl").write_text(lost)
    cfg.save_yaml(tmp_path / "run.yaml")
    assert main(["train", str(tmp_path / "run.yaml")]) == 2
    assert "or start it over with --resume auto" in capsys.readouterr().err
    with caplog.at_level("WARNING", logger="grouprl.training_state"):
        assert main(["train", str(tmp_path / "run.yaml"), "--resume", "auto"]) == 0
    assert caplog.text.count("the run starts over; the rows that run logged are kept aside") == 1
    assert (out / "metrics.jsonl.lost").read_text() == lost
    assert [r["step"] for r in read_metrics(cfg.output_dir) if "reward/mean" in r] == [1, 2]
    argv = ["train", "run.yaml", "--resume", "auto"]
    assert resume_command(argv) == "grouprl train run.yaml --resume auto"  # what a signal's message prints
    assert resume_command(["train", "run.yaml", "--resume"]) == "grouprl train run.yaml --resume"


def test_resume_auto_keeps_the_rows_of_every_start_lost_before_its_first_save(make_cfg):
    """A requeued job that dies before its first save twice: the second start-over replaced the first's
    kept rows (metrics.jsonl.lost), which the docs say are kept aside."""
    from grouprl.training_state import prepare_output_dir

    cfg, ctx = make_cfg(), D.DistContext()
    out = Path(cfg.output_dir)
    out.mkdir(parents=True)
    for attempt in (1, 2):
        (out / "metrics.jsonl").write_text(f'{{"step": 1, "attempt": {attempt}}}\n')
        assert prepare_output_dir(cfg, ctx, "auto") is False and not (out / "metrics.jsonl").exists()
    assert (out / "metrics.jsonl.lost").read_text() == '{"step": 1, "attempt": 1}\n{"step": 1, "attempt": 2}\n'


def test_a_second_run_in_an_output_dir_in_use_is_refused_and_touches_nothing(make_cfg, tmp_path, monkeypatch):
    """A job submitted twice (or requeued while the first still runs) on one output_dir: the second run
    would delete the first's unfinished save as a killed save's leftover and append to its metrics. It is
    refused naming the first's process, before it touches anything; once that process ends (the kernel
    drops its lock) the run starts, and when the run ends another process can have the folder."""
    import subprocess
    import sys

    from grouprl import runlog

    monkeypatch.setattr(runlog, "LOCK_WAIT_S", 3.0)  # a run waits this long for the folder (NFS leases), then refuses
    cfg = make_cfg(max_steps=1)
    out = Path(cfg.output_dir)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom grouprl.runlog import lock_output_dir\n"
                               f"lock_output_dir({str(out)!r})\nprint('held', flush=True)\ntime.sleep(120)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        unfinished = out / "checkpoints" / ".tmp-step-000002-1"  # the other run's save in progress
        unfinished.mkdir(parents=True)
        with pytest.raises(ConfigError, match=rf"output_dir=.* is in use by another run \(pid {holder.pid} on host "
                                              r".*\): two runs in one folder would delete each other's checkpoints"):
            Trainer(cfg).train()
        assert unfinished.is_dir() and not (out / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    Trainer(cfg).train()
    assert not unfinished.exists() and (out / "checkpoints" / "step-000001").is_dir()
    after = subprocess.run([sys.executable, "-c", f"from grouprl.runlog import lock_output_dir\n"
                            f"lock_output_dir({str(out)!r})\nprint('held')"],
                           capture_output=True, text=True, timeout=60)
    assert after.stdout.strip() == "held", after.stderr


def test_a_run_waits_for_an_output_dir_whose_holder_ends_soon(tmp_path, monkeypatch, caplog):
    """On NFS the lock of a node that died lasts until the server's lease runs out, and a requeued job may
    start before that: a held folder is waited for (LOCK_WAIT_S), saying so once, and taken when freed."""
    import logging
    import subprocess
    import sys

    from grouprl import runlog

    monkeypatch.setattr(runlog, "LOCK_WAIT_S", 60.0)
    holder = subprocess.Popen([sys.executable, "-c", "import time\nfrom grouprl.runlog import lock_output_dir\n"
                               f"lock_output_dir({str(tmp_path)!r})\nprint('held', flush=True)\ntime.sleep(3)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with caplog.at_level(logging.WARNING, logger="grouprl.runlog"):
            runlog.lock_output_dir(tmp_path)  # refused first (the warning), then taken once the holder ended
        assert caplog.text.count(f"is held by another run (pid {holder.pid} on host") == 1
        assert "waiting up to 60 s" in caplog.text and holder.wait(10) == 0
    finally:
        holder.kill()
        holder.wait()
        runlog.unlock_output_dir(tmp_path)


def test_a_run_that_fails_lets_go_of_its_output_dir(make_cfg, monkeypatch):
    """In a notebook the process outlives a run that raised: its folder is let go (a review's crashed run kept
    it from every other process until the kernel restarted), whether the run failed while training or its
    resume was refused."""
    import subprocess
    import sys

    def other_process_can_lock(out) -> bool:
        code = ("import sys\nfrom grouprl import runlog\nrunlog.LOCK_WAIT_S = 0\n"
                f"try:\n    runlog.lock_output_dir({str(out)!r})\nexcept runlog.OutputDirInUse:\n    sys.exit(3)")
        return subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0

    cfg = make_cfg(max_steps=3, save_steps=1, lora_r=4)
    trainer = Trainer(cfg)
    original = trainer.train_step
    monkeypatch.setattr(trainer, "train_step", lambda: 1 / 0 if trainer.step == 2 else original())
    with pytest.raises(ZeroDivisionError):
        trainer.train()
    assert other_process_can_lock(cfg.output_dir)
    with pytest.raises(ConfigError, match="lora_alpha"):
        Trainer(replace(cfg, lora_alpha=64)).train(resume=True)  # refused while resuming
    assert other_process_can_lock(cfg.output_dir)
    with pytest.raises(ConfigError, match="already holds a run with checkpoints"):
        Trainer(cfg).train()  # refused before it starts
    assert other_process_can_lock(cfg.output_dir)
