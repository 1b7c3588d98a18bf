"""PPO's learned-value pieces: generalised advantage estimation (GAE) over completion tokens and
the clipped value loss.

GAE (Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation", eq. 16). A completion is an episode whose actions are its tokens; V_t is the value
estimate of the state before token t (the prompt and the tokens before t), r_t the reward of token
t. With discount γ and λ:

    δ_t = r_t + γ·V_{t+1} − V_t            (V after the last token: 0, the episode has ended)
    A_t = Σ_{l≥0} (γλ)^l · δ_{t+l}  =  δ_t + γλ·A_{t+1}
    R_t = A_t + V_t                        (the value target, the λ-return)

Rewards: the outcome reward r_i (the weighted sum of the reward functions, shaping included) sits
on completion i's last action token, every other token gets 0 (``outcome_token_rewards``).
λ = 1 gives A_t = γ^{L−1−t}·r − V_t (Monte-Carlo return minus the baseline); λ = 0 gives the
one-step TD error.

Registered as the advantage estimator "gae": it reads ``AdvantageInputs.values`` (V_old, the
value head's estimates at sampling time) and ``token_mask``, ``gamma`` and ``lam``, and returns
one advantage per token [N, T]. ``scale`` "batch" whitens the advantages over every action token
of the batch, (A − mean)/(std + eps), as verl's and OpenRLHF's PPO do; "none" leaves them raw;
"group" has no meaning (no groups in PPO's baseline) and raises.

Value loss (PPO2's clipped form, as in OpenAI baselines, TRL, verl): with v the new prediction,
v_old the prediction at sampling time, R the return and c = cliprange_value,

    v_clip = v_old + clip(v − v_old, −c, c)
    ℓ^V_t  = ½·max((v − R)², (v_clip − R)²)          (c = None: ½·(v − R)²)

aggregated over real tokens like the policy loss (``aggregate_loss``, same mode and normaliser).

Deliberate choices:
- tokens outside ``token_mask`` (context a multi-turn rollout inserted: tool results) are not
  steps: the recursion passes over them (their V is not used, A and R are 0 there), so a tool
  result between two actions does not cut the episode. verl's multi-turn GAE does the same.
- no KL penalty is folded into the per-token rewards (PPO-RLHF's r_t − β·KL_t): β adds the KL to
  the loss as for every other estimator of grouprl, which keeps the reference pass in the update;
  ``gae_advantages`` takes per-token rewards [N, T], so a caller can fold one in.
- a truncated completion is treated as ended (no bootstrap from V after it), as the peers do.
- computed in float64 (a column loop over T, vectorised over the N completions), returned as float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, check_scale
from .aggregation import aggregate_loss, bool_mask


def _check_probability(name: str, x: float) -> None:
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"{name}={x} must be in [0, 1]")


def outcome_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Per-token rewards [N, T]: ``rewards  # [N]`` on each completion's last token of ``mask  # [N, T]``
    (its last action), 0 elsewhere; a row with no action tokens gets none."""
    valid = bool_mask(mask, mask.shape)
    if rewards.shape != valid.shape[:1]:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}, expected [N]={tuple(valid.shape[:1])}")
    T = valid.shape[1]
    last = T - 1 - valid.flip(1).int().argmax(1)  # [N] index of the last action token
    out = torch.zeros(valid.shape, dtype=torch.float64)
    has = valid.any(1)  # [N]
    out[has.nonzero().squeeze(-1), last[has]] = rewards[has].double()
    return out  # [N, T]


def gae_advantages(token_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float,
                   lam: float) -> tuple[Tensor, Tensor]:
    """GAE advantages and returns, [N, T] each (0 off ``mask``), from per-token rewards, value
    estimates and the action mask, all [N, T]. See the module docstring."""
    _check_probability("gamma", gamma)
    _check_probability("lam", lam)
    valid = bool_mask(mask, values.shape)  # [N, T]
    if token_rewards.shape != values.shape:
        raise ValueError(f"token_rewards has shape {tuple(token_rewards.shape)}, expected "
                         f"{tuple(values.shape)} like values")
    r = torch.where(valid, token_rewards.double(), 0.0)  # [N, T]
    v = torch.where(valid, values.detach().double(), 0.0)  # [N, T]
    if not (torch.isfinite(r).all() and torch.isfinite(v).all()):
        raise ValueError("token_rewards or values hold NaN or inf on action tokens: both must be finite")
    N, T = v.shape
    adv = torch.zeros_like(v)  # [N, T]
    next_value = v.new_zeros(N)  # [N] V of the next action's state; 0 after the last
    next_adv = v.new_zeros(N)  # [N] A of the next action
    for t in range(T - 1, -1, -1):
        m = valid[:, t]  # [N]
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(m, a, 0.0)
        next_value = torch.where(m, v[:, t], next_value)  # off-mask tokens pass both on unchanged
        next_adv = torch.where(m, a, next_adv)
    returns = torch.where(valid, adv + v, 0.0)
    return adv.float(), returns.float()


