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
engine's `keep_conversations()` (GenerationEngine): the built-in engine then continues each row from
the KV cache it kept when the row's previous turn ended (only the new tokens are prefilled); vLLM
reuses the cached prefix (VLLMEngine runs with enable_prefix_caching); any other engine prefills.
Rows finish at different turns; the next call holds only the rows still going.

Environments (docs/tools.md): a class named by import path, one instance per trajectory, with
`reset(**row) -> first observation` (None, a string: a user message, or a list of messages appended
to the prompt) and `step(assistant_message) -> (observation, done)` or `(observation, done, reward)`;
a reward is summed per trajectory and reaches reward functions as the column `env_reward`.
Instances of a batch are built and run concurrently (threads; `async def` methods are awaited), each
call within env_timeout_s.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

import numpy as np
import torch

from grouprl.importpath import import_callable
from grouprl.rollout.types import (STOP_REASONS, TRUNCATING, GenerationEngine, Rollout, SamplingParams, Trajectories,
                                   left_pad_prompts)
from grouprl.tools import (ParsedTurn, Tool, ToolCallParser, execute_calls, render_after_turn,
                           render_tool_messages)

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0  # how long environments' close() may take where env_timeout_s sets no limit


class Environment(Protocol):
    """A stateful task the policy acts in, turn by turn (one instance per trajectory). An optional
    attribute `concurrency` (an int) caps how many of its calls run at once (1: one at a time, each
    call's env_timeout_s counted from its own start); 16 otherwise.

    Optional: `close()`, called once when the rollout is done with the instance, whether it finished,
    was cut by a limit, or the batch failed (also while a call that outlived env_timeout_s still runs:
    closing is how the driver lets go of it). A close that raises or outlives env_timeout_s is logged."""

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
class _Row:
    """One trajectory while it is generated."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)  # the completion so far
    act: list[bool] = field(default_factory=list)  # per token: the policy sampled it
    logp: list[float] = field(default_factory=list)  # per token: the sampler's log-prob (0 on context)
    messages: list[dict] = field(default_factory=list)
    stop: str | None = None  # one of STOP_REASONS once it stopped
    turns: int = 0
    calls: int = 0  # calls attempted, malformed ones included (what max_tool_calls counts)
    env: Any = None
    env_reward: float = 0.0
    hung: bool = False  # a call into its environment outlived env_timeout_s and was given up on

    def add(self, tokens: list[int], *, action: bool, logp: list[float] | None = None) -> None:
        self.ids += tokens
        self.act += [action] * len(tokens)
        self.logp += logp if logp is not None else [0.0] * len(tokens)


class MultiTurnDriver:
    """Multi-turn rollouts over any `GenerationEngine` (module docstring). `tools` with a `parser`,
    or an `environment` factory (called once per trajectory, no arguments); not both."""

    def __init__(self, tokenizer: Any, limits: TurnLimits, *,
                 tools: dict[str, Tool] | None = None, parser: ToolCallParser | None = None,
                 environment: Callable[[], Environment] | None = None, encode: Callable[[Any], list[int]] | None = None,
                 eos_token_ids: tuple[int, ...] = (), tool_timeout_s: float = 30.0, max_concurrency: int = 16,
                 env_timeout_s: float | None = None, max_tool_output_chars: int | None = None,
                 template_kwargs: dict[str, Any] | None = None):
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
        self.env_timeout_s = env_timeout_s  # each reset/step call at most this long; None: no limit
        self.max_tool_output_chars = max_tool_output_chars  # each result's head and tail; None: whole
        self.template_kwargs = template_kwargs  # chat_template_kwargs, as the prompts were rendered with

    def generate(self, engine: GenerationEngine, prompt_ids: list[list[int]], num_generations: int,
                 params: SamplingParams, generator: torch.Generator | None = None, *,
                 prompts: list[Any] | None = None, columns: dict[str, list] | None = None) -> Trajectories:
        """G trajectories for each of B prompts (rows g*G .. g*G+G-1 share prompt g), each turn one
        `engine.generate` call. `prompts` and `columns` (the dataset rows, B each) are what an
        environment's `reset` receives."""
        if params.ignore_eos:
            raise ValueError("ignore_eos=True: a multi-turn rollout ends a turn at EOS; switch it off")
        rows = [_Row(list(p)) for p in prompt_ids for _ in range(num_generations)]
        try:
            return self._generate(engine, rows, prompt_ids, num_generations, params, generator, prompts, columns)
        finally:  # every environment, also when one of the batch failed (a cycle kept the others open until a GC)
            if self.environment is not None:
                self._close_envs(rows)

    def _generate(self, engine: GenerationEngine, rows: list[_Row], prompt_ids: list[list[int]], G: int,
                  params: SamplingParams, generator: torch.Generator | None, prompts: list[Any] | None,
                  columns: dict[str, list] | None) -> Trajectories:
        T = self.limits.max_completion_length
        counts = dict.fromkeys(("tool_calls", "tool_errors", "tool_timeouts", "parse_failures", "tool_seconds",
                                "env_seconds"), 0.0)
        if self.environment is not None:
            t0 = time.perf_counter()
            self._reset(rows, prompts, columns or {}, G)
            counts["env_seconds"] += time.perf_counter() - t0
        active, first, has_logp = rows, True, None
        # the built-in engine continues each row from its KV cache; the last allowed turn's rows go no further
        with _keep_conversations(engine, self.limits.max_turns):
            while active:
                room = [T - len(r.ids) for r in active]
                p = replace(params, max_new_tokens=max(room), row_max_new_tokens=None if first else tuple(room))
                if first and self.environment is None:  # each prompt prefilled once, its cache shared by its G rows
                    ro = engine.generate(prompt_ids, G, p, generator)
                else:
                    ro = engine.generate([r.prompt + r.ids for r in active], 1, p, generator)
                first, has_logp = False, (ro.sampling_logp is not None) if has_logp is None else has_logp
                ended = [(r, turn) for j, r in enumerate(active)
                         if (turn := self._read_turn(r, ro, j, room[j], has_logp)) is not None]
                answers = self._answer_tools(ended, counts) if self.environment is None \
                    else self._step_envs(ended, counts)
                for r, (context, messages) in answers:
                    if len(r.ids) + len(context) >= T:  # no room left for another turn after these messages
                        r.stop = "max_length"
                        continue
                    r.add(context, action=False)
                    r.messages += messages
                active = [r for r in active if r.stop is None]
        counts.update(trajectories=len(rows), turns=sum(r.turns for r in rows),
                      **{f"stop_{s}": sum(r.stop == s for r in rows) for s in STOP_REASONS})
        env_rewards = [r.env_reward for r in rows] if self.environment is not None else None
        return Trajectories(self._rollout(rows, has_logp), [r.messages for r in rows], [r.stop for r in rows],
                            env_rewards, counts)

    def _read_turn(self, row: _Row, ro: Rollout, j: int, room: int, has_logp: bool) -> ParsedTurn | None:
        """Append row j of this turn's rollout to `row` (cut to its room, where the engines stop it; the
        cut reads an engine that decoded further alike); the parsed turn when it ended with EOS, else
        None (the row stops: max_length)."""
        new = ro.completion_ids[j][ro.completion_mask[j]].tolist()[:room]
        row.add(new, action=True, logp=ro.sampling_logp[j][: len(new)].tolist() if has_logp else None)
        row.turns += 1
        if not new or new[-1] not in self.eos:  # cut by the budget before its end of turn
            row.messages.append({"role": "assistant", "content": self.tokenizer.decode(new, skip_special_tokens=True)})
            row.stop = "max_length"
            return None
        text = self.tokenizer.decode(new[:-1], skip_special_tokens=False)
        if self.parser is None:
            turn = ParsedTurn(text)
        elif self.parser.format == "template":  # transformers' parsing must see what the prompt pre-wrote (<think>)
            before = self.tokenizer.decode(row.prompt + row.ids[: -len(new)], skip_special_tokens=False)
            turn = self.parser.parse(text, prefix=before)
        else:
            turn = self.parser.parse(text)
        row.messages.append(turn.as_message())
        return turn

    # ------------------------------------------------------------------ between turns
    def _answer_tools(self, ended: list[tuple[_Row, ParsedTurn]], counts: dict[str, float]
                      ) -> list[tuple[_Row, tuple[list[int], list[dict]]]]:
        """Run the calls of the turns that made some; the rendered tool messages per row."""
        run: list[tuple[_Row, ParsedTurn]] = []
        for row, turn in ended:
            if not turn.calls:
                row.stop = "answer"
            elif row.turns >= self.limits.max_turns:
                row.stop = "max_turns"
            elif row.calls + len(turn.calls) > self.limits.max_tool_calls:
                row.stop = "max_tool_calls"
            else:
                run.append((row, turn))
                row.calls += len(turn.calls)
        if not run:
            return []
        batch = execute_calls([turn.calls for _, turn in run], self.tools, timeout_s=self.tool_timeout_s,
                              max_concurrency=self.max_concurrency, max_output_chars=self.max_tool_output_chars)
        counts["tool_calls"] += batch.num_calls  # calls made (a ParseError is none, but counts to the limit)
        counts["tool_errors"] += batch.count("error") + batch.count("timeout")
        counts["tool_timeouts"] += batch.count("timeout")
        counts["parse_failures"] += batch.count("parse_error")
        counts["tool_seconds"] += batch.wall_s
        return [(row, (render_tool_messages(self.tokenizer, results, self.tools, self.template_kwargs),
                       [r.message for r in results]))
                for (row, _), results in zip(run, batch.results)]

    def _step_envs(self, ended: list[tuple[_Row, ParsedTurn]], counts: dict[str, float]
                   ) -> list[tuple[_Row, tuple[list[int], list[dict]]]]:
        """Each ended turn's environment step (concurrently); the rendered observations per row."""
        if not ended:
            return []
        t0 = time.perf_counter()
        outs = self._on_envs([row for row, _ in ended], [(row.env.step, (row.messages[-1],)) for row, _ in ended])
        counts["env_seconds"] += time.perf_counter() - t0
        answers = []
        for (row, _), out in zip(ended, outs):
            name = type(row.env).__name__
            if not (isinstance(out, tuple) and len(out) in (2, 3)):
                raise TypeError(f"{name}.step returned {out!r}: return (observation, done) or "
                                "(observation, done, reward)")
            observation, done = out[0], out[1]
            if not isinstance(done, (bool, np.bool_)):
                raise TypeError(f"{name}.step returned done={done!r}: return True or False")
            if len(out) == 3 and out[2] is not None:
                reward = out[2]
                if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
                    raise TypeError(f"{name}.step returned the reward {reward!r}: return a finite number, or "
                                    "None for no reward")
                row.env_reward += float(reward)
            if done:
                row.stop = "env_done"
                continue
            if row.turns >= self.limits.max_turns:
                row.stop = "max_turns"
                continue
            obs = _as_messages(observation, f"{name}.step")
            if not obs:
                raise ValueError(f"{name}.step returned no observation and done=False: "
                                 "the policy needs something to answer, or return done=True")
            answers.append((row, (render_after_turn(self.tokenizer, obs, self.tools or None,
                                                    template_kwargs=self.template_kwargs), obs)))
        return answers

    def _reset(self, rows: list[_Row], prompts: list[Any] | None, columns: dict[str, list], G: int) -> None:
        """One environment per row; each first observation appended to its row's prompt messages (re-encoded)."""
        if prompts is None:
            raise ValueError("an environment's reset receives the dataset row: pass prompts= (and columns=)")
        data = [{"prompt": prompts[b], **{k: v[b] for k, v in columns.items()}} for b in range(len(prompts))
                for _ in range(G)]

        lock, given_up = threading.Lock(), []

        def build(row: _Row) -> None:  # each environment on its row as it is built, so that none goes unclosed
            env = self.environment()
            with lock:
                if not given_up:
                    row.env = env
                    return
            if callable(getattr(env, "close", None)):  # built after the batch was given up on (and closed)
                _close(env)

        def give_up(_: list[int]) -> None:
            with lock:
                given_up.append(True)

        # built concurrently and each within env_timeout_s, as a factory may open a session (an OpenEnv client);
        # then reset, as many at once as the instances say (an OpenEnv factory's say so only once built)
        name = getattr(self.environment, "__qualname__", None) or type(self.environment).__name__
        _concurrently([(build, (row,)) for row in rows], self.env_timeout_s, _concurrency([self.environment]),
                      what=f"{name}() (building the environment)", on_give_up=give_up)
        outs = self._on_envs(rows, [(row.env.reset, (), d) for row, d in zip(rows, data)])
        for row, obs, d in zip(rows, outs, data):
            if obs is None:
                continue
            if not isinstance(d["prompt"], list):
                raise ValueError(f"{type(row.env).__name__}.reset returned an observation but the prompt is a "
                                 "string: give the dataset's prompts as chat messages, or return None")
            row.prompt = self.encode(d["prompt"] + _as_messages(obs, f"{type(row.env).__name__}.reset"))

    def _on_envs(self, rows: list[_Row], jobs: list[tuple]) -> list[Any]:
        """_concurrently over one call into each row's environment; a row whose call is given up on is `hung`."""

        def give_up(indices: list[int]) -> None:
            for i in indices:
                rows[i].hung = True

        return _concurrently(jobs, self.env_timeout_s, _concurrency([r.env for r in rows]), on_give_up=give_up)

    def _close_envs(self, rows: list[_Row]) -> None:
        """close() each row's environment that has one, as many at once as they take, within env_timeout_s
        (CLOSE_TIMEOUT_S where it sets no limit): first those whose call was given up on (an OpenEnv
        environment of one call at a time then knows that its thread is stuck, and the others' closes do
        not queue behind it), then the rest. A close that raises or does not return is logged; those
        still queued behind one that does not return are started as it returns, not dropped."""
        timeout_s = self.env_timeout_s if self.env_timeout_s is not None else CLOSE_TIMEOUT_S
        closable = [r for r in rows if callable(getattr(r.env, "close", None))]
        for envs in ([r.env for r in closable if r.hung], [r.env for r in closable if not r.hung]):
            if not envs:
                continue
            try:
                failures = _concurrently([(_close, (e,)) for e in envs], timeout_s, _concurrency(envs),
                                         what=f"{type(envs[0]).__name__}.close", start_all=True)
            except EnvironmentTimeout:
                logger.warning("%s.close() did not return within %g s (env_timeout_s, or %g s without one) for some of "
                               "%d environments: they are left to finish in the background, and the run goes on",
                               type(envs[0]).__name__, timeout_s, CLOSE_TIMEOUT_S, len(envs))
                continue
            except Exception as e:  # noqa: BLE001 -- the rollout's own outcome (its result or error) comes first
                logger.warning("closing %d environments: %s", len(envs), e)
                continue
            for env, failure in zip(envs, failures):
                if failure is not None:
                    logger.warning("%s.close() raised %s", type(env).__name__, failure)

    def _rollout(self, rows: list[_Row], has_logp: bool) -> Rollout:
        pad = self.tokenizer.pad_token_id
        pids, pmask = left_pad_prompts([r.prompt for r in rows], pad)  # [N, P]
        N, T = len(rows), max(1, max(len(r.ids) for r in rows))
        cids = torch.full((N, T), pad, dtype=torch.long)  # [N, T]
        cmask = torch.zeros((N, T), dtype=torch.bool)
        amask = torch.zeros((N, T), dtype=torch.bool)
        slogp = torch.zeros((N, T), dtype=torch.float32) if has_logp else None
        for i, r in enumerate(rows):
            n = len(r.ids)
            cids[i, :n] = torch.tensor(r.ids, dtype=torch.long)
            cmask[i, :n] = True
            amask[i, :n] = torch.tensor(r.act, dtype=torch.bool)
            if slogp is not None:
                slogp[i, :n] = torch.tensor(r.logp, dtype=torch.float32)
        truncated = torch.tensor([r.stop in TRUNCATING for r in rows], dtype=torch.bool)  # [N]
        return Rollout(pids, pmask, cids, cmask, truncated, slogp, amask)


