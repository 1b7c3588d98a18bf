"""Reward functions for GRPO-family training, their combination, and a sandbox for untrusted code.

Every reward function has TRL's signature f(prompts, completions, **columns) -> list[float | None]; for process
supervision a row's value may instead be a list of (end, reward) step pairs (process.py).
See docs/rewards.md for the list of built-ins and their parameters.
"""

from .code import code_tests, extract_code
from .combine import RewardFunctionError, RewardScores, reward_metrics, reward_names, score_completions
from .format import regex_match, think_format, think_format_soft
from .math import extract_answer, math_accuracy, verify_math
from .model import RewardModelScorer, reward_model
from .prm import ProcessRewardModel, process_reward_model
from .process import CharOffset, ProcessRewards, process_rewards, split_steps, token_char_ends
from .registry import BUILTIN_REWARDS, resolve_reward_func, resolve_reward_spec
from grouprl.sandbox import (CodeResult, ProgramResult, SandboxUnavailableError, run_code, run_code_batch, run_program,
                             sandbox_mechanism)
from .shaping import completion_lengths, cosine_length, length_target, overlong_penalty, repetition_penalty

__all__ = [
    "BUILTIN_REWARDS",
    "CharOffset",
    "ProcessRewardModel",
    "ProcessRewards",
    "CodeResult",
    "ProgramResult",
    "RewardFunctionError",
    "RewardModelScorer",
    "RewardScores",
    "SandboxUnavailableError",
    "code_tests",
    "completion_lengths",
    "cosine_length",
    "extract_answer",
    "extract_code",
    "length_target",
    "math_accuracy",
    "overlong_penalty",
    "process_reward_model",
    "process_rewards",
    "regex_match",
    "repetition_penalty",
    "resolve_reward_func",
    "resolve_reward_spec",
    "reward_metrics",
    "reward_model",
    "reward_names",
    "run_code",
    "run_code_batch",
    "run_program",
    "sandbox_mechanism",
    "score_completions",
    "split_steps",
    "think_format",
    "think_format_soft",
    "token_char_ends",
    "verify_math",
]
