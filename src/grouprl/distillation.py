"""On-policy distillation in the trainer: the frozen teacher, and the call of the `advantages` stage
that mixes its per-token signal into the advantages. The math, its sources and why this signal:
core/distillation.py; the config: teacher_model, distill_coef, distill_reward_coef, distill_signal.

- The teacher loads like the policy (policy.load_policy: dropout off, packed passes), then is frozen:
  eval mode, no parameter requires a gradient, outside the optimizer (optim.py takes the policy's
  parameters) and outside the checkpoints (training_state.TrainingParts does not hold it; a resumed
  run loads it again from teacher_model).
- It is held in the compute dtype: bf16 when the run's matmuls are bf16 (a model that is never
  updated needs no fp32 master copy: half the bytes of the reference's copy), fp32 otherwise.
- It runs where the reference model runs: on the policy's device (sharded like the reference under
  FSDP2), through the update's no-grad log-prob passes (update.PolicyUpdate.logprobs: the same
  micro-batches, token budget, packing and autocast).
- The student's log-probs are π_old, the policy before this step's update: one no-grad pass more
  per step (with num_iterations > 1 the update computes them again for its ratio). Under torchrun
  each rank scores its micro-batches' rows and the sums over ranks give every rank the whole batch,
  as the advantages are computed on the global batch.
- Teacher and student must share the tokenizer (the same token -> id map; a teacher whose embedding
  has extra padded rows is fine): checked before any model loads, a mismatch a ConfigError naming both.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from grouprl import distributed as D
from grouprl.config import ConfigError, TrainConfig
from grouprl.core import DISTILL_SIGNALS, distill_advantages, distill_stats
from grouprl.packing import supports_packing
from grouprl.policy import check_model_source, load_policy, load_tokenizer
from grouprl.rollout import Rollout
from grouprl.update import PolicyUpdate


def check_same_tokenizer(teacher: PreTrainedTokenizerBase, student: PreTrainedTokenizerBase,
                         teacher_name: str, student_name: str) -> None:
    """ConfigError unless both tokenizers map every token to the same id."""
    t_vocab, s_vocab = teacher.get_vocab(), student.get_vocab()
    if t_vocab == s_vocab:
        return
    differ = sorted({tok for tok in t_vocab.keys() | s_vocab.keys() if t_vocab.get(tok) != s_vocab.get(tok)})
    tok = differ[0]
    raise ConfigError(
        f"teacher_model={teacher_name!r} does not share the policy's tokenizer: the teacher's "
        f"{type(teacher).__name__} has {len(t_vocab)} tokens, the policy's ({student_name!r}) "
        f"{type(student).__name__} has {len(s_vocab)}, and {len(differ)} token(s) differ (e.g. {tok!r}: id "
        f"{t_vocab.get(tok)} for the teacher, {s_vocab.get(tok)} for the policy). The teacher scores the "
        "policy's token ids, so both need one vocabulary: pick a teacher of the policy's family (the same "
        "tokenizer), or a student built on the teacher's tokenizer")


def load_teacher(cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase, dist: D.DistContext,
                 autocast: torch.dtype | None) -> Teacher | None:
    """The frozen teacher of a run with teacher_model set (None without): its tokenizer checked
    against the policy's `tokenizer` first, then loaded, frozen, cast to `autocast` (the compute
    dtype; None: fp32) and put on the run's device (sharded under FSDP2)."""
    if not cfg.teacher_model:
        return None
    try:
        path, gguf_file = check_model_source(cfg.teacher_model, None, None)
    except ConfigError as e:
        raise ConfigError(f"teacher_model: {e}") from None
    own = load_tokenizer(path, gguf_file, field="teacher_model", fix="save the tokenizer the teacher was trained "
                         "with beside it (tokenizer.save_pretrained(folder)), so that it can be checked against "
                         "the policy's")  # no tokenizer beside its weights: nothing to check the policy's ids against
    check_same_tokenizer(own, tokenizer, cfg.teacher_model, cfg.tokenizer or cfg.model)
    model = load_policy(path, gguf_file=gguf_file, dtype=autocast or torch.float32).eval()  # never whole in fp32
    model.requires_grad_(False)
    rows = getattr(model.get_output_embeddings(), "out_features", None)  # the ids the teacher scores
    if rows is not None and rows < len(tokenizer):
        raise ConfigError(f"teacher_model={cfg.teacher_model!r} scores {rows} token ids and the policy's tokenizer "
                          f"has {len(tokenizer)}: use a teacher whose head covers the whole vocabulary")
    model.to(dtype=autocast or torch.float32)  # a no-op unless the loader kept another dtype (a GGUF file may)
    if dist.enabled and cfg.distributed_strategy == "fsdp2":
        D.shard_model(model)  # fully_shard moves each shard to the rank's device, never the whole teacher
    elif dist.device.type == "cuda":
        model.to(dist.device)
    return Teacher(model, dist)


class Teacher:
    """π_T: a frozen model that scores the policy's completions (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, dist: D.DistContext):
        self.model, self.dist = model, dist

    def logprobs(self, rollout: Rollout, updater: PolicyUpdate, cfg: TrainConfig) -> torch.Tensor:
        """The teacher's log-probs [N, T] of the completion tokens, the whole batch on every rank."""
        if updater.planner.packed and not supports_packing(self.model):
            raise ConfigError(f"teacher_model={cfg.teacher_model!r}: its attention "
                              f"({getattr(self.model.config, '_attn_implementation', None)}) cannot run the packed "
                              "passes the policy runs: set padding_free: false")
        return D.all_reduce_tensor(self.dist, updater.logprobs(self.model, rollout, cfg))  # [N, T]

    def mix(self, advantages: torch.Tensor, rollout: Rollout, updater: PolicyUpdate, cfg: TrainConfig,
            metrics: dict[str, float] | None = None) -> torch.Tensor:
        """`advantages  # [N] or [N, T]` of the verifier rewards with the teacher's signal mixed in:
        distill_reward_coef x advantages + distill_coef x signal on the policy's own tokens  # [N, T].
        The batch's `distill/` means (reverse_kl, teacher_logp, student_logp) go into `metrics`."""
        student = D.all_reduce_tensor(self.dist, updater.logprobs(updater.model, rollout, cfg))  # [N, T] π_old
        teacher = self.logprobs(rollout, updater, cfg)  # [N, T]
        mask = rollout.action_mask  # [N, T]: not the context a multi-turn rollout inserted
        signal = DISTILL_SIGNALS.get(cfg.distill_signal, "distill_signal")(teacher, student, mask)  # [N, T]
        if metrics is not None:
            metrics.update({f"distill/{k}": v for k, v in distill_stats(teacher, student, mask).items()})
        return distill_advantages(advantages, signal, mask, coef=cfg.distill_coef,
                                  reward_coef=cfg.distill_reward_coef)  # [N, T]