def _as_messages(observation: Any, where: str) -> list[dict]:
    """An observation as chat messages: a string is one user message."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, dict):
        observation = [observation]
    if not (isinstance(observation, list) and all(isinstance(m, dict) and "role" in m and isinstance(
            m.get("content"), (str, list)) for m in observation)):
        raise TypeError(f"{where} returned {observation!r}: an observation is a string or a list of "
                        "{'role': ..., 'content': '...'} messages, each content a string (or a template's parts)")
    return list(observation)


def _keep_conversations(engine: GenerationEngine, calls: int) -> Any:
    """`engine.keep_conversations(calls=calls)`, or without the bound for an engine whose method takes
    none (one written to the protocol before the bound existed)."""
    try:
        params = inspect.signature(engine.keep_conversations).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): call it as the protocol had it
        params = ()
    takes = any(p.name == "calls" or p.kind is p.VAR_KEYWORD for p in params)
    return engine.keep_conversations(calls=calls) if takes else engine.keep_conversations()


def _concurrency(envs: list[Any]) -> int:
    """How many of these environments' calls run at once: 16, or less where one says so (`concurrency`)."""
    return min([16] + [c for e in envs if isinstance(c := getattr(e, "concurrency", None), int) and c >= 1])


def _call(fn: Callable, args: tuple, kwargs: dict) -> Any:
    out = fn(*args, **kwargs)
    return asyncio.run(out) if inspect.isawaitable(out) else out


