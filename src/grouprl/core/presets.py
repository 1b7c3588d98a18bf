"""Named algorithm presets (docs/algorithms.md, "Named presets"), as plain data.

Keys are core's own parameter names (``PRESET_KEYS``): estimator and scale (advantages.py), agg,
eps_low, eps_high, beta, ratio_level and loss_type (loss_params.py's LossParams), multi_objective
(multi_objective.py), entropy_quantile and off_policy_threshold (token_masks.py), distill_coef and
distill_reward_coef (distillation.py), and the trainer's dynamic_sampling, overlong_shaping and
value_head switches. The config maps them onto its fields (config/validate.py, ``PRESET_FIELDS``);
every value stays overridable by the user.

preset                 advantage             loss   aggregation              ε_low/ε_high  β     extras
---------------------  --------------------  -----  -----------------------  ------------  ----  -----------------------
grpo                   group std             clip   seq-mean-token-mean      0.2 / 0.2     0.04  —
dr_grpo                none (mean only)      clip   seq-mean-token-sum-norm  0.2 / 0.2     0     —
dapo                   group std             clip   token-mean               0.2 / 0.28    0     dyn. sampling, overlong
gspo                   group std             clip   seq-mean-token-mean      3e-4 / 4e-4   0     sequence-level ratio
gmpo                   group std             gmpo   seq-mean-token-mean      0.4 / 0.4     0     ε in log space
rloo                   leave-one-out         clip   seq-mean-token-sum       0.2 / 0.2     0     —
cispo                  group std             cispo  token-mean               1 / 4         0     IS weight in [0, 5]
sapo                   group std             sapo   seq-mean-token-mean      unused        0     τ 1.0 / 1.05
bnpo                   group std             clip   token-mean               0.2 / 0.2     0     = token-mean
gdpo                   per-reward group std  clip   seq-mean-token-mean      0.2 / 0.2     0     normalize_then_sum
top_entropy            group std             clip   token-mean               0.2 / 0.28    0     dapo + top 20 % entropy
opsm                   group std             clip   seq-mean-token-mean      0.2 / 0.2     0     off-policy mask δ 0.5
reinforce_pp           batch mean / std      clip   token-mean               0.2 / 0.2     0     —
reinforce_pp_baseline  group mean/batch std  clip   token-mean               0.2 / 0.2     0     —
grpo_passk             r_max − r_2nd, best   clip   token-mean               0.2 / 0.2     0     —
on_policy_distill      teacher − student     clip   token-mean               0.2 / 0.2     0     λ 1, rewards' weight 0
ppo                    GAE, batch-whitened   clip   token-mean               0.2 / 0.2     0     value head

Sources: DeepSeekMath (grpo), arXiv 2503.20783 (dr_grpo), arXiv 2503.14476 (dapo),
arXiv 2507.18071 (gspo), Ahmadian et al. 2024 (rloo). rloo uses scale="none": the
leave-one-out advantage unscaled, as in the paper; and each completion is one action, whose
log-probability is the sum of its tokens': seq-mean-token-sum, (1/N)·Σ_i A_i·∇Σ_t log π, the paper's
gradient and TRL RLOOTrainer's exactly on-policy. Off-policy (num_iterations > 1, a sampler's own
log-probs) the clip acts per token, where TRL clips the whole sequence's ratio exp(Σ_t δ_t).
- cispo: MiniMax-M1 (arXiv 2506.13585) §3.1, no lower bound on the IS weight (ε_low = 1 gives 0),
  token-mean over the batch, no KL. The paper gives no ε_high; 1 + 4 = 5 is ScaleRL's cap (arXiv
  2510.13786, TRL's recommended ``epsilon_high=5.0`` for its cap-at-ε_high form; policy_terms.py).
- sapo: arXiv 2511.20347, τ_pos = 1.0, τ_neg = 1.05 (config fields sapo_temperature_pos/neg),
  sequence mean; ε is unused by the gate.
- bnpo: TRL's loss_type "bnpo" (tokens of the batch); grouprl's token-mean already divides by the
  whole optimizer batch's tokens, so bnpo *is* token-mean with TRL's defaults (ε 0.2, β 0); TRL's
  bnpo divides per local micro-batch instead, which changes with micro-batching.
- gdpo: arXiv 2601.05242, multi_objective="normalize_then_sum" (multi_objective.py);
  otherwise grpo with β = 0 (TRL's default).
- top_entropy: arXiv 2506.01939, DAPO with entropy_quantile = 0.2 (token_masks.py).
- gmpo: arXiv 2507.20673 and its code (callsys/GMPO): the clip range (e^−0.4, e^0.4), i.e.
  ε_low = ε_high = 0.4 in log space (policy_terms.py), group-std advantages, no KL (β = 0), the
  per-completion mean then the mean over the batch (seq-mean-token-mean). Not preset fields, for
  orientation: the paper's script trains with lr 1e-6 and G = 8. On-policy (μ = 1) the gradient is
  GRPO's; the clip acts with num_iterations > 1 or a sampler's own log-probs (vLLM).
- opsm: DeepSeek-V3.2 (arXiv 2512.02556) off-policy sequence masking on grpo; the paper gives no δ,
  0.5 is TRL's suggestion. It acts only off-policy: num_iterations > 1, or a sampler such as vLLM.
- reinforce_pp, reinforce_pp_baseline: arXiv 2501.03262; the paper's KL-in-reward is not
  implemented (β adds the KL to the loss instead), so β = 0; token-mean as verl's default.
- on_policy_distill: Lu & Thinking Machines Lab 2025 (tinker-cookbook), GKD (Agarwal et al. 2024):
  the advantage of each token is log π_teacher − log π_student on the sampled token (distillation.py),
  distill_coef λ = 1 and distill_reward_coef 0 (the verifier rewards still scored and logged, not
  learned from); token-mean, so every sampled token's KL counts alike; β = 0, the teacher is the anchor.
  It needs teacher_model (config validation says so). Every other preset has λ = 0, reward weight 1.
- ppo: Schulman et al. 2017 with GAE (Schulman et al. 2016, gae.py): a value head on the policy's
  last hidden state (grouprl/value.py) is the baseline; advantages whitened over the batch's tokens
  and no KL, as verl's PPO defaults (use_kl_in_reward and use_kl_loss off); token-mean as verl.
- grpo_passk: arXiv 2503.19595 as verl implements it; unscaled as in the paper (verl divides by the
  group std by default: scale_rewards="group"); token-mean as verl's default.
"""

