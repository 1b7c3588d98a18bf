"""Generation engines behind one small interface: G completions per prompt."""

from grouprl.rollout.engine import HFEngine, sample_next
from grouprl.rollout.types import GenerationEngine, Rollout, SamplingParams, same_prompt_ids

__all__ = ["GenerationEngine", "HFEngine", "Rollout", "SamplingParams", "same_prompt_ids", "sample_next"]