def _close(env: Any) -> str | None:
    """env.close(); what it raised, as text, or None."""
    try:
        _call(env.close, (), {})
    except Exception as e:  # noqa: BLE001 -- logged by the caller
        return f"{type(e).__name__}: {e}"
    return None


class EnvironmentTimeout(TimeoutError):
    """An environment's construction, reset or step did not return within env_timeout_s."""


def _called(fn: Callable) -> str:
    """What an error calls `fn`: a method by its instance's class (OpenEnv's are subclasses named by the adapter)."""
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, type) and hasattr(fn, "__name__"):
        return f"{type(owner).__name__}.{fn.__name__}"
    return getattr(fn, "__qualname__", None) or repr(fn)


def _concurrently(jobs: list[tuple], timeout_s: float | None = None, concurrency: int = 16,
                  what: str | None = None, on_give_up: Callable[[list[int]], None] | None = None,
                  start_all: bool = False) -> list[Any]:
    """Run (fn, args[, kwargs]) jobs in threads, `concurrency` at a time, results in order. Every call is
    waited for; then the first exception in the calls' order propagates (a bug in an environment is the
    user's to see, unlike a tool's failure, which the model is shown), and a call running longer than
    `timeout_s` from its start stops the wait as EnvironmentTimeout, naming the call (or `what`). Daemon
    threads: Python cannot stop a hung call, so it is abandoned, and cannot block the exit; calls not
    yet started then are not started (unless `start_all`: closes, which must all run), and `on_give_up`
    hears the indices of those running."""
    gate, futures = threading.Semaphore(concurrency), [Future() for _ in jobs]
    started: list[float | None] = [None] * len(jobs)
    stopped = threading.Event()

    def run(i: int, fn: Callable, args: tuple, kwargs: dict) -> None:
        future = futures[i]  # (the caller drops its list once it has an error to raise: a late call needs its own)
        try:
            with gate:
                if stopped.is_set() and not start_all:
                    return
                started[i] = time.monotonic()
                try:
                    future.set_result(_call(fn, args, kwargs))
                except Exception as e:  # noqa: BLE001 -- handed to the caller's thread
                    future.set_exception(e)
                except BaseException as e:  # SystemExit, KeyboardInterrupt: not the run's end (exit 3 is an alarm's)
                    future.set_exception(RuntimeError(
                        f"{what or _called(fn)} raised {type(e).__name__}{e.args!r}: an environment may "
                        "not end the process; raise an exception for a bug, or end the episode with done=True"))
        finally:  # an error's traceback keeps this frame: it must not hold the error (a cycle) or the batch
            future = fn = args = kwargs = None

    for i, job in enumerate(jobs):
        threading.Thread(target=run, args=(i, job[0], job[1], job[2] if len(job) > 2 else {}), daemon=True,
                         name="grouprl-env").start()
    pending = set(futures)
    while pending:
        now = time.monotonic()
        running = [started[i] for i, f in enumerate(futures) if f in pending and started[i] is not None]
        if timeout_s is not None and any(now - t > timeout_s for t in running):
            break
        # wake at the first completion or at the earliest deadline (a call that starts later ends later
        # than now + timeout_s); every call is waited for, so that each failed environment is closed
        wake = None if timeout_s is None else max(0.0, min([t + timeout_s for t in running] + [now + timeout_s]) - now)
        pending = wait(pending, timeout=None if wake is None else wake + 1e-3, return_when=FIRST_COMPLETED)[1]
    if pending:
        stopped.set()
        if on_give_up is not None:
            on_give_up([i for i, f in enumerate(futures) if f in pending and started[i] is not None])
    error = next((f.exception() for f in futures if f.done() and f.exception() is not None), None)
    if error is not None:  # the first in the calls' order, as a bug in the environment
        # its traceback holds this frame: without the frame's ways back to it (futures, error), the cycle would
        # keep every frame of the traceback, and so the batch's environments, until a full GC
        futures = pending = None
        try:
            raise error
        finally:
            error = None
    if pending:
        fn = jobs[next(i for i, f in enumerate(futures) if f in pending)][0]
        raise EnvironmentTimeout(
            f"{what or _called(fn)} did not return within env_timeout_s={timeout_s:g} s ({len(pending)} "
            f"of {len(jobs)} calls had not returned): a hung environment stops the run like one that raises (its "
            "thread is abandoned); fix the environment, or raise env_timeout_s (null: no limit)")
    return [f.result() for f in futures]


def resolve_environment(spec: str | type | None) -> type | None:
    """The environment class from `environment: package.module:Class` (or the class itself);
    ValueError when it cannot be imported or lacks `reset`/`step`."""
    if spec is None or isinstance(spec, type):
        return spec
    env = import_callable(spec, "environment")
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise ValueError(f"environment={spec!r} has no {' or '.join(missing)} method: an environment has "
                         "reset(**row) -> first observation and step(assistant_message) -> (observation, done)")
    return env
