"""The policy and reference models: loading, LoRA, and the log-prob forward pass.

The forward pass reads a `MicroBatch` (micro_batches.py plans them, each trimmed to its own
longest prompt and completion), computes logits only for the positions that predict completion
tokens (`logits_to_keep`), runs each distinct prompt of a micro-batch once (its G completions
share its KV cache, see `completion_logprobs`), and turns logits into per-token log-probs with
`core.token_logprobs`, which never materialises a full log-softmax copy of the logits.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import importlib.util
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from grouprl import packing
from grouprl.config import ConfigError, TrainConfig
from grouprl.core import head_logprobs, token_logprobs, token_logprobs_and_entropy
from grouprl.lora import (
    adapted_tied_embeddings,
    adapter_disabled,
    add_adapter,
    base_model,
    is_peft_model,
    linear_module_names,
    named_by,
    unmatched_targets,
    with_adapter_merged,
)
from grouprl.micro_batches import MicroBatch
from grouprl.rollout.types import cache_kwarg

logger = logging.getLogger(__name__)


def resolve_model_path(name: str) -> str:
    if name.startswith("builtin:"):
        from grouprl.tasks import DEFAULT_POLICY_DIR, TOOL_POLICY_DIR

        builtin = {"builtin:default_policy": DEFAULT_POLICY_DIR, "builtin:tool_policy": TOOL_POLICY_DIR}
        if name not in builtin:
            raise ValueError(f"model={name!r} is unknown: the built-in models are {', '.join(builtin)}")
        return str(builtin[name])
    return str(Path(name).expanduser()) if Path(name).expanduser().exists() else name


def check_model_source(model: str, gguf_file: str | None, tokenizer: str | None) -> tuple[str, str | None]:
    """Before any model loads: `model` and `tokenizer` exist, and a GGUF model is readable. Returns
    (folder or hub id, GGUF file name or None); `model: dir/m.gguf` becomes ("dir", "m.gguf")."""
    for name, value in (("model", model), ("tokenizer", tokenizer)):
        if value:
            _check_exists(name, value)
    return _check_gguf(model, gguf_file, tokenizer)


def _check_exists(name: str, value: str) -> None:
    """Local paths must exist; `builtin:` names are checked when loaded. A model or tokenizer may
    also be a hub id (`org/name`); with HF_HUB_OFFLINE=1 only one the Hugging Face cache holds."""
    if value.startswith("builtin:") or Path(value).expanduser().exists():
        return
    hub_name = not value.startswith((".", "/", "~")) and value.count("/") <= 1 and not value.endswith(".gguf")
    if hub_name and os.environ.get("HF_HUB_OFFLINE") == "1" and not _in_hub_cache(value):
        raise ConfigError(f"{name}={value!r} is not a local folder, and the hub is offline (HF_HUB_OFFLINE=1) with "
                          f"no copy of {value} in the Hugging Face cache: download it once where the hub is "
                          f"reachable (hf download {value}; then offline runs find it in the cache), or set {name} "
                          f"to a local folder that holds it (relative paths are resolved from {os.getcwd()})")
    if not hub_name:
        raise ConfigError(f"{name}={value!r} does not exist: check the path "
                          f"(relative paths are resolved from {os.getcwd()})")


def _in_hub_cache(repo_id: str) -> bool:
    """Whether the Hugging Face cache holds a snapshot of `repo_id` (what an offline load reads)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError):
        return False
    return True


