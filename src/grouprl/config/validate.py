"""A TrainConfig's values, checked before any model loads: each field's type (`check_fields`, before
any value is read), the preset filled in (`resolve_preset`), then every field and the combinations
that make no sense (`validate_config`), each failure a ConfigError that names the field and the fix.
TrainConfig.resolved() and .validate() call these.

Paths are not probed here: the loaders do it (policy.check_model_source, data.check_data_source).
The names a field may take come from where they are defined: core's registries (so a registered
variant is accepted), core's SCALES and presets, the tool-call FORMATS of grouprl.tools; the loss
settings are checked by core's check_loss_settings, which LossParams runs too.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from typing import Any, TypeVar

from grouprl.core import (ADVANTAGE_ESTIMATORS, DISTILL_SIGNALS, IS_MODES, KL_ESTIMATORS, LOSS_AGGREGATIONS, LOSS_TYPES,
                          MULTI_OBJECTIVE_AGGREGATIONS, PRESETS, RATIO_LEVELS, Registry)
from grouprl.core.advantages import SCALES
from grouprl.core.loss_params import check_loss_settings
from grouprl.tools import FORMATS

from .errors import TRL_VALUES, ConfigError
from .fieldtypes import check_type, field_types, value_matches
from .schema import TrainFields

logger = logging.getLogger(__name__)

C = TypeVar("C", bound=TrainFields)

PRESET_FIELDS = {"estimator": "advantage_estimator", "scale": "scale_rewards", "agg": "loss_agg",
                 "eps_low": "epsilon", "eps_high": "epsilon_high", "beta": "beta",
                 "ratio_level": "importance_sampling_level", "dynamic_sampling": "dynamic_sampling",
                 "overlong_shaping": "overlong_shaping", "loss_type": "loss_type",
                 "multi_objective": "multi_objective_aggregation", "entropy_quantile": "top_entropy_quantile",
                 "off_policy_threshold": "off_policy_mask_threshold", "distill_coef": "distill_coef",
                 "distill_reward_coef": "distill_reward_coef", "value_head": "value_head"}
"""The field each key of a preset (grouprl.core.PRESETS, core's parameter names) fills."""


def check_fields(cfg: TrainFields) -> None:
    """Each field's type, and every float in it finite (NaN passes every `x < 0` check and infinity
    every `x > 0` one, to fail mid-run or silently): before any value is read."""
    types = field_types()
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if (trl := TRL_VALUES.get((f.name, str(value).lower()))) and not value_matches(value, types[f.name]):
            raise ConfigError(f"{f.name}={value!r} has the wrong type: {trl}")  # TRL's `scale_rewards: false`
        check_type(f.name, value, types[f.name])
        many = isinstance(value, (list, dict))
        numbers = value if isinstance(value, list) else list(value.values()) if isinstance(value, dict) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
            null = "; null gives its default" if value_matches(None, types[f.name]) else ""
            raise ConfigError(f"{f.name}={value!r} must {'hold finite numbers' if many else 'be a finite number'}: "
                              f"NaN and infinity are not settings{null}")


def preset_values(algorithm: str) -> dict:
    """{config field: value} of a known preset."""
    return {PRESET_FIELDS[k]: v for k, v in PRESETS[algorithm].items()}


def resolve_preset(cfg: C) -> C:
    """A copy with the preset's values filled into every algorithm field left at None; the fields'
    types are checked first (`check_fields`)."""
    check_fields(cfg)
    if cfg.algorithm not in PRESETS:
        raise ConfigError(
            f"algorithm={cfg.algorithm!r} is unknown: choose one of {', '.join(sorted(PRESETS))}"
        )
    preset = preset_values(cfg.algorithm)
    values = {k: v for k, v in preset.items() if getattr(cfg, k) is None}
    if cfg.epsilon_high is None and own_epsilon(cfg):
        values["epsilon_high"] = cfg.epsilon  # a symmetric preset's range stays symmetric (TRL: epsilon_high = epsilon)
    out = dataclasses.replace(cfg, **values)
    if out.overlong_cache_len is None:
        out.overlong_cache_len = max(1, out.max_completion_length // 5)  # DAPO: 4,096 of 20,480
    return out


def derived_overlong(cfg: TrainFields) -> bool:
    """Whether a resolved config's overlong_cache_len is the one derived from its max_completion_length
    (`resolve_preset`; a quarter before 2026-11-26), not a value of its own: a new length or preset over
    it (a run's config.yaml) derives it again."""
    m = cfg.max_completion_length
    return cfg.overlong_cache_len is not None and cfg.overlong_cache_len in (m // 4, max(1, m // 5))


TOKEN_RATIO = "the ratio of each token (1 - epsilon to 1 + epsilon_high)"
EPSILON_EXAMPLES = {TOKEN_RATIO: "0.2 / 0.2 (grpo) or 0.2 / 0.28 (dapo)",
                    "the length-normalised ratio of each completion (GSPO)": "3e-4 / 4e-4 (gspo)",
                    "the log-ratio of each token (a band in log space)": "0.4 / 0.4 (gmpo)"}


def epsilon_meaning(loss_type: str, ratio_level: str) -> str | None:
    """What epsilon / epsilon_high bound under a loss type and ratio level (None: nothing). The clip's
    band and cispo's bounds on the importance weight are the same band on the same token ratio."""
    if loss_type == "sapo":
        return None  # the gate reads no epsilon
    if loss_type == "gmpo":
        return "the log-ratio of each token (a band in log space)"
    return TOKEN_RATIO if ratio_level == "token" else "the length-normalised ratio of each completion (GSPO)"


def own_epsilon(cfg: TrainFields) -> bool:
    """Whether the config as written sets its clip range itself: both bounds, or `epsilon` where the
    preset's range is symmetric (epsilon_high then follows it, `resolve_preset`)."""
    if cfg.epsilon is None:
        return False
    preset = PRESETS.get(cfg.algorithm)
    return cfg.epsilon_high is not None or preset is not None and preset["eps_low"] == preset["eps_high"]


def preset_epsilon(cfg: TrainFields) -> str:
    """", from the PRESET preset" when the config left epsilon / epsilon_high for its preset to fill
    (for an error about them: the user did not write them); ", epsilon_high from ..." when only that."""
    if own_epsilon(cfg):
        return ""
    return f", {'epsilon_high ' if cfg.epsilon is not None else ''}from the {cfg.algorithm} preset"


def _check_preset_epsilon(given: TrainFields, c: TrainFields) -> None:
    """The preset's clip range means what it means under the preset's own loss type and ratio level:
    taken over by a config that changes either (gspo's 3e-4 on token ratios clips half the tokens;
    gmpo's log-space 0.4 as a ratio band), it is a ConfigError that asks for a range of its own.
    `given`: the config as written (None: left to the preset); `c`: resolved."""
    if own_epsilon(given):
        return
    preset = preset_values(c.algorithm)
    was = epsilon_meaning(preset["loss_type"], preset["importance_sampling_level"])
    now = epsilon_meaning(c.loss_type, c.importance_sampling_level)
    if now is None or now == was:
        return
    changed = [f"{k}={getattr(c, k)}" for k in ("loss_type", "importance_sampling_level") if getattr(c, k) != preset[k]]
    raise ConfigError(f"epsilon={c.epsilon}, epsilon_high={c.epsilon_high} come from the {c.algorithm} preset, "
                      f"where they bound {was or 'nothing (its gate reads no epsilon)'}; with {', '.join(changed)} "
                      f"they would bound {now}: set epsilon and epsilon_high for that, e.g. "
                      f"{EPSILON_EXAMPLES[now]}")


def with_algorithm(cfg: C, algorithm: str, keep=()) -> C:
    """`cfg` (read from a file) switched to `algorithm`. When the file is a resolved config (a run's
    config.yaml: every algorithm field set), each field that holds the old preset's value, and is not
    in `keep` (given on the command line), is cleared for the new preset to fill; without this,
    `algorithm` would change only its name. A file of one's own (some fields unset) keeps what it
    sets: those are choices, and the new preset fills the rest. Returns the copy and, for the log,
    "field old -> new" for each cleared field whose value the new preset changes."""
    old = PRESETS.get(cfg.algorithm)
    resolved = old is not None and all(getattr(cfg, field) is not None for key, field in PRESET_FIELDS.items()
                                       if old[key] is not None)
    if old is None or algorithm == cfg.algorithm or not resolved:  # a file of one's own: its values are its choices
        return dataclasses.replace(cfg, algorithm=algorithm), []
    cleared = [field for key, field in PRESET_FIELDS.items()
               if field not in keep and getattr(cfg, field) is not None and getattr(cfg, field) == old[key]]
    pair = {"epsilon", "epsilon_high"}
    if len(pair & set(cleared)) == 1 and not pair & set(keep):  # one bound the file's, one the new preset's
        kept = (pair - set(cleared)).pop()
        raise ConfigError(f"--algorithm {algorithm} over a resolved config of {cfg.algorithm}: {kept}="
                          f"{getattr(cfg, kept)} differs from {cfg.algorithm}'s and would be kept beside {algorithm}'s "
                          f"other bound; give both epsilon and epsilon_high on the command line")
    if "overlong_cache_len" not in keep and derived_overlong(cfg):
        cleared.append("overlong_cache_len")
    out = dataclasses.replace(cfg, algorithm=algorithm, **{f: None for f in cleared})
    if algorithm not in PRESETS:
        return out, []  # resolve_preset names the unknown algorithm
    new = resolve_preset(out)
    return out, [f"{f} {getattr(cfg, f)} -> {getattr(new, f)}" for f in cleared if getattr(cfg, f) != getattr(new, f)]


MIN_TEMPERATURE = 1e-6  # logits of 1e3 over it stay far inside float32; at 1e-40 every draw was the last token


def validate_config(cfg: C) -> C:
    """Check every field; raise ConfigError naming the field and the fix. Returns the resolved copy."""
    c = resolve_preset(cfg)
    if isinstance(c.bf16, str) and c.bf16 != "auto":
        raise ConfigError(f"bf16={c.bf16!r} is not one of: auto, true, false")
    if isinstance(c.gradient_checkpointing, str) and c.gradient_checkpointing != "auto":
        raise ConfigError(f"gradient_checkpointing={c.gradient_checkpointing!r} is not one of: auto, true, false")
    targets = [c.lora_target_modules] if isinstance(c.lora_target_modules, str) else c.lora_target_modules
    if any(isinstance(t, str) and t.strip().lower().replace("_", "-") == "all-linear" for t in targets):
        if len(targets) > 1:
            raise ConfigError(f"lora_target_modules={c.lora_target_modules!r}: all-linear takes every linear "
                              "module but the LM head; give it alone, or name the modules without it")
        c.lora_target_modules = "all-linear"  # PEFT knows this spelling only
    if isinstance(c.lora_target_modules, str) and c.lora_target_modules != "all-linear":
        # one name, or names with commas (as a list field takes them on the command line); PEFT would read a
        # string as a pattern for the whole module path, which "q_proj" never matches, after the model loaded
        c.lora_target_modules = [m.strip() for m in c.lora_target_modules.split(",") if m.strip()]
    if c.lora_r:  # PEFT's own errors came after the model loaded, naming no field
        if not 0 <= c.lora_dropout < 1:
            raise ConfigError(f"lora_dropout={c.lora_dropout} must be in [0, 1)")
        if not c.lora_alpha > 0:
            raise ConfigError(f"lora_alpha={c.lora_alpha} must be positive (the update is scaled by lora_alpha / "
                              "lora_r)")
        if not c.lora_target_modules:
            raise ConfigError("lora_target_modules is empty: name the modules (q_proj,v_proj) or all-linear")
    elif given := _changed(c, ("lora_alpha", "lora_dropout", "lora_target_modules")):
        values = ", ".join(f"{name}={getattr(c, name)!r}" for name in given)
        _warn_once(f"{values} {'has' if len(given) == 1 else 'have'} no effect with lora_r=0, which trains every "
                   "weight: set lora_r (the adapter's rank, e.g. 16) to train a LoRA adapter")
    if not c.model:
        raise ConfigError("model is empty: pass a model folder, e.g. --model path/to/model "
                          "(or builtin:default_policy)")
    if not c.train_data:
        raise ConfigError("train_data is empty: pass a .jsonl/.csv/.parquet file with a "
                          "`prompt` column, e.g. --train_data prompts.jsonl")
    if c.num_generations < 2:
        raise ConfigError(f"num_generations={c.num_generations}: the trainer samples each prompt's completions as "
                          "a group, of at least 2 (GRPO's baseline is the group's mean; PPO and distillation "
                          "sample groups too, docs/algorithms.md §1.8): use 2 or more")
    for name in ("prompts_per_step", "max_completion_length", "max_steps",
                 "num_iterations", "logging_steps", "max_sampling_rounds"):
        if getattr(c, name) < 1:
            raise ConfigError(f"{name}={getattr(c, name)} must be at least 1")
    for name in ("eval_steps", "save_steps", "warmup_steps", "lora_r", "ref_update_steps",
                 "share_prompt_min_tokens", "top_k", "num_logged_samples"):
        if getattr(c, name) < 0:
            raise ConfigError(f"{name}={getattr(c, name)} must be 0 or more")
    for name, null in (("save_total_limit", "keeps every checkpoint"), ("max_prompt_length", "keeps prompts whole"),
                       ("max_eval_samples", "evaluates on every eval prompt"),
                       ("num_threads", "leaves the thread count to torch")):
        if getattr(c, name) is not None and getattr(c, name) < 1:
            raise ConfigError(f"{name}={getattr(c, name)} must be at least 1; null {null}")
    if not str(c.output_dir).strip():  # an unset shell variable: the run would write into the current folder
        raise ConfigError("output_dir is empty: name the folder the run writes to (e.g. runs/my-run)")
    if not 0 <= c.seed < 2**32:
        raise ConfigError(f"seed={c.seed} must be in 0..{2**32 - 1} (numpy's seed range)")
    if not c.advantage_eps >= 0:
        raise ConfigError(f"advantage_eps={c.advantage_eps} must be 0 or more: it is added to the std before "
                          "dividing, and a negative one can make the divisor 0 (1e-4 is usual)")
    if c.reward_timeout_s is not None and not c.reward_timeout_s > 0:
        raise ConfigError(f"reward_timeout_s={c.reward_timeout_s} must be a positive number of seconds, or null "
                          "for no timeout")
    if isinstance(c.reward_workers, bool) or not isinstance(c.reward_workers, int) or c.reward_workers < 0:
        raise ConfigError(f"reward_workers={c.reward_workers!r} must be a whole number of processes: 0 scores in "
                          "the trainer's process, N > 0 in N worker processes (about one per free core)")
    if isinstance(c.max_tokens_per_micro_batch, str) and c.max_tokens_per_micro_batch != "auto":
        raise ConfigError(f"max_tokens_per_micro_batch={c.max_tokens_per_micro_batch!r} is not a number of "
                          "tokens, auto (sized per device) or null (micro_batch_size rows per pass)")
    if isinstance(c.max_tokens_per_micro_batch, int) and c.max_tokens_per_micro_batch < 1:
        raise ConfigError(f"max_tokens_per_micro_batch={c.max_tokens_per_micro_batch} must be at least 1 "
                          "(tokens of prompt and completion per pass), or null for micro_batch_size rows")
    n = c.prompts_per_step * c.num_generations
    if isinstance(c.generation_compile, str) and c.generation_compile != "auto":
        raise ConfigError(f"generation_compile={c.generation_compile!r} is not one of: auto, true, false")
    if c.generation_batch_size is not None and c.generation_batch_size < c.num_generations:
        raise ConfigError(f"generation_batch_size={c.generation_batch_size} is under num_generations="
                          f"{c.num_generations}: a prompt's group is decoded together (its prompt prefilled "
                          f"once), so at least {c.num_generations} rows are; set it to {c.num_generations} or "
                          "more (a multiple decodes whole groups), or null for all at once")
    if isinstance(c.micro_batch_size, str):
        if c.micro_batch_size != "auto":
            raise ConfigError(f"micro_batch_size={c.micro_batch_size!r} is not a number of completions per pass "
                              "or auto (sized per device)")
    elif c.micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size={c.micro_batch_size} must be at least 1, or auto")
    elif c.micro_batch_size > n:  # a pass never holds more than the step: the whole step (the embedded
        c.micro_batch_size = n  # task's 128 with --num_generations 3 --prompts_per_step 5 is 15)
    if isinstance(c.micro_batch_size, int) and n % c.micro_batch_size:
        raise ConfigError(f"micro_batch_size={c.micro_batch_size} does not divide the {n} "
                          "completions of a step (prompts_per_step * num_generations = "
                          f"{c.prompts_per_step} * {c.num_generations}); pick a divisor of {n}")
    if not c.reward_funcs:
        raise ConfigError("reward_funcs is empty: name at least one reward function, e.g. "
                          "--reward_funcs '[math_accuracy]' or a `module:function` path")
    for field in ("reward_funcs", "audit_funcs"):
        for i, spec in enumerate(getattr(c, field)):
            if not _names_something(spec):
                raise ConfigError(f"{field}[{i}]={spec!r}: name a reward function as `math_accuracy`, "
                                  "`package.module:function`, or a mapping {name: regex_match, pattern: '...'}")
    if c.reward_weights is not None and len(c.reward_weights) != len(c.reward_funcs):
        raise ConfigError(f"reward_weights has {len(c.reward_weights)} values but reward_funcs "
                          f"has {len(c.reward_funcs)}: give one weight per function")
    _check_choice("advantage_estimator", c.advantage_estimator, ADVANTAGE_ESTIMATORS)
    if not c.step_delimiter:
        raise ConfigError("step_delimiter is empty: step rewards by index need a delimiter, e.g. '\\n'")
    if c.advantage_estimator == "process" and (c.tools or c.environment):
        raise ConfigError("advantage_estimator=process with tools or an environment: step rewards are "
                          "offsets into one completion's text, which a multi-turn trajectory is not; "
                          "use an outcome estimator (grpo) for multi-turn runs")
    _check_choice("scale_rewards", c.scale_rewards, SCALES)
    _check_variants(c)
    _check_choice("loss_agg", c.loss_agg, LOSS_AGGREGATIONS)
    _check_choice("kl_estimator", c.kl_estimator, KL_ESTIMATORS)
    if c.kl_estimator == "k1" and c.beta > 0:  # E_pi[beta * grad log pi] = 0
        raise ConfigError(f"kl_estimator=k1 with beta={c.beta}: added to the loss, k1 = logp - ref_logp has a "
                          "gradient of zero in expectation on the policy's own samples, so it would add noise "
                          "and hold nothing near the reference; use k3 (the forward KL's gradient, as DeepSeekMath "
                          "and TRL) or k2 (the reverse KL's)")
    _check_choice("importance_sampling_level", c.importance_sampling_level, RATIO_LEVELS)
    _check_choice("lr_scheduler_type", c.lr_scheduler_type, ("constant", "linear", "cosine"))
    _check_choice("vllm_importance_sampling_mode", c.vllm_importance_sampling_mode, IS_MODES)
    if not c.vllm_importance_sampling_cap >= 1:
        raise ConfigError(f"vllm_importance_sampling_cap={c.vllm_importance_sampling_cap} must be at "
                          "least 1, so that a token with no mismatch keeps weight 1 (TRL uses 3, TIS 2)")
    if not 0 <= c.vllm_importance_sampling_min <= 1:
        raise ConfigError(f"vllm_importance_sampling_min={c.vllm_importance_sampling_min} must be in "
                          "[0, 1] (0: mask only ratios above vllm_importance_sampling_cap)")
    if c.vllm_importance_sampling_min > 0 and c.vllm_importance_sampling_mode.endswith("_truncate"):
        raise ConfigError(f"vllm_importance_sampling_min={c.vllm_importance_sampling_min} has no effect "
                          f"with vllm_importance_sampling_mode={c.vllm_importance_sampling_mode}, which "
                          "only truncates from above: use token_mask or sequence_mask, or set it to 0")
    # 1 - epsilon is a ratio bound, except for gmpo, whose bounds are in log space (e^-epsilon > 0)
    max_epsilon_ok = c.epsilon < 1 or (c.epsilon == 1 and c.loss_type == "cispo") or c.loss_type == "gmpo"
    if c.epsilon <= 0 or c.epsilon_high <= 0 or not max_epsilon_ok:
        raise ConfigError(f"epsilon={c.epsilon}, epsilon_high={c.epsilon_high}{preset_epsilon(cfg)}: clip ranges must "
                          "be positive and epsilon below 1 (at most 1 with loss_type cispo: no lower bound; "
                          "any size with loss_type gmpo, whose bounds are in log space)")
    try:
        check_loss_settings(
            epsilon=c.epsilon, epsilon_high=c.epsilon_high, beta=c.beta, dual_clip=c.dual_clip, delta=c.delta,
            loss_type=c.loss_type, importance_sampling_level=c.importance_sampling_level,
            sapo_temperature_pos=c.sapo_temperature_pos, sapo_temperature_neg=c.sapo_temperature_neg,
            entropy_coef=c.entropy_coef)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_preset_epsilon(cfg, c)
    if c.dual_clip is not None and c.dual_clip <= 1 + c.epsilon_high:
        raise ConfigError(f"dual_clip={c.dual_clip} must be above 1 + epsilon_high = {1 + c.epsilon_high:g}: the "
                          "cap -dual_clip*A would otherwise stop the gradient of negative-advantage tokens still "
                          "inside the clip range (3 is usual)")
    if c.delta is not None and c.delta <= 1 + c.epsilon_high:
        raise ConfigError(f"delta={c.delta} must be above 1 + epsilon_high = {1 + c.epsilon_high:g}: the cap "
                          "min(ratio, delta) would otherwise stop the gradient of positive-advantage tokens "
                          "still inside the clip range (INTELLECT-2 uses delta 4)")
    if not (MIN_TEMPERATURE <= c.temperature):  # below it, logits / temperature overflow float32 into NaN draws
        raise ConfigError(f"temperature={c.temperature} must be at least {MIN_TEMPERATURE:g}: GRPO learns from the "
                          "differences between a prompt's G samples, and at temperature 0 they are all the same "
                          "(1.0 is usual; greedy decoding is for evaluation: eval_metrics [greedy])")
    if not (0 < c.top_p <= 1):
        raise ConfigError(f"top_p={c.top_p} must be in (0, 1]")
    if not (0 <= c.eval_fraction < 1):
        raise ConfigError(f"eval_fraction={c.eval_fraction} must be in [0, 1)")
    if c.learning_rate <= 0:
        raise ConfigError(f"learning_rate={c.learning_rate} must be a positive number")
    if c.max_grad_norm is not None and not c.max_grad_norm >= 0:  # torch would flip every gradient
        raise ConfigError(f"max_grad_norm={c.max_grad_norm} must be positive, or null (or 0) for no "
                          "clipping; a negative norm would reverse the gradient")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(c, name) < 1:
            raise ConfigError(f"{name}={getattr(c, name)} must be in [0, 1) (AdamW's decay rates: 0.9, 0.99)")
    if not c.weight_decay >= 0:
        raise ConfigError(f"weight_decay={c.weight_decay} must be 0 or more (0 turns it off)")
    if c.ref_update_steps and c.lora_r:
        raise ConfigError("ref_update_steps with LoRA is not supported: with LoRA the reference "
                          "is the base model with the adapter disabled; set ref_update_steps: 0")
    _check_choice("distributed_strategy", c.distributed_strategy, ("ddp", "fsdp2"))
    if not 0 < c.ddp_timeout < float("inf"):
        raise ConfigError(f"ddp_timeout={c.ddp_timeout} must be a positive number of seconds (default 1800)")
    if c.num_generations_eval < 1:
        raise ConfigError(f"num_generations_eval={c.num_generations_eval} must be at least 1")
    for name in c.eval_metrics:
        kind, k = parse_eval_metric(name)
        if kind != "greedy" and k > c.num_generations_eval:
            raise ConfigError(f"eval_metrics: {name} needs at least {k} samples per prompt, and "
                              f"num_generations_eval={c.num_generations_eval}: raise it to {k} or more")
    if not c.eval_metrics:
        raise ConfigError("eval_metrics is empty: name at least one, e.g. [greedy] or [greedy, pass@8]")
    if c.eval_temperature is not None and not c.eval_temperature >= MIN_TEMPERATURE:
        raise ConfigError(f"eval_temperature={c.eval_temperature} must be at least {MIN_TEMPERATURE:g} (greedy is "
                          "the `greedy` metric)")
    if c.load_best_model_at_end and not c.metric_for_best_model:
        raise ConfigError("load_best_model_at_end needs metric_for_best_model, e.g. accuracy or pass@8")
    if c.metric_for_best_model:
        _check_best_metric(c.metric_for_best_model, c.eval_metrics)
    for name in c.report_to:
        _check_choice("report_to", name, ("tensorboard", "trackio", "wandb", "mlflow", "none"))
    if c.log_completions_steps < 0:
        raise ConfigError(f"log_completions_steps={c.log_completions_steps} must be 0 (never) or more")
    _check_choice("on_reward_hacking", c.on_reward_hacking, ("warn", "stop", "off"))
    _check_choice("on_collapse", c.on_collapse, ("warn", "stop", "rollback", "off"))
    if not 0 < c.rollback_lr_factor <= 1:
        raise ConfigError(f"rollback_lr_factor={c.rollback_lr_factor} must be in (0, 1]: each rollback "
                          "multiplies the learning rate by it (e.g. 0.1)")
    if c.max_rollbacks < 0:
        raise ConfigError(f"max_rollbacks={c.max_rollbacks} must be 0 or more")
    taken = sorted({"conversation", "tools", "add_generation_prompt", "continue_final_message", "tokenize"}
                   & set(c.chat_template_kwargs))
    if taken:
        raise ConfigError(f"chat_template_kwargs sets {', '.join(taken)}, which grouprl sets itself for each "
                          "conversation it renders (the tools from `tools`, the generation prompt by the last "
                          "message's role): drop them")
    if c.prompt_filter_history < 1:
        raise ConfigError(f"prompt_filter_history={c.prompt_filter_history} must be at least 1 (groups)")
    if not 0 <= c.prompt_filter_revisit <= 1:
        raise ConfigError(f"prompt_filter_revisit={c.prompt_filter_revisit} must be in [0, 1]")
    if c.distributed_strategy == "fsdp2" and c.lora_r:
        raise ConfigError("distributed_strategy=fsdp2 with LoRA is not supported: LoRA weights are "
                          "small enough for ddp; set distributed_strategy: ddp or lora_r: 0")
    if c.overlong_shaping and not 0 < c.overlong_cache_len <= c.max_completion_length:
        raise ConfigError(f"overlong_cache_len={c.overlong_cache_len} must be in "
                          f"(0, max_completion_length={c.max_completion_length}]")
    _check_distillation(c)
    _check_group_skips(c)
    _check_vllm(c)
    _check_tools(c)
    return c


# ------------------------------------------------------------ eval_metrics: the names evaluation.py computes
_EVAL_METRIC = re.compile(r"^(greedy|(mean|pass|maj)@([1-9][0-9]*))$")


def parse_eval_metric(name: str) -> tuple[str, int]:
    """`pass@8` -> ("pass", 8); `greedy` -> ("greedy", 1); anything else is a ConfigError."""
    m = _EVAL_METRIC.match(name)
    if m is None:
        raise ConfigError(f"eval_metrics: {name!r} is not one of greedy, mean@k, pass@k, maj@k (k a positive "
                          "integer, e.g. pass@8)")
    return ("greedy", 1) if m.group(1) == "greedy" else (m.group(2), int(m.group(3)))


def _check_best_metric(metric: str, eval_metrics: list[str]) -> None:
    """`metric` must be a result the eval reports (evaluation.run_evaluation): accuracy, reward_mean,
    length_mean, each sampled metric of `eval_metrics` (greedy's is accuracy), rewards/NAME. NAME
    depends on the reward functions, which resolve later: evaluation.check_eval_names checks it, still
    before any model loads."""
    reported = ["accuracy", "reward_mean", "length_mean", *(m for m in eval_metrics if m != "greedy")]
    if metric in reported or metric.startswith("rewards/"):
        return
    if metric == "greedy":
        fix = "greedy decoding's result is reported as accuracy: name accuracy"
    elif _EVAL_METRIC.match(metric):
        fix = f"add {metric} to eval_metrics, or name one of these"
    else:
        fix = "name one of these"
    raise ConfigError(f"metric_for_best_model={metric!r} is not an eval result: with eval_metrics={eval_metrics} "
                      f"the eval reports {', '.join(reported)} and rewards/NAME for each reward function; {fix}")


def _check_choice(name: str, value: str, choices: tuple[str, ...] | Registry) -> None:
    """``choices`` a tuple, or a core registry: then its names, so that a registered variant is accepted."""
    if value not in choices:
        how = f"; register a new one with @{choices.decorator}(name)" if isinstance(choices, Registry) else ""
        trl = TRL_VALUES.get((name, str(value).lower()))
        raise ConfigError(f"{name}={value!r} is not one of: {', '.join(choices)}{how}" + (f"; {trl}" if trl else ""))


def _check_variants(c: TrainFields) -> None:
    """The loss and advantage variants, and the combinations that make no sense (the loss settings'
    own: core's check_loss_settings)."""
    _check_choice("loss_type", c.loss_type, LOSS_TYPES)
    _check_choice("multi_objective_aggregation", c.multi_objective_aggregation, MULTI_OBJECTIVE_AGGREGATIONS)
    if c.advantage_estimator.startswith("reinforce_pp") and c.scale_rewards == "group":
        raise ConfigError(f"advantage_estimator={c.advantage_estimator} normalises over the whole batch: "
                          "set scale_rewards: batch (the paper's) or none")
    if c.multi_objective_aggregation == "normalize_then_sum":
        if c.advantage_estimator != "grpo":
            raise ConfigError(f"multi_objective_aggregation=normalize_then_sum (GDPO) normalises each reward "
                              f"function within its group itself; advantage_estimator={c.advantage_estimator} "
                              "has no meaning there: set advantage_estimator: grpo")
        if c.overlong_shaping:
            raise ConfigError("overlong_shaping with multi_objective_aggregation=normalize_then_sum: the length "
                              "penalty is added to the summed reward, which GDPO does not use; set "
                              "overlong_shaping: false, or write the penalty as a reward function")
    _check_value_function(c)
    if not 0 < c.top_entropy_quantile <= 1:
        raise ConfigError(f"top_entropy_quantile={c.top_entropy_quantile} must be in (0, 1] (the paper "
                          "keeps the top 0.2 of tokens by entropy; 1 keeps all)")
    if c.off_policy_mask_threshold is not None and not c.off_policy_mask_threshold >= 0:
        raise ConfigError(f"off_policy_mask_threshold={c.off_policy_mask_threshold} must be >= 0 "
                          "(a mean log-ratio per token; TRL suggests 0.5) or null to switch it off")


def _check_distillation(c: TrainFields) -> None:
    """On-policy distillation: a teacher exactly when its signal has a weight. Whether the teacher
    shares the policy's tokenizer is checked when it loads (grouprl/distillation.py)."""
    _check_choice("distill_signal", c.distill_signal, DISTILL_SIGNALS)
    for name in ("distill_coef", "distill_reward_coef"):
        if not getattr(c, name) >= 0:
            raise ConfigError(f"{name}={getattr(c, name)} must be 0 or more (a weight in A = distill_reward_coef * "
                              "A_reward + distill_coef * (log pi_teacher - log pi_student))")
    if c.distill_coef > 0 and not c.teacher_model:
        raise ConfigError(f"distill_coef={c.distill_coef} (algorithm={c.algorithm}) distils from a teacher, and "
                          "teacher_model is unset: set teacher_model to a model that shares the policy's tokenizer "
                          "(e.g. a trained run's RUN/checkpoints/step-N/model), or distill_coef: 0")
    if c.teacher_model and c.distill_coef == 0:
        raise ConfigError(f"teacher_model={c.teacher_model!r} with distill_coef=0 (algorithm={c.algorithm}): the "
                          "teacher would load and never count; set distill_coef (e.g. 1.0 to add its per-token "
                          "signal to the reward advantages), or algorithm: on_policy_distill to learn from the "
                          "teacher alone, or drop teacher_model")
    if c.distill_coef == 0 and c.distill_reward_coef != 1:
        raise ConfigError(f"distill_reward_coef={c.distill_reward_coef} weighs the reward advantages against a "
                          "teacher's signal, and there is none (distill_coef=0): drop distill_reward_coef, or set "
                          "teacher_model and distill_coef")


def _check_group_skips(c: TrainFields) -> None:
    """Dynamic sampling drops the groups whose rewards are all equal, and the prompt filter stops
    drawing the prompts whose last groups were: both rest on such a group's advantages being all 0,
    which holds for a group baseline and no other signal, not where a group still teaches."""
    if c.distill_coef > 0:
        why = (f"distill_coef={c.distill_coef}", "with a teacher those groups still carry its per-token signal")
    elif c.value_head:
        why = ("advantage_estimator=gae (PPO)", "GAE's baseline is the value function, not the group's mean, so "
               "those groups still teach")
    elif c.advantage_estimator == "reinforce_pp":
        why = ("advantage_estimator=reinforce_pp", "its baseline is the batch's mean, not the group's, so those "
               "groups still get advantages (reinforce_pp_baseline centres each group first)")
    else:
        return
    for name, does in (("dynamic_sampling", "dynamic sampling drops the groups whose rewards are all equal"),
                       ("prompt_filter", "the prompt filter stops drawing prompts whose groups' rewards were all "
                                         "equal")):
        if getattr(c, name):
            raise ConfigError(f"{name} with {why[0]}: {does}, and {why[1]}; set {name}: false")


def _check_vllm(c: TrainFields) -> None:
    _check_choice("vllm_mode", c.vllm_mode, ("colocate", "server"))
    _check_choice("vllm_weight_transfer", c.vllm_weight_transfer, ("auto", "gloo", "nccl", "file"))
    _check_choice("vllm_lora_sync", c.vllm_lora_sync, ("auto", "adapter", "merged"))
    if c.vllm_mode == "server" and not c.use_vllm:
        raise ConfigError("vllm_mode=server without use_vllm: set use_vllm: true to sample with the vLLM server")
    if not 0 < c.vllm_server_port < 65536:
        raise ConfigError(f"vllm_server_port={c.vllm_server_port} must be a TCP port in 1..65535")
    if not c.vllm_server_timeout_s > 0:
        raise ConfigError(f"vllm_server_timeout_s={c.vllm_server_timeout_s} must be positive")
    if c.max_staleness < 0:
        raise ConfigError(f"max_staleness={c.max_staleness} must be 0 or more (0: synchronous)")
    if c.async_rollouts and not (c.use_vllm and c.vllm_mode == "server"):
        raise ConfigError("async_rollouts needs use_vllm: true with vllm_mode: server. The built-in engine "
                          "decodes with the very weights the update changes, and a colocated vLLM shares "
                          "the trainer's device and process: neither has generation to overlap with the update")
    if c.partial_rollouts and not c.async_rollouts:
        raise ConfigError("partial_rollouts without async_rollouts: only batches generated ahead can be in flight "
                          "during a weight update; set async_rollouts: true (with vllm_mode: server) or "
                          "partial_rollouts: false")
    if c.async_rollouts and c.vllm_importance_sampling_correction is False:
        raise ConfigError("async_rollouts with vllm_importance_sampling_correction=false: stale samples would "
                          "be trained on as if on-policy; leave the correction on (unset or true)")
    if not 0 < c.vllm_gpu_memory_utilization <= 1:
        raise ConfigError(f"vllm_gpu_memory_utilization={c.vllm_gpu_memory_utilization} must be in (0, 1]")
    if c.vllm_dtype is not None:
        _check_choice("vllm_dtype", c.vllm_dtype, ("float32", "bfloat16", "float16", "auto"))
    if c.vllm_max_model_length is not None:
        needed = (c.max_prompt_length or 1) + c.max_completion_length
        if c.vllm_max_model_length < needed:
            raise ConfigError(f"vllm_max_model_length={c.vllm_max_model_length} is shorter than "
                              f"max_prompt_length + max_completion_length = {needed}: raise it or leave it null")
    if c.vllm_importance_sampling_correction and not c.use_vllm:
        raise ConfigError("vllm_importance_sampling_correction=true without use_vllm: the built-in engine samples "
                          "from the trainer's own model, so there is no sampler/trainer mismatch to correct; set "
                          "use_vllm: true, or leave the field unset")
    _check_vllm_mode_fields(c)
    if c.partial_rollouts and c.max_staleness == 0:
        raise ConfigError("partial_rollouts with max_staleness=0: nothing is generated ahead, so no batch is in "
                          "flight during an update; set max_staleness to 1 or more, or partial_rollouts: false")
    if c.use_vllm and not 0.01 <= c.temperature <= 2:
        raise ConfigError(f"temperature={c.temperature} with use_vllm: vLLM samples at temperatures in "
                          "[0.01, 2] only (it raises lower ones to 0.01, which the trainer's log-probs "
                          "would not know); pick one in that range")


# vLLM settings that only one mode reads: the colocated engine's (and the `grouprl vllm-serve` flag that
# sets a server's instead), and the server client's
COLOCATED_ONLY = {"vllm_gpu_memory_utilization": "--gpu-memory-utilization", "vllm_enable_sleep_mode":
                  "--enable-sleep-mode", "vllm_dtype": "--dtype", "vllm_max_model_length": "--max-model-len",
                  "vllm_enforce_eager": "--enforce-eager"}
SERVER_ONLY = ("vllm_server_host", "vllm_server_port", "vllm_server_timeout_s", "vllm_server_weight_dir",
               "vllm_weight_transfer", "vllm_weight_transfer_address")


def _changed(c: TrainFields, names: tuple[str, ...] | list[str]) -> list[str]:
    """Those of `names` whose value is not the schema's default: settings the run was given."""
    defaults = {f.name: f.default for f in dataclasses.fields(c) if f.name in names}
    return [name for name in names if getattr(c, name) != defaults[name]]


def _check_vllm_mode_fields(c: TrainFields) -> None:
    """A vLLM setting changed from its default that the run will not read (without use_vllm, or in the
    other vllm_mode) is said in a warning, once: a run that ignored it silently would sample otherwise
    than its config seems to say. Not an error: a run's own config.yaml holds every setting it ran
    with, so `grouprl eval --model RUN/... --use_vllm false` on a machine without vLLM, or a config
    written when a vLLM default differed, must still run."""
    for name in _changed(c, (*COLOCATED_ONLY, *SERVER_ONLY, "vllm_lora_sync")):
        value = f"{name}={getattr(c, name)!r}"
        if not c.use_vllm:
            _warn_once(f"{value} is a vLLM setting, and use_vllm is false: it is ignored (set use_vllm: true to "
                       "use it)")
        elif c.vllm_mode == "server" and name in COLOCATED_ONLY:
            _warn_once(f"{value} shapes the colocated engine, and vllm_mode is server, whose engine is set where it "
                       f"starts (grouprl vllm-serve MODEL {COLOCATED_ONLY[name]} ...): it is ignored here")
        elif c.vllm_mode == "colocate" and name in SERVER_ONLY:
            _warn_once(f"{value} applies to vllm_mode: server, and this run colocates vLLM: it is ignored (set "
                       "vllm_mode: server to use it)")


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """A config warning, once per process (a config is validated again where the trainer starts)."""
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def _names_something(spec: Any) -> bool:
    """A reward function's, audit function's or tool's entry: a name or import path, a mapping with a
    `name` (and the factory's arguments), or the callable itself (given in memory)."""
    return bool(isinstance(spec, str) and spec) or (isinstance(spec, dict) and isinstance(spec.get("name"), str)) \
        or callable(spec)


def _check_tools(c: TrainFields) -> None:
    """Multi-turn fields; the tools and the environment themselves are imported by the trainer (still
    before any model loads)."""
    for i, spec in enumerate(c.tools):
        if not _names_something(spec):
            raise ConfigError(f"tools[{i}]={spec!r}: name a tool as `python`, `package.module:function`, or a "
                              "mapping {name: python, timeout_s: 5}")
    if c.tool_parser is not None:
        _check_choice("tool_parser", c.tool_parser, FORMATS)
    for name in ("max_tool_calls", "max_turns"):
        if getattr(c, name) < 1:
            raise ConfigError(f"{name}={getattr(c, name)} must be at least 1")
    if not c.tool_timeout_s > 0:
        raise ConfigError(f"tool_timeout_s={c.tool_timeout_s} must be a positive number of seconds")
    if c.max_tool_output_chars is not None and c.max_tool_output_chars < 1:
        raise ConfigError(f"max_tool_output_chars={c.max_tool_output_chars} must be at least 1 (the model sees "
                          "the result's head and tail), or null to show results whole")
    if c.env_timeout_s is not None and not c.env_timeout_s > 0:
        raise ConfigError(f"env_timeout_s={c.env_timeout_s} must be a positive number of seconds, or null for "
                          "no limit")
    if c.tools and c.environment:
        raise ConfigError("tools and environment are both set: an environment answers every assistant turn "
                          "itself, so let it run the tools it offers; set one of them")
    if c.environment is not None and ":" not in c.environment:
        raise ConfigError(f"environment={c.environment!r}: name the class by import path, `package.module:Class`")
    if (c.tools or c.environment) and c.ignore_eos:
        raise ConfigError("ignore_eos=true with tools or an environment: a multi-turn rollout ends each turn at "
                          "EOS; set ignore_eos: false")


def _check_value_function(c: TrainFields) -> None:
    """PPO's value head and GAE go together; their numbers in range."""
    if c.advantage_estimator == "gae" and not c.value_head:
        raise ConfigError("advantage_estimator=gae reads a learned value function and value_head is false: "
                          "set value_head: true (algorithm: ppo sets both), or choose a critic-free estimator "
                          "such as grpo")
    if c.value_head and c.advantage_estimator != "gae":
        raise ConfigError(f"value_head: true trains a value function that advantage_estimator="
                          f"{c.advantage_estimator} never reads: set advantage_estimator: gae (PPO), or "
                          "value_head: false")
    if c.advantage_estimator == "gae" and c.scale_rewards == "group":
        raise ConfigError("advantage_estimator=gae has no group baseline (the value function is the baseline): "
                          "set scale_rewards: batch (whiten over the batch's tokens) or none")
    for name in ("gamma", "lam"):
        if not 0 <= getattr(c, name) <= 1:
            raise ConfigError(f"{name}={getattr(c, name)} must be in [0, 1] (GAE's discount and lambda)")
    if not c.vf_coef > 0:
        raise ConfigError(f"vf_coef={c.vf_coef} must be positive: it weights the value loss (the value head "
                          "learns nothing at 0)")
    if c.value_learning_rate is not None and not c.value_learning_rate > 0:
        raise ConfigError(f"value_learning_rate={c.value_learning_rate} must be positive, or null for "
                          "10 x learning_rate")
    if c.cliprange_value is not None and not c.cliprange_value > 0:
        raise ConfigError(f"cliprange_value={c.cliprange_value} must be positive, or null for no value clipping")
    changed = _changed(c, ("gamma", "lam", "vf_coef", "value_learning_rate", "cliprange_value"))
    if changed and not c.value_head:  # as teacher_model without distill_coef: a setting that does nothing
        name = changed[0]
        raise ConfigError(f"{name}={getattr(c, name)} shapes PPO's value head and GAE, and this run has "
                          f"none (value_head is false): set algorithm: ppo, or remove {name}")
