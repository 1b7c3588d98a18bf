"""The multi-turn driver over a scripted engine: token layout against the chat template, the action
mask, every stop reason, rows finishing at different turns, environments, hostile python calls.

The scripted engine answers each prompt (the conversation so far, decoded) with the text its script
chooses, so each test knows exactly what the policy "said"; the driver itself is the real one.
"""

import gc
import os
import re
import threading
import time
import weakref

import pytest
import torch

from grouprl.rollout import GenerationEngine, Rollout, SamplingParams
from grouprl.rollout.types import left_pad_prompts
from grouprl.rollout.multiturn import MultiTurnDriver, TurnLimits
from grouprl.tools import get_tool_parser, python_tool, resolve_tools
from tests.tools.conftest import add, build_qwen_tokenizer

CALL = '<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


class ScriptedEngine(GenerationEngine):
    """generate() answers each row with `script(conversation_text)` + EOS, cut to max_new_tokens."""

    decodes_with_policy = True

    def sync_weights(self, model, version):
        """Scripted: no weights."""

    def close(self):
        """Nothing held."""

    def __init__(self, tokenizer, script):
        self.tok, self.script, self.calls, self.params = tokenizer, script, [], []

    def generate(self, prompt_ids, num_generations, params, generator=None):
        self.calls.append(len(prompt_ids) * num_generations)
        self.params.append((params, [len(p) for p in prompt_ids]))
        rows = []
        for p in prompt_ids:
            text = self.tok.decode(p, skip_special_tokens=False)
            for g in range(num_generations):
                out = self.tok(self.script(text), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
                rows.append(out[: params.max_new_tokens])
        T = max(len(r) for r in rows)
        ids = torch.full((len(rows), T), self.tok.pad_token_id)
        mask = torch.zeros((len(rows), T), dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), True
        pids, pmask = left_pad_prompts([p for p in prompt_ids for _ in range(num_generations)], self.tok.pad_token_id)
        truncated = torch.tensor([r[-1] != self.tok.eos_token_id for r in rows])
        return Rollout(pids, pmask, ids, mask, truncated)


@pytest.fixture(scope="module")
def tok():
    return build_qwen_tokenizer()


def prompt_ids(tok, tools, questions):
    schemas = [t.schema for t in tools.values()]
    return [tok.apply_chat_template([{"role": "user", "content": q}], tools=schemas, add_generation_prompt=True,
                                    tokenize=True, return_dict=False) for q in questions]


def driver(tok, script, tools=None, tool_timeout_s=30.0, **limits):
    tools = tools or resolve_tools([add])
    limits = {"max_completion_length": 400, **limits}
    multiturn = MultiTurnDriver(tok, TurnLimits(**limits), tools=tools, parser=get_tool_parser(tok, tools),
                                eos_token_ids=(tok.eos_token_id,), tool_timeout_s=tool_timeout_s)
    return Driver(ScriptedEngine(tok, script), multiturn), tools


class Driver:
    """The driver bound to its engine, as the trainer calls it."""

    def __init__(self, engine, driver):
        self.engine, self.driver = engine, driver

    def generate(self, *args, **kwargs):
        return self.driver.generate(self.engine, *args, **kwargs)


def adder(text):
    """Call add once per question number; answer with the last tool result."""
    results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text)
    if not results:
        n = int(re.search(r"Q(\d+)", text).group(1))
        return CALL.format(a=n, b=10)
    return f"The answer is {results[-1]}."