from __future__ import annotations

from typing import Any

PRESET_KEYS = ("estimator", "scale", "agg", "eps_low", "eps_high", "beta", "ratio_level", "dynamic_sampling",
               "overlong_shaping", "loss_type", "multi_objective", "entropy_quantile", "off_policy_threshold",
               "distill_coef", "distill_reward_coef", "value_head")


def _preset(estimator: str, scale: str, agg: str, eps_low: float, eps_high: float, beta: float,
            ratio_level: str = "token", dynamic_sampling: bool = False, overlong_shaping: bool = False,
            loss_type: str = "clip", multi_objective: str = "sum_then_normalize", entropy_quantile: float = 1.0,
            off_policy_threshold: float | None = None, distill_coef: float = 0.0,
            distill_reward_coef: float = 1.0, value_head: bool = False) -> dict[str, Any]:
    return dict(estimator=estimator, scale=scale, agg=agg, eps_low=eps_low, eps_high=eps_high, beta=beta,
                ratio_level=ratio_level, dynamic_sampling=dynamic_sampling, overlong_shaping=overlong_shaping,
                loss_type=loss_type, multi_objective=multi_objective, entropy_quantile=entropy_quantile,
                off_policy_threshold=off_policy_threshold, distill_coef=distill_coef,
                distill_reward_coef=distill_reward_coef, value_head=value_head)


PRESETS: dict[str, dict[str, Any]] = {
    "grpo": _preset("grpo", "group", "seq-mean-token-mean", 0.2, 0.2, 0.04),
    "dr_grpo": _preset("grpo", "none", "seq-mean-token-sum-norm", 0.2, 0.2, 0.0),
    "dapo": _preset("grpo", "group", "token-mean", 0.2, 0.28, 0.0,
                    dynamic_sampling=True, overlong_shaping=True),
    "gspo": _preset("grpo", "group", "seq-mean-token-mean", 3e-4, 4e-4, 0.0,
                    ratio_level="sequence"),
    "rloo": _preset("rloo", "none", "seq-mean-token-sum", 0.2, 0.2, 0.0),
    "cispo": _preset("grpo", "group", "token-mean", 1.0, 4.0, 0.0, loss_type="cispo"),
    "sapo": _preset("grpo", "group", "seq-mean-token-mean", 0.2, 0.2, 0.0, loss_type="sapo"),
    "bnpo": _preset("grpo", "group", "token-mean", 0.2, 0.2, 0.0),
    "gdpo": _preset("grpo", "group", "seq-mean-token-mean", 0.2, 0.2, 0.0,
                    multi_objective="normalize_then_sum"),
    "top_entropy": _preset("grpo", "group", "token-mean", 0.2, 0.28, 0.0, dynamic_sampling=True,
                           overlong_shaping=True, entropy_quantile=0.2),
    "opsm": _preset("grpo", "group", "seq-mean-token-mean", 0.2, 0.2, 0.0, off_policy_threshold=0.5),
    "reinforce_pp": _preset("reinforce_pp", "batch", "token-mean", 0.2, 0.2, 0.0),
    "reinforce_pp_baseline": _preset("reinforce_pp_baseline", "batch", "token-mean", 0.2, 0.2, 0.0),
    "grpo_passk": _preset("grpo_passk", "none", "token-mean", 0.2, 0.2, 0.0),
    "on_policy_distill": _preset("grpo", "group", "token-mean", 0.2, 0.2, 0.0, distill_coef=1.0,
                                 distill_reward_coef=0.0),
    "gmpo": _preset("grpo", "group", "seq-mean-token-mean", 0.4, 0.4, 0.0, loss_type="gmpo"),
    "ppo": _preset("gae", "batch", "token-mean", 0.2, 0.2, 0.0, value_head=True),
}


def get_preset(name: str) -> dict[str, Any]:
    """A copy of preset ``name`` (mutating it leaves ``PRESETS`` intact)."""
    if name not in PRESETS:
        raise ValueError(f"unknown algorithm preset {name!r}; known presets: {', '.join(PRESETS)}")
    return dict(PRESETS[name])
