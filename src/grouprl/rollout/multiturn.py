"""The multi-turn driver: tool calls and environment steps between generation calls, above any engine.

Each of the N = B*G rows is one trajectory. A turn is one `engine.generate` call over the rows still
going; between turns the driver reads each row's assistant turn and appends what answers it:

    turn 1   engine.generate(prompts, G)               assistant tokens up to the end-of-turn (EOS) token
             tools: parse the calls (the model's template format), run them (rows concurrently),
                    render the tool messages with the chat template -> token ids
             environment: env.step(assistant message) -> observation messages, done
             -> appended as context tokens (action_mask False)
    turn k   engine.generate(prompt + completion so far, 1)   for the rows still going

The completion of a row is every turn's tokens and every inserted message's tokens, in order; the
`Rollout`'s `action_mask` is True only on tokens the policy sampled, so the loss, KL and entropy see
the policy's actions while the log-prob pass conditions on the whole conversation.

How a row stops (`Trajectories.stop_reasons`, and `Rollout.truncated`):

    answer          the turn ended with EOS and called no tool                          truncated False
    env_done        the environment said done                                           truncated False
    max_length      the budget of max_completion_length tokens (actions and context
                    together) ran out inside a turn, or the next messages would leave
                    no room for another turn                                            truncated True
    max_turns       the max_turns-th assistant turn still called a tool                  truncated True
    max_tool_calls  the turn's calls would take the trajectory past max_tool_calls
                    (they are not run)                                                  truncated True

Continuation: a later turn passes the whole conversation as the prompt. The driver opens the
engine's `keep_conversations()` when it has one: the built-in engine then continues each row from
the KV cache it kept when the row's previous turn ended (only the new tokens are prefilled); vLLM
reuses the cached prefix (VLLMEngine runs with enable_prefix_caching); any other engine prefills.
Rows finish at different turns; the next call holds only the rows still going.

Environments (docs/tools.md): a class named by import path, one instance per trajectory, with
`reset(**row) -> first observation` (None, a string: a user message, or a list of messages appended
to the prompt) and `step(assistant_message) -> (observation, done)` or `(observation, done, reward)`;
a reward is summed per trajectory and reaches reward functions as the column `env_reward`.
Instances of a batch run concurrently (threads; `async def` methods are awaited).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

import torch

from grouprl.rollout.types import GenerationEngine, Rollout, SamplingParams, left_pad_prompts
from grouprl.tools import (ParsedTurn, Tool, ToolCallParser, execute_calls, render_after_turn,
                           render_tool_messages)

STOP_REASONS = ("answer", "env_done", "max_length", "max_turns", "max_tool_calls")
TRUNCATING = ("max_length", "max_turns", "max_tool_calls")


class Environment(Protocol):
    """A stateful task the policy acts in, turn by turn (one instance per trajectory)."""

    def reset(self, **row: Any) -> str | list[dict] | None: ...

    def step(self, message: dict) -> tuple[str | list[dict], bool] | tuple[str | list[dict], bool, float]: ...


@dataclass(frozen=True)
class TurnLimits:
    max_completion_length: int  # tokens per trajectory, the policy's and the inserted context together
    max_turns: int = 8  # assistant turns per trajectory
    max_tool_calls: int = 8  # tool calls per trajectory

    def __post_init__(self) -> None:
        for name in ("max_completion_length", "max_turns", "max_tool_calls"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: a multi-turn rollout needs at least 1")


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
    out["time/tools"] = counts.get("tool_seconds", 0.0)
    out["time/environment"] = counts.get("env_seconds", 0.0)
    return out


class MultiTurnDriver:
    """Multi-turn rollouts over any `GenerationEngine` (module docstring). `tools` with a `parser`,
    or an `environment` factory (called once per trajectory, no arguments); not both."""

    def __init__(self, tokenizer: Any, limits: TurnLimits, *,
                 tools: dict[str, Tool] | None = None, parser: ToolCallParser | None = None,
                 environment: Callable[[], Environment] | None = None, encode: Callable[[Any], list[int]] | None = None,
                 eos_token_ids: tuple[int, ...] = (), tool_timeout_s: float = 30.0, max_concurrency: int = 16):
        if bool(tools) == (environment is not None):
            raise ValueError("a multi-turn rollout needs tools or an environment (one of them: an environment "
                             "answers every assistant turn itself, so it runs any tools it offers)")
        if tools and parser is None:
            raise ValueError("tools need a parser (grouprl.tools.get_tool_parser) to read the model's calls")
        if environment is not None and encode is None:
            raise ValueError("an environment needs `encode` (prompt messages -> ids) for its first observation")
        self.tokenizer, self.limits = tokenizer, limits
        self.tools, self.parser, self.environment, self.encode = tools or {}, parser, environment, encode
        self.eos = set(eos_token_ids) or {tokenizer.eos_token_id}
        self.tool_timeout_s, self.max_concurrency = tool_timeout_s, max_concurrency

    def generate(self, engine: GenerationEngine, prompt_ids: list[list[int]], num_generations: int,
                 params: SamplingParams, generator: torch.Generator | None = None, *,
                 prompts: list[Any] | None = None, columns: dict[str, list] | None = None) -> Trajectories:
        """G trajectories for each of B prompts (rows g*G .. g*G+G-1 share prompt g), each turn one
        `engine.generate` call. `prompts` and `columns` (the dataset rows, B each) are what an
        environment's `reset` receives."""
        G, T = num_generations, self.limits.max_completion_length
        if params.ignore_eos:
            raise ValueError("ignore_eos=True: a multi-turn rollout ends a turn at EOS; switch it off")
        N = len(prompt_ids) * G
        prompt = [list(p) for p in prompt_ids for _ in range(G)]  # [N][P_i]
        ids: list[list[int]] = [[] for _ in range(N)]  # [N][T_i] completion so far
        act: list[list[bool]] = [[] for _ in range(N)]
        logp: list[list[float]] = [[] for _ in range(N)]
        messages: list[list[dict]] = [[] for _ in range(N)]
        reason: list[str | None] = [None] * N
        turns, calls = [0] * N, [0] * N
        counts = dict.fromkeys(("tool_calls", "tool_errors", "tool_timeouts", "parse_failures", "tool_seconds",
                                "env_seconds"), 0.0)
        envs, env_rewards = None, None
        if self.environment is not None:
            envs, env_rewards = [self.environment() for _ in range(N)], [0.0] * N
            t0 = time.perf_counter()
            prompt = self._reset(envs, prompt, prompts, columns or {}, G)
            counts["env_seconds"] += time.perf_counter() - t0
        has_logp, first = None, True
        active = list(range(N))
        keep = getattr(engine, "keep_conversations", None)  # the built-in engine continues from its KV cache
        with keep() if keep is not None else contextlib.nullcontext():
            while active:
                room = {i: T - len(ids[i]) for i in active}
                p = replace(params, max_new_tokens=max(room.values()))
                if first and envs is None:  # each prompt prefilled once, its cache shared by its G rows
                    ro = engine.generate(prompt_ids, G, p, generator)
                else:
                    ro = engine.generate([prompt[i] + ids[i] for i in active], 1, p, generator)
                has_logp = ro.sampling_logp is not None if has_logp is None else has_logp
                first = False
                ended: dict[int, ParsedTurn] = {}
                for j, i in enumerate(active):
                    new = ro.completion_ids[j][ro.completion_mask[j]].tolist()[: room[i]]
                    ids[i] += new
                    act[i] += [True] * len(new)
                    if has_logp:
                        logp[i] += ro.sampling_logp[j][: len(new)].tolist()
                    turns[i] += 1
                    if not new or new[-1] not in self.eos:  # cut by the budget before its end of turn
                        text = self.tokenizer.decode(new, skip_special_tokens=True)
                        messages[i].append({"role": "assistant", "content": text})
                        reason[i] = "max_length"
                        continue
                    text = self.tokenizer.decode(new[:-1], skip_special_tokens=False)
                    turn = self.parser.parse(text) if self.parser is not None else ParsedTurn(text)
                    messages[i].append(turn.as_message())
                    ended[i] = turn
                context = self._answer_tools(ended, reason, turns, calls, counts) if envs is None \
                    else self._step_envs(envs, ended, reason, turns, env_rewards, messages, counts)
                for i, (ctx, answer) in context.items():
                    if len(ids[i]) + len(ctx) >= T:  # no room left for another turn after these messages
                        reason[i] = "max_length"
                        continue
                    ids[i] += ctx
                    act[i] += [False] * len(ctx)
                    logp[i] += [0.0] * len(ctx)
                    messages[i] += answer
                active = [i for i in active if reason[i] is None]
        counts.update(trajectories=N, turns=sum(turns),
                      **{f"stop_{r}": sum(x == r for x in reason) for r in STOP_REASONS})
        rollout = self._rollout(prompt, ids, act, logp if has_logp else None, reason)
        return Trajectories(rollout, messages, list(reason), env_rewards, counts)

    # ------------------------------------------------------------------ between turns
    def _answer_tools(self, ended: dict[int, ParsedTurn], reason: list, turns: list[int], calls: list[int],
                      counts: dict[str, float]) -> dict[int, tuple[list[int], list[dict]]]:
        """Run the calls of the turns that made some; the rendered tool messages per row."""
        run: dict[int, ParsedTurn] = {}
        for i, turn in ended.items():
            if not turn.calls:
                reason[i] = "answer"
            elif turns[i] >= self.limits.max_turns:
                reason[i] = "max_turns"
            elif calls[i] + len(turn.calls) > self.limits.max_tool_calls:
                reason[i] = "max_tool_calls"
            else:
                run[i] = turn
                calls[i] += len(turn.calls)
        if not run:
            return {}
        batch = execute_calls([t.calls for t in run.values()], self.tools, timeout_s=self.tool_timeout_s,
                              max_concurrency=self.max_concurrency)
        counts["tool_calls"] += batch.num_calls  # calls made (a ParseError is none, but counts to the limit)
        counts["tool_errors"] += batch.count("error") + batch.count("timeout")
        counts["tool_timeouts"] += batch.count("timeout")
        counts["parse_failures"] += batch.count("parse_error")
        counts["tool_seconds"] += batch.wall_s
        return {i: (render_tool_messages(self.tokenizer, results, self.tools), [r.message for r in results])
                for i, results in zip(run, batch.results)}

    def _step_envs(self, envs: list, ended: dict[int, ParsedTurn], reason: list, turns: list[int],
                   env_rewards: list[float], messages: list[list[dict]], counts: dict[str, float]
                   ) -> dict[int, tuple[list[int], list[dict]]]:
        """Each ended turn's environment steps (concurrently); the rendered observations per row."""
        if not ended:
            return {}
        t0 = time.perf_counter()
        rows = list(ended)
        outs = _concurrently([(envs[i].step, (messages[i][-1],)) for i in rows])
        counts["env_seconds"] += time.perf_counter() - t0
        context = {}
        for i, out in zip(rows, outs):
            if not (isinstance(out, tuple) and len(out) in (2, 3)):
                raise TypeError(f"{type(envs[i]).__name__}.step returned {out!r}: return (observation, done) or "
                                "(observation, done, reward)")
            observation, done = out[0], bool(out[1])
            if len(out) == 3 and out[2] is not None:
                env_rewards[i] += float(out[2])
            if done:
                reason[i] = "env_done"
                continue
            if turns[i] >= self.limits.max_turns:
                reason[i] = "max_turns"
                continue
            obs = _as_messages(observation, f"{type(envs[i]).__name__}.step")
            if not obs:
                raise ValueError(f"{type(envs[i]).__name__}.step returned no observation and done=False: "
                                 "the policy needs something to answer, or return done=True")
            context[i] = (render_after_turn(self.tokenizer, obs, self.tools or None), obs)
        return context

    def _reset(self, envs: list, prompt: list[list[int]], prompts: list[Any] | None, columns: dict[str, list],
               G: int) -> list[list[int]]:
        """Each environment's first observation, appended to its row's prompt messages (re-encoded)."""
        if prompts is None:
            raise ValueError("an environment's reset receives the dataset row: pass prompts= (and columns=)")
        rows = [{"prompt": prompts[b], **{k: v[b] for k, v in columns.items()}} for b in range(len(prompts))
                for _ in range(G)]
        outs = _concurrently([(env.reset, (), row) for env, row in zip(envs, rows)])
        for i, (obs, row) in enumerate(zip(outs, rows)):
            if obs is None:
                continue
            if not isinstance(row["prompt"], list):
                raise ValueError(f"{type(envs[i]).__name__}.reset returned an observation but the prompt is a "
                                 "string: give the dataset's prompts as chat messages, or return None")
            prompt[i] = self.encode(row["prompt"] + _as_messages(obs, f"{type(envs[i]).__name__}.reset"))
        return prompt

    def _rollout(self, prompt: list[list[int]], ids: list[list[int]], act: list[list[bool]],
                 logp: list[list[float]] | None, reason: list) -> Rollout:
        pad = self.tokenizer.pad_token_id
        pids, pmask = left_pad_prompts(prompt, pad)  # [N, P]
        N, T = len(ids), max(1, max(len(x) for x in ids))
        cids = torch.full((N, T), pad, dtype=torch.long)  # [N, T]
        cmask = torch.zeros((N, T), dtype=torch.bool)
        amask = torch.zeros((N, T), dtype=torch.bool)
        slogp = torch.zeros((N, T), dtype=torch.float32) if logp is not None else None
        for i, row in enumerate(ids):
            cids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            cmask[i, : len(row)] = True
            amask[i, : len(row)] = torch.tensor(act[i], dtype=torch.bool)
            if slogp is not None:
                slogp[i, : len(row)] = torch.tensor(logp[i], dtype=torch.float32)
        truncated = torch.tensor([r in TRUNCATING for r in reason], dtype=torch.bool)  # [N]
        return Rollout(pids, pmask, cids, cmask, truncated, slogp, amask)


def _as_messages(observation: Any, where: str) -> list[dict]:
    """An observation as chat messages: a string is one user message."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, dict):
        observation = [observation]
    if not (isinstance(observation, list) and all(isinstance(m, dict) and "role" in m for m in observation)):
        raise TypeError(f"{where} returned {observation!r}: an observation is a string or a list of "
                        "{'role': ..., 'content': ...} messages")
    return list(observation)


def _call(fn: Callable, args: tuple, kwargs: dict) -> Any:
    out = fn(*args, **kwargs)
    return asyncio.run(out) if inspect.isawaitable(out) else out


def _concurrently(jobs: list[tuple]) -> list[Any]:
    """Run (fn, args[, kwargs]) jobs in threads, results in order; an exception propagates (a bug in
    an environment is the user's to see, unlike a tool's failure, which the model is shown)."""
    with ThreadPoolExecutor(max(1, min(16, len(jobs))), thread_name_prefix="grouprl-env") as pool:
        futures = [pool.submit(_call, job[0], job[1], job[2] if len(job) > 2 else {}) for job in jobs]
        return [f.result() for f in futures]