def test_one_tool_round_trip_matches_the_chat_template_token_for_token(tok):
    drv, tools = driver(tok, adder)
    P = SamplingParams(max_new_tokens=1)
    traj = drv.generate(prompt_ids(tok, tools, ["Q7"]), 2, P)
    ro = traj.rollout
    assert traj.stop_reasons == ["answer", "answer"] and not ro.truncated.any()
    conversation = [{"role": "user", "content": "Q7"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"type": "function", "function": {"name": "add", "arguments": {"a": 7, "b": 10}}}]},
                    {"role": "tool", "name": "add", "content": "17"},
                    {"role": "assistant", "content": "The answer is 17."}]
    schemas = [t.schema for t in tools.values()]
    full = tok.apply_chat_template(conversation, tools=schemas, tokenize=False)
    prompt = tok.decode(ro.prompt_ids[0], skip_special_tokens=False)
    completion = tok.decode(ro.completion_ids[0][ro.completion_mask[0]], skip_special_tokens=False)
    assert prompt + completion == full.removesuffix("\n")  # the template's glue after the last <|im_end|>
    # actions: exactly the two assistant turns (each with its <|im_end|>); the rest is context
    actions = tok.decode(ro.completion_ids[0][ro.action_mask[0]], skip_special_tokens=False)
    first = CALL.format(a=7, b=10) + "<|im_end|>"
    assert actions == first + "The answer is 17.<|im_end|>"
    context = tok.decode(ro.completion_ids[0][ro.completion_mask[0] & ~ro.action_mask[0]], skip_special_tokens=False)
    assert context == "\n<|im_start|>user\n<tool_response>\n17\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert traj.messages[0] == conversation[1:]
    assert traj.counts["tool_calls"] == 2 and traj.counts["turns"] == 4 and traj.counts["stop_answer"] == 2
    assert drv.engine.calls == [2, 2]  # turn 1 over both rows, turn 2 over both rows


def test_rows_finish_at_different_turns_and_the_rest_keep_going(tok):
    def script(text):  # Q0 answers at once, Qk calls k times
        k = int(re.search(r"Q(\d+)", text).group(1))
        done = text.count("<tool_response>")
        return CALL.format(a=done, b=1) if done < k else f"done after {done}"

    drv, tools = driver(tok, script, max_turns=8)
    traj = drv.generate(prompt_ids(tok, tools, ["Q0", "Q1", "Q3"]), 1, SamplingParams(max_new_tokens=1))
    assert traj.stop_reasons == ["answer"] * 3
    assert [m[-1]["content"] for m in traj.messages] == ["done after 0", "done after 1", "done after 3"]
    assert drv.engine.calls == [3, 2, 1, 1]  # rows leave the batch as they answer
    (first, prompts), *later = drv.engine.params
    assert first.row_max_new_tokens is None and first.max_new_tokens == 400
    for params, contexts in later:  # each row's own room: what its earlier turns left of the 400 tokens
        rooms = params.row_max_new_tokens
        assert len(rooms) == len(contexts) and params.max_new_tokens == max(rooms)
        assert [c + r for c, r in zip(contexts, rooms)] == [p + 400 for p in prompts[-len(contexts):]]
    assert [int(r.sum()) for r in traj.rollout.action_mask] != [int(r.sum()) for r in traj.rollout.completion_mask]


def test_turn_and_call_limits(tok):
    always = lambda text: CALL.format(a=1, b=2)  # noqa: E731
    drv, tools = driver(tok, always, max_turns=3)
    traj = drv.generate(prompt_ids(tok, tools, ["Q1"]), 1, SamplingParams(max_new_tokens=1))
    assert traj.stop_reasons == ["max_turns"] and traj.rollout.truncated.tolist() == [True]
    assert traj.counts["turns"] == 3 and traj.counts["tool_calls"] == 2  # the 3rd turn's call is not run
    assert [m["role"] for m in traj.messages[0]] == ["assistant", "tool"] * 2 + ["assistant"]

    twice = lambda text: CALL.format(a=1, b=2) + "\n" + CALL.format(a=3, b=4)  # noqa: E731
    drv, tools = driver(tok, twice, max_tool_calls=3)
    traj = drv.generate(prompt_ids(tok, tools, ["Q1"]), 1, SamplingParams(max_new_tokens=1))
    assert traj.stop_reasons == ["max_tool_calls"] and traj.counts["tool_calls"] == 2
    assert traj.rollout.truncated.tolist() == [True]