def _check_gguf(model: str, gguf_file: str | None, tokenizer: str | None) -> tuple[str, str | None]:
    """A GGUF model as (folder or hub id, file name). Runs after `_check_exists`, so a local `model` exists."""
    if tokenizer is not None and tokenizer.endswith(".gguf"):
        raise ConfigError(f"tokenizer={tokenizer!r} is a GGUF file: a GGUF tokenizer is read from the model's "
                          "own file; leave tokenizer unset, or point it at a tokenizer folder")
    path = Path(model).expanduser()
    if gguf_file is None and not model.endswith(".gguf"):
        found = sorted(p.name for p in path.glob("*.gguf")) if path.is_dir() else []
        if found and not (path / "config.json").is_file():
            raise ConfigError(f"model={model!r} holds no config.json but GGUF file(s) {', '.join(found)}: "
                              f"name the one to train with gguf_file: {found[0]} (or model: {path / found[0]})")
        if path.is_dir() and (path / ADAPTER_CONFIG).is_file():  # a PEFT adapter, merged by load_policy
            _check_adapter_base(model, path)
            return model, None
        if path.is_dir() and not (path / "config.json").is_file():  # a checkpoint or run folder, not its model
            inner = [p for p in (path / "model", *sorted(path.glob("checkpoints/step-*/model"))[-1:])
                     if (p / "config.json").is_file()]
            raise ConfigError(f"model={model!r} is a folder without config.json, so it holds no model: "
                              + (f"use model: {inner[0]} (a checkpoint keeps its model in model/)" if inner else
                                 "point model at the folder that holds the model's config.json and weights"))
        return model, None
    if gguf_file is not None and model.endswith(".gguf"):
        raise ConfigError(f"gguf_file={gguf_file!r} is set and model={model!r} is itself a GGUF file: set "
                          "model to the folder that holds the file, or drop gguf_file")
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"model={model!r} is a GGUF model and reading it needs the gguf package: "
                          "pip install 'grouprl[gguf]' (or pip install gguf)")
    if gguf_file is None:
        folder, gguf_file = path.parent, path.name
    elif model.startswith("builtin:") or path.is_file():
        raise ConfigError(f"gguf_file={gguf_file!r} needs model to be the folder that holds it, and "
                          f"model={model!r} is not a folder: set model to the file's folder")
    elif not path.exists():  # a hub id (allowed by _check_exists when online): transformers downloads the file
        return model, gguf_file
    else:
        folder = path
    file = folder / gguf_file
    if not file.is_file():
        found = sorted(p.name for p in folder.glob("*.gguf"))
        raise ConfigError(f"gguf_file={gguf_file!r} is not in the model folder {str(folder)!r}, which holds "
                          + (f"the GGUF file(s) {', '.join(found)}" if found else "no .gguf file")
                          + ": check the name")
    with open(file, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ConfigError(f"{str(file)!r} is not a GGUF file (it does not start with the GGUF magic "
                              "bytes): point model/gguf_file at a llama.cpp .gguf file")
    return str(folder), gguf_file


ADAPTER_CONFIG = "adapter_config.json"


def adapter_base(folder: str | Path) -> str | None:
    """For a PEFT adapter folder (adapter_config.json, no config.json) the base model it names
    (`base_model_name_or_path`, "" when none); None for any other path."""
    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).is_file() or (folder / "config.json").is_file():
        return None
    try:
        return json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or ""
    except (OSError, ValueError) as e:
        raise ConfigError(f"model={str(folder)!r}: its {ADAPTER_CONFIG} cannot be read ({e}): copy the adapter "
                          "folder again") from None


def _check_adapter_base(model: str, path: Path) -> None:
    """A PEFT adapter folder: `load_policy` loads the base model it names and merges the adapter into it;
    a folder that holds a model too (config.json) is its own base."""
    base = adapter_base(path)
    if base == "":
        raise ConfigError(f"model={model!r} is a PEFT adapter folder whose {ADAPTER_CONFIG} names no base "
                          "model: set base_model_name_or_path there to the base model's folder or hub id")
    if base is None:
        return
    try:
        _check_exists("model", base)
    except ConfigError as e:
        raise ConfigError(f"model={model!r} is a PEFT adapter folder for the base model {base!r} "
                          f"(base_model_name_or_path in its {ADAPTER_CONFIG}), which cannot be loaded: {e}; "
                          f"or set base_model_name_or_path in {path / ADAPTER_CONFIG} to where the base "
                          "model is") from None


