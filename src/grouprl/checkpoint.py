"""Checkpoints: written whole into a temporary folder, then renamed into place.

Layout of `output_dir/checkpoints/step-000010/`:
  model/              `save_pretrained` model + tokenizer, loadable by transformers (with LoRA:
                      the adapter merged into the base), usable as `model` for a new run
  adapter/            with LoRA only: the adapter in PEFT's format (adapter_config.json, a few MB) and the
                      tokenizer, for PeftModel.from_pretrained(base model, it) or vLLM's LoRA; left out when
                      the run's model folder held an adapter of its own, merged at load (no base on disk
                      is the start it was trained over: use model/)
  trainable.safetensors  the trainable weights exactly as trained (LoRA: the adapter)
  ref.safetensors     the reference weights, only in DeepSeekMath's iterative mode (state.pt's
                      `ref_written` says so: a checkpoint that lacks it is damaged)
  state.pt            optimizer, scheduler, RNG states, data position, step, eval results
  COMPLETE            written last; a folder without it is never read
  loop.pt             only after an eval that followed the save (eval_after; one made up on
                      resume): the eval results, pending flag, best record and run guard as they
                      stand after it, read over state.pt's (`write_loop_state`)

A rename within one filesystem is atomic, so a run killed at any moment leaves either the new
checkpoint complete or no trace of it beside the previous one. A checkpoint replaced by a new one of
its step is first moved aside (`.old-step-N-PID`), so a complete one of that step exists at every
instant; one that save_total_limit deletes is first renamed (`.del-step-N-PID`), so no checkpoint is
ever half deleted. `recover_interrupted_saves`, at the start of a run, puts back what a kill left
aside and deletes the temporary folders of saves that never finished and the deletions it cut short.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.utils._pytree import tree_map_only
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model

from grouprl.lora import base_model, is_peft_model, merged_named_weights

_NAME = re.compile(r"^step-(\d+)$")
# a save's temporary folder; a checkpoint moved aside to be replaced; one save_total_limit is deleting
_LEFTOVER = re.compile(r"^\.(tmp|old|del)-step-(\d+)-\d+$")


class CheckpointMismatch(ValueError):
    """A checkpoint written by a run with another model or LoRA shape than the one resuming it."""


class DamagedCheckpoint(ValueError):
    """A checkpoint marked COMPLETE whose files cannot be read (truncated or changed after it was written)."""


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_path(output_dir: str | Path, step: int) -> Path:
    """Where the checkpoint of `step` lives (complete once its COMPLETE file exists)."""
    return checkpoint_dir(output_dir) / f"step-{step:06d}"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_dir(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _NAME.match(p.name)) and (p / "COMPLETE").is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    ckpts = list_checkpoints(output_dir)
    return ckpts[-1] if ckpts else None


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(output_dir: str | Path, step: int, *, model: torch.nn.Module, tokenizer,
                    state: dict[str, Any], ref_model: torch.nn.Module | None = None,
                    keep: int | None = None, model_state: dict[str, torch.Tensor] | None = None,
                    ref_state: dict[str, torch.Tensor] | None = None, protect: Path | None = None) -> Path:
    """Write a checkpoint and keep the newest `keep` (and `protect`, the best one, whatever its
    age). `model_state` / `ref_state` are whole state dicts gathered from a sharded (FSDP2) model,
    written in place of the model's own (sharded) tensors."""
    root = checkpoint_dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(output_dir, step)
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write_files(tmp, step, model, tokenizer, state, ref_model, model_state, ref_state)
    except BaseException:  # a full disk, a second signal: the partial checkpoint does not stay on the disk
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    aside = None
    if final.exists():
        # the same step from an earlier attempt: moved aside, not deleted, until the new one is in place, so
        # a kill in between leaves a whole checkpoint of this step (recover_interrupted_saves puts it back)
        aside = root / f".old-step-{step:06d}-{os.getpid()}"
        os.replace(final, aside)
    os.replace(tmp, final)
    _fsync_dir(root)
    if aside is not None:
        shutil.rmtree(aside)
    if keep:
        for old in list_checkpoints(output_dir)[:-keep]:
            if protect is None or old.resolve() != Path(protect).resolve():
                # renamed first: a kill midway through the deletion leaves a leftover that recovery deletes, never
                # a step-N folder that has lost some files but kept COMPLETE (rmtree's order is the directory's)
                gone = root / f".del-{old.name}-{os.getpid()}"
                os.replace(old, gone)
                _fsync_dir(root)
                shutil.rmtree(gone, ignore_errors=True)
    return final