def test_budget_counts_actions_and_context_together(tok):
    drv, tools = driver(tok, adder, max_completion_length=60)
    traj = drv.generate(prompt_ids(tok, tools, ["Q5"]), 1, SamplingParams(max_new_tokens=1))
    ro = traj.rollout
    # the call (~55 tokens) fits; its tool message would leave no room for another turn
    assert traj.stop_reasons == ["max_length"] and ro.truncated.tolist() == [True]
    assert int(ro.completion_mask.sum()) <= 60 and ro.action_mask.equal(ro.completion_mask)
    drv, tools = driver(tok, adder, max_completion_length=20)  # cut inside the first turn
    traj = drv.generate(prompt_ids(tok, tools, ["Q5"]), 1, SamplingParams(max_new_tokens=1))
    assert traj.stop_reasons == ["max_length"] and int(traj.rollout.completion_mask.sum()) == 20
    assert traj.counts["tool_calls"] == 0


def test_malformed_and_failing_calls_are_fed_back(tok):
    def boom(x: int) -> int:
        """Fail.

        Args:
            x: Anything.
        """
        raise RuntimeError("no luck")

    def script(text):
        seen = text.count("<tool_response>")
        if seen == 0:
            return '<tool_call>\n{"name": "add", "arguments": {"a": 1 "b": 2}}\n</tool_call>'
        if seen == 1:
            return '<tool_call>\n{"name": "boom", "arguments": {"x": 1}}\n</tool_call>'
        return "giving up"

    drv, tools = driver(tok, script, tools=resolve_tools([add, boom]), max_completion_length=1000)
    traj = drv.generate(prompt_ids(tok, tools, ["Q1"]), 1, SamplingParams(max_new_tokens=1))
    tool_msgs = [m["content"] for m in traj.messages[0] if m["role"] == "tool"]
    assert tool_msgs[0].startswith("error: could not read this tool call: invalid JSON")
    assert tool_msgs[1] == "error: boom raised RuntimeError: no luck"
    assert traj.stop_reasons == ["answer"]
    assert traj.counts["parse_failures"] == 1 and traj.counts["tool_errors"] == 1


# transformers' response parsing for a thinking model: reasoning, then calls, then content
THINKING_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close": "</think>", "content": "text", "optional": True},
        "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"\s*<\|im_end\|>", "content": "text"},
    },
}


