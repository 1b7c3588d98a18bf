"""Pure tensor math of the GRPO family (and PPO's GAE and value loss): advantages (on-policy
distillation's too), KL estimators, policy terms and the policy loss, loss aggregation, token masks,
log-probs, presets, and the sampler/trainer importance-sampling correction. The formulas and their
sources: docs/algorithms.md.

No model, no config object, no torch.distributed, no I/O; nothing else from grouprl is imported.
Every variant is a function in a ``Registry`` (registry.py) under the name the config uses.
"""

from .registry import Registry
from .advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
    group_advantages,
    passk_advantages,
    register_advantage_estimator,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    zero_std_groups,
)
from .process_advantages import process_advantages, zero_std_step_groups
from .gae import gae_advantages, outcome_token_rewards, value_loss
from .distillation import DISTILL_SIGNALS, distill_advantages, distill_stats, reverse_kl_signal
from .multi_objective import MULTI_OBJECTIVE_AGGREGATIONS, normalize_then_sum, sum_then_normalize
from .importance import IS_MODES, importance_weights, register_is_mode
from .kl import KL_ESTIMATORS, kl_estimate
from .head_logprobs import head_logprobs
from .logprobs import token_entropy, token_logprobs, token_logprobs_and_entropy
from .aggregation import LOSS_AGGREGATIONS, aggregate_loss, batch_normalizer, register_loss_agg
from .loss_params import LOSS_TYPES, RATIO_LEVELS, LossParams, register_loss_type, register_ratio_level
from .policy_loss import policy_loss
from .reward_shaping import overlong_penalty
from .token_masks import TOKEN_MASKS, MaskInputs, off_policy_sequence_mask, top_entropy_mask
from .presets import PRESET_KEYS, PRESETS, get_preset

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "DISTILL_SIGNALS",
    "IS_MODES",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "LOSS_TYPES",
    "MULTI_OBJECTIVE_AGGREGATIONS",
    "PRESETS",
    "PRESET_KEYS",
    "RATIO_LEVELS",
    "TOKEN_MASKS",
    "AdvantageInputs",
    "LossParams",
    "MaskInputs",
    "Registry",
    "aggregate_loss",
    "batch_normalizer",
    "compute_advantages",
    "distill_advantages",
    "distill_stats",
    "gae_advantages",
    "get_preset",
    "group_advantages",
    "importance_weights",
    "kl_estimate",
    "normalize_then_sum",
    "off_policy_sequence_mask",
    "outcome_token_rewards",
    "overlong_penalty",
    "passk_advantages",
    "policy_loss",
    "process_advantages",
    "register_advantage_estimator",
    "register_is_mode",
    "register_loss_agg",
    "register_loss_type",
    "register_ratio_level",
    "reinforce_pp_advantages",
    "reverse_kl_signal",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "sum_then_normalize",
    "token_entropy",
    "head_logprobs",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "top_entropy_mask",
    "value_loss",
    "zero_std_groups",
    "zero_std_step_groups",
]
