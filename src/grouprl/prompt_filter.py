"""Skips prompts that no longer teach, so rollouts go where the gradient is.

GRPO learns only from groups (G completions of one prompt) whose rewards differ: a group whose
rewards are all equal ("zero variance": every completion right, or every one wrong) has zero
advantage everywhere and contributes nothing. `PromptFilter` remembers, per prompt, the outcome
of its last `history` groups and calls the prompt *settled* when each of them had zero reward
variance. `draw` then passes settled prompts over when taking indices from the `PromptSampler`,
so their G rollouts are not generated at all.

A settled prompt is still taken with probability `revisit`: as the policy changes, a prompt it
always failed may come within reach (or one it always solved may start to slip), and only
sampling it again can tell. The revisit decisions use the filter's own seeded RNG, so every
process of a distributed run, calling with the same arguments in the same order, draws alike,
and a checkpoint (`state_dict`) reproduces the future draws exactly.

If nearly every prompt is settled, `draw` stops skipping after passing over `num_rows` prompts
in one call (a whole epoch's worth) and takes the next ones regardless, warning once: the data
set is exhausted for this policy.

This is separate from DAPO-style dynamic sampling, which samples first and then drops the
zero-variance groups; this filter skips prompts before sampling, from their past groups.
"""

from __future__ import annotations

import logging
import random
from typing import Any, Sequence

from grouprl.data import PromptSampler

logger = logging.getLogger(__name__)


class PromptFilter:
    """Per-prompt memory of flat (zero-variance) groups, used to skip settled prompts."""

    def __init__(self, num_rows: int, *, history: int, revisit: float, seed: int):
        if num_rows < 1:
            raise ValueError(f"num_rows={num_rows}: the prompt filter needs a dataset with at least one row")
        if history < 1:
            raise ValueError(f"history={history}: prompt_filter_history must be >= 1 (the number of "
                             f"consecutive zero-variance groups that settle a prompt); use 1 or more")
        if not 0.0 <= revisit <= 1.0:
            raise ValueError(f"revisit={revisit}: prompt_filter_revisit must be in [0, 1] (the chance "
                             f"of taking a settled prompt anyway); e.g. 0.1")
        self.num_rows, self.history, self.revisit, self.seed = num_rows, history, float(revisit), seed
        # Length of the trailing run of zero-variance groups per prompt, capped at `history`: the
        # prompt's last `history` outcomes are all flat exactly when this equals `history`.
        self._flat_run = [0] * num_rows
        self._rng = random.Random(seed)
        self.skipped = 0
        self._warned = False

    def is_settled(self, index: int) -> bool:
        return self._flat_run[index] >= self.history

    @property
    def num_settled(self) -> int:
        return sum(run >= self.history for run in self._flat_run)

    def record(self, indices: Sequence[int], zero_variance: Sequence[bool]) -> None:
        """One entry per group trained on: its prompt's dataset index and whether its rewards were
        all equal. Only the last `history` outcomes per prompt count; a non-zero-variance group
        among them means the prompt is not settled."""
        if len(indices) != len(zero_variance):
            raise ValueError(f"record got {len(indices)} indices but {len(zero_variance)} "
                             f"zero_variance flags: pass one flag per group")
        for index, flat in zip(indices, zero_variance):
            index = int(index)
            if not 0 <= index < self.num_rows:
                raise ValueError(f"record got prompt index {index}, outside the dataset's "
                                 f"{self.num_rows} rows: pass dataset indices from draw")
            self._flat_run[index] = min(self._flat_run[index] + 1, self.history) if bool(flat) else 0

    def draw(self, sampler: PromptSampler, k: int) -> list[int]:
        """k prompt indices from `sampler`, skipping settled prompts: a prompt is settled when each
        of its last `history` groups had zero reward variance. A settled prompt is still taken with
        probability `revisit` (decided by the filter's own seeded RNG, so every process of a
        distributed run decides alike when they call it with the same arguments in the same order).
        Skipped prompts count in `skipped`."""
        if sampler.num_rows != self.num_rows:
            raise ValueError(f"the sampler has {sampler.num_rows} rows but the prompt filter "
                             f"{self.num_rows}: build both from the same training data")
        out: list[int] = []
        skipped_now = 0
        while len(out) < k:
            index = sampler.next(1)[0]
            if skipped_now >= self.num_rows:  # a whole epoch skipped in this call: stop skipping
                out.append(index)
                continue
            if self.is_settled(index) and self._rng.random() >= self.revisit:
                skipped_now += 1
                self.skipped += 1
                if skipped_now >= self.num_rows and not self._warned:
                    self._warned = True
                    logger.warning(
                        "prompt filter: skipped %d prompts (a whole epoch) in one draw; %d of %d "
                        "prompts are settled (every one of their last %d groups had equal rewards), "
                        "so the data set is exhausted for this policy: taking prompts regardless",
                        skipped_now, self.num_settled, self.num_rows, self.history)
                continue
            out.append(index)
        return out

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss_next = self._rng.getstate()
        return {"num_rows": self.num_rows, "history": self.history, "flat_run": list(self._flat_run),
                "skipped": self.skipped, "rng_version": version, "rng_state": list(internal),
                "rng_gauss_next": gauss_next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_rows"] != self.num_rows:
            raise ValueError(f"the checkpoint's prompt filter was made with {state['num_rows']} "
                             f"training rows, the data now has {self.num_rows}: resume with the same train_data")
        # A changed `history` keeps the runs, capped: settled then means the last min(old, new) flat.
        self._flat_run = [min(int(run), self.history) for run in state["flat_run"]]
        self.skipped = int(state["skipped"])
        self._rng.setstate((int(state["rng_version"]), tuple(int(x) for x in state["rng_state"]),
                            state["rng_gauss_next"]))