@contextlib.contextmanager
def _from_hub(what: str, name: str) -> Iterator[None]:
    """A hub id that cannot be fetched (no network, a gated or unknown repo): transformers' OSError, after
    its retries, as an error that says what to do instead. A local folder's errors pass as they are."""
    try:
        yield
    except OSError as e:
        local = errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS  # this machine's disk: as it is
        if name.startswith("builtin:") or Path(name).expanduser().exists() or e.errno in local:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{what}={name!r} is not a local folder, and the Hugging Face hub did not give it ({first}): "
                          f"check the name and the network; or download it once where the hub is reachable "
                          f"(hf download {name}) and run with HF_HUB_OFFLINE=1, or set {what} to a local folder "
                          "that holds it") from None


class MissingTokenizer(ConfigError):
    """A local model folder without tokenizer files."""

    def __init__(self, name: str, fix: str, field: str | None = None):
        super().__init__(f"{f'{field}=' if field else ''}{name!r} holds no tokenizer files "
                         f"({', '.join(TOKENIZER_FILES[:2])}, ...), only what model.save_pretrained writes: {fix}")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                   "spiece.model", "tekken.json")


def load_tokenizer(name: str, gguf_file: str | None = None, *, field: str | None = None, fix: str | None = None):
    """The tokenizer of a model folder or hub id, or the one stored in its GGUF file `gguf_file`. A
    local folder without tokenizer files (weights saved with `model.save_pretrained` alone) is a
    MissingTokenizer naming `field` and `fix`: transformers would build an empty tokenizer of the
    config's type from it, one token long."""
    path = resolve_model_path(name)
    folder = Path(path)
    if gguf_file is None and folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise MissingTokenizer(name, fix or "save the tokenizer beside it (tokenizer.save_pretrained(folder)), or "
                                            "set tokenizer to the folder or hub id of the one it was trained with",
                               field=field)
    with _from_hub("tokenizer", name):
        tok = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
    if tok.pad_token_id is None:  # e.g. GPT-2, Llama: pad with EOS (padding is always masked out)
        if tok.eos_token is None:
            raise ValueError(f"tokenizer {name!r} has neither a pad nor an EOS token: add one")
        tok.pad_token = tok.eos_token
    return tok


def policy_tokenizer(cfg: TrainConfig):
    """The run's tokenizer: `tokenizer` where set, else the model's (its GGUF file's), each named as its
    field when its folder holds no tokenizer files."""
    if cfg.tokenizer:
        return load_tokenizer(cfg.tokenizer, field="tokenizer", fix="set tokenizer to a folder that holds them "
                              "(where tokenizer.save_pretrained wrote) or to a hub id")
    folder = Path(resolve_model_path(cfg.model))
    base = adapter_base(folder) if cfg.gguf_file is None else None
    if base and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(f"model={cfg.model!r} is a PEFT adapter folder without tokenizer files: set tokenizer "
                          f"to its base model's (tokenizer: {base}), or save the tokenizer beside the adapter")
    return load_tokenizer(cfg.model, cfg.gguf_file, field="model")