def test_template_parser_reads_the_turn_after_the_reasoning_the_prompt_opened():
    """The generation prompt pre-writes "<think>\n" (as Qwen3-Thinking-2507's and DeepSeek-R1's templates do),
    so the policy's text starts inside its reasoning. Parsed with the prompt as prefix, a call drafted while
    reasoning is not run and the reasoning stays out of the content: one call, add(2, 3) = 5."""
    tok = build_qwen_tokenizer()
    assert tok.chat_template.count("'<|im_start|>assistant\\n'") == 1  # the generation prompt
    tok.chat_template = tok.chat_template.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")
    tok.response_template = THINKING_RESPONSE_TEMPLATE

    def script(text):
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text)
        if not results:
            return ('Maybe <tool_call>{"name": "add", "arguments": {"a": 9, "b": 9}}</tool_call>? No.\n</think>\n\n'
                    "Let me add.\n" + CALL.format(a=2, b=3))
        return f"Got it.\n</think>\n\nThe answer is {results[-1]}."

    tools = resolve_tools([add])
    multiturn = MultiTurnDriver(tok, TurnLimits(600), tools=tools, parser=get_tool_parser(tok, tools),
                                eos_token_ids=(tok.eos_token_id,))
    assert multiturn.parser.format == "template"
    traj = multiturn.generate(ScriptedEngine(tok, script), prompt_ids(tok, tools, ["Q1"]), 1,
                              SamplingParams(max_new_tokens=1))
    assert traj.stop_reasons == ["answer"] and traj.counts["tool_calls"] == 1
    assert traj.messages[0] == [
        {"role": "assistant", "content": "Let me add.", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": "The answer is 5."}]


class GuessEnv:
    """Guess the hidden number (the row's `target`): each wrong guess gets "higher"/"lower"."""

    instances = []

    def __init__(self):
        self.guesses = 0
        GuessEnv.instances.append(self)

    def reset(self, prompt, target):
        self.target = int(target)
        return "Guess a number from 0 to 9."

    def step(self, message):
        self.guesses += 1
        guess = int(message["content"])
        if guess == self.target:
            return [], True, 1.0 - 0.1 * (self.guesses - 1)
        return ("higher" if guess < self.target else "lower"), False, 0.0


def bisect(text):
    """Guess 0, then move one step in the direction the environment says."""
    guesses = re.findall(r"<\|im_start\|>assistant\n(\d)", text)
    if not guesses:
        return "0"
    last = text.rsplit("<|im_start|>user\n", 1)[-1]
    return str(int(guesses[-1]) + (1 if last.startswith("higher") else -1))


def test_environment_end_to_end(tok):
    GuessEnv.instances = []
    engine = ScriptedEngine(tok, bisect)
    encode = lambda msgs: tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,  # noqa: E731
                                                  return_dict=False)
    drv = Driver(engine, MultiTurnDriver(tok, TurnLimits(400, max_turns=5), environment=GuessEnv, encode=encode,
                                         eos_token_ids=(tok.eos_token_id,)))
    prompts = [[{"role": "user", "content": "Play."}]] * 2
    traj = drv.generate([encode(p) for p in prompts], 2, SamplingParams(max_new_tokens=1), prompts=prompts,
                        columns={"target": ["2", "7"]})
    assert len(GuessEnv.instances) == 4  # one per trajectory
    # target 2: guesses 0, 1, 2; target 7 needs 8 guesses, so the 5-turn limit stops it
    assert traj.stop_reasons == ["env_done", "env_done", "max_turns", "max_turns"]
    assert traj.env_rewards == pytest.approx([0.8, 0.8, 0.0, 0.0])
    assert [m["content"] for m in traj.messages[0]] == ["0", "higher", "1", "higher", "2"]
    prompt = tok.decode(traj.rollout.prompt_ids[0][traj.rollout.prompt_mask[0].bool()], skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>user\nPlay.<|im_end|>\n<|im_start|>user\nGuess a number from 0 to 9."
                           "<|im_end|>\n<|im_start|>assistant\n")


class HangingEnv(GuessEnv):
    """Hangs in `step` on target 7 (until the test lets it go: the thread is abandoned, not killed)."""

    release = threading.Event()

    def step(self, message):
        if self.target == 7:
            HangingEnv.release.wait(60)
        return super().step(message)


def test_an_environment_call_that_hangs_stops_the_run_naming_the_call(tok):
    """A hung step is a bug in the environment, like one that raises: it stops the rollout after
    env_timeout_s with an error naming the call and how many had not returned (the 2 hung ones, and
    under load perhaps others), instead of hanging the run."""
    encode = lambda msgs: tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,  # noqa: E731
                                                  return_dict=False)
    drv = Driver(ScriptedEngine(tok, bisect), MultiTurnDriver(
        tok, TurnLimits(400, max_turns=5), environment=HangingEnv, encode=encode, eos_token_ids=(tok.eos_token_id,),
        env_timeout_s=0.5))
    prompts = [[{"role": "user", "content": "Play."}]] * 2
    try:
        with pytest.raises(TimeoutError, match=r"HangingEnv.step did not return within env_timeout_s=0.5 s \([234] of "
                                               r"4 calls had not returned\): .* raise env_timeout_s"):
            drv.generate([encode(p) for p in prompts], 2, SamplingParams(max_new_tokens=1), prompts=prompts,
                         columns={"target": ["2", "7"]})
    finally:
        HangingEnv.release.set()


