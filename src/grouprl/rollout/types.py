"""The containers that travel between rollout and trainer, and the engine interface."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, ContextManager, Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How an engine samples. `row_max_new_tokens`, when set, is each prompt's own most new tokens (a
    multi-turn continuation: a row's room is what its earlier turns left), `max_new_tokens` their
    largest. The engines here stop each row at its own (a row stopped there is truncated, as one
    stopped at `max_new_tokens` is), and one with a length limit (vLLM's max_model_len) checks each
    row against its own; the multi-turn driver still cuts each row to its room, so an engine that
    decodes every row to `max_new_tokens` gives the same trajectories, only slower."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    ignore_eos: bool = False
    greedy: bool = False
    row_max_new_tokens: tuple[int, ...] | None = None


@dataclass
class Rollout:
    """N = B*G sampled completions; rows g*G .. g*G+G-1 share prompt g.

    Prompts are left-padded (every prompt ends at column P-1), completions right-padded, so
    `cat([prompt_ids, completion_ids], 1)` is a causal-LM input whose completion starts at column P.

    `sampling_logp` is optional: an engine that samples outside the trainer's model (vLLM) returns
    the log-prob of each completion token under the distribution it actually drew from (temperature
    applied, renormalised over the top-k/top-p set), 0 on padding. The trainer uses it to correct
    the sampler/trainer mismatch. HFEngine samples from the trainer's own model and returns None.

    `action_mask` says which completion tokens the policy sampled (its actions) and which the
    trainer inserted as context (tool results, chat-template glue between turns, see
    rollout/multiturn.py). The loss, KL, entropy, importance correction and completion-length
    metrics read it; the log-prob pass conditions on every real token (`completion_mask`). Left
    None, it is `completion_mask` (a single-turn rollout: every real token is an action).
    `sampling_logp` is 0 on context tokens.
    """

    prompt_ids: torch.Tensor       # [N, P] long
    prompt_mask: torch.Tensor      # [N, P] long (1 = real token)
    completion_ids: torch.Tensor   # [N, T] long
    completion_mask: torch.Tensor  # [N, T] bool, True on real completion tokens (EOS included)
    # [N] bool, True when no EOS came within max_new_tokens (multi-turn: a limit stopped it)
    truncated: torch.Tensor
    sampling_logp: torch.Tensor | None = None  # [N, T] float32, sampler's log-prob, 0 on padding
    action_mask: torch.Tensor | None = None  # [N, T] bool, True on tokens the policy sampled

    def __post_init__(self) -> None:
        if self.action_mask is None:
            self.action_mask = self.completion_mask.clone()  # [N, T]
        elif (self.action_mask & ~self.completion_mask).any():
            raise ValueError("Rollout.action_mask marks padding as an action: every action is a real "
                             "completion token (action_mask <= completion_mask)")

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def lengths(self) -> torch.Tensor:
        """Real completion tokens per row [N]: the policy's and, in a multi-turn rollout, the context."""
        return self.completion_mask.sum(-1)  # [N]

    @property
    def action_lengths(self) -> torch.Tensor:
        """Tokens the policy sampled per row [N] (what completion-length metrics report)."""
        return self.action_mask.sum(-1)  # [N]

    def token_lists(self) -> list[list[int]]:
        """Each row's real completion tokens as a list [N][T_i] (what decoding and rewards read)."""
        return [row[m].tolist() for row, m in zip(self.completion_ids, self.completion_mask)]

    def prompt_groups(self) -> torch.Tensor:
        """[N] long: rows with the same prompt (ids and padding) get the same id."""
        return same_prompt_ids(self.prompt_ids, self.prompt_mask)

    def select(self, rows: torch.Tensor | list[int]) -> Rollout:
        rows = torch.as_tensor(rows, dtype=torch.long)
        return Rollout(self.prompt_ids[rows], self.prompt_mask[rows], self.completion_ids[rows],
                       self.completion_mask[rows], self.truncated[rows],
                       None if self.sampling_logp is None else self.sampling_logp[rows],
                       self.action_mask[rows])

    @staticmethod
    def cat(parts: list[Rollout], pad_token_id: int) -> Rollout:
        """Concatenate rollouts, re-padding prompts on the left and completions on the right.
        `sampling_logp` must be on all parts or on none."""
        if len(parts) == 1:
            return parts[0]
        has_logp = [r.sampling_logp is not None for r in parts]
        if any(has_logp) and not all(has_logp):
            raise ValueError(f"Rollout.cat: sampling_logp is set on {sum(has_logp)} of {len(parts)} parts; "
                             "an engine must return it on every rollout or on none")
        P = max(r.prompt_ids.shape[1] for r in parts)
        T = max(r.completion_ids.shape[1] for r in parts)

        def pad(x: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:
            extra = width - x.shape[1]
            fill = x.new_full((x.shape[0], extra), value)
            return torch.cat([fill, x] if left else [x, fill], dim=1)

        return Rollout(
            torch.cat([pad(r.prompt_ids, P, pad_token_id, True) for r in parts]),
            torch.cat([pad(r.prompt_mask, P, 0, True) for r in parts]),
            torch.cat([pad(r.completion_ids, T, pad_token_id, False) for r in parts]),
            torch.cat([pad(r.completion_mask, T, False, False) for r in parts]),
            torch.cat([r.truncated for r in parts]),
            torch.cat([pad(r.sampling_logp, T, 0.0, False) for r in parts]) if all(has_logp) else None,
            torch.cat([pad(r.action_mask, T, False, False) for r in parts]),
        )


def left_pad_prompts(prompt_ids: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids [B, P] and mask [B, P] (1 on real tokens): every prompt ends at column P-1,
    the layout `Rollout` promises for its prompts."""
    P = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), P), pad_token_id, dtype=torch.long)  # [B, P]
    mask = torch.zeros((len(prompt_ids), P), dtype=torch.long)  # [B, P]
    for b, p in enumerate(prompt_ids):
        ids[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[b, P - len(p):] = 1
    return ids, mask


def sampled_rollout(prompt_ids: list[list[int]], G: int, tokens: list[list[int]], logprobs: list[list[float]],
                    T: int, eos_token_ids: tuple[int, ...], pad_token_id: int, ignore_eos: bool) -> Rollout:
    """A Rollout from an external sampler's answers: `tokens[i]` and `logprobs[i]` are completion i's
    ids and sampling log-probs (i = g*G + j for prompt g), at most T long. A completion is truncated
    when its last token is no EOS (with ignore_eos every completion is T tokens by request)."""
    N = len(tokens)
    ids = torch.full((N, T), pad_token_id, dtype=torch.long)  # [N, T]
    logp = torch.zeros((N, T), dtype=torch.float32)  # [N, T]
    for i, (tok, lp) in enumerate(zip(tokens, logprobs)):
        ids[i, :len(tok)] = torch.tensor(tok, dtype=torch.long)
        logp[i, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
    lengths = torch.tensor([len(t) for t in tokens], dtype=torch.long)  # [N]
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [N, T]
    last = ids.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)  # [N]
    truncated = ~torch.isin(last, torch.tensor(eos_token_ids)) | (lengths == 0)  # [N]
    if ignore_eos:
        truncated[:] = False
    prompt, prompt_mask = left_pad_prompts(prompt_ids, pad_token_id)  # [B, P]
    return Rollout(prompt.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0), ids, mask,
                   truncated, sampling_logp=logp)


def same_prompt_ids(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """[n] long from left-padded prompts [n, P]: equal prompts get equal ids, numbered 0..u-1 in
    sorted order of their tokens."""
    key = torch.where(prompt_mask.bool(), prompt_ids, -1)  # [n, P]
    return torch.unique(key, dim=0, return_inverse=True)[1]


class GenerationEngine(Protocol):
    """What the trainer needs from a generation engine. An external engine (vLLM, SGLang) fits
    behind this: `generate` returns token ids, and `sync_weights` is called after every optimizer
    step (and after a resume loads weights) so the engine samples from the current policy.
    `version` grows whenever the weights change: an engine that copies weights sends nothing when
    it already holds that version. `decodes_with_policy` says whether `generate` runs the training
    model itself (then FSDP2 must gather its weights first) or the engine's own copy."""

    decodes_with_policy: bool

    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 generator: torch.Generator | None = None) -> Rollout: ...

    def sync_weights(self, model: torch.nn.Module, version: int) -> None: ...

    def close(self) -> None:
        """Release what the engine holds (an external engine's memory and processes)."""

    def keep_conversations(self, calls: int | None = None) -> ContextManager[None]:
        """Inside this context the multi-turn driver calls `generate` turn after turn on growing
        conversations, at most `calls` times: an engine that can continue a row from its own cache
        (the built-in engine's KV cache) keeps it between calls. By default nothing is kept (vLLM
        caches prefixes itself)."""
        return contextlib.nullcontext()


STOP_REASONS = ("answer", "env_done", "max_length", "max_turns", "max_tool_calls")
TRUNCATING = ("max_length", "max_turns", "max_tool_calls")


@dataclass
class Trajectories:
    """What `MultiTurnDriver.generate` returns: the tokens and, per row, the conversation."""

    rollout: Rollout
    messages: list[list[dict]] | None  # [N] the assistant, tool and observation messages, in order
    stop_reasons: list[str] | None     # [N] one of STOP_REASONS
    env_rewards: list[float] | None    # [N] summed environment rewards, None without an environment
    counts: dict[str, float] = field(default_factory=dict)  # sums behind `trajectory_metrics`

    def reward_columns(self) -> dict[str, list]:
        """Extra columns for reward functions: `env_reward` when an environment gave rewards."""
        return {} if self.env_rewards is None else {"env_reward": list(self.env_rewards)}


class SingleTurn:
    """The plain rollout behind the same call as `MultiTurnDriver.generate`: one engine call, no
    messages (the trainer decodes the completions). The engine is an argument of each call: the
    trainer owns it (weight syncs, closing) and may swap it."""

    def generate(self, engine: GenerationEngine, prompt_ids: list[list[int]], num_generations: int,
                 params: SamplingParams, generator: torch.Generator | None = None, **rows: Any) -> Trajectories:
        return Trajectories(engine.generate(prompt_ids, num_generations, params, generator), None, None, None)


def trajectory_metrics(counts: dict[str, float]) -> dict[str, float]:
    """Metrics from `Trajectories.counts` (summed over rounds and ranks): per-trajectory means of tool
    calls, tool errors (raised or timed out), parse failures and turns; the fraction of trajectories
    that stopped for each reason; seconds spent in tools and environments. Empty for a single-turn
    rollout (no counts)."""
    if not counts:
        return {}
    n = max(counts.get("trajectories", 0.0), 1.0)
    out = {f"multiturn/{k}_per_trajectory": counts.get(k, 0.0) / n
           for k in ("tool_calls", "tool_errors", "tool_timeouts", "parse_failures", "turns")}
    out.update({f"multiturn/stop_{r}_frac": counts.get(f"stop_{r}", 0.0) / n for r in STOP_REASONS})
    if "tool_calls" in counts:  # a gauge of this process, not a count of the step: threads Python cannot stop
        from grouprl.tools.execute import abandoned_calls

        out["multiturn/tool_calls_abandoned"] = float(abandoned_calls())
    out["time/tools"] = counts.get("tool_seconds", 0.0)
    out["time/environment"] = counts.get("env_seconds", 0.0)
    return out


_CACHE_KWARG: dict[type, str] = {}


def cache_kwarg(model: Any) -> str:
    """The keyword by which `model`'s forward takes a KV cache: `cache` in transformers 5.24 and later,
    which deprecate `past_key_values` (a FutureWarning at every call; gone in 5.40), `past_key_values`
    before. Read from the forward's signature once per model class, through a DDP or FSDP wrapper
    (`.module`) and a PEFT model (its base model)."""
    inner = getattr(model, "module", model)
    if hasattr(inner, "get_base_model"):
        inner = inner.get_base_model()
    cls = type(inner)
    if cls not in _CACHE_KWARG:
        import inspect

        params = inspect.signature(cls.forward).parameters
        _CACHE_KWARG[cls] = "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"
    return _CACHE_KWARG[cls]
