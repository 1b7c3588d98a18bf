"""OpenEnv environments through `OpenEnvAdapter`, built from OpenEnv's own classes (Environment, Action,
Observation, State, Rubric, WeightedSum): the rows and rewards of a single-turn task checked by hand,
a multi-turn game turn by turn against the chat template, the same game served by OpenEnv's server,
training end to end with the shipped tool policy, and a failing environment named in the error
(test_openenv_missing.py: the message without OpenEnv).

The single- and multi-turn tests drive the real multi-turn driver with a scripted engine (each test
knows exactly what the policy "said"); the end-to-end test samples the policy itself.
"""

from __future__ import annotations

import gc
import json
import re
import socket
import threading

import pytest
import torch

from grouprl.config import TrainConfig
from grouprl.rewards import score_completions
from grouprl.rollout import SamplingParams
from grouprl.rollout.multiturn import MultiTurnDriver, TurnLimits
from grouprl.tasks import TOOL_POLICY_DIR
from grouprl.trainer import Trainer
from tests.rollout.test_multiturn import Driver, ScriptedEngine
from tests.tools.conftest import build_qwen_tokenizer
from tests.trainer.conftest import read_metrics

pytest.importorskip("openenv.core", reason="the openenv extra: pip install 'grouprl[openenv]'")
import uvicorn  # noqa: E402  (openenv-core's dependency)
from openenv.core import Action, Environment, GenericEnvClient, Observation, State, create_fastapi_app  # noqa: E402
from openenv.core.rubrics import Rubric, WeightedSum  # noqa: E402

from grouprl.envs.openenv import NOTE, OpenEnvAdapter, OpenEnvCallError, openenv_reward, rubric_reward  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return build_qwen_tokenizer()


def encoder(tok):
    return lambda msgs: tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)


def run(tok, adapter, rows, replies, G=2, max_turns=4, env_timeout_s=None):
    """The driver over `rows` with the adapter's environment; the scripted engine answers with replies(text)."""
    encode = encoder(tok)
    driver = MultiTurnDriver(tok, TurnLimits(400, max_turns=max_turns), environment=adapter.environment, encode=encode,
                             eos_token_ids=(tok.eos_token_id,), env_timeout_s=env_timeout_s)
    prompts = [r["prompt"] for r in rows]
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    return Driver(ScriptedEngine(tok, replies), driver).generate([encode(p) for p in prompts], G,
                                                                 SamplingParams(max_new_tokens=1), prompts=prompts,
                                                                 columns=columns)


# ---------------------------------------------------------------- single turn, a rubric with weights
class AnswerAction(Action):
    answer: str


class QuestionObservation(Observation):
    question: str = ""


class ExactAnswer(Rubric):
    def forward(self, action, observation):
        return float(action.answer.strip() == str(observation.metadata["expected"]))


class DigitsOnly(Rubric):
    def forward(self, action, observation):
        return float(action.answer.strip().isdigit())


