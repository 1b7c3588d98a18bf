"""OpenEnv environments trained by grouprl: `OpenEnvAdapter` puts OpenEnv's Gym-style API behind the
environment protocol that the multi-turn driver runs (rollout/multiturn.py, docs/tools.md).

What this module relies on in OpenEnv (openenv-core 0.3, package `openenv.core`):

    Environment.reset(seed=None, episode_id=None, **kwargs) -> Observation
    Environment.step(action: Action, timeout_s=None, **kwargs) -> Observation
    Observation   pydantic model: done, reward, metadata, and the environment's own fields
    Action        pydantic model: metadata, and the environment's own fields
    Environment.rubric   a Rubric or None; rubric.named_rubrics() yields (dotted path, Rubric), each
                  holding the last_score of its latest call; WeightedSum exposes its children's weights
    SUPPORTS_CONCURRENT_SESSIONS, REQUIRES_SINGLE_THREAD_EXECUTOR   class flags of an Environment
    EnvClient(...).sync()   a remote environment: reset/step return StepResult(observation, reward, done)

The mapping, for each trajectory (each gets its own OpenEnv environment: built by a class or a
factory, or deep-copied from an instance, so trajectories never share state):

    dataset row             -> env.reset(**the row's columns that reset accepts); `prompt` stays ours:
                               the messages shown before the first observation
    reset's observation     -> a user message, appended to the prompt
    the policy's reply      -> env.step(action(reply text))
    step's observation      -> the next user (or tool) message (NO_OUTPUT, "[no output]", where it renders
                               to no text); observation.done ends the trajectory
    observation.reward      -> summed per trajectory by the driver into the `env_reward` column, which
                               the reward function `openenv_reward` returns as is
    rubric components       -> each step's last_score, noted on the assistant message the step answered
                               (under the key "openenv"), summed over the trajectory by `rubric_reward`

Deliberate choices:
- OpenEnv's Environment API has no dataset or task notion (reset takes free keyword arguments), so a
  training row is one set of reset arguments, or a prompt, or both (`rows`); the G trajectories of a
  group reset with the same arguments, i.e. play the same episode, which is what a group baseline needs.
- A reply that cannot be made into an Action (pydantic rejects it) is the model's mistake: the model
  is told ("invalid action: ...") and the trajectory goes on, as a malformed tool call is answered by
  a tool message. An exception inside reset or step is a bug in the environment and stops the step,
  as it does for any environment (docs/tools.md), raised as `OpenEnvCallError` naming the
  environment, the call and the action.
- An environment that keeps OpenEnv's default SUPPORTS_CONCURRENT_SESSIONS = False, or sets
  REQUIRES_SINGLE_THREAD_EXECUTOR, has its calls run one at a time on one thread: the driver otherwise
  calls the N environments of a batch concurrently from a pool of threads. That thread is a daemon, so a
  call that never returns cannot hold up the process's exit. When the driver closes an environment whose
  call is still running there (it gave up on it: env_timeout_s), the thread is stuck: later calls fail at
  once (OpenEnvStuck) instead of queueing behind it, and close() waits CLOSE_WAIT_S at most (closes
  stay queued there, to run if the hung call ever returns).
- The reward trained on is the environment's own, never recomputed; the rubric components are logged
  beside it (weight 0) unless `reward_weights(from_rubric=True)` trains on them, weighted as the
  WeightedSum rubrics holding them weigh them.
- An environment is closed when its episode is done, when a call into it failed, and otherwise (a
  trajectory cut off by max_turns or the token budget, or a batch that failed) when the driver closes
  it at the end of the rollout (or, outside the driver, when it is dropped).
- A remote environment (a factory returning `EnvClient(...).sync()`) validates actions on its server,
  where a reply that makes no valid action is a server error; `action=` building the typed Action
  locally (`lambda text: GuessAction(guess=text)`) turns it into the model's "invalid action" instead.
- The rubric components travel on the trajectory's own messages because the driver hands reward
  functions one summed `env_reward` per trajectory, and the messages are what else they receive.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import logging
import queue
import threading
import time
import typing
import weakref
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

try:
    from openenv.core.client_types import StepResult
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation
    from openenv.core.rubrics import Rubric, WeightedSum
except ImportError as e:
    raise ImportError(f"grouprl.envs.openenv needs OpenEnv (the openenv-core package), which cannot be imported "
                      f"({e}): pip install 'grouprl[openenv]'") from e

logger = logging.getLogger(__name__)

NOTE = "openenv"  # the assistant-message key where a step records what the environment said about the reply
NO_OUTPUT = "[no output]"  # what the policy reads for a step whose observation renders to no text
_OBSERVATION_BASE = set(Observation.model_fields)  # done, reward, metadata: read by the adapter, not shown
_ACTION_BASE = set(Action.model_fields)  # metadata
CLOSE_WAIT_S = 10.0  # how long close() waits for a serial environment's thread; the close stays queued there


class OpenEnvCallError(RuntimeError):
    """An OpenEnv environment raised while it was built, reset or stepped: a bug in the environment."""


class OpenEnvStuck(OpenEnvCallError):
    """A call into an environment of one call at a time was given up on and still runs, so no other can."""


class OpenEnvAdapter:
    """An OpenEnv environment as grouprl's `environment`, with its training rows and reward functions.

    env: an OpenEnv Environment subclass or a factory (called with no arguments, once per
    trajectory), or an instance (deep-copied for each trajectory).
    action: reply text -> Action. Default: the Action type (step's `action` annotation, or the
    class's Environment[Action, ...] parameters) built from its one field (its one required field).
    observation: Observation -> text. Default: `observation_text`.
    observation_role: the role of step observations: "user", or "tool" where they are tool results.
    instructions: the prompt of rows made without prompts, a system message. Default: the environment's
    metadata description.
    name: what errors and the environment class are called. Default: the class's or factory's name.

    `.environment` is the class the driver instantiates once per trajectory; a config names it by
    import path (`environment: my_pkg.envs:guess.environment`, where `guess` is the adapter).
    """

    def __init__(self, env: Any, *, action: Callable[[str], Any] | None = None,
                 observation: Callable[[Any], str] | None = None, observation_role: str = "user",
                 instructions: str | None = None, name: str | None = None):
        if observation_role not in ("user", "tool"):
            raise ValueError(f"observation_role={observation_role!r}: use 'user' or 'tool'")
        self.factory, kind = _factory(env)
        self.name = name or getattr(kind, "__name__", None) or type(env).__name__
        self.action, self.observation = action, observation or observation_text
        self.observation_role, self.instructions = observation_role, instructions
        self._builders: dict[type, Callable[[str], Any]] = {}
        self._serial: _SerialThread | None = None
        self._lock = threading.Lock()
        if action is None and isinstance(kind, type) and issubclass(kind, Environment):
            self._builder(kind)  # a class names its Action type: an undeclared one fails here, not mid-rollout
        attrs = {"adapter": self, "__module__": __name__, "__qualname__": self.name,
                 "__doc__": f"The OpenEnv environment {self.name}, one instance per trajectory (OpenEnvAdapter)."}
        if isinstance(kind, type):  # a class says before one is built (the driver builds them so many at once)
            attrs["concurrency"] = None if self._concurrent(kind) else 1
        self.environment: type = type(self.name, (_Episode,), attrs)

    # ------------------------------------------------------------------ data and rewards
    def rows(self, reset_kwargs: Iterable[Mapping[str, Any]] | None = None, *,
             prompts: Iterable[str | list[dict[str, str]]] | None = None) -> list[dict[str, Any]]:
        """Training rows, one per episode: from reset arguments (e.g. `[{"seed": i} for i in range(256)]`),
        from prompts (questions a dataset holds; a string is a user message), or from both, paired.
        Without prompts, a row's prompt is `instructions` as a system message and reset's observation
        asks the question. The reset arguments are columns: every row gets every column, None where it
        has none (a dataset keeps only its first row's columns; None is not passed to reset)."""
        if reset_kwargs is None and prompts is None:
            raise ValueError(f"{self.name}: rows need reset arguments, prompts, or both")
        given = None if prompts is None else [[{"role": "user", "content": p}] if isinstance(p, str) else list(p)
                                              for p in prompts]
        kwargs = [dict(k) for k in reset_kwargs] if reset_kwargs is not None else [{} for _ in given]
        if given is not None and len(given) != len(kwargs):
            raise ValueError(f"{self.name}: {len(given)} prompts for {len(kwargs)} sets of reset arguments; "
                             "give one prompt per episode")
        if not kwargs:
            raise ValueError(f"{self.name}: no episodes, so no rows")
        if any("prompt" in k for k in kwargs):
            raise ValueError(f"{self.name}: 'prompt' is the rows' prompt column, not a reset argument; rename it")
        columns = list(dict.fromkeys(c for k in kwargs for c in k))
        default = None if given else [{"role": "system", "content": self.instructions or self._facts[0]}]
        return [{"prompt": given[i] if given else default, **{c: k.get(c) for c in columns}}
                for i, k in enumerate(kwargs)]

    @property
    def rubric_paths(self) -> list[str]:
        """The dotted paths of the environment's rubric components (`env.rubric.named_rubrics()`)."""
        return list(self._facts[1])

    @property
    def rubric_weights(self) -> dict[str, float]:
        """The weight in the environment's reward of each component the library weighs: those under
        WeightedSum rubrics only (a Gate or a Sequential is not linear), nested weights multiplied."""
        return dict(self._facts[2])

    def reward_funcs(self) -> list[Callable[..., list]]:
        """`openenv_reward` (the environment's reward), then `rubric.<path>` for each rubric component."""
        return [openenv_reward] + [rubric_reward(p) for p in self.rubric_paths]

    def reward_weights(self, *, from_rubric: bool = False) -> list[float]:
        """Weights for `reward_funcs()`: the environment's reward alone (components logged, weight 0),
        or, with `from_rubric`, the components as its WeightedSum rubrics weigh them (and the total 0)."""
        if not from_rubric:
            return [1.0] + [0.0] * len(self.rubric_paths)
        if not self.rubric_weights:
            raise ValueError(f"{self.name}: its rubric exposes no weights (only a WeightedSum does); "
                             "train on its reward: reward_weights()")
        return [0.0] + [self.rubric_weights.get(p, 0.0) for p in self.rubric_paths]

    @functools.cached_property
    def _facts(self) -> tuple[str, list[str], dict[str, float]]:
        """(description, rubric paths, rubric weights), read once from an environment built for it."""
        env = self._make()
        try:
            meta = env.get_metadata() if callable(getattr(env, "get_metadata", None)) else None
            description = getattr(meta, "description", None) or f"The {self.name} environment."
            rubric = getattr(env, "rubric", None)
            paths = [p for p, _ in rubric.named_rubrics()] if isinstance(rubric, Rubric) else []
            weights = _exposed_weights(rubric) if isinstance(rubric, Rubric) else {}
        finally:
            self._close(env)
        return description, paths, weights

    # ------------------------------------------------------------------ calls into the environment
    def _make(self) -> Any:
        try:
            return self.factory()
        except Exception as e:
            raise OpenEnvCallError(f"OpenEnv environment {self.name}: building it raised "
                                   f"{type(e).__name__}: {e}") from e

    def _call(self, env: Any, method: str, args: tuple = (), kwargs: dict | None = None, shown: Any = None) -> Any:
        """env.method(*args, **kwargs), on the serial thread where the environment asks for one; an exception
        comes back as OpenEnvCallError naming the environment, the call and the action."""
        kwargs = kwargs or {}
        call = f"{method}({shown!r})" if shown is not None else f"{method}(**{kwargs!r})"
        try:
            return self._run(env, getattr(env, method), args, kwargs, call=call)
        except OpenEnvStuck:
            raise
        except Exception as e:
            raise OpenEnvCallError(f"OpenEnv environment {self.name}: {call} raised {type(e).__name__}: {e} "
                                   "(an exception in an environment is a bug in it and stops the step; to let "
                                   "the policy see a failure, return it as an observation)") from e

    @staticmethod
    def _concurrent(env: Any) -> bool:
        """Whether the environment takes calls from several threads at once (OpenEnv's flags)."""
        return bool(getattr(env, "SUPPORTS_CONCURRENT_SESSIONS", True)) and not getattr(
            env, "REQUIRES_SINGLE_THREAD_EXECUTOR", False)

    def _run(self, env: Any, fn: Callable, args: tuple = (), kwargs: dict | None = None, *, call: str) -> Any:
        """fn(*args, **kwargs): here, or on the serial thread where the environment asks for one."""
        kwargs = kwargs or {}
        if self._concurrent(env):
            return fn(*args, **kwargs)
        serial = self._serial_thread()
        stuck = serial.stuck
        if stuck is not None:
            age = time.monotonic() - stuck.started
            raise OpenEnvStuck(
                f"OpenEnv environment {self.name}: its calls run one at a time on one thread (it keeps "
                f"SUPPORTS_CONCURRENT_SESSIONS = False or sets REQUIRES_SINGLE_THREAD_EXECUTOR), and that thread is "
                f"still in {stuck.call}, which the driver gave up on (env_timeout_s) {age:.1f} s after it started, "
                f"so {call} cannot run. Fix the hang in the environment (a call without a "
                "timeout?) and start the run again; if its instances share nothing, set SUPPORTS_CONCURRENT_SESSIONS "
                "= True, so that a hung call holds up only its own trajectory")
        return serial.submit(env, call, fn, args, kwargs).result()

    def _serial_thread(self) -> _SerialThread:
        with self._lock:
            if self._serial is None:
                self._serial = _SerialThread(f"openenv-{self.name}")
            return self._serial

    def _close(self, env: Any) -> None:
        """Close an environment whose episode is over; a failure to close is logged, the run goes on. On the
        serial thread, the close is queued and waited for CLOSE_WAIT_S at most. An environment whose own
        call still runs there was given up on (closing it is how the driver lets go): the thread is stuck,
        so the close is not waited for (it runs if that call ever returns) and later calls fail at once."""
        if not callable(getattr(env, "close", None)):
            return
        if self._concurrent(env):
            try:
                env.close()
            except Exception as e:
                self._close_failed(e)
            return
        serial = self._serial_thread()
        stuck = serial.give_up(env)
        if stuck is not None:
            logger.warning("OpenEnv environment %s: %s has not returned in %.1f s and was given up on; its one "
                           "thread is stuck in it, so no later call can run", self.name, stuck.call,
                           time.monotonic() - stuck.started)
        closing = serial.submit(env, "close()", env.close, (), {})
        closing.add_done_callback(self._closed)
        if serial.stuck is None:
            try:
                closing.exception(CLOSE_WAIT_S)
            except FutureTimeout:
                logger.warning("OpenEnv environment %s: close() waited %g s for the environment's thread, busy "
                               "with another call; it runs there once that call returns", self.name, CLOSE_WAIT_S)

    def _closed(self, closing: Future) -> None:
        if closing.exception() is not None:
            self._close_failed(closing.exception())

    def _close_failed(self, error: BaseException) -> None:
        logger.warning("OpenEnv environment %s: close() raised %s: %s", self.name, type(error).__name__, error)

    def _unpack(self, result: Any, method: str) -> tuple[Any, float | None, bool]:
        """(observation, reward, done) from an Observation (in-process) or a StepResult (a client)."""
        if isinstance(result, StepResult):
            return result.observation, _number(result.reward), bool(result.done)
        if isinstance(result, Observation):
            return result, _number(result.reward), bool(result.done)
        raise TypeError(f"OpenEnv environment {self.name}: {method} returned {type(result).__name__}, not an "
                        "Observation (or, from a client, a StepResult)")

    def _builder(self, kind: type) -> Callable[[str], Any]:
        """reply text -> Action for environments of class `kind` (the `action` given, or its Action type's field)."""
        if self.action is not None:
            return self.action
        if kind not in self._builders:
            self._builders[kind] = _text_action(_action_type(kind), self.name)
        return self._builders[kind]

    def _messages(self, observation: Any, role: str) -> list[dict[str, str]]:
        text = self.observation(observation)
        return [{"role": role, "content": text}] if text else []


@dataclass(frozen=True)
class _Job:
    env: Any
    call: str  # what errors call it: "step(GuessAction(guess=4))"
    started: float  # time.monotonic() when the thread began it


class _SerialThread:
    """One thread running an environment's calls in the order they come (`submit`). A daemon fed by a
    queue, not a ThreadPoolExecutor, whose worker Python joins at exit: a call that never returns must
    not keep the process from ending. `stuck`: the call running that was given up on (`give_up`)."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running: _Job | None = None
        self.stuck: _Job | None = None
        threading.Thread(target=self._work, daemon=True, name=name).start()

    def submit(self, env: Any, call: str, fn: Callable, args: tuple, kwargs: dict) -> Future:
        future: Future = Future()
        self._jobs.put((future, env, call, fn, args, kwargs))
        return future

    def give_up(self, env: Any) -> _Job | None:
        """The call running for `env`, now stuck (its caller has let go of env), or None if none runs."""
        with self._lock:
            if self._running is not None and self._running.env is env:
                self.stuck = self._running
            return self.stuck if self.stuck is not None and self.stuck.env is env else None

    def _work(self) -> None:
        while True:
            future, env, call, fn, args, kwargs = self._jobs.get()
            with self._lock:
                self._running = _Job(env, call, time.monotonic())
            result, error = None, None
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread
                error = e
            with self._lock:  # done before the caller hears: a close that follows at once must not find it running
                self._running = self.stuck = None  # a stuck call that returned frees the thread
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
            future = fn = args = kwargs = env = result = error = None  # nothing kept while the queue waits


class _Episode:
    """One trajectory's OpenEnv environment behind grouprl's protocol: reset(**row) -> first observation
    messages; step(assistant message) -> (observation messages, done, reward). `OpenEnvAdapter.environment`
    is a subclass with `adapter` set."""

    adapter: OpenEnvAdapter

    def __init__(self) -> None:
        self.env = self.adapter._make()
        self.carried: float | None = None  # a reward that reset returned: the driver takes rewards from steps only
        # close() once: when the episode is done, a call failed, the driver is done with it, or it is dropped
        # (a remote environment's session would otherwise stay open on its server)
        self.close = weakref.finalize(self, self.adapter._close, self.env)
        self.close.atexit = False

    @property
    def concurrency(self) -> int | None:
        """(A class attribute where the adapter has the environment's class; this reads a factory's product.)
        1 for an environment that takes one call at a time (SUPPORTS_CONCURRENT_SESSIONS = False, OpenEnv's
        default): the driver then makes one call at a time, so each call's env_timeout_s counts from its own
        start, not from its place in the queue (it counted from the queue's: 12 steps of 0.5 s timed out at 2 s)."""
        return None if self.adapter._concurrent(self.env) else 1

    def _call(self, method: str, args: tuple = (), kwargs: dict | None = None, shown: Any = None
              ) -> tuple[Any, float | None, bool]:
        """(observation, reward, done) of env.method(...); the environment is closed when it fails."""
        try:
            return self.adapter._unpack(self.adapter._call(self.env, method, args, kwargs, shown), method)
        except Exception:
            self.close()
            raise

    def reset(self, prompt: Any = None, **columns: Any) -> list[dict[str, str]] | None:
        a = self.adapter
        kwargs = _accepted(self.env.reset, {k: v for k, v in columns.items() if v is not None})
        observation, self.carried, done = self._call("reset", kwargs=kwargs)
        if done:
            self.close()
            raise ValueError(f"OpenEnv environment {a.name}: reset({kwargs}) returned done=True; an episode "
                             "needs at least one step for the policy to act in")
        return a._messages(observation, "user") or None

    def step(self, message: dict) -> tuple[list[dict[str, str]], bool] | tuple[list[dict[str, str]], bool, float]:
        a = self.adapter
        build = a._builder(type(self.env))
        try:
            action = build(message.get("content") or "")
        except ValueError as e:  # pydantic's ValidationError: the reply does not make an Action; the model's to see
            message[NOTE] = {"invalid_action": _reason(e)}
            return [{"role": a.observation_role, "content": f"invalid action: {_reason(e)}"}], False
        rubrics = _named_rubrics(self.env)
        for _, rubric in rubrics:
            rubric.last_score = None  # so a component the step did not evaluate is not read from an earlier step
        observation, reward, done = self._call("step", (action,), shown=action)
        if self.carried is not None:
            reward, self.carried = (reward or 0.0) + self.carried, None
        scores = {p: float(r.last_score) for p, r in rubrics if r.last_score is not None}
        message[NOTE] = {"reward": reward, "done": done, "rubric": scores}
        if done:
            self.close()
            return [], True, reward
        # the episode goes on, so the policy needs a message to answer, even after a step that printed nothing
        messages = a._messages(observation, a.observation_role)
        return messages or [{"role": a.observation_role, "content": NO_OUTPUT}], False, reward


# ---------------------------------------------------------------------- reward functions
def openenv_reward(prompts: list, completions: list, env_reward: list[float] | None = None,
                   **kwargs: Any) -> list[float]:
    """The environment's reward for each trajectory: what its steps returned, summed (the driver's
    `env_reward` column), as is."""
    if env_reward is None:
        raise ValueError("openenv_reward reads the env_reward column, which only a run with an environment has: "
                         "set environment to an OpenEnvAdapter's .environment")
    return [float(r) for r in env_reward]


def rubric_reward(path: str) -> Callable[..., list[float | None]]:
    """The reward function `rubric.<path>`: the rubric component's scores summed over a trajectory's
    steps, as the steps noted them; None (not scored) for a trajectory whose steps never evaluated it."""

    def score(prompts: list, completions: list, **kwargs: Any) -> list[float | None]:
        return [_component_total(c, path) for c in completions]

    score.__name__ = f"rubric.{path}"
    return score


def _component_total(completion: Any, path: str) -> float | None:
    if not isinstance(completion, list):
        raise TypeError(f"rubric.{path} reads a trajectory's messages: it needs a run with an environment")
    scores = [m[NOTE]["rubric"][path] for m in completion
              if isinstance(m, dict) and path in m.get(NOTE, {}).get("rubric", {})]
    return sum(scores) if scores else None


# ---------------------------------------------------------------------- observations and actions
def observation_text(observation: Any) -> str:
    """What the policy reads of an observation: a string as is; an Observation's one string field
    (beyond done, reward and metadata, which the adapter reads itself); else its own fields as JSON with
    sorted keys (the text must not depend on field order)."""
    if isinstance(observation, str):
        return observation
    if isinstance(observation, Observation):
        data = observation.model_dump(exclude=_OBSERVATION_BASE)
    elif isinstance(observation, Mapping):
        data = {k: v for k, v in observation.items() if k not in _OBSERVATION_BASE}
    else:
        raise TypeError(f"observation of type {type(observation).__name__}: pass observation= to turn it into text")
    values = list(data.values())
    if len(values) == 1 and isinstance(values[0], str):
        return values[0]
    return json.dumps(data, sort_keys=True, default=str)


def _action_type(kind: type) -> type | None:
    """The Action subclass an environment class takes: step's annotation, else Environment[Action, ...]."""
    try:
        hint = typing.get_type_hints(kind.step).get("action")
    except (NameError, TypeError, AttributeError):  # an annotation that does not resolve: try the parameters
        hint = None
    candidates = [hint] + [typing.get_args(base)[0] for klass in kind.__mro__
                           for base in getattr(klass, "__orig_bases__", ()) if typing.get_args(base)]
    return next((t for t in candidates if isinstance(t, type) and issubclass(t, Action) and t is not Action), None)


def _text_action(action_type: type | None, name: str) -> Callable[[str], Any]:
    """reply text -> action_type(field=text), for an Action with one field (or one required field)."""
    if action_type is None:
        raise TypeError(f"OpenEnv environment {name} does not declare its Action type (annotate step's `action`, "
                        "or subclass Environment[MyAction, MyObservation, State]); pass "
                        "OpenEnvAdapter(..., action=lambda text: MyAction(...))")
    own = {n: f for n, f in action_type.model_fields.items() if n not in _ACTION_BASE}
    fields = [n for n, f in own.items() if f.is_required()] or list(own)
    if len(fields) != 1:
        raise TypeError(f"OpenEnv environment {name}: {action_type.__name__} has fields {sorted(own)}, so which "
                        "one the reply fills is not clear; pass OpenEnvAdapter(..., action=lambda text: ...)")
    field = fields[0]
    return lambda text: action_type(**{field: text})


# ---------------------------------------------------------------------- helpers
def _factory(env: Any) -> tuple[Callable[[], Any], Any]:
    """(a function building one environment per call, the class or factory it comes from)."""
    if isinstance(env, Environment):
        try:
            copy.deepcopy(env)
        except Exception as e:
            raise TypeError(f"OpenEnv environment {type(env).__name__}: an instance is copied for each trajectory "
                            f"and this one cannot be ({type(e).__name__}: {e}); pass its class or a factory") from e
        return (lambda: copy.deepcopy(env)), type(env)
    if callable(env):
        return env, env
    raise TypeError(f"{env!r}: pass an OpenEnv Environment class, a factory building one, or an instance")


def _accepted(fn: Callable, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments `fn` accepts: all of them if it takes **kwargs (OpenEnv's reset does)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in kwargs.items() if k in names}


def _named_rubrics(env: Any) -> list[tuple[str, Rubric]]:
    rubric = getattr(env, "rubric", None)
    return list(rubric.named_rubrics()) if isinstance(rubric, Rubric) else []


def _exposed_weights(rubric: Rubric, prefix: str = "", scale: float = 1.0) -> dict[str, float]:
    """path -> weight in the total, for each rubric below a chain of WeightedSums (not itself one)."""
    if not isinstance(rubric, WeightedSum):
        return {}
    out: dict[str, float] = {}
    for (name, child), w in zip(rubric.named_children(), rubric.weights):
        path = f"{prefix}.{name}" if prefix else name
        out.update(_exposed_weights(child, path, scale * w) if isinstance(child, WeightedSum) else {path: scale * w})
    return out


def _number(reward: Any) -> float | None:
    return None if reward is None else float(reward)


def _reason(error: ValueError) -> str:
    """A pydantic ValidationError's messages without its URL; another ValueError's text."""
    errors = getattr(error, "errors", None)
    if callable(errors):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'action'}: {e['msg']}" for e in errors())
    return str(error)
