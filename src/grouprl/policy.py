"""The policy and reference models: loading, LoRA, and the log-prob forward pass.

The forward pass computes logits only for the positions that predict completion tokens
(`logits_to_keep`), trims each micro-batch to its own longest prompt and completion, and turns
logits into per-token log-probs with `core.token_logprobs`, which never materialises a full
log-softmax copy of the logits.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grouprl.core import token_entropy, token_logprobs
from grouprl.rollout import Rollout


def resolve_model_path(name: str) -> str:
    if name.startswith("builtin:"):
        from grouprl.tasks import DEFAULT_POLICY_DIR

        if name != "builtin:default_policy":
            raise ValueError(f"model={name!r} is unknown: the built-in model is builtin:default_policy")
        return str(DEFAULT_POLICY_DIR)
    return str(Path(name).expanduser()) if Path(name).expanduser().exists() else name


def load_tokenizer(name: str):
    tok = AutoTokenizer.from_pretrained(resolve_model_path(name))
    if tok.pad_token_id is None:  # e.g. GPT-2, Llama: pad with EOS (padding is always masked out)
        if tok.eos_token is None:
            raise ValueError(f"tokenizer {name!r} has neither a pad nor an EOS token: add one")
        tok.pad_token = tok.eos_token
    return tok


def load_policy(name: str, *, lora_r: int = 0, lora_alpha: float = 16.0, lora_dropout: float = 0.0,
                lora_target_modules: str | list[str] = "all-linear",
                gradient_checkpointing: bool = False) -> torch.nn.Module:
    """Load a causal LM in fp32 (bf16 runs under autocast) and wrap it with LoRA when asked."""
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(name), dtype=torch.float32)
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(
            r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
            target_modules=lora_target_modules, task_type="CAUSAL_LM"))
    return model


class Reference:
    """π_ref. With LoRA it is the base model with the adapter disabled (no second copy); otherwise
    a frozen copy of the initial policy, which `reset` replaces by the current policy
    (DeepSeekMath's iterative mode)."""

    def __init__(self, policy: torch.nn.Module):
        self.uses_adapter = hasattr(policy, "disable_adapter")
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
        return self.policy.disable_adapter() if self.uses_adapter else contextlib.nullcontext()

    @property
    def forward_model(self) -> torch.nn.Module:
        return self.policy if self.uses_adapter else self.model


@dataclass
class MicroBatch:
    """A slice of a rollout, trimmed to its own longest prompt and completion."""

    input_ids: torch.Tensor       # [n, P' + T']
    attention_mask: torch.Tensor  # [n, P' + T']
    completion_ids: torch.Tensor  # [n, T']
    completion_mask: torch.Tensor  # [n, T'] bool
    rows: torch.Tensor            # [n] rows of the rollout

    @staticmethod
    def from_rollout(rollout: Rollout, rows: torch.Tensor) -> MicroBatch:
        pm, cm = rollout.prompt_mask[rows], rollout.completion_mask[rows]  # [n, P], [n, T]
        first = int((pm.sum(0) > 0).nonzero()[0]) if pm.any() else 0  # drop all-padding columns
        T = max(1, int(cm.sum(-1).max()))
        cids = rollout.completion_ids[rows, :T]
        cm = cm[:, :T]
        ids = torch.cat([rollout.prompt_ids[rows, first:], cids], dim=1)
        attn = torch.cat([pm[:, first:], cm.long()], dim=1)
        return MicroBatch(ids, attn, cids, cm, rows)


def completion_logprobs(model: torch.nn.Module, mb: MicroBatch, *, temperature: float,
                        autocast_dtype: torch.dtype | None = None,
                        with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs [n, T'] of the completion tokens (and their entropy when asked)."""
    device = next(model.parameters()).device
    T = mb.completion_ids.shape[1]
    attn = mb.attention_mask.to(device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # [n, P'+T'] positions skip left padding
    ac = (torch.autocast(device.type, dtype=autocast_dtype)
          if autocast_dtype is not None else contextlib.nullcontext())
    with ac:
        logits = model(input_ids=mb.input_ids.to(device), attention_mask=attn, position_ids=pos,
                       use_cache=False, logits_to_keep=T + 1).logits[:, :-1]  # [n, T', V]
    logp = token_logprobs(logits, mb.completion_ids.to(device), temperature=temperature)  # [n, T']
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = token_entropy(logits.detach(), temperature=temperature)  # [n, T']
    return logp, entropy
