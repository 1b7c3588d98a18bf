"""Multi-turn training through the Trainer: the action mask in the update, tools and an environment
end to end, and bad multi-turn settings failing before any model loads."""

import copy
import json
from pathlib import Path
import re

import pytest
import torch
import yaml

import grouprl.trainer as trainer_module
import grouprl.update as update_module
from grouprl.batch import StepBatch
from grouprl.config import ConfigError
from grouprl.rollout import Rollout
from grouprl.tasks.testing import build_qwen2
from grouprl.trainer import Trainer
from tests.rollout.test_multiturn import ScriptedEngine
from tests.tools.conftest import add, build_qwen_tokenizer
from tests.trainer.conftest import read_metrics


def _rollout(context: list[int]) -> Rollout:
    """Two rows sharing a prompt; completion = 4 actions, 4 context tokens (`context`), 4 actions."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, 100, (1, 5), generator=g).repeat(2, 1)  # [2, 5]
    acts = torch.randint(4, 100, (2, 8), generator=g)  # [2, 8]
    ctx = torch.tensor(context).repeat(2, 1)  # [2, 4]
    completion = torch.cat([acts[:, :4], ctx, acts[:, 4:]], 1)  # [2, 12]
    action = torch.tensor([True] * 4 + [False] * 4 + [True] * 4).repeat(2, 1)  # [2, 12]
    return Rollout(prompt, torch.ones_like(prompt), completion, torch.ones_like(action),
                   torch.zeros(2, dtype=torch.bool), action_mask=action)


def test_context_tokens_carry_no_gradient_and_do_not_change_the_actions_gradient(make_cfg, monkeypatch):
    """d loss / d logp is 0 on the context tokens, and on the actions it is -A_i / (action tokens)
    (token-mean, on-policy), whatever the context says; the log-probs of the actions after the
    context do depend on it (the log-prob pass conditions on it)."""
    trainer = Trainer(make_cfg(num_generations=2, prompts_per_step=1, micro_batch_size=2, loss_agg="token-mean",
                               beta=0.0))
    captured = []
    real = update_module.completion_forward

    def spy(*args, **kwargs):
        logp, entropy, values = real(*args, **kwargs)
        if logp.requires_grad:
            logp.retain_grad()
            captured.append(logp)
        return logp, entropy, values

    monkeypatch.setattr(update_module, "completion_forward", spy)
    weights = copy.deepcopy(trainer.model.state_dict())
    grads, logps = [], []
    for context in ([10, 11, 12, 13], [70, 20, 90, 40]):
        trainer.model.load_state_dict(weights)
        captured.clear()
        ro = _rollout(context)
        batch = StepBatch(ro, ["p", "p"], ["a", "b"], torch.tensor([1.0, 0.0]), {}, {})
        advantages = trainer.advantages(batch)
        stats = trainer.update(batch, advantages)
        (logp,) = captured  # on the trainer's device (cuda:0 where there is one): compared on the CPU
        grad = logp.grad.cpu().clone()
        grads.append(grad)
        logps.append(logp.detach().cpu().clone())
        assert torch.equal(grad[:, 4:8], torch.zeros(2, 4))  # context: no gradient at all
        want = (-advantages.cpu()[:, None] / 16).expand(2, 8)  # 16 action tokens in the batch
        torch.testing.assert_close(grad[:, ro.action_mask[0]], want, rtol=1e-6, atol=0)
        assert stats["entropy"] > 0
    assert torch.equal(grads[0], grads[1])
    assert not torch.allclose(logps[0][:, 8:], logps[1][:, 8:])  # the later actions saw the context


def test_completion_length_metrics_count_actions_only(make_cfg):
    ro = _rollout([1, 2, 3, 4])
    assert ro.lengths.tolist() == [12, 12] and ro.action_lengths.tolist() == [8, 8]
    both = Rollout.cat([ro, Rollout(ro.prompt_ids, ro.prompt_mask, ro.completion_ids[:, :3],
                                    ro.completion_mask[:, :3], ro.truncated)], pad_token_id=0)
    assert both.action_lengths.tolist() == [8, 8, 3, 3] and both.select([1, 2]).action_lengths.tolist() == [8, 3]


# ---------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def qwen_model_dir(tmp_path_factory):
    """A random 0.2 M-parameter Qwen2 with the character tokenizer, Qwen2.5's chat template and turn tokens."""
    tok = build_qwen_tokenizer()
    model = build_qwen2(tok, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                        max_position_embeddings=4096)
    path = tmp_path_factory.mktemp("models") / "qwen-chat"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def chat_cfg(make_cfg, qwen_model_dir):
    rows = [{"prompt": [{"role": "user", "content": f"Add {i} and 3."}], "answer": str(i + 3)} for i in range(8)]

    def make(**overrides):
        values = dict(model=str(qwen_model_dir), num_generations=2, prompts_per_step=2, micro_batch_size=4,
                      max_completion_length=96, max_steps=2, temperature=1.0)
        return make_cfg(**{**values, **overrides}), rows

    return make


