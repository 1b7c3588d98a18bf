"""completion_rows: the logged samples of a batch, checked by hand on a multi-turn rollout."""

import pytest
import torch

from grouprl.batch import StepBatch
from grouprl.rollout import Rollout
from grouprl.sample_stats import completion_rows


def test_per_token_advantage_is_the_mean_over_the_action_tokens():
    """Row 0 is a multi-turn trajectory: 3 actions, 4 context tokens (a tool message), 3 actions.
    Its per-token advantages are 1 on the first turn and 5 on the second (0 on context), so the
    logged advantage is (3*1 + 3*5) / 6 = 3.0, not the mean of the first 6 columns (3*1 + 3*0) / 6 = 0.5.
    Row 1 is single-turn: 2 actions, then padding: (2 + 4) / 2 = 3.0."""
    completion_mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
                                    [1, 1, 0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)  # [N=2, T=10]
    action_mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 1, 1, 1],
                                [1, 1, 0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)  # [N, T]
    rollout = Rollout(torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2, dtype=torch.long),
                      torch.arange(20).view(2, 10), completion_mask, torch.tensor([False, False]), None, action_mask)
    advantages = torch.tensor([[1.0, 1, 1, 0, 0, 0, 0, 5, 5, 5],
                               [2.0, 4, 0, 0, 0, 0, 0, 0, 0, 0]])  # [N, T]
    batch = StepBatch(rollout, ["p0", "p1"], ["c0", "c1"], torch.tensor([1.0, 0.0]), {}, {},
                      stop_reasons=["answer", "answer"])
    rows = completion_rows(batch, advantages, 2)
    assert [r["advantage"] for r in rows] == pytest.approx([3.0, 3.0], abs=1e-7)
    assert [r["length"] for r in rows] == [6, 2]  # the policy's tokens only