class OddEnv(GuessEnv):
    """Answers its first step with whatever `answer` is set to."""

    answer: tuple = ()

    def step(self, message):
        return OddEnv.answer


def _guess_once(tok, env, **kw):
    encode = lambda msgs: tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,  # noqa: E731
                                                  return_dict=False)
    drv = Driver(ScriptedEngine(tok, bisect), MultiTurnDriver(tok, TurnLimits(400, max_turns=3), environment=env,
                                                              encode=encode, eos_token_ids=(tok.eos_token_id,), **kw))
    prompts = [[{"role": "user", "content": "Play."}]] * 2
    return drv.generate([encode(p) for p in prompts], 2, SamplingParams(max_new_tokens=1), prompts=prompts,
                        columns={"target": ["2", "7"]})


@pytest.mark.parametrize("answer, error", [
    (("higher", False, "high"), r"OddEnv.step returned the reward 'high': return a finite number, or None"),
    (("higher", False, float("nan")), r"OddEnv.step returned the reward nan: return a finite number"),
    (("higher", "no"), r"OddEnv.step returned done='no': return True or False"),
    (([{"role": "user"}], False), r"OddEnv.step returned \[\{'role': 'user'\}\]: an observation is .* each content "
                                  r"a string"),
    (([{"role": "user", "content": 5}], False), r"OddEnv.step returned .*'content': 5.*: an observation is"),
])
def test_an_environments_wrong_answer_is_an_error_naming_it_and_the_form(tok, answer, error):
    """A reward that is not a finite number (it failed later, blamed on the reward function, or as a bare
    ValueError), a done that is not a bool (taken as True), a message without text content (blamed on the
    chat template): each is the environment's error, named, with the form it should return."""
    OddEnv.answer = answer
    with pytest.raises(TypeError, match=error):
        _guess_once(tok, OddEnv)


class ExitingEnv(GuessEnv):
    def step(self, message):
        raise SystemExit(3)


def test_an_environment_that_exits_is_an_error_not_the_runs_end(tok):
    """SystemExit(3) in a step ended the process silently with exit 3, an alarm's exit status."""
    with pytest.raises(RuntimeError, match=r"ExitingEnv.step raised SystemExit\(3,\): an environment may not end "
                                           "the process"):
        _guess_once(tok, ExitingEnv)


class SerialEnv(GuessEnv):
    """One call at a time, each 0.3 s: a queue of 4 takes 1.2 s."""

    concurrency = 1
    lock = threading.Lock()

    def step(self, message):
        assert SerialEnv.lock.acquire(blocking=False), "two calls at once"
        try:
            time.sleep(0.3)
            return [], True, 1.0
        finally:
            SerialEnv.lock.release()


def test_an_environment_of_one_call_at_a_time_gets_them_so_each_timed_from_its_start(tok):
    """`concurrency = 1` (OpenEnv's environments without concurrent sessions): the calls run one after
    another, and env_timeout_s (0.8 s) bounds each call, not the queue (1.2 s), which timed out before."""
    traj = _guess_once(tok, SerialEnv, env_timeout_s=0.8)
    assert traj.stop_reasons == ["env_done"] * 4


class MeetingEnv(GuessEnv):
    """Each instance's construction waits for the batch's other three (as a factory opening a session
    waits on a server): only environments built concurrently get past it."""

    meeting = threading.Barrier(4)

    def __init__(self):
        MeetingEnv.meeting.wait(30)
        super().__init__()


def test_environments_are_built_concurrently(tok):
    """They were built one after another in the caller's thread: N sessions opened in series."""
    MeetingEnv.meeting = threading.Barrier(4, timeout=30)
    traj = _guess_once(tok, MeetingEnv)
    assert len(traj.stop_reasons) == 4


