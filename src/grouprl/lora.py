"""Every LoRA/PEFT concern in one place: adding the adapter, recognising a PEFT model and its LoRA
layers, and reading the adapted weights W' = W + s·BA (s = lora_alpha / r) without touching W.

The rest of grouprl meets LoRA through these functions only, so the few facts about PEFT's
internals the project relies on (`base_layer`, `get_delta_weight`, `merged`, `disable_adapters`,
`lora_dropout`, `.lora_` parameter names) are written down once:
- the fast decoder (`rollout/llama_decoder.py`) reads `merged_weight` per layer, when `mergeable`;
- the vLLM weight sync (`rollout/vllm.py`, and the server client through it) sends
  `merged_named_weights`;
- a checkpoint's `model/` folder is `merged_named_weights` (copied to host memory one weight at a time)
  saved with the base model's `save_pretrained`; `merged_copy` (PEFT's own merge) is the tests' reference;
- with LoRA the reference policy is the base model with the adapter disabled (`adapter_disabled`);
- a model folder that holds a PEFT adapter is loaded as its base with that adapter merged in
  (`with_adapter_merged`), so the run starts from plain weights.

Merged weights are always built out of place: merging into W and unmerging afterwards would leave
rounding drift in the frozen base weights, which are the reference policy.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Iterator

import torch


def add_adapter(model: torch.nn.Module, *, r: int, alpha: float, dropout: float,
                target_modules: str | list[str]) -> torch.nn.Module:
    """`model` wrapped by PEFT with LoRA adapters of rank `r` on `target_modules` (`all-linear` or
    module names), scaled by alpha / r, with `dropout` on the LoRA branch. B starts at zero, so the
    wrapped model computes what `model` did until B is trained."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                                            target_modules=target_modules, task_type="CAUSAL_LM"))


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The short names (the last part of each path) of `model`'s linear layers, each once, in the model's
    order: the names `lora_target_modules` can give (`all-linear` takes them all but the LM head)."""
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers

    return list(dict.fromkeys(name.rpartition(".")[2] for name, m in base_model(model).named_modules()
                              if isinstance(m, (torch.nn.Linear, Conv1D)) and ".lora_" not in name
                              and not name.endswith(".base_layer")))


def named_by(target: str, module_name: str) -> bool:
    """Whether an entry of a list of target modules names the module at `module_name` (PEFT's rule: the whole
    path, or its last parts after a dot)."""
    return module_name == target or module_name.endswith(f".{target}")


def unmatched_targets(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """The entries of `targets` that name none of a PEFT model's LoRA layers: PEFT adapts what the others
    name, and says nothing of them unless none names a module."""
    adapted = [name for name, m in base_model(model).named_modules() if is_lora_layer(m)]
    return [t for t in targets if not any(named_by(t, name) for name in adapted)]


def adapted_tied_embeddings(model: torch.nn.Module) -> list[str]:
    """The adapted modules among an LM head and input embedding that share one weight (tied
    embeddings), by name; [] when they are untied or neither is adapted. An adapter there changes
    one side of the pair only, which no merged model can hold: merging writes its delta into the
    shared weight, so both sides change. `all-linear` leaves the LM head out (PEFT's rule)."""
    base = base_model(model)
    head, embedding = base.get_output_embeddings(), base.get_input_embeddings()
    if head is None or head.weight is not embedding.weight:
        return []
    return [name for name, m in base.named_modules() if (m is head or m is embedding) and is_lora_layer(m)]


def is_peft_model(model: torch.nn.Module) -> bool:
    """A PEFT-wrapped model (a `PeftModel`, also once FSDP2 has sharded it). A transformers model that
    loaded an adapter itself (`load_adapter`, or `from_pretrained` of a folder with adapter_config.json)
    carries a `peft_config` too, but has no `disable_adapter` or `get_base_model`: it is not one."""
    from peft import PeftModel

    return isinstance(model, PeftModel)


def with_adapter_merged(model: torch.nn.Module, folder: str | Path) -> torch.nn.Module:
    """`model` with the PEFT adapter saved in `folder` merged into its weights, by PEFT's own recipe
    (`PeftModel.from_pretrained(model, folder).merge_and_unload()`): a plain transformers model that
    computes base + adapter, every weight trainable again, as a loaded model's are."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(folder)).merge_and_unload().requires_grad_(True)


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PEFT wrapper, whose LoRA layers stay in place; any other
    model as it is."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def adapter_disabled(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """A context in which a PEFT model computes its base model (adapter off); for any other model,
    a context that does nothing."""
    return model.disable_adapter() if is_peft_model(model) else contextlib.nullcontext()


def is_lora_layer(module: torch.nn.Module) -> bool:
    """A PEFT LoRA layer: the wrapped `base_layer` plus low-rank deltas."""
    return hasattr(module, "base_layer") and hasattr(module, "get_delta_weight")


def merged_weight(layer: torch.nn.Module) -> torch.Tensor:
    """A linear layer's weight [out, in]; for a LoRA layer W + Σ s·BA over its active adapters
    (a new tensor, detached), unless its adapters are merged in already or disabled."""
    if not is_lora_layer(layer):
        return layer.weight
    if getattr(layer, "merged", False) or getattr(layer, "disable_adapters", False):
        return layer.base_layer.weight
    if not plain_lora(layer):
        raise ValueError("a DoRA adapter, or one with its own bias (lora_bias), is not W + s·BA: its weights "
                         "cannot be merged here; train a plain LoRA adapter (use_dora and lora_bias off), or "
                         "generate with the built-in engine, which then runs the adapter's own forward")
    with torch.no_grad():
        return layer.base_layer.weight + sum(layer.get_delta_weight(a) for a in held_adapters(layer))


def held_adapters(layer: torch.nn.Module) -> list[str]:
    """The active adapters this layer holds: a second adapter may cover other layers than the first,
    and PEFT's forward and merge skip it where it has no weights."""
    return [a for a in layer.active_adapters if a in getattr(layer, "lora_A", {})
            or a in getattr(layer, "lora_embedding_A", {})]


def plain_lora(layer: torch.nn.Module) -> bool:
    """Each active adapter of a LoRA layer is W + s·BA: not DoRA (which rescales each row of the sum
    by a learned magnitude) and without an adapter bias (`lora_bias`), which s·BA leaves out."""
    return not any(getattr(layer, "use_dora", {}).get(a, False) or getattr(layer, "lora_bias", {}).get(a, False)
                   or getattr(layer.lora_B[a], "bias", None) is not None
                   for a in layer.active_adapters if a in getattr(layer, "lora_B", {}))


def plain_adapters(model: torch.nn.Module) -> bool:
    """Every LoRA layer of `model` is `plain_lora` (True without any): what the merged weights hold."""
    return all(map(plain_lora, filter(is_lora_layer, model.modules())))


def mergeable(model: torch.nn.Module) -> bool:
    """Every adapted module is a plain LoRA linear layer (`plain_adapters`) without dropout (dropout
    would make the adapter's forward random, which merged weights cannot reproduce)."""
    if not plain_adapters(model):
        return False
    for m in filter(is_lora_layer, model.modules()):
        if not isinstance(m.base_layer, torch.nn.Linear):
            return False
        if any(isinstance(d, torch.nn.Dropout) and d.p > 0 for d in m.lora_dropout.values()):
            return False
    return True


def merged_named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name in the base model's checkpoint, tensor) for every parameter of the base model, one at
    a time: an adapted weight as `merged_weight` (W + s·BA), every other parameter detached as it
    is (possibly a sharded DTensor: gathering it is the caller's business). The adapter's own
    parameters are left out and PEFT's `.base_layer.` is dropped from the names."""
    for name, param, lora in _base_parameters(model):
        yield name, merged_weight(lora) if lora is not None else param.detach()


def base_named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What `merged_named_weights` yields with the adapter left out: the frozen base weights W,
    under the same names (what a vLLM that runs the adapter itself must hold)."""
    for name, param, _ in _base_parameters(model):
        yield name, param.detach()


def merged_weight_meta(model: torch.nn.Module) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of what `merged_named_weights` yields, in its order, without merging or
    gathering anything (a sharded DTensor reports its whole shape). A merged weight keeps its base
    weight's dtype and shape."""
    return [(name, param.dtype, tuple(param.shape)) for name, param, _ in _base_parameters(model)]


def _base_parameters(model: torch.nn.Module):
    """(checkpoint name, base parameter, its LoRA layer when the parameter is an adapted weight)."""
    base = base_model(model)
    adapted = {name: m for name, m in base.named_modules() if is_lora_layer(m)}
    for name, param in base.named_parameters():
        if ".lora_" in name:
            continue
        module, _, leaf = name.rpartition(".")
        lora = adapted.get(module.removesuffix(".base_layer"))
        yield name.replace(".base_layer.", "."), param, lora if leaf == "weight" else None


def merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A PEFT model's base model with the adapter merged in, built from a deep copy: `model` and
    its adapter are left as they were (merging in place and unmerging would not restore the base
    weights bit for bit)."""
    return copy.deepcopy(model).merge_and_unload()
