"""A run that stops for a cause the user can fix says what to do next. Out of memory: where
(generation, the log-prob passes, the update) and what to lower there, each setting with its value
now; what it wrote stays, and --resume continues from it; other errors pass through unchanged. A
tracker that cannot start is one line; a reward that raises prints the command that goes on."""

import errno
import json
import re
from pathlib import Path

import pytest
import torch

from grouprl import memory
from grouprl.cli import main
from grouprl.rollout.engine import HFEngine
from grouprl.update import PolicyUpdate


def _allocate_too_much():
    return torch.empty(1 << 55)  # 128 PiB: the CPU allocator's own failure, raised for real


def _advice(err: str) -> str:
    """The advice of an out-of-memory report, without the log lines before it."""
    return err.split("To fit:\n", 1)[1].split("\nThe error:", 1)[0]


def _config(make_cfg, tmp_path, **overrides) -> Path:
    path = tmp_path / "run.yaml"
    make_cfg(**overrides).save_yaml(path)
    return path


def test_is_out_of_memory_knows_each_allocator_failure():
    with pytest.raises(RuntimeError) as cpu:
        _allocate_too_much()
    assert memory.is_out_of_memory(cpu.value)
    assert memory.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert memory.is_out_of_memory(MemoryError())
    assert not memory.is_out_of_memory(RuntimeError("shape mismatch"))
    # CUDA's failures from outside the caching allocator: the driver's, cuBLAS's, NCCL's
    assert memory.is_out_of_memory(torch.AcceleratorError("CUDA error: out of memory\nCUDA kernel errors might be"))
    assert memory.is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate`"))
    assert memory.is_out_of_memory(RuntimeError("NCCL error: unhandled cuda error, Cuda failure 'out of memory'"))
    assert not memory.is_out_of_memory(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))


def test_out_of_memory_in_the_update_names_the_budget_keeps_the_checkpoint_and_resume_finishes(
        make_cfg, tmp_path, monkeypatch, capsys):
    """4 steps, a checkpoint every 2; the third update's optimizer step cannot allocate. The error says
    it was the update, gives the token budget it ran with (auto: 4,096 on CPU) and half of it, and
    checkpointing's setting; step 2's checkpoint is on disk, and the printed command finishes the run."""
    path = _config(make_cfg, tmp_path, max_steps=4, save_steps=2)
    real, calls = PolicyUpdate.optimizer_step, []

    def optimizer_step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            _allocate_too_much()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PolicyUpdate, "optimizer_step", optimizer_step)
    assert main(["train", str(path)]) == 1
    err = capsys.readouterr().err
    assert "grouprl train: error: out of memory in the update. To fit:" in err
    budget = re.search(r"max_tokens_per_micro_batch \(auto: (\d+) tokens\): set it to (\d+), or micro_batch_size "
                       r"\(8 completions\) to 4", err)
    assert budget and int(budget[2]) == int(budget[1]) // 2  # auto is 4,096 on CPU, sized from free memory on CUDA
    assert budget[1] == "4096" or torch.cuda.is_available()
    advice = _advice(err)
    # auto checkpoints every pass on CUDA (memory.checkpoint_mode): there it is no advice
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert ("gradient_checkpointing: true keeps only each layer's input" in advice
            and "(now 'auto'" in advice) == (memory.checkpoint_mode("auto", device) != "always")
    assert "generation_batch_size" not in advice  # advice for the stage that failed, not every stage's
    assert "DefaultCPUAllocator: can't allocate memory" in err
    run = Path(make_cfg().output_dir)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]
    again = err.split("(the checkpoints written are intact):\n  ")[1].splitlines()[0]
    assert again == f"grouprl train {path} --resume"

    monkeypatch.setattr(PolicyUpdate, "optimizer_step", real)
    assert main(["train", str(path), "--resume"]) == 0
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-2:] == [3, 4] and json.loads((run / "summary.json").read_text())["steps"] == 4


def test_out_of_memory_while_generating_names_the_rows_decoded_together(make_cfg, tmp_path, monkeypatch, capsys):
    """16 completions a step (4 prompts x 4), decoded all at once by default: halve them."""
    path = _config(make_cfg, tmp_path)

    def generate(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total "
                                     "capacity of 79.19 GiB of which 1.5 GiB is free.")

    monkeypatch.setattr(HFEngine, "generate", generate)
    assert main(["train", str(path)]) == 1
    err = capsys.readouterr().err
    assert "out of memory while generating. To fit:" in err
    assert ("generation decodes 16 rows together (generation_batch_size: null, all 16 of a step), each with a KV "
            "cache of prompt + max_completion_length (12) tokens: set generation_batch_size to 8") in err
    assert "max_tokens_per_micro_batch" not in _advice(err)  # (on CUDA the log names the budget auto sized)
    assert "Tried to allocate 20.00 GiB" in err and "the run wrote no checkpoint" in err


def test_another_error_in_a_stage_passes_through_unchanged_with_its_stage(make_cfg, tmp_path, monkeypatch):
    path = _config(make_cfg, tmp_path)

    def optimizer_step(self, *args, **kwargs):
        raise RuntimeError("a bug, not memory")

    monkeypatch.setattr(PolicyUpdate, "optimizer_step", optimizer_step)
    with pytest.raises(RuntimeError, match="a bug, not memory") as e:
        main(["train", str(path)])
    assert e.value.grouprl_stage == "update"


def test_advice_outside_a_step_covers_generation_and_the_passes(make_cfg):
    cfg = make_cfg(generation_batch_size=8, max_tokens_per_micro_batch=1024, gradient_checkpointing=True)
    text = memory.out_of_memory_advice(None, cfg, budget=1024, checkpointing="always")
    assert text.startswith("out of memory outside a training step")
    assert "generation decodes 8 rows together (generation_batch_size: 8)" in text and "set it to 512" in text
    assert "gradient_checkpointing: true" not in text  # already checkpointing every pass


def test_out_of_memory_in_grouprl_eval_speaks_of_its_batches(make_cfg, digits_data, tmp_path, monkeypatch, capsys):
    path = _config(make_cfg, tmp_path, eval_data=str(digits_data), num_generations_eval=2)

    def generate(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB.")

    monkeypatch.setattr(HFEngine, "generate", generate)
    assert main(["eval", str(path)]) == 1
    err = capsys.readouterr().err
    assert "grouprl eval: error: out of memory while generating for the eval. To fit:" in err
    assert "generation decodes 128 rows together (generation_batch_size: null, all 128 of an eval batch" in err


def test_a_full_disk_while_saving_says_so_leaves_no_partial_checkpoint_and_resume_finishes(
        make_cfg, tmp_path, monkeypatch, capsys):
    """4 steps, a checkpoint every 2; the disk fills while step 4's state.pt is written. Before, a raw
    OSError traceback, no resume command, and .tmp-step-000004-PID left on the full disk. Now: the disk
    is full, where, the command that continues the run; only step 2's checkpoint in checkpoints/."""
    import grouprl.checkpoint

    path = _config(make_cfg, tmp_path, max_steps=4, save_steps=2)
    real, saves = grouprl.checkpoint.torch.save, []

    def full_disk(obj, f, *args, **kwargs):
        if str(getattr(f, "name", f)).endswith("state.pt"):
            saves.append(1)
            if len(saves) == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(grouprl.checkpoint.torch, "save", full_disk)
    assert main(["train", str(path)]) == 1
    err = capsys.readouterr().err
    run = Path(make_cfg().output_dir)
    assert f"grouprl train: error: the disk is full: free space on the disk of output_dir={str(run)!r}" in err
    assert "The error: [Errno 28] No space left on device" in err and "Traceback" not in err
    assert f"(the checkpoints written are intact):\n  grouprl train {path} --resume" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]

    monkeypatch.setattr(grouprl.checkpoint.torch, "save", real)
    assert main(["train", str(path), "--resume"]) == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 4


def test_disk_full_knows_each_writers_report_of_it():
    """Measured on a full 2 MiB tmpfs: Python's own writes raise OSError 28; safetensors' (the model and
    the trainable weights) a SafetensorError quoting it; torch.save to a Python file a RuntimeError whose
    __context__ is the file's OSError (to a path, torch's writer names no errno)."""
    from safetensors import SafetensorError

    from grouprl.cli import disk_full

    assert disk_full(OSError(errno.ENOSPC, "No space left on device")) is not None
    assert disk_full(OSError(errno.EDQUOT, "Disk quota exceeded")) is not None
    assert disk_full(SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"))
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    except RuntimeError as e:
        assert isinstance(disk_full(e), OSError)
    assert disk_full(OSError(errno.EACCES, "Permission denied")) is None
    assert disk_full(RuntimeError("shape mismatch")) is None


def test_a_stop_for_a_fixable_cause_prints_the_command_that_goes_on(make_cfg, tmp_path, monkeypatch, capsys):
    """A tracker that cannot start is one line, no traceback; a reward that raises after a checkpoint
    prints the resume command (as a signal does), and before any checkpoint says to start again."""
    from grouprl import trackers

    def unreachable(*args):
        raise ConnectionError("the tracker's server is unreachable")

    monkeypatch.setitem(trackers.OPENERS, "wandb", unreachable)
    monkeypatch.setattr(trackers, "missing_tracker_packages", lambda names: [])  # wandb installed or not
    path = _config(make_cfg, tmp_path, report_to=["wandb"])
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("grouprl train: error: report_to wandb failed to start") and (
        "Traceback" not in err)

    calls = []

    def raises_at_step_3(prompts, completions, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyError("no gold answer")
        return [0.5] * len(completions)

    monkeypatch.setattr("tests.trainer.conftest.digit_fraction", raises_at_step_3)
    path = _config(make_cfg, tmp_path, max_steps=4, save_steps=2, output_dir=str(tmp_path / "r2"))
    assert main(["train", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"continue from the latest checkpoint (the checkpoints written are intact):\n  grouprl train {path} " \
           f"--resume" in err
    # the function's own traceback, its line included: a bare KeyError deep inside a reward names no place
    assert "Traceback" in err and 'raise KeyError("no gold answer")' in err and err.index("KeyError: 'no gold") < (
        err.index("grouprl train: error: reward function"))
    calls.clear()
    monkeypatch.setattr("tests.trainer.conftest.digit_fraction", lambda p, c, **k: 1 / 0)
    path = _config(make_cfg, tmp_path, output_dir=str(tmp_path / "r3"))
    assert main(["train", str(path)]) == 1
    assert "the run wrote no checkpoint: run the same command again to start over." in capsys.readouterr().err
    # steps logged before the failure, no checkpoint: the same command would be refused for its metrics.jsonl,
    # so the advice is --resume auto, which starts over (a review followed the old advice into a refusal)
    calls.clear()
    monkeypatch.setattr("tests.trainer.conftest.digit_fraction", raises_at_step_3)
    path = _config(make_cfg, tmp_path, max_steps=4, save_steps=10, output_dir=str(tmp_path / "r4"))
    assert main(["train", str(path)]) == 1
    err = capsys.readouterr().err
    assert (f"the run wrote no checkpoint, and it logged steps, kept aside in metrics.jsonl.lost when it starts over "
            f"with:\n  grouprl train {path} --resume auto.") in err
    monkeypatch.setattr("tests.trainer.conftest.digit_fraction",
                        lambda prompts, completions, **k: [0.5] * len(completions))
    assert main(["train", str(path), "--resume", "auto"]) == 0
    assert (tmp_path / "r4" / "metrics.jsonl.lost").is_file()


def test_version_and_a_missing_gguf_file(capsys, make_cfg, tmp_path):
    assert main(["--version"]) == 0 and capsys.readouterr().out.startswith("grouprl ")
    assert main(["train", str(_config(make_cfg, tmp_path)), "--model", "models/nowhere.Q4_1.gguf"]) == 2
    err = capsys.readouterr().err
    assert "model='models/nowhere.Q4_1.gguf' does not exist: check the path" in err and "hf download" not in err


def test_a_damaged_model_folder_is_named_not_a_traceback(tiny_model_dir, tmp_path, capsys, digits_data):
    """A model.safetensors cut short (a copy interrupted, a full disk): grouprl eval names the model and
    the fix."""
    import shutil

    broken = tmp_path / "model"
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["eval", "--model", str(broken), "--eval_data", str(digits_data), "--reward_funcs",
                 "[tests.trainer.conftest:digit_fraction]"]) == 2
    err = capsys.readouterr().err
    assert f"model={str(broken)!r}: its weights cannot be read" in err and "copy the model again" in err


def test_advice_for_a_reward_out_of_memory_speaks_of_the_reward_model(make_cfg):
    text = memory.out_of_memory_advice("reward", make_cfg())
    assert text.startswith("out of memory in a reward function. To fit:") and "a reward model" in text
    assert "max_tokens_per_micro_batch" not in text and "generation_batch_size" not in text