def load_policy(name: str, *, gguf_file: str | None = None, lora_r: int = 0, lora_alpha: float = 16.0,
                lora_dropout: float = 0.0, lora_target_modules: str | list[str] = "all-linear",
                gradient_checkpointing: bool | str = False, disable_dropout: bool = True,
                dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Load a causal LM in fp32 (bf16 runs under autocast) and wrap it with LoRA when asked (refused
    on either side of tied embeddings: `lora.adapted_tied_embeddings`). With
    `gguf_file`, the model is that GGUF file in the folder (or hub repo) `name`, dequantized.
    `dtype`: another storage dtype for a model that is never trained (a distillation teacher in
    bf16), so that it is never whole in fp32."""
    path = resolve_model_path(name)
    try:
        with _from_hub("model", name), _base_folder(path, gguf_file) as base:
            model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, **_gguf_kwargs(gguf_file))
    except SafetensorError as e:
        raise ConfigError(f"model={name!r}: its weights cannot be read ({e}): a file is damaged or incomplete (a "
                          "copy cut short, a full disk); copy the model again, or use an earlier checkpoint's "
                          "model/") from None
    if base != path:
        model = with_adapter_merged(model, path)
        model.grouprl_merged_adapter = path  # no base on disk matches a later adapter (checkpoint.py: no adapter/)
        logger.info("model=%r holds a PEFT adapter: it is merged into its base model's weights, which are the "
                    "policy's starting weights%s", name, " (lora_r adds a new adapter over them)" if lora_r else "")
    elif hasattr(model, "peft_config"):  # transformers loaded an adapter by itself, unmerged, its base frozen
        raise ConfigError(f"model={name!r} is a PEFT adapter: download it (hf download {name}) and set model to "
                          "the folder it is in, whose adapter grouprl merges into its base model")
    model.config.use_cache = False
    packing.enable(model)  # padding-free passes (packing.py); other uses are unchanged
    if gradient_checkpointing is True:  # "auto" checkpoints pass by pass (activation_checkpointing)
        checkpointing(model, True)
    if lora_r:
        linear = linear_module_names(model)
        try:
            model = add_adapter(model, r=lora_r, alpha=lora_alpha, dropout=lora_dropout,
                                target_modules=lora_target_modules)
        except ValueError as e:  # PEFT's: no entry names a module, or one names a module LoRA cannot adapt
            raise ConfigError(_target_modules_error(model, lora_target_modules, linear, e)) from None
        if isinstance(lora_target_modules, list) and unmatched_targets(model, lora_target_modules):
            raise ConfigError(_target_modules_error(model, lora_target_modules, linear))  # PEFT adapted the others
        if tied := adapted_tied_embeddings(model):
            raise ConfigError(f"lora_target_modules={lora_target_modules!r} puts LoRA on {' and '.join(tied)}, "
                              f"and model={name!r} ties its LM head to its input embedding (tie_word_embeddings=True): "
                              "the merged model (the checkpoint's model/ folder, the weights sent to vLLM) would not "
                              "compute what was trained. Leave lm_head and the embedding out of lora_target_modules "
                              "(all-linear does), or train a copy of the model saved with untied embeddings "
                              "(tie_word_embeddings=False, lm_head.weight a copy of the embedding's)")
    if disable_dropout:  # after the adapter: its dropout too (as TRL's disable_dropout), or the update's
        if lora_r and lora_dropout > 0:  # forward would be noisy against the engine's, which has none
            logger.warning("lora_dropout=%s is switched off with the model's other dropout (disable_dropout: true); "
                           "set disable_dropout: false to keep it", lora_dropout)
        switch_off_dropout(model)
    return model


@contextlib.contextmanager
def _base_folder(path: str, gguf_file: str | None) -> Iterator[str]:
    """What `from_pretrained` reads for the model at `path`: `path` itself, unless it is a folder that holds a
    PEFT adapter (adapter_config.json), whose base is then the model it names (base_model_name_or_path) or,
    when the folder holds a model too (config.json), a temporary folder of links to the folder's files but
    the adapter's (transformers would load and freeze the adapter by itself, unmerged)."""
    folder = Path(path)
    if gguf_file is not None or not (folder / ADAPTER_CONFIG).is_file():
        yield path
    elif not (folder / "config.json").is_file():
        yield resolve_model_path(adapter_base(folder))
    else:
        with tempfile.TemporaryDirectory(prefix="grouprl-base-model-") as links:
            for file in folder.iterdir():
                if not file.name.startswith("adapter_"):  # adapter_config.json, adapter_model.safetensors
                    (Path(links) / file.name).symlink_to(file.resolve())
            yield links


def _target_modules_error(model: torch.nn.Module, targets: str | list[str], linear: list[str],
                          error: ValueError | None = None) -> str:
    """What is wrong with `targets` in `model` (wrapped by PEFT, or not when PEFT refused them with `error`):
    entries that name no module, or modules other than linear layers (PEFT's own message lists a whole
    module); `linear`: the names that can be given."""
    problems = []
    for target in [targets] if isinstance(targets, str) else targets:
        kinds = sorted({type(m).__name__ for path, m in model.named_modules() if named_by(target, path)})
        if not kinds:
            problems.append(f"{target!r} names no module of the model")
        elif not {"Linear", "Conv1D"} & set(kinds):
            problems.append(f"{target!r} names {' and '.join(kinds)}, not a linear layer")
    if problems:
        reason = "; ".join(problems)
    elif error is None:
        reason = f"PEFT put no LoRA layer on {', '.join(map(repr, unmatched_targets(model, targets)))}"
    else:
        reason = f"PEFT cannot add LoRA there ({str(error).strip().splitlines()[0]})"
    return (f"lora_target_modules={targets!r}: {reason}. LoRA adapts linear layers, and this model's are "
            f"{', '.join(linear)}: name some of them (q_proj,v_proj), or use all-linear")


def _gguf_kwargs(gguf_file: str | None) -> dict:
    """`from_pretrained` arguments that read a GGUF file as plain weights. `dequantize=True` unpacks
    every block (transformers may otherwise keep them packed, which cannot be trained) and drops the
    quantization config, without which `save_pretrained` refuses ("quantized with gguf and is not
    serializable"); so checkpoints are ordinary safetensors folders. Transformers releases without
    `GgufConfig` always dequantize."""
    if gguf_file is None:
        return {}
    import transformers

    if not hasattr(transformers, "GgufConfig"):
        return {"gguf_file": gguf_file}
    return {"gguf_file": gguf_file, "quantization_config": transformers.GgufConfig(dequantize=True)}


def switch_off_dropout(model: torch.nn.Module) -> None:
    """Dropout 0 in every module: `nn.Dropout` layers, and the rates transformers' modules keep as
    float attributes named `dropout` or `*_dropout` and pass to `F.dropout` themselves (attention
    modules' `attention_dropout`; OPT's and BART's decoders' `dropout`, `activation_dropout`). The
    saved config is left as it was."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in vars(module).items():
            if isinstance(value, float) and (name == "dropout" or name.endswith("_dropout")):
                setattr(module, name, 0.0)


class Reference:
    """π_ref. With LoRA it is the base model with the adapter disabled (no second copy); otherwise
    a frozen copy of the initial policy, which `reset` replaces by the current policy
    (DeepSeekMath's iterative mode)."""

    def __init__(self, policy: torch.nn.Module):
        self.uses_adapter = is_peft_model(policy)
        self.policy = policy
        self.model = None if self.uses_adapter else self._frozen_copy(policy)

    @staticmethod
    def _frozen_copy(policy: torch.nn.Module) -> torch.nn.Module:
        ref = copy.deepcopy(policy).eval()
        ref.requires_grad_(False)
        return ref

    def reset(self, policy: torch.nn.Module) -> None:
        if self.uses_adapter:
            raise ValueError("the LoRA reference is the adapter-disabled base: it cannot be reset")
        self.model.load_state_dict(policy.state_dict())

    def context(self):
        return adapter_disabled(self.policy)

    @property
    def forward_model(self) -> torch.nn.Module:
        return self.policy if self.uses_adapter else self.model


@contextlib.contextmanager
def activation_checkpointing(model: torch.nn.Module, enabled: bool = True):
    """Transformers' gradient checkpointing (non-reentrant) for the passes inside the block, on
    `model` (under DDP or PEFT wrappers); a model that checkpoints already is left as it is.

    Enabling it also hooks the input embedding to make its output require grad
    (`enable_input_require_grads`, transformers 5), which disabling it leaves in place for a model
    without transformers' own PEFT integration: the hook is removed on leaving the block unless the
    model had one before, or every pass would add one more."""
    base = base_model(getattr(model, "module", model))
    if not enabled or is_checkpointing(base):
        yield
        return
    hooked = hasattr(base, "_require_grads_hook")  # transformers sets it with the hook and deletes it with it
    checkpointing(base, True)
    try:
        yield
    finally:
        checkpointing(base, False)
        if not hooked and hasattr(base, "_require_grads_hook"):
            base.disable_input_require_grads()


def checkpointing(model: torch.nn.Module, on: bool) -> None:
    """transformers' activation checkpointing of `model` (non-reentrant) on or off, by the names
    transformers 5.24 gives it (`activation_checkpointing_*`; the `gradient_checkpointing_*` ones warn
    at every call there, and go in v6), or the old ones before."""
    new = hasattr(model, "activation_checkpointing_enable")
    if on and new:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        (model.activation_checkpointing_disable if new else model.gradient_checkpointing_disable)()


def is_checkpointing(model: torch.nn.Module) -> bool:
    name = ("is_activation_checkpointing" if hasattr(model, "is_activation_checkpointing")
            else "is_gradient_checkpointing")
    return bool(getattr(model, name, False))


def can_share_prompts(model: torch.nn.Module) -> bool:
    """The shared-prompt forward feeds the prompts' KV cache into a second forward pass: not
    possible when gradient checkpointing turns the cache off."""
    return not is_checkpointing(getattr(model, "module", model))


# The [n, T', V] logits are made whole only below this many elements (256 MB in fp32); above it
# the log-probs come from the hidden states through the head in chunks (core/head_logprobs.py),
# which recomputes the head's matmul in the backward: slower on short batches, bounded on long ones.
# On CUDA the limit is 4x lower: there the head's extra matmul is a few milliseconds of a step, and
# whole logits with their softmax temporaries and gradient (~1 GB at 2^26) set a small model's
# peak (issue 34: grouprl's 135M step peaked 0.37 GiB above TRL's on an H200; this change is not
# yet measured on a GPU).
WHOLE_LOGITS_MAX_ELEMENTS = {"cpu": 1 << 26, "cuda": 1 << 24}  # by device type, as head_logprobs' chunks
DEFAULT_WHOLE_LOGITS_MAX_ELEMENTS = 1 << 26
# Models whose logits are exactly lm_head(last hidden state): no soft-capping or scaling after it.
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "smollm3"})