def whiten(x: Tensor, mask: Tensor, *, eps: float, unbiased: bool = True) -> Tensor:
    """(x − mean) / (std + eps) over the real tokens of ``x  # [N, T]`` (``mask  # [N, T]``); 0 elsewhere."""
    valid = bool_mask(mask, x.shape)
    n = int(valid.sum())
    if n == 0:
        return torch.zeros_like(x)
    vals = x[valid].double()
    centered = vals - vals.mean()
    std = centered.square().sum().div(max(n - (1 if unbiased else 0), 1)).sqrt()
    out = torch.zeros(x.shape, dtype=torch.float64)
    out[valid] = centered / (std + eps)
    return out.to(x.dtype)


@ADVANTAGE_ESTIMATORS.register("gae")
def _gae_estimator(inputs: AdvantageInputs, *, scale: str, eps: float, unbiased: bool) -> Tensor:
    check_scale(scale, eps)
    if scale == "group":
        raise ValueError("gae has no group baseline (the value function is the baseline): use scale "
                         "'batch' (whiten over the batch's tokens, as verl and OpenRLHF) or 'none'")
    if inputs.values is None or inputs.token_mask is None:
        raise ValueError("advantage estimator 'gae' reads the value function's estimates: give "
                         "AdvantageInputs its values and token_mask [N, T] (the trainer's value head "
                         "makes them: value_head: true, or algorithm: ppo)")
    rewards = outcome_token_rewards(inputs.rewards, inputs.token_mask)  # [N, T]
    adv, _ = gae_advantages(rewards, inputs.values, inputs.token_mask, gamma=inputs.gamma, lam=inputs.lam)
    return whiten(adv, inputs.token_mask, eps=eps, unbiased=unbiased) if scale == "batch" else adv  # [N, T]


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *,
               cliprange_value: float | None, agg: str, max_tokens: int | None = None,
               normalizer: float | Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """The clipped value loss (scalar) and its stats; see the module docstring.

    values (with gradient), old_values, returns, mask  # [N, T]. Stats, means over the real tokens:
    value_loss (the per-token ℓ^V), value_clip_frac (tokens where the clipped term is the larger),
    value_mean, return_mean (the tokens are those ``policy_loss`` counts in its num_tokens)."""
    valid = bool_mask(mask, values.shape)  # [N, T]
    for name, x in (("old_values", old_values), ("returns", returns)):
        if x.shape != values.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(values.shape)} like values")
    if cliprange_value is not None and cliprange_value <= 0:
        raise ValueError(f"cliprange_value={cliprange_value} must be positive (or None: no clipping)")
    zero = values.new_zeros(())
    v = torch.where(valid, values, zero)  # [N, T]
    old = torch.where(valid, old_values.detach().to(v.dtype), zero)
    ret = torch.where(valid, returns.detach().to(v.dtype), zero)
    unclipped = (v - ret).square()
    if cliprange_value is None:
        per_token, clipped_wins = 0.5 * unclipped, torch.zeros_like(valid)
    else:
        v_clip = old + (v - old).clamp(-cliprange_value, cliprange_value)
        clipped = (v_clip - ret).square()
        per_token, clipped_wins = 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped
    loss = aggregate_loss(per_token, valid, agg, max_tokens=max_tokens, normalizer=normalizer)
    with torch.no_grad():
        num = valid.sum()
        denom = num.clamp(min=1).double()
        values_ = {"value_loss": per_token.sum() / denom, "value_clip_frac": (clipped_wins & valid).sum() / denom,
                   "value_mean": v.sum() / denom, "return_mean": ret.sum() / denom}
        floats = torch.stack([x.double() for x in values_.values()]).tolist()
    return loss, dict(zip(values_, floats))
