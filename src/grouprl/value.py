"""PPO's learned value function: a linear value head on the policy's last hidden state, and the glue
from its estimates to GAE's advantages and the value loss (core/gae.py holds the math).

    V_φ(s_t) = w·h_t + b,   h_t the policy's last hidden state at the position that predicts token t

Why a head and not a separate critic model (verl's and OpenRLHF's default): the head shares the
policy's trunk, so one forward pass gives the log-probs and the values (policy.completion_forward),
and it adds H+1 parameters and their Adam state, not a second copy of the model with its gradients
and optimizer state (about 4|θ| more in fp32 with Adam). The value loss's gradient reaches the
trunk, scaled by vf_coef: the trunk learns features for both, as in the shared-network PPO of
Schulman et al. 2017 (their c1·L^VF term) and cleanRL's Atari PPO. The price is that interference:
a separate critic keeps the policy's weights out of the value regression. A separate critic is not
offered; benchmarks/ppo_vs_grpo.py measures this head, and states what a separate critic would add.

What each step does (trainer.train_step):
- `PolicyUpdate.values`: a no-grad pass with the head gives V_old [N, T] for the sampled batch;
- the "gae" advantage estimator turns the outcome rewards and V_old into per-token advantages;
- `objective.value_targets` computes the returns R = A + V_old (before any whitening) for the update;
- each micro-batch's pass gives v with gradient, and `add_value_loss` adds vf_coef·ℓ^V (clipped
  to V_old ± cliprange_value, aggregated like the policy loss) to the policy loss.

Deliberate choices:
- the head starts at zero (w = 0, b = 0): V_old = 0 at the first step, so the first advantages are
  the discounted rewards, whitened; no random value noise, and no gradient into the trunk until w
  moves.
- the head's parameters sit in the policy's optimizer, in their own group: their own learning rate
  (value_learning_rate, default 10 x learning_rate, optim.py) on the policy's schedule, clipped with
  the policy's gradient norm.
- under torchrun the head is not wrapped by DDP/FSDP2 (H + 1 parameters, replicated): its
  gradients are averaged over ranks by one all-reduce before the gradient norm is taken
  (`distributed.average_gradients`), and V_old, which each rank computes for its own rows, is
  summed over ranks, so the advantages see the whole batch's values (tests/distributed).
- an `on_collapse: rollback` restores the head's weights with the policy's and the optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grouprl import distributed as D
from grouprl.config import TrainConfig
from grouprl.core import value_loss
from grouprl.lora import base_model


class ValueHead(torch.nn.Module):
    """V(h) = w·h + b on hidden states [..., H]; returns [..., 1]. Starts at zero."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden)


def make_value_head(cfg: TrainConfig, model: torch.nn.Module, dist: D.DistContext) -> ValueHead | None:
    """The value head of a config with value_head set (None otherwise), on the trainer's device."""
    if not cfg.value_head:
        return None
    hidden = base_model(getattr(model, "module", model)).config.get_text_config().hidden_size
    return ValueHead(hidden).to(dist.device)


def optimized_modules(model: torch.nn.Module, value_head: torch.nn.Module | None) -> torch.nn.Module:
    """Every module the optimizer steps, as one: the policy alone, or the policy and the value head
    (names "0.*" and "1.*"). What a rollback snapshot keeps and puts back (guard.py), and, under FSDP2,
    the names the optimizer's checkpointed state is keyed by (training_state.py)."""
    return model if value_head is None else torch.nn.ModuleList([model, value_head])


@dataclass(frozen=True)
class ValueTargets:
    """What the value loss reads, for the whole batch, on the host."""

    old_values: torch.Tensor  # [N, T] V_old, the head's estimates when the batch was sampled
    returns: torch.Tensor     # [N, T] R = A + V_old, GAE's λ-returns


def add_value_loss(loss: torch.Tensor, stats: dict[str, float], values: torch.Tensor | None,
                   old_values: torch.Tensor | None, returns: torch.Tensor | None, mask: torch.Tensor,
                   cfg: TrainConfig, normalizer: int) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss plus vf_coef times the value loss of one pass (unchanged without a value
    head), and the stats with the value loss's. values, old_values, returns, mask  # [n, T']."""
    if values is None:
        return loss, stats
    if old_values is None or returns is None:
        raise ValueError("the update has a value head but no value targets: build the UpdateBatch with "
                         "ValueTargets (trainer.update(batch, advantages, values=...))")
    v_loss, v_stats = value_loss(values, old_values, returns, mask, cliprange_value=cfg.cliprange_value,
                                 agg=cfg.loss_agg, max_tokens=cfg.max_completion_length, normalizer=normalizer)
    return loss + cfg.vf_coef * v_loss, {**stats, **v_stats}
