"""Whether a generation engine samples from the policy's weights: its log-probs against the policy's.

An engine that samples outside the trainer's model (vLLM, colocated or a server) returns the log-prob
of each token it drew (`Rollout.sampling_logp`). With the policy's weights in the engine, these equal
the policy's own log-probs of the same tokens up to numerics (fp32 on both sides, measured on CPU:
at most 2.1e-5 greedy, 1.8e-5 after a weight sync; tests/rollout/_vllm.py); weights that did not
arrive, or arrived wrong, show as a far larger gap. The vLLM tests and benchmarks/weight_transfer.py
check a sync with `max_logprob_gap`.
"""

from __future__ import annotations

import torch

from grouprl.micro_batches import MicroBatch
from grouprl.policy import completion_logprobs
from grouprl.rollout import GenerationEngine, Rollout, SamplingParams


def policy_logprobs(model: torch.nn.Module, rollout: Rollout, temperature: float = 1.0) -> torch.Tensor:
    """The policy's per-token log-probs [N, T'] of the rollout's completions (full vocabulary), on
    the CPU as the rollout's are (a trainer's model is on cuda:0 on a CUDA machine)."""
    mb = MicroBatch.from_rollout(rollout, torch.arange(len(rollout)))
    with torch.no_grad():
        return completion_logprobs(model, mb, temperature=temperature)[0].cpu()


def max_logprob_gap(engine: GenerationEngine, model: torch.nn.Module, prompts: list[list[int]]) -> float:
    """Greedy completions (8 tokens) from the engine; the largest |engine - policy| log-prob on their tokens."""
    ro = engine.generate(prompts, 1, SamplingParams(max_new_tokens=8, greedy=True))
    logp = policy_logprobs(model, ro)  # [N, T']
    T = logp.shape[1]
    return float((logp - ro.sampling_logp[:, :T]).abs()[ro.completion_mask[:, :T]].max())