class HangingInitEnv(GuessEnv):
    release = threading.Event()

    def __init__(self):
        HangingInitEnv.release.wait(10)
        self.guesses = 0  # not in GuessEnv.instances: these finish after the test, in another test's count


def test_an_environment_whose_construction_hangs_stops_the_run_naming_it(tok):
    """Construction is bounded by env_timeout_s as reset and step are (it had no bound)."""
    HangingInitEnv.release = threading.Event()
    try:
        with pytest.raises(TimeoutError, match=r"HangingInitEnv\(\) \(building the environment\) did not return "
                                               r"within env_timeout_s=0.2 s \([1-4] of 4 calls"):
            _guess_once(tok, HangingInitEnv, env_timeout_s=0.2)
    finally:
        HangingInitEnv.release.set()


class ClosingEnv(GuessEnv):
    """GuessEnv with a close(); `broken` makes the step of target 7 raise."""

    closed, broken = [], False

    def step(self, message):
        if ClosingEnv.broken and self.target == 7:
            raise RuntimeError("the board caught fire")
        return super().step(message)

    def close(self):
        ClosingEnv.closed.append(id(self))


def test_every_environment_is_closed_once_the_rollout_is_done_with_it(tok):
    """Target 2 finishes (env_done), target 7 is cut by max_turns: each of the 4 is closed, once."""
    GuessEnv.instances, ClosingEnv.closed, ClosingEnv.broken = [], [], False
    traj = _guess_once(tok, ClosingEnv)
    assert traj.stop_reasons == ["env_done", "env_done", "max_turns", "max_turns"]
    assert sorted(ClosingEnv.closed) == sorted(id(e) for e in GuessEnv.instances)


def test_when_one_environment_raises_the_whole_batch_is_closed_and_let_go(tok):
    """The error of one stopped the step and left the batch's other environments open, held by a cycle
    (the error, its traceback, the frame holding the futures that hold the error) until a full GC; an
    environment without atexit closing was then never closed if the process ended first."""
    GuessEnv.instances, ClosingEnv.closed, ClosingEnv.broken = [], [], True
    gc.disable()
    try:
        try:
            _guess_once(tok, ClosingEnv)
        except RuntimeError as e:
            assert str(e) == "the board caught fire"
        else:
            pytest.fail("the step should have raised")
        assert sorted(ClosingEnv.closed) == sorted(id(e) for e in GuessEnv.instances) and len(ClosingEnv.closed) == 4
        envs = [weakref.ref(e) for e in GuessEnv.instances]
        GuessEnv.instances = []
        assert [r() for r in envs] == [None] * 4  # freed with the error, no GC needed
    finally:
        gc.enable()
        ClosingEnv.broken = False


class SlowClosingEnv(ClosingEnv):
    """One call at a time; the first instance's close hangs until the test lets it go."""

    concurrency, release = 1, threading.Event()

    def close(self):
        if self is GuessEnv.instances[0]:
            SlowClosingEnv.release.wait(60)
        super().close()


def _wait_for(condition, what: str) -> None:
    for _ in range(600):  # generous: the background threads only need a moment
        if condition():
            return
        time.sleep(0.1)
    pytest.fail(f"not within 60 s: {what}")


def test_a_close_that_hangs_holds_the_others_back_but_drops_none(tok, caplog):
    """One environment's close outlives env_timeout_s (one call at a time, so the others queue behind
    it): the closes not yet started were dropped, with a log line from the step's timeout saying the
    run stopped. Now the run goes on, says so, and the queued closes run once the hung one returns."""
    GuessEnv.instances, ClosingEnv.closed, SlowClosingEnv.release = [], [], threading.Event()
    with caplog.at_level("WARNING", logger="grouprl.rollout.multiturn"):
        traj = _guess_once(tok, SlowClosingEnv, env_timeout_s=0.5)
    assert len(traj.stop_reasons) == 4 and ClosingEnv.closed == []
    assert "SlowClosingEnv.close() did not return within 0.5 s" in caplog.text and "the run goes on" in caplog.text
    SlowClosingEnv.release.set()
    _wait_for(lambda: len(ClosingEnv.closed) == 4, "every environment closed")
    assert sorted(ClosingEnv.closed) == sorted(id(e) for e in GuessEnv.instances)