SEEN: list = []


def trajectory_reward(prompts, completions, **kwargs):
    """Records what reward functions receive; rewards a trajectory for each tool message in it."""
    SEEN.append((completions, kwargs))
    return [float(sum(m["role"] == "tool" for m in c)) for c in completions]


def test_training_with_tools_end_to_end(chat_cfg):
    """A random policy writes <tool_call> tokens now and then (one token in 104): with a budget of 96
    tokens most turns end by length, some are answered with a parse error; every path keeps the step going."""
    SEEN.clear()
    cfg, rows = chat_cfg(max_turns=2, max_tool_calls=2)
    trainer = Trainer(cfg, train_dataset=rows, reward_funcs=[trajectory_reward], tools=[add])
    prompt = trainer.formatter.text(rows[0]["prompt"])
    assert '"name": "add"' in prompt  # the schema reaches the model through the chat template
    trainer.train()
    completions, kwargs = SEEN[0]
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in completions)
    assert "env_reward" not in kwargs
    metrics = read_metrics(cfg.output_dir)
    keys = {"multiturn/tool_calls_per_trajectory", "multiturn/parse_failures_per_trajectory",
            "multiturn/turns_per_trajectory", "multiturn/stop_max_length_frac", "time/tools"}
    assert keys <= set(metrics[0])
    for m in metrics:
        stops = sum(m[f"multiturn/stop_{r}_frac"] for r in ("answer", "env_done", "max_length", "max_turns",
                                                             "max_tool_calls"))
        assert stops == pytest.approx(1.0)
        assert 1 <= m["multiturn/turns_per_trajectory"] <= 2
        assert m["completion/length_max"] <= 96


class CountdownEnv:
    """Says a number; the episode ends at the policy's second reply, rewarded by its length."""

    def reset(self, prompt, answer):
        self.left = 2
        return f"Start at {answer}."

    async def step(self, message):  # async on purpose: environments may be
        self.left -= 1
        return "Go on.", self.left == 0, len(message["content"]) / 100


class CountdownEnvAnyRow(CountdownEnv):
    def reset(self, prompt, answer, **row):  # the row's other columns are not its business
        return super().reset(prompt, answer)


def env_reward(prompts, completions, env_reward, **kwargs):
    SEEN.append((completions, env_reward))
    return list(env_reward)


def test_environment_through_the_trainer(chat_cfg):
    """The replies come from a scripted engine (a random policy rarely ends a turn in time); the
    environment, the driver, the rewards and the update are the trainer's own."""
    SEEN.clear()
    cfg, rows = chat_cfg(environment="tests.trainer.test_multiturn_train:CountdownEnv", max_turns=4,
                         max_completion_length=200, env_timeout_s=45.0, max_tool_output_chars=99,
                         chat_template_kwargs={"unused_by_this_template": 1})
    trainer = Trainer(cfg, train_dataset=rows, reward_funcs=[env_reward])
    assert (trainer.turns.env_timeout_s, trainer.turns.max_tool_output_chars) == (45.0, 99)  # the config's limits
    assert trainer.turns.template_kwargs == {"unused_by_this_template": 1}  # the next turns' headers, as the prompts
    replies = {"Start": "first reply", "Go on": "second"}
    trainer.engine = ScriptedEngine(trainer.tokenizer, lambda text: replies[text.split("user\n")[-1][:5]])
    trainer.train()
    completions, rewards = SEEN[0]
    assert completions == [[{"role": "assistant", "content": "first reply"}, {"role": "user", "content": "Go on."},
                            {"role": "assistant", "content": "second"}]] * 4
    assert rewards == pytest.approx([0.17] * 4)  # (11 + 6) / 100, summed over the two steps
    m = read_metrics(cfg.output_dir)[0]
    assert m["multiturn/stop_env_done_frac"] == 1.0 and m["multiturn/turns_per_trajectory"] == 2.0
    assert m["completion/length_mean"] == len("first reply") + len("second") + 2  # actions: 2 replies + <|im_end|>


