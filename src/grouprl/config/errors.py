"""ConfigError, and the hints that name the field a misspelt name was meant to be, or what a name or
value of TRL's GRPOConfig is here (the README's "Coming from TRL" table, said where the name is met)."""

from __future__ import annotations

import difflib


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and the fix."""


def did_you_mean(name: str, known: set[str]) -> str:
    """` (did you mean 'x'?)` for the known name closest to a misspelt one, else ''."""
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


_BATCH = ("a step is prompts_per_step (B) whole groups of num_generations (G); micro_batch_size or "
          "max_tokens_per_micro_batch cut its update into passes without changing the gradient")
_STEPS = "runs are counted in steps: max_steps, eval_steps, save_steps (the prompt sampler wraps epochs by itself)"
_ABSENT = "not present: grouprl has its own chunked LM head and packed passes, and FSDP2 rather than DeepSpeed"
_HUB = "a data set on the hub is train_data (or eval_data): hf:NAME[:CONFIG][@SPLIT]"

# TRL's GRPOConfig / TrainingArguments names that are not fields here, and what to use instead: a
# close spelling would point elsewhere (num_train_epochs -> num_iterations, PPO's epochs per batch)
TRL_NAMES = {
    **dict.fromkeys(("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                     "steps_per_generation"), _BATCH),
    **dict.fromkeys(("num_train_epochs", "eval_strategy", "save_strategy", "logging_strategy"), _STEPS),
    **dict.fromkeys(("use_liger_kernel", "use_liger_loss", "use_transformers_paged", "cast_lm_head_to_fp32",
                     "ds3_gather_for_generation"), _ABSENT),
    **dict.fromkeys(("dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split"), _HUB),
    **dict.fromkeys(("sync_ref_model", "ref_model_sync_steps", "ref_model_mixup_alpha"),
                    "ref_update_steps: the reference replaced by the policy every this many steps (no mixing)"),
    "log_completions": "log_completions_steps: a table of completions every this many steps",
    "num_completions_to_print": "num_logged_samples: the completions in each logged table",
    "resume_from_checkpoint": "grouprl train CONFIG --resume (or --resume auto); in Python, train(resume=True)",
    "fp16": "no fp16: bf16: auto (bf16 autocast where the device has it natively, else fp32)",
    "vllm_server_timeout": "vllm_server_timeout_s",
    "cache_implementation": "generation_compile (the built-in engine's static-cache decode step)",
    "shuffle_dataset": "prompts are always shuffled, seeded, per epoch",
    "model_name_or_path": "model",
    "use_peft": "LoRA is on when lora_r > 0 (with lora_alpha, lora_dropout, lora_target_modules)",
    "warmup_ratio": "warmup_steps (a count of steps)",
    "lora_modules_to_save": "no modules trained whole beside the adapter: with LoRA only the adapter trains; to "
                            "train the embedding or the LM head too, train every weight (lora_r: 0)",
    "use_dora": "no DoRA: plain LoRA (lora_r, lora_alpha), whose merged weights W + s·BA the checkpoint's model/ "
                "and vLLM get",
    "use_rslora": "no rsLoRA: the update is scaled by lora_alpha / lora_r; for rsLoRA's alpha / sqrt(r), set "
                  "lora_alpha to alpha·sqrt(lora_r) (alpha 16 at rank 64: lora_alpha 128)",
    "lora_target_parameters": "no LoRA on parameters that are not linear layers: lora_target_modules names the "
                              "linear layers to adapt",
    "lora_task_type": "not needed: the adapter is always a causal LM's",
}

# values of TRL's that name something else here: (field, value as text) -> what to write
TRL_VALUES = {
    **{("loss_type", v): f"TRL's loss_type {v} is algorithm: {v} here (loss_type is the per-token term)"
       for v in ("grpo", "dr_grpo", "dapo", "bnpo")},
    ("scale_rewards", "false"): "TRL's scale_rewards false is scale_rewards: none here",
    ("scale_rewards", "true"): "TRL's scale_rewards true is scale_rewards: group here",
}


def unknown_field_hint(name: str, known: set[str]) -> str:
    """`: TRL's name; here, what to use` for a name of TRL's, else `did_you_mean`."""
    if name in TRL_NAMES:
        return f": TRL's name; here, {TRL_NAMES[name]}"
    return did_you_mean(name, known)