def _write_files(tmp: Path, step: int, model: torch.nn.Module, tokenizer, state: dict[str, Any],
                 ref_model: torch.nn.Module | None, model_state: dict[str, torch.Tensor] | None,
                 ref_state: dict[str, torch.Tensor] | None) -> None:
    """A checkpoint's files into its temporary folder `tmp`, on disk, COMPLETE last (save_checkpoint)."""
    save_model_folder(model, tmp / "model", model_state)
    tokenizer.save_pretrained(tmp / "model")
    # the adapter alone in PEFT's format: PeftModel.from_pretrained(base, it), vLLM's LoRA; not over a policy that
    # started from a folder's adapter merged into its base (policy.load_policy): no base on disk is that start
    if is_peft_model(model) and not hasattr(base_model(model), "grouprl_merged_adapter"):
        model.save_pretrained(tmp / "adapter", state_dict=model_state, safe_serialization=True)
        tokenizer.save_pretrained(tmp / "adapter")
    trainable = trainable_state(model)
    if model_state is not None:
        trainable = {k: model_state[k].contiguous() for k in trainable}
    save_file(trainable, tmp / "trainable.safetensors")
    if ref_state is not None:
        names = {n for n, _ in ref_model.named_parameters()} | {n for n, _ in ref_model.named_buffers()}
        save_file({k: v.contiguous() for k, v in ref_state.items() if k in names}, tmp / "ref.safetensors")
    elif ref_model is not None:
        save_model(ref_model, str(tmp / "ref.safetensors"))  # handles tied embeddings
    with open(tmp / "state.pt", "wb") as f:  # a Python file: see write_loop_state
        torch.save({**state, "ref_written": ref_model is not None}, f)  # read_checkpoint requires the reference
    _fsync_tree(tmp)
    (tmp / "COMPLETE").write_text(f"{step}\n")


def recover_interrupted_saves(output_dir: str | Path) -> None:
    """Undo what a save killed midway left in checkpoints/ (rank 0, at the start of a run, before any
    checkpoint is read): a checkpoint moved aside to be replaced goes back into place if its
    replacement never arrived, else it is deleted; temporary folders of unfinished saves, and
    checkpoints whose deletion (save_total_limit) was cut short, are deleted, and so are the temporary
    files of a loop.pt write that a kill cut short inside a checkpoint."""
    root = checkpoint_dir(output_dir)
    if not root.is_dir():
        return
    for path in sorted(root.iterdir()):
        if _NAME.match(path.name):  # a loop.pt write killed midway (write_loop_state) left its temporary file
            for tmp in path.glob(".loop.pt.tmp-*"):
                tmp.unlink(missing_ok=True)
        if not (m := _LEFTOVER.match(path.name)):
            continue
        final = checkpoint_path(output_dir, int(m.group(2)))
        if m.group(1) == "old" and not final.exists():
            os.replace(path, final)
        else:
            shutil.rmtree(path)
    _fsync_dir(root)


def save_model_folder(model: torch.nn.Module, path: Path,
                      model_state: dict[str, torch.Tensor] | None = None) -> None:
    """The model in save_pretrained form (safetensors, no quantization config). With LoRA, the base
    model's weights with the adapter merged in (W + s·BA), built one weight at a time in host memory:
    a merged deep copy of the model would hold a second copy of every weight on its device."""
    if model_state is not None:  # whole weights gathered from a sharded model
        model.save_pretrained(path, state_dict=model_state, safe_serialization=True)
        return
    if is_peft_model(model):
        merged = {name: t.detach().to("cpu", copy=True) for name, t in merged_named_weights(model)}
        base_model(model).save_pretrained(path, state_dict=merged, safe_serialization=True)
        return
    model.save_pretrained(path, safe_serialization=True)