class ArithmeticEnv(Environment[AnswerAction, QuestionObservation, State]):
    """One question, one answer; the reward is the rubric's 0.7 * exact + 0.3 * digits-only."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    returned: list = []

    def __init__(self):
        super().__init__(rubric=WeightedSum([ExactAnswer(), DigitsOnly()], weights=[0.7, 0.3]))
        self._state = State()

    def reset(self, seed=None, episode_id=None, a=0, b=0, **kwargs):
        self._reset_rubric()
        self.a, self.b = a, b
        return QuestionObservation(question=f"What is {a}+{b}?")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        obs = QuestionObservation(done=True, metadata={"expected": self.a + self.b})
        obs.reward = self._apply_rubric(action, obs)
        ArithmeticEnv.returned.append((action.answer, obs.reward))
        return obs

    @property
    def state(self):
        return self._state


def test_single_turn_rows_and_rubric_rewards_are_the_environments(tok):
    """3+4 and 10+7, two replies each. By hand (0.7 exact + 0.3 digits-only):
    "7" -> 0.7 + 0.3 = 1.0; "seven" -> 0; "16" -> 0 + 0.3 = 0.3; "17" -> 1.0."""
    ArithmeticEnv.returned = []
    adapter = OpenEnvAdapter(ArithmeticEnv, instructions="Answer with the number.")
    rows = adapter.rows([{"a": 3, "b": 4}, {"a": 10, "b": 7}])
    system = [{"role": "system", "content": "Answer with the number."}]
    assert rows == [{"prompt": system, "a": 3, "b": 4}, {"prompt": system, "a": 10, "b": 7}]
    replies = iter(["7", "seven", "16", "17"])
    traj = run(tok, adapter, rows, lambda text: next(replies))

    assert traj.stop_reasons == ["env_done"] * 4
    assert ArithmeticEnv.returned == [("7", 1.0), ("seven", 0.0), ("16", 0.3), ("17", 1.0)]
    assert traj.env_rewards == [1.0, 0.0, 0.3, 1.0]  # what the environment returned, exactly
    prompt = tok.decode(traj.rollout.prompt_ids[0][traj.rollout.prompt_mask[0].bool()], skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>system\nAnswer with the number.<|im_end|>\n"
                           "<|im_start|>user\nWhat is 3+4?<|im_end|>\n<|im_start|>assistant\n")

    assert adapter.rubric_paths == ["rubric_0", "rubric_1"]
    assert adapter.rubric_weights == {"rubric_0": 0.7, "rubric_1": 0.3}
    funcs = adapter.reward_funcs()
    assert [f.__name__ for f in funcs] == ["openenv_reward", "rubric.rubric_0", "rubric.rubric_1"]
    cols = traj.reward_columns()
    scores = score_completions(funcs, adapter.reward_weights(), [None] * 4, traj.messages, cols)
    assert scores.per_func["openenv_reward"].tolist() == pytest.approx([1.0, 0.0, 0.3, 1.0], abs=1e-7)
    assert scores.per_func["rubric.rubric_0"].tolist() == [1.0, 0.0, 0.0, 1.0]  # exact
    assert scores.per_func["rubric.rubric_1"].tolist() == [1.0, 0.0, 1.0, 1.0]  # digits only
    assert adapter.reward_weights() == [1.0, 0.0, 0.0]
    assert scores.metrics["rewards/openenv_reward/mean"] == pytest.approx(2.3 / 4)
    by_rubric = score_completions(funcs, adapter.reward_weights(from_rubric=True), [None] * 4, traj.messages, cols)
    assert adapter.reward_weights(from_rubric=True) == [0.0, 0.7, 0.3]
    torch.testing.assert_close(by_rubric.total, scores.total)  # the components, weighted, give the reward back
    assert traj.messages[2][0][NOTE] == {"reward": 0.3, "done": True, "rubric": {"rubric_0": 0.0, "rubric_1": 1.0}}


class NestedArithmeticEnv(ArithmeticEnv):
    def __init__(self):
        super().__init__()
        self.rubric = WeightedSum([ExactAnswer(), WeightedSum([DigitsOnly(), ExactAnswer()], [0.5, 0.5])], [0.6, 0.4])


def test_rubric_weights_multiply_down_nested_weighted_sums():
    """0.6 for the first child; 0.4 * 0.5 = 0.2 for each grandchild; the inner WeightedSum itself is
    logged, not weighted again (its children carry its weight)."""
    adapter = OpenEnvAdapter(NestedArithmeticEnv)
    assert adapter.rubric_paths == ["rubric_0", "rubric_1", "rubric_1.rubric_0", "rubric_1.rubric_1"]
    assert adapter.rubric_weights == {"rubric_0": 0.6, "rubric_1.rubric_0": 0.2, "rubric_1.rubric_1": 0.2}
    assert adapter.reward_weights(from_rubric=True) == [0.0, 0.6, 0.0, 0.2, 0.2]
    calc = OpenEnvAdapter(CalcEnv)  # a rubric of its own making: components, but no weights
    assert calc.rubric_paths == ["correct", "used_tool"] and calc.rubric_weights == {}
    with pytest.raises(ValueError, match="CalcEnv: its rubric exposes no weights"):
        calc.reward_weights(from_rubric=True)


# ---------------------------------------------------------------- multi-turn: guess a number
class GuessAction(Action):
    guess: int


class HintObservation(Observation):
    hint: str = ""


class GuessEnv(Environment):
    """Guess the target from 0 to 9: "higher" / "lower" until right; reward 1 - 0.1 per extra guess.
    Keeps OpenEnv's default SUPPORTS_CONCURRENT_SESSIONS = False, so its calls run one at a time."""

    log: list = []

    def __init__(self):
        super().__init__()
        self._state = State()

    def reset(self, seed=None, episode_id=None, target=0):  # no **kwargs: only `target` is passed
        GuessEnv.log.append(("reset", id(self), threading.get_ident()))
        self.target, self.guesses = target, 0
        return HintObservation(hint="Guess a number from 0 to 9.")

    def step(self, action: GuessAction, timeout_s=None, **kwargs):
        GuessEnv.log.append(("step", id(self), threading.get_ident()))
        self.guesses += 1
        if action.guess == self.target:
            return HintObservation(done=True, reward=1.0 - 0.1 * (self.guesses - 1))
        return HintObservation(hint="higher" if action.guess < self.target else "lower", reward=0.0)

    def close(self):
        GuessEnv.log.append(("close", id(self), threading.get_ident()))

    @property
    def state(self):
        return self._state


