"""Pure tensor math of the GRPO family: advantages, KL estimators, policy losses, log-probs, presets,
and the sampler/trainer importance-sampling correction.

No model, no config object, no torch.distributed, no I/O; nothing else from grouprl is imported.
"""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    group_advantages,
    process_advantages,
    register_advantage_estimator,
    rloo_advantages,
    zero_std_groups,
)
from .advantage_variants import (
    normalize_then_sum,
    passk_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
)
from .importance import IS_MODES, importance_weights, register_is_mode
from .kl import KL_ESTIMATORS, kl_estimate
from .logprobs import token_entropy, token_logprobs, token_logprobs_and_entropy
from .losses import (
    LOSS_AGGREGATIONS,
    RATIO_LEVELS,
    aggregate_loss,
    overlong_penalty,
    policy_loss,
    register_loss_agg,
    register_ratio_level,
)
from .policy_losses import LOSS_TYPES, LossParams, register_loss_type
from .token_masks import off_policy_sequence_mask, top_entropy_mask
from .presets import PRESET_KEYS, PRESETS, get_preset

__all__ = [
    "top_entropy_mask",
    "reinforce_pp_baseline_advantages",
    "reinforce_pp_advantages",
    "passk_advantages",
    "off_policy_sequence_mask",
    "normalize_then_sum",
    "ADVANTAGE_ESTIMATORS",
    "IS_MODES",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "LOSS_TYPES",
    "LossParams",
    "PRESETS",
    "PRESET_KEYS",
    "RATIO_LEVELS",
    "aggregate_loss",
    "compute_advantages",
    "get_preset",
    "group_advantages",
    "importance_weights",
    "kl_estimate",
    "overlong_penalty",
    "policy_loss",
    "process_advantages",
    "register_advantage_estimator",
    "register_is_mode",
    "register_loss_agg",
    "register_loss_type",
    "register_ratio_level",
    "rloo_advantages",
    "token_entropy",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "zero_std_groups",
]