def completion_logprobs(model: torch.nn.Module, mb: MicroBatch, *, temperature: float,
                        autocast_dtype: torch.dtype | None = None, with_entropy: bool = False,
                        entropy_grad: bool = False, max_logits_elements: int | None = None,
                        packed: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs [n, T'] of the completion tokens (and their entropy when asked: with
    `entropy_grad` the entropy carries a gradient too, for an entropy bonus): `completion_forward`
    without a value head."""
    logp, entropy, _ = completion_forward(model, mb, temperature=temperature, autocast_dtype=autocast_dtype,
                                          with_entropy=with_entropy, entropy_grad=entropy_grad,
                                          max_logits_elements=max_logits_elements, packed=packed)
    return logp, entropy


def completion_forward(model: torch.nn.Module, mb: MicroBatch, *, temperature: float,
                       autocast_dtype: torch.dtype | None = None, with_entropy: bool = False,
                       entropy_grad: bool = False, max_logits_elements: int | None = None,
                       packed: bool = False, value_head: torch.nn.Module | None = None,
                       logprobs: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Per-token log-probs [n, T'] of the completion tokens, their entropy when asked (with
    `entropy_grad` carrying a gradient too, for an entropy bonus), and with `value_head` (PPO,
    value.py) the value of the state before each completion token [n, T']: the head on the last
    hidden state at the position that predicts the token. All from the same pass. With
    `logprobs=False` (PPO's V_old pass) only the values are computed: the LM head runs at one
    position, not at every completion token, and the log-probs and entropy are None.

    `packed` (the model `packing.enable`d): the micro-batch's real tokens run as one row, each
    distinct prompt once, attention confined to each sequence (packing.py): no padding is computed.
    Otherwise the rows run padded; when the micro-batch holds fewer distinct prompts than
    completions (u < n), each prompt is run once, with a KV cache, and its completions attend to
    those keys and values in a second pass: the same logits, and gradients that reach the prompt's
    activations summed over its completions, for u*(P'-1) + n*T' tokens instead of n*(P'+T').
    One-token prompts take the single pass.

    Logits of more than `max_logits_elements` (real completion tokens x V; default
    WHOLE_LOGITS_MAX_ELEMENTS of the device type) are never made whole: the model returns its last hidden states and
    `core.head_logprobs` takes them through the LM head in chunks, forward and backward, for models
    whose head is a plain linear layer (`PLAIN_HEAD_MODEL_TYPES`, not sharded by FSDP2). Either
    way only the real completion positions are computed (0 elsewhere)."""
    device = next(model.parameters()).device
    ac = (torch.autocast(device.type, dtype=autocast_dtype)
          if autocast_dtype is not None else contextlib.nullcontext())
    cids, cmask = mb.completion_ids.to(device), mb.completion_mask.to(device)  # [n, T']
    head = _plain_head(model)
    limit = max_logits_elements if max_logits_elements is not None else WHOLE_LOGITS_MAX_ELEMENTS.get(
        device.type, DEFAULT_WHOLE_LOGITS_MAX_ELEMENTS)
    if not logprobs and value_head is None:
        raise ValueError("completion_forward(logprobs=False) computes only values: pass value_head")
    use_head = head is not None and int(cmask.sum()) * head.out_features > limit
    skip_logits = use_head or not logprobs  # the logits of one position only: the hidden states are read
    capture = skip_logits or value_head is not None  # the last hidden states are read
    if packed:
        layout = packing.pack(mb.prompt_ids, mb.prompt_mask, mb.prompt_index, mb.completion_ids,
                              mb.completion_mask, device)
        with ac, _last_hidden_state(model) if capture else contextlib.nullcontext() as captured:
            logits = packing.forward_packed(model, layout, 1 if skip_logits else layout.pred_index)  # [1, M, V]
        hidden = captured["hidden"][0, layout.pred_index] if capture else None  # [M, H]
        if not logprobs:
            return None, None, _values(value_head, hidden, cmask)
        targets = layout.targets  # [M]
    else:
        # a micro-batch planned shared runs joint when the model checkpoints now (a pass over the
        # budget under `auto` turns it on after the plan): the prompt pass's cache would be off, and
        # the completions would attend to no prompt
        shared = (len(mb.prompt_ids) < len(mb.completion_ids) and int(mb.prompt_mask.sum(-1).min()) > 1
                  and can_share_prompts(model))
        forward = _shared_prompt_logits if shared else _joint_logits
        with ac, _last_hidden_state(model) if capture else contextlib.nullcontext() as captured:
            logits = forward(model, mb, device, keep_logits=not skip_logits)  # [n, T', V]
        T = cids.shape[1]
        hidden = (captured["hidden"][:, -T - 1:-1] if not shared else captured["hidden"])[cmask] if capture else None
        if not logprobs:
            return None, None, _values(value_head, hidden, cmask)
        if not use_head:
            if with_entropy:  # one pass over the [n, T', V] logits for both
                logp, entropy = token_logprobs_and_entropy(logits, cids, temperature=temperature,
                                                           entropy_grad=entropy_grad)  # [n, T'] each
            else:
                logp, entropy = token_logprobs(logits, cids, temperature=temperature), None  # [n, T']
            return logp, entropy, _values(value_head, hidden, cmask)
        targets = cids[cmask]  # [M]
    if use_head:
        logp_real, entropy_real = head_logprobs(hidden, head.weight, targets, bias=head.bias,
                                                temperature=temperature, with_entropy=with_entropy,
                                                compute_dtype=autocast_dtype,
                                                entropy_grad=entropy_grad)  # [M] each, M real tokens
    elif with_entropy:
        logp_real, entropy_real = (x[0] for x in token_logprobs_and_entropy(
            logits, targets[None], temperature=temperature, entropy_grad=entropy_grad))  # [M]
    else:
        logp_real, entropy_real = token_logprobs(logits, targets[None], temperature=temperature)[0], None
    zeros = torch.zeros(cids.shape, dtype=logp_real.dtype, device=device)  # [n, T']
    logp = zeros.masked_scatter(cmask, logp_real)
    entropy = None if entropy_real is None else zeros.masked_scatter(cmask, entropy_real)
    return logp, entropy, _values(value_head, hidden, cmask)


def _values(value_head: torch.nn.Module | None, hidden: torch.Tensor | None,
            cmask: torch.Tensor) -> torch.Tensor | None:
    """The value head on the real positions' hidden states [M, H], in fp32 (outside autocast), as [n, T']."""
    if value_head is None:
        return None
    v = value_head(hidden.float()).squeeze(-1)  # [M]
    return torch.zeros(cmask.shape, dtype=v.dtype, device=v.device).masked_scatter(cmask, v)  # [n, T']


def _plain_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The LM head of `model` (under DDP or PEFT wrappers) when the logits are exactly
    head(last hidden state), else None (the logits path is used)."""
    from torch.distributed.fsdp import FSDPModule

    inner = getattr(model, "module", model)  # DDP
    base = base_model(inner)
    if isinstance(inner, FSDPModule) or getattr(base.config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    return head if type(head) is torch.nn.Linear else None  # a LoRA-adapted head takes the logits path


@contextlib.contextmanager
def _last_hidden_state(model: torch.nn.Module):
    """Captures the decoder body's output (the normed last hidden states [n, S, H]) of the next
    forward pass of `model` into the yielded dict under "hidden"."""
    captured: dict[str, torch.Tensor] = {}

    def hook(module, args, output):
        captured["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    body = base_model(getattr(model, "module", model)).get_decoder()
    handle = body.register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


def _joint_logits(model: torch.nn.Module, mb: MicroBatch, device: torch.device,
                  keep_logits: bool = True) -> torch.Tensor:
    """One pass over prompt + completion; logits [n, T', V] of the positions predicting completion
    tokens (`keep_logits=False`: of the last position only, for a caller that reads the hidden states)."""
    T = mb.completion_ids.shape[1]
    attn = mb.attention_mask.to(device)  # [n, P'+T']
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # positions skip left padding
    return model(input_ids=mb.input_ids.to(device), attention_mask=attn, position_ids=pos,
                 use_cache=False, logits_to_keep=T + 1 if keep_logits else 1).logits[:, :-1]  # [n, T', V]


def _shared_prompt_logits(model: torch.nn.Module, mb: MicroBatch, device: torch.device,
                          keep_logits: bool = True) -> torch.Tensor:
    """Prompts but their last token once [u, P'-1], cached; then, over the cache rows repeated by
    `prompt_index` (an indexing op: the backward sums a prompt's gradient over its completions),
    each row's last prompt token and completion [n, T'] (its last token predicts nothing we need).
    Every logit comes from the second pass, so the policy and a frozen reference go through the
    same kernels (a KL of exactly 0 at step 1)."""
    T = mb.completion_ids.shape[1]
    pm, index = mb.prompt_mask.to(device), mb.prompt_index.to(device)  # [u, P'], [n]
    head = pm[:, :-1]  # left padding: column P'-1 is every prompt's last token
    cache = DynamicCache(config=getattr(model, "module", model).config)
    by = cache_kwarg(model)  # `cache` from transformers 5.24, `past_key_values` before
    model(input_ids=mb.prompt_ids[:, :-1].to(device), attention_mask=head,
          position_ids=(head.cumsum(-1) - 1).clamp(min=0), use_cache=True, logits_to_keep=1, **{by: cache})
    cache.batch_select_indices(index)  # [u, ...] -> [n, ...]
    ids = torch.cat([mb.prompt_ids[:, -1:].to(device)[index], mb.completion_ids[:, : T - 1].to(device)], 1)  # [n, T']
    attn = torch.cat([pm[index], mb.completion_mask[:, : T - 1].to(device).long()], 1)  # [n, P'+T'-1]
    pos = (pm.sum(-1) - 1)[index, None] + torch.arange(T, device=device)[None]  # [n, T']
    return model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True,
                 logits_to_keep=0 if keep_logits else 1, **{by: cache}).logits  # [n, T', V]