def player(text):
    """First "maybe" (not a number), then 0, then one step the way the hint says."""
    said = re.findall(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", text)
    if not said:
        return "maybe"
    if said[-1] == "maybe":
        return "0"
    return str(int(said[-1]) + (1 if text.rsplit("<|im_start|>user\n", 1)[-1].startswith("higher") else -1))


INVALID = "invalid action: guess: Input should be a valid integer, unable to parse string as an integer"


def test_multi_turn_game_turn_by_turn(tok):
    """Target 2: maybe (invalid), 0, 1, 2 -> done after 3 guesses, reward 1 - 0.2 = 0.8. Target 7 would
    need 8 guesses: the 5-turn limit stops it, unrewarded."""
    GuessEnv.log = []
    adapter = OpenEnvAdapter(GuessEnv, instructions="Play.")
    rows = adapter.rows([{"target": 2, "note": "easy"}, {"target": 7}])
    assert [r["note"] for r in rows] == ["easy", None]  # every row gets every column
    traj = run(tok, adapter, rows, player, max_turns=5)
    gc.collect()  # the driver has let go of its environments

    assert traj.stop_reasons == ["env_done", "env_done", "max_turns", "max_turns"]
    assert traj.env_rewards == pytest.approx([0.8, 0.8, 0.0, 0.0])
    assert [(m["role"], m["content"]) for m in traj.messages[0]] == [
        ("assistant", "maybe"), ("user", INVALID), ("assistant", "0"), ("user", "higher"),
        ("assistant", "1"), ("user", "higher"), ("assistant", "2")]
    assert traj.messages[0][0][NOTE] == {"invalid_action": INVALID.removeprefix("invalid action: ")}
    assert traj.messages[0][-1][NOTE] == {"reward": pytest.approx(0.8), "done": True, "rubric": {}}
    # every turn's text reaches the model as the chat template renders the whole conversation
    ro = traj.rollout
    prompt = tok.decode(ro.prompt_ids[0][ro.prompt_mask[0].bool()], skip_special_tokens=False)
    completion = tok.decode(ro.completion_ids[0][ro.completion_mask[0]], skip_special_tokens=False)
    conversation = [{"role": "system", "content": "Play."}, {"role": "user", "content": "Guess a number from 0 to 9."}]
    conversation += [{"role": m["role"], "content": m["content"]} for m in traj.messages[0]]
    assert prompt + completion == tok.apply_chat_template(conversation, tokenize=False).removesuffix("\n")
    actions = tok.decode(ro.completion_ids[0][ro.action_mask[0]], skip_special_tokens=False)
    assert actions == "maybe<|im_end|>0<|im_end|>1<|im_end|>2<|im_end|>"  # the observations are context

    envs = {i for _, i, _ in GuessEnv.log}
    assert len(envs) == 4  # one environment per trajectory (G = 2 per row), no `note` reaching reset
    assert len({t for _, _, t in GuessEnv.log}) == 1 and GuessEnv.log[0][2] != threading.get_ident()
    closes = [i for kind, i, _ in GuessEnv.log if kind == "close"]
    assert len(closes) == 4 and set(closes) == envs  # finished ones when done, the others when dropped
    assert rubric_reward("anything")(None, traj.messages) == [None] * 4  # no rubric: nothing noted
    assert adapter.environment().concurrency == 1  # the driver's calls too: each timed from its own start
    assert adapter.environment.concurrency == 1  # said by the class: the driver builds them one at a time too


def test_an_instance_is_copied_for_each_trajectory(tok):
    template = GuessEnv()
    adapter = OpenEnvAdapter(template, instructions="Play.")
    a, b = adapter.environment(), adapter.environment()
    assert a.env is not b.env and a.env is not template and type(a.env) is GuessEnv
    a.reset(prompt=None, target=3)
    b.reset(prompt=None, target=5)
    assert (a.env.target, b.env.target) == (3, 5) and not hasattr(template, "target")

    class Locked(GuessEnv):
        def __init__(self):
            super().__init__()
            self.lock = threading.Lock()

    with pytest.raises(TypeError, match="Locked: an instance is copied for each trajectory.*pass its class"):
        OpenEnvAdapter(Locked())


def test_an_undeclared_action_type_asks_for_action():
    class Untyped(GuessEnv):
        def step(self, action, timeout_s=None, **kwargs):
            return super().step(action)

    with pytest.raises(TypeError, match="Untyped does not declare its Action type.*action=lambda text"):
        OpenEnvAdapter(Untyped)
    adapter = OpenEnvAdapter(Untyped, action=lambda text: GuessAction(guess=text))
    env = adapter.environment()
    env.reset(target=1)
    assert env.step({"role": "assistant", "content": "1"}) == ([], True, 1.0)


class QuietGuessEnv(GuessEnv):
    """GuessEnv whose wrong guesses get an observation with no text, as a shell command that printed nothing."""

    def step(self, action: GuessAction, timeout_s=None, **kwargs):
        observation = super().step(action)
        return observation if observation.done else HintObservation(reward=0.0)


def test_an_empty_observation_is_shown_as_no_output_and_the_episode_goes_on(tok):
    """Target 2, guesses 0, 1, 2: the two wrong guesses are answered "[no output]", the third is done."""
    adapter = OpenEnvAdapter(QuietGuessEnv, instructions="Play.")
    guess_in_order = lambda text: str(text.count("<|im_start|>assistant\n") - 1)  # noqa: E731
    traj = run(tok, adapter, adapter.rows([{"target": 2}]), guess_in_order, G=1)
    assert traj.stop_reasons == ["env_done"] and traj.env_rewards == pytest.approx([0.8])
    assert [(m["role"], m["content"]) for m in traj.messages[0]] == [
        ("assistant", "0"), ("user", "[no output]"), ("assistant", "1"), ("user", "[no output]"), ("assistant", "2")]


class ServedGuessEnv(GuessEnv):
    SUPPORTS_CONCURRENT_SESSIONS = True  # the server opens one session per trajectory


@pytest.fixture
def guess_server():
    """OpenEnv's own server (FastAPI, WebSocket sessions) for ServedGuessEnv on a free local port."""
    app = create_fastapi_app(ServedGuessEnv, GuessAction, HintObservation, max_concurrent_envs=4)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        threading.Event().wait(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)


def test_a_remote_environment_through_its_client(tok, guess_server):
    """The same game served by OpenEnv's server and reached through its GenericEnvClient (steps return
    StepResults): the same trajectories and rewards as in process, the action validated locally. The
    server holds 4 sessions: the second rollout finds room only if the first closed all of its own."""
    adapter = OpenEnvAdapter(lambda: GenericEnvClient(base_url=guess_server).sync(), name="RemoteGuess",
                             action=lambda text: GuessAction(guess=text), instructions="Play.")
    for _ in range(2):
        traj = run(tok, adapter, adapter.rows([{"target": 2}, {"target": 7}]), player, max_turns=5)
        gc.collect()
        assert traj.stop_reasons == ["env_done", "env_done", "max_turns", "max_turns"]
        assert traj.env_rewards == pytest.approx([0.8, 0.8, 0.0, 0.0])
        assert [m["content"] for m in traj.messages[0]] == ["maybe", INVALID, "0", "higher", "1", "higher", "2"]


# ---------------------------------------------------------------- a failing environment
class BrokenEnv(GuessEnv):
    def reset(self, seed=None, episode_id=None, target=0, level=1):
        if level == 3:
            raise KeyError("no level 3")
        return super().reset(target=target)

    def step(self, action: GuessAction, timeout_s=None, **kwargs):
        raise RuntimeError("the board caught fire")


@pytest.mark.parametrize("level, message", [
    (1, "OpenEnv environment BrokenEnv: step(GuessAction(metadata={}, guess=4)) raised RuntimeError: "
        "the board caught fire"),
    (3, "OpenEnv environment BrokenEnv: reset(**{'target': 2, 'level': 3}) raised KeyError: 'no level 3'"),
])
def test_an_environment_that_raises_stops_the_step_named(tok, level, message):
    GuessEnv.log = []
    adapter = OpenEnvAdapter(BrokenEnv, instructions="Play.")
    with pytest.raises(OpenEnvCallError) as info:
        run(tok, adapter, adapter.rows([{"target": 2, "level": level}]), lambda text: "4")
    assert str(info.value).startswith(message)
    assert "a bug in it and stops the step" in str(info.value)
    assert isinstance(info.value.__cause__, KeyError if level == 3 else RuntimeError)
    assert [kind for kind, _, _ in GuessEnv.log].count("close") == 2  # each failed environment was closed


# ---------------------------------------------------------------- a call that hangs
class StuckGuessEnv(GuessEnv):
    """GuessEnv (one call at a time) whose step hangs on target 7, until the test lets it go."""

    entered, release = threading.Event(), threading.Event()

    def step(self, action: GuessAction, timeout_s=None, **kwargs):
        if self.target == 7:
            StuckGuessEnv.entered.set()
            StuckGuessEnv.release.wait(60)
        return super().step(action)


def test_a_hung_call_holds_up_neither_the_exit_nor_the_closes_and_later_calls_fail_at_once(monkeypatch, caplog):
    """The serial thread is a daemon (a ThreadPoolExecutor's worker is joined at exit: a hung call kept the
    process from ending); a close queued behind a running call waits CLOSE_WAIT_S, not for ever (a finalizer
    waiting so blocked the main thread); closing the environment of the call running there (the driver
    giving up on it) marks the thread stuck, so later calls fail at once, naming the call and the fix;
    once the hung call returns, the thread runs the closes left queued, and takes calls again."""
    from grouprl.envs import openenv

    monkeypatch.setattr(openenv, "CLOSE_WAIT_S", 0.05, raising=False)
    GuessEnv.log, StuckGuessEnv.entered, StuckGuessEnv.release = [], threading.Event(), threading.Event()
    adapter = OpenEnvAdapter(StuckGuessEnv, instructions="Play.")
    hung, other = adapter.environment(), adapter.environment()
    hung.reset(target=7)
    other.reset(target=2)
    threading.Thread(target=hung.step, args=({"role": "assistant", "content": "4"},), daemon=True).start()
    assert StuckGuessEnv.entered.wait(30)
    try:
        serial = [t for t in threading.enumerate() if t.name.startswith("openenv-StuckGuessEnv")]
        assert len(serial) == 1 and serial[0].daemon

        closing = threading.Thread(target=other.close, daemon=True)  # as a finalizer would, from any thread
        closing.start()
        closing.join(30)
        assert not closing.is_alive()
        hung.close()  # the driver lets go of the environment whose call it gave up on
        later = adapter.environment()
        with pytest.raises(openenv.OpenEnvStuck, match=r"StuckGuessEnv: its calls run one at a time on one thread "
                           r".* still in step\(GuessAction\(metadata=\{\}, guess=4\)\), which the driver gave up "
                           r"on .* reset\(\*\*\{'target': 1\}\) cannot run\. Fix the hang .* "
                           r"SUPPORTS_CONCURRENT_SESSIONS = True"):
            later.reset(target=1)
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 2
        assert "close() waited 0.05 s for the environment's thread" in warnings[0]
        assert "step(GuessAction(metadata={}, guess=4)) has not returned" in warnings[1]
        assert [kind for kind, _, _ in GuessEnv.log].count("close") == 0
    finally:
        StuckGuessEnv.release.set()
    for _ in range(3000):  # until the hung step returned and the closes queued behind it ran (a no-hang bound)
        if ("close", id(hung.env)) in [(kind, i) for kind, i, _ in GuessEnv.log]:
            break
        threading.Event().wait(0.01)
    fresh = adapter.environment()
    fresh.reset(target=1)
    assert fresh.step({"role": "assistant", "content": "1"}) == ([], True, 1.0)
    closes = [i for kind, i, _ in GuessEnv.log if kind == "close"]
    assert closes == [id(e.env) for e in (other, hung, later, fresh)]  # those left queued ran after the hung call


def test_after_a_step_that_hangs_the_driver_lets_go_of_it_and_the_next_rollout_fails_at_once(tok, caplog):
    """Target 7's first step hangs past env_timeout_s, the other trajectory's step waiting for the one
    thread: the driver closes the hung environment first, so the adapter knows its thread is stuck, and
    does not wait for the other's close behind it (nor leaves it to a finalizer to wait on); the next rollout
    fails at once, naming the hung call, instead of timing out again behind it."""
    from grouprl.envs.openenv import OpenEnvStuck
    from grouprl.rollout.multiturn import EnvironmentTimeout

    GuessEnv.log, StuckGuessEnv.entered, StuckGuessEnv.release = [], threading.Event(), threading.Event()
    adapter = OpenEnvAdapter(StuckGuessEnv, instructions="Play.")
    try:
        with pytest.raises(EnvironmentTimeout, match=r"StuckGuessEnv.step did not return within env_timeout_s=0.3"):
            run(tok, adapter, adapter.rows([{"target": 7}]), lambda text: "4", env_timeout_s=0.3)
        with pytest.raises(OpenEnvStuck, match=r"still in step\(GuessAction\(metadata=\{\}, guess=4\)\), which the "
                                               r"driver gave up on .* reset\(\*\*\{'target': 2\}\) cannot run"):
            run(tok, adapter, adapter.rows([{"target": 2}]), lambda text: "2", env_timeout_s=0.3)
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and "step(GuessAction(metadata={}, guess=4)) has not returned" in warnings[0]
        assert StuckGuessEnv.entered.is_set() and [kind for kind, _, _ in GuessEnv.log] == ["reset", "reset"]
    finally:
        StuckGuessEnv.release.set()


# ---------------------------------------------------------------- end to end with the shipped tool policy
class CalcAction(Action):
    message: str


class CalcObservation(Observation):
    text: str = ""


class ExactProduct(Rubric):
    def forward(self, action, observation):
        return float(action.message.strip() == str(observation.metadata["product"]))


class UsedTool(Rubric):
    def forward(self, action, observation):
        return float(observation.metadata["calls"] > 0)


class CalcRubric(Rubric):
    """The reward is exactness; whether the calculator was used is scored beside it (a component)."""

    def __init__(self):
        super().__init__()
        self.correct = ExactProduct()
        self.used_tool = UsedTool()

    def forward(self, action, observation):
        self.used_tool(action, observation)
        return self.correct(action, observation)


class CalcEnv(Environment[CalcAction, CalcObservation, State]):
    """a*b with a calculator: a reply holding <tool_call>{"name": "mul", ...}</tool_call> gets the product
    as a tool result; any other reply is the answer and ends the episode, rewarded by the rubric."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    episodes: list = []

    def __init__(self):
        super().__init__(rubric=CalcRubric())
        self._state = State()
        self.total, self.done, self.calls = 0.0, False, 0
        CalcEnv.episodes.append(self)

    def reset(self, seed=None, episode_id=None, a=0, b=0, **kwargs):
        self.a, self.b = a, b
        return CalcObservation()  # nothing to add: the question is the row's prompt

    def step(self, action, timeout_s=None, **kwargs):
        call = re.search(r"<tool_call>(.*?)</tool_call>", action.message, re.S)
        if call:
            self.calls += 1
            try:
                args = json.loads(call.group(1))["arguments"]
                return CalcObservation(text=str(int(args["a"]) * int(args["b"])), reward=0.0)
            except (ValueError, KeyError, TypeError):
                return CalcObservation(text="error", reward=0.0)
        obs = CalcObservation(done=True, metadata={"product": self.a * self.b, "calls": self.calls})
        obs.reward = self._apply_rubric(action, obs)
        self.total, self.done = obs.reward, True
        return obs

    @property
    def state(self):
        return self._state


CALC = OpenEnvAdapter(CalcEnv, observation_role="tool")


def test_training_end_to_end_on_the_environments_reward(tmp_path):
    """The shipped tool policy (0.54 M parameters; it ends its turns, which a random model rarely does)
    against CalcEnv, named in the config by import path, as are the rewards; the questions are the
    rows' prompts, in the policy's own format ("347*86", rendered "347*86="). Each step's
    rewards/openenv_reward/mean is the mean of what that step's 16 environments returned."""
    pairs = [(347, 86), (512, 23), (908, 41), (233, 67)] * 2
    rows = CALC.rows([{"a": a, "b": b} for a, b in pairs], prompts=[f"{a}*{b}" for a, b in pairs])
    assert rows[0] == {"prompt": [{"role": "user", "content": "347*86"}], "a": 347, "b": 86}
    cfg = TrainConfig(
        model=str(TOOL_POLICY_DIR), environment="tests.envs.test_openenv:CALC.environment",
        reward_funcs=["grouprl.envs.openenv:openenv_reward",
                      {"name": "grouprl.envs.openenv:rubric_reward", "path": "correct"},
                      {"name": "grouprl.envs.openenv:rubric_reward", "path": "used_tool"}],
        reward_weights=CALC.reward_weights(), max_turns=2, num_generations=4, prompts_per_step=4,
        micro_batch_size=16, max_completion_length=80, learning_rate=3e-4, max_steps=3, beta=0.0,
        output_dir=str(tmp_path / "run"), progress=False, seed=0, report_to=[], bf16=False, num_threads=1)
    CalcEnv.episodes = []  # from here on: the trajectories' environments only (reward_weights built one)
    Trainer(cfg, train_dataset=rows).train()

    metrics = read_metrics(cfg.output_dir)
    assert len(metrics) == 3 and len(CalcEnv.episodes) == 3 * 16  # no environment built outside the steps
    for m, step in zip(metrics, range(0, 48, 16)):
        envs = CalcEnv.episodes[step: step + 16]
        finished = [e for e in envs if e.done]
        assert m["rewards/openenv_reward/mean"] == pytest.approx(sum(e.total for e in envs) / 16, abs=1e-6)
        assert m["reward/mean"] == pytest.approx(m["rewards/openenv_reward/mean"], abs=1e-6)  # the only weight
        assert m["multiturn/stop_env_done_frac"] == len(finished) / 16
        if finished:  # components: the finished episodes only (the others never reached the rubric)
            assert m["rewards/rubric.correct/mean"] == pytest.approx(sum(e.total for e in finished) / len(finished))
            assert m["rewards/rubric.used_tool/mean"] == pytest.approx(
                sum(e.calls > 0 for e in finished) / len(finished))
    assert sum(e.done for e in CalcEnv.episodes) > 0 and sum(e.calls for e in CalcEnv.episodes) > 0


def test_openenv_reward_needs_an_environment():
    with pytest.raises(ValueError, match="only a run with an environment has"):
        openenv_reward(["p"], ["c"])


def test_the_config_names_an_openenv_environment_with_its_prefix(tmp_path):
    """`environment: openenv:package.module:Class` builds the adapter with its defaults: each instance
    of the resolved class is a fresh CalcEnv episode, its observation a user message."""
    from grouprl.config import ConfigError
    from grouprl.rollout.factory import resolve_multiturn

    def cfg(env):
        return TrainConfig(environment=env, output_dir=str(tmp_path), report_to=[])

    _, env_class = resolve_multiturn(cfg("openenv:tests.envs.test_openenv:CalcEnv"))
    CalcEnv.episodes = []
    first = env_class().reset(prompt=None, a=12, b=34)
    assert len(CalcEnv.episodes) == 1 and (CalcEnv.episodes[0].a, CalcEnv.episodes[0].b) == (12, 34)
    assert first is None or all(m["role"] == "user" for m in first)
    env_class().reset(prompt=None, a=1, b=2)
    assert len(CalcEnv.episodes) == 2  # one environment per trajectory
    with pytest.raises(ConfigError, match="tests.envs.test_openenv:NoSuchEnv"):
        resolve_multiturn(cfg("openenv:tests.envs.test_openenv:NoSuchEnv"))


def test_an_episode_closed_as_its_last_call_returns_is_not_taken_for_a_hung_one(monkeypatch, caplog):
    """A step that ends the episode closes it at once. The serial thread handed the step's result over
    before it marked itself idle, so a close in between found the finished step "running": a false
    "given up on" warning, and the next call failed with OpenEnvStuck. The hand-over is made slow here
    (as a preempted thread would make it); the thread is idle before anyone hears the result."""
    import time
    from concurrent.futures import Future

    from grouprl.envs import openenv

    class SlowHandOver(Future):
        def set_result(self, result):
            super().set_result(result)
            time.sleep(0.005)

    monkeypatch.setattr(openenv, "Future", SlowHandOver)
    adapter = OpenEnvAdapter(GuessEnv, instructions="Guess.")
    with caplog.at_level("WARNING", logger="grouprl.envs.openenv"):
        for _ in range(20):
            episode = adapter.environment()
            episode.reset(target=3)
            _, done, _ = episode.step({"role": "assistant", "content": "3"})  # right: done, closed at once
            assert done
    assert "given up on" not in caplog.text