class LateClosingEnv(ClosingEnv):
    """The first instance's construction outlives env_timeout_s, then finishes."""

    release, built = threading.Event(), []

    def __init__(self):
        first = not LateClosingEnv.built
        LateClosingEnv.built.append(1)
        if first:
            LateClosingEnv.release.wait(60)
        super().__init__()


def test_an_environment_built_after_its_batch_was_given_up_on_is_closed(tok):
    """The driver gave up on the batch (and closed what it had) before this construction returned:
    nothing closed the environment built late."""
    GuessEnv.instances, ClosingEnv.closed, LateClosingEnv.built = [], [], []
    LateClosingEnv.release = threading.Event()
    with pytest.raises(TimeoutError, match="building the environment"):
        _guess_once(tok, LateClosingEnv, env_timeout_s=0.3)
    assert len(ClosingEnv.closed) == 3  # the batch's others
    LateClosingEnv.release.set()
    _wait_for(lambda: len(ClosingEnv.closed) == 4, "the late environment closed")
    assert sorted(ClosingEnv.closed) == sorted(id(e) for e in GuessEnv.instances)


def test_a_call_that_fails_after_the_wait_gave_up_fails_in_its_own_thread_quietly(monkeypatch):
    """When one call raised, the wait dropped its list of results to free the batch; a call still running
    that then raised found the list gone (TypeError in its thread)."""
    from grouprl.rollout.multiturn import _concurrently

    crashed, later = [], threading.Event()
    monkeypatch.setattr(threading, "excepthook", lambda args: crashed.append(args.exc_value))

    def now():
        raise ValueError("a bug in the environment")

    def afterwards():
        later.wait(60)
        raise RuntimeError("closed under it")

    with pytest.raises(ValueError, match="a bug in the environment"):
        _concurrently([(now, ()), (afterwards, ())], timeout_s=0.3)
    threads = [t for t in threading.enumerate() if t.name == "grouprl-env"]
    later.set()
    for t in threads:
        t.join(60)
    assert crashed == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the sandbox needs a POSIX host")
def test_hostile_python_calls_are_contained_and_the_rollout_continues(tok, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET-13")
    codes = {
        "Q1": f"print(open({str(secret)!r}).read())",
        "Q2": "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\nprint('connected')",
        "Q3": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "Q4": "print(6 * 7)",
    }

    def script(text):
        q = re.search(r"(Q\d)", text).group(1)
        if "<tool_response>" not in text:
            return '<tool_call>\n{"name": "python", "arguments": {"code": %s}}\n</tool_call>' % (
                __import__("json").dumps(codes[q]))
        return "finished"

    tools = resolve_tools([python_tool(timeout_s=2.0, memory_mb=128, max_output_chars=300)])
    drv, _ = driver(tok, script, tools=tools, max_completion_length=1200)
    traj = drv.generate(prompt_ids(tok, tools, list(codes)), 1, SamplingParams(max_new_tokens=1))
    assert traj.stop_reasons == ["answer"] * 4  # every row went on to its next turn
    results = [[m["content"] for m in msgs if m["role"] == "tool"][0] for msgs in traj.messages]
    assert "TOPSECRET" not in results[0] and "Error: " in results[0].splitlines()[-1]  # e.g. FileNotFoundError
    assert "connected" not in results[1] and "Error: " in results[1].splitlines()[-1]  # e.g. network unreachable
    assert results[2].endswith("[timeout: stopped after 2 s]")  # the fork bomb, killed with its children
    assert results[3] == "42"
    assert secret.read_text() == "TOPSECRET-13"