def test_tools_with_plain_string_prompts_are_refused_naming_the_fix(chat_cfg):
    """The model learns of the tools from the chat template, which a string prompt never passes through:
    the run trained with tools the model was never shown, silently. Refused when the trainer is built,
    before the policy loads."""
    from grouprl.data import DataError

    cfg, rows = chat_cfg()
    strings = [{"prompt": r["prompt"][0]["content"], "answer": r["answer"]} for r in rows]
    with pytest.raises(DataError, match=r"a prompt is a plain string \('Add \d and 3.'\) and tools are set: .* give "
                                        r"the prompts as \[\{'role': 'user'"):
        Trainer(cfg, train_dataset=strings, reward_funcs=[trajectory_reward], tools=[add])


class BrokenEnv(CountdownEnv):
    def reset(self, prompt, answer):
        return int("x" + answer)  # a bug: ValueError


def test_a_value_error_in_an_environment_is_a_fault_with_its_traceback_not_a_config_error(chat_cfg, tmp_path, capsys):
    """`grouprl train` printed any ValueError as "error: <message>" with exit 2, a wrong setting's form, so an
    environment's bug lost its traceback and looked like a config mistake; it now propagates (exit 1),
    naming where it was raised."""
    from grouprl.cli import main

    cfg, rows = chat_cfg(environment="tests.trainer.test_multiturn_train:BrokenEnv")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({**cfg.to_dict(), "train_data": str(data)}))
    with pytest.raises(RuntimeError, match="the run stopped on ValueError while training") as raised:
        main(["train", str(tmp_path / "run.yaml")])
    assert isinstance(raised.value.__cause__, ValueError) and "'x" in str(raised.value.__cause__)
    assert "error: invalid literal" not in capsys.readouterr().err


def test_a_dataset_column_named_env_reward_is_its_own_without_an_environment_and_refused_with_one(chat_cfg):
    """The trainer passes `env_reward` only when an environment reports rewards: a dataset column of that
    name reaches the rewards as it is without one, and with one is a clash named before any reward runs."""
    from grouprl.data import DataError

    SEEN.clear()
    cfg, rows = chat_cfg(max_steps=1)
    rows = [{**r, "env_reward": 0.25} for r in rows]
    Trainer(cfg, train_dataset=rows, reward_funcs=[env_reward]).train()
    assert SEEN[0][1] == [0.25] * len(SEEN[0][1])
    cfg, _ = chat_cfg(environment="tests.trainer.test_multiturn_train:CountdownEnvAnyRow", max_turns=4,
                      max_completion_length=200, output_dir=str(Path(cfg.output_dir).parent / "with-env"))
    trainer = Trainer(cfg, train_dataset=rows, reward_funcs=[env_reward])
    trainer.engine = ScriptedEngine(trainer.tokenizer, lambda text: "a reply")
    with pytest.raises(DataError, match="a column named 'env_reward', which the environment's rewards also take"):
        trainer.train_step()


@pytest.mark.parametrize("overrides, message", [
    (dict(tools=["no_such_tool"]), "unknown tool 'no_such_tool'"),
    (dict(tools=["tests.tools.conftest:nothing_here"]), "has no attribute 'nothing_here'"),
    (dict(tools=[{"name": "python", "timeout": 3}]), "its parameters are"),
    (dict(environment="tests.trainer.test_multiturn_train"), "package.module:Class"),
    (dict(environment="tests.trainer.test_multiturn_train:SEEN"), "not a function"),
    (dict(environment="tests.trainer.test_multiturn_train:env_reward"), "no reset or step method"),
    (dict(tools=["python"], environment="tests.trainer.test_multiturn_train:CountdownEnv"), "both set"),
    (dict(tools=["python"], ignore_eos=True), "ignore_eos=true"),
    (dict(tools=["python"], tool_parser="xml"), "tool_parser='xml'"),
    (dict(tools=["python"], max_turns=0), "max_turns=0"),
])
def test_bad_multiturn_settings_fail_before_any_model_loads(make_cfg, monkeypatch, overrides, message):
    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the error")

    monkeypatch.setattr(trainer_module, "load_policy", no_load)
    monkeypatch.setattr(trainer_module, "policy_tokenizer", no_load)
    with pytest.raises(ConfigError, match=re.escape(message)):
        Trainer(make_cfg(**overrides))


def test_a_template_without_a_tool_format_asks_for_tool_parser(make_cfg, monkeypatch):
    """The character tokenizer given a chat template that shows no tool-call format."""
    load = trainer_module.policy_tokenizer

    def with_plain_template(*args, **kwargs):
        tok = load(*args, **kwargs)
        tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        return tok

    monkeypatch.setattr(trainer_module, "policy_tokenizer", with_plain_template)
    rows = [{"prompt": [{"role": "user", "content": f"Say numbers {i}: "}]} for i in range(4)]
    with pytest.raises(ConfigError, match="tool_parser: one of hermes, llama3, template"):
        Trainer(make_cfg(tools=["tests.tools.conftest:add"]), train_dataset=rows)