def load_checkpoint(path: str | Path, model: torch.nn.Module,
                    ref_model: torch.nn.Module | None = None) -> dict[str, Any]:
    """Restore the trainable weights (and reference) into the models; return the trainer state."""
    weights, ref_weights, state = read_checkpoint(path)
    check_fits(path, weights, model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k, v in weights.items():
            params[k].copy_(v)
    if ref_model is not None and ref_weights is not None:
        load_model(ref_model, str(Path(path) / "ref.safetensors"))
    return state


def check_fits(path: str | Path, weights: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    """The checkpoint's trainable weights are exactly the model's trainable parameters, shape for shape
    (a run resumed with another lora_r or lora_target_modules fails here, naming them, not in torch)."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    extra = [k for k in weights if k not in dict(model.named_parameters())]
    lacking = [k for k in params if k not in weights]
    shapes = [f"{k} {tuple(weights[k].shape)} -> {tuple(params[k].shape)}" for k in weights
              if k in params and tuple(weights[k].shape) != tuple(params[k].shape)]
    problems = ([f"weights the model lacks ({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''})"] if extra
                else []) + ([f"no weights for {len(lacking)} trainable parameter(s) ({', '.join(lacking[:3])}"
                             f"{', ...' if len(lacking) > 3 else ''})"] if lacking else []) + (
        [f"other shapes ({', '.join(shapes[:3])}{', ...' if len(shapes) > 3 else ''})"] if shapes else [])
    if problems:
        raise CheckpointMismatch(f"checkpoint {path} does not fit this model: it has {'; '.join(problems)}. "
                                 "Resume with the model and LoRA settings (lora_r, lora_target_modules) of the "
                                 "run that wrote it, as its config.yaml records them")


def read_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None,
                                                dict[str, Any]]:
    """The trainable weights, the reference weights (or None) and the trainer state, as stored. A
    checkpoint written with a reference (state.pt's `ref_written`) is damaged without its file; one
    written before that record (2026-11-27) is read with its reference where the file is there."""
    path = Path(path)
    if not (path / "COMPLETE").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint")
    state = _read(path / "state.pt", lambda p: torch.load(p, weights_only=False, map_location="cpu"))
    # (map_location: a GPU run's optimizer state is saved on its device; read on the CPU, it resumes on a
    # machine without that GPU, and K ranks do not each load it onto cuda:0. load_state_dict moves it.)
    ref_file = path / "ref.safetensors"
    ref = _read(ref_file, load_file) if state.get("ref_written", ref_file.is_file()) else None
    return _read(path / "trainable.safetensors", load_file), ref, state


def write_loop_state(path: Path, fields: dict[str, Any]) -> None:
    """`fields` of state.pt as they stand now, into `path`/loop.pt, replaced atomically: a run that
    evaluated after writing the checkpoint `path` (its weights unchanged) records the eval without
    writing the weights and optimizer state again."""
    tmp = path / f".loop.pt.tmp-{os.getpid()}"
    try:
        # written through a Python file: on a full disk torch's error then carries the OSError (ENOSPC) that
        # says so, as its __context__ (torch's own file writer reports no errno)
        with open(tmp, "wb") as f:
            torch.save(fields, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:  # recover_interrupted_saves does not look inside checkpoints
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path / "loop.pt")
    _fsync_dir(path)


def read_loop_state(path: Path) -> dict[str, Any]:
    """What `write_loop_state` recorded beside the checkpoint `path`, or {}."""
    file = Path(path) / "loop.pt"
    return _read(file, lambda p: torch.load(p, weights_only=False)) if file.is_file() else {}


def _read(file: Path, load: Callable[[Path], Any]) -> Any:
    """`load(file)`; what a truncated or missing file raises becomes a DamagedCheckpoint naming it."""
    try:
        return load(file)
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError, SafetensorError) as e:
        raise DamagedCheckpoint(f"checkpoint {file.parent} is damaged: {file.name} cannot be read "
                                f"({type(e).__name__}: {e})") from e


def rng_states(generator: torch.Generator) -> dict[str, Any]:
    """This process's random states: torch's, Python's, numpy's and the sampling generator's; and its
    GPU's (dropout on CUDA draws from it) once CUDA is in use (asking starts CUDA, which a CPU run must not)."""
    states = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
              "sampling": generator.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()  # the current device: this rank's (init_distributed)
    return states


def restore_rng_states(by_rank: list[dict[str, Any]], rank: int, world_size: int, generator: torch.Generator,
                       fresh_seed: int) -> None:
    """Put back this rank's saved states (`rng_states` of every rank, in rank order). Resumed with
    a different number of processes, each rank takes rank 0's global states and reseeds its sampling
    generator with `fresh_seed` (distinct per rank), since no saved stream is its own."""
    same_world = len(by_rank) == world_size
    rng = by_rank[rank] if same_world else by_rank[0]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    if same_world:
        generator.set_state(rng["sampling"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:
        generator.manual_seed(fresh_seed)


def _fsync_tree(root: Path) -> None:
    """Every file of a new checkpoint on disk, readable as the process's umask allows: safetensors
    (0.8) creates its files 0600, which a teammate or a vLLM server running as another user cannot read."""
    mode = _file_mode()
    for p in root.rglob("*"):
        if p.is_file():
            os.chmod(p, mode)
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(root)


def _file_mode() -> int:
    """0666 less the umask (read from /proc: setting the umask to read it would race other threads)."""
    try:
        with open("/proc/self/status") as f:
            umask = next((int(line.split()[1], 8) for line in f if line.startswith("Umask:")), 0o022)
    except OSError:
        umask = 0o022
    return 0o666 & ~umask


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def memory_snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A copy of the trainable weights and the optimizer state, in host memory (a sharded tensor
    stays where it is: each rank keeps its own shard), for `on_collapse: rollback`. It costs the
    trainable weights plus Adam's two moments: 3x the trainable parameters, in their dtype."""
    def host(x: torch.Tensor) -> torch.Tensor:
        if hasattr(x, "full_tensor"):  # a DTensor shard: copied where it is
            return x.detach().clone()
        return x.detach().to("cpu", copy=True)  # a Parameter too (on CUDA, one copy, made in host memory)

    return {"weights": {n: host(p) for n, p in model.named_parameters() if p.requires_grad},
            "optimizer": tree_map_only(torch.Tensor, host, optimizer.state_dict())}


def restore_snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer, snapshot: dict[str, Any]) -> None:
    """Put a `memory_snapshot` back: the trainable weights, in place, and the optimizer state."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in snapshot["weights"].items():
            params[name].copy_(value.to(params[name].device) if type(value) is torch.Tensor else value)
    # load_state_dict adopts as it is a tensor that already has its parameter's device and dtype
    # (Adam's step, a 0-dim tensor that stays where it is, and the moments when the snapshot sits
    # where the parameters do: CPU, a shard). Adopted, the optimizer's later steps would change it in
    # place -- the snapshot itself, which a second rollback to it would put back as the later state.
    # Those go in as copies; the rest the load copies to its device.
    optimizer.load_state_dict(_loadable(snapshot["optimizer"], {p.device for p in params.values()}))


def _loadable(state: dict[str, Any], devices: set[torch.device]) -> dict[str, Any]:
    """`state` with a copy of each tensor that load_state_dict would adopt as it is (see restore_snapshot)."""
    return tree_map_only(torch.Tensor, lambda x: x.clone() if x.dim() == 0 or x.device in devices else x, state)
