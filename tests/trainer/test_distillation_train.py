"""On-policy distillation through the Trainer: the advantages the loss receives are the mix of
core/distillation.py with the teacher's log-probs worked out here by a plain forward pass, the teacher
is never trained, a tiny student learns towards a tiny teacher, and every wrong combination fails
before a model loads with an error that names the fix."""

import re
import shutil

import pytest
import torch
import torch.nn.functional as F

import grouprl.update as update_module
from grouprl.checkpoint import checkpoint_path
from grouprl.config import ConfigError
from grouprl.core import group_advantages
from grouprl.distillation import load_teacher
from grouprl.distributed import DistContext
from grouprl.tasks.testing import build_char_tokenizer, build_qwen2, build_tiny_model
from grouprl.trainer import Trainer
from tests.trainer.conftest import read_metrics


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A teacher that knows the digits task: the policy's tiny Qwen2 (seed 0, the same character
    tokenizer) fine-tuned for 30 steps to answer the training prompts "Say numbers i: " with
    "0123456789" and EOS (cross-entropy on the answer; a second on this CPU)."""
    model, tok = build_tiny_model("tiny", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prompts = [tok(f"Say numbers {i}: ")["input_ids"] for i in range(10, 58)]  # one length: no padding
    answer = tok("0123456789")["input_ids"] + [tok.eos_token_id]
    with torch.random.fork_rng(devices=[]):
        for step in range(30):
            ids = torch.tensor([p + answer for p in prompts[16 * (step % 3): 16 * (step % 3) + 16]])  # [16, L]
            logits = model(input_ids=ids).logits[:, -len(answer) - 1: -1]  # [16, |answer|, V]
            loss = F.cross_entropy(logits.flatten(0, 1), ids[:, -len(answer):].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
    path = tmp_path_factory.mktemp("teacher") / "tiny"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def other_tokenizer_dir(tmp_path_factory):
    """A tiny model whose tokenizer has one token more than the policy's: `<think>`, id 100."""
    tok = build_char_tokenizer()
    tok.add_tokens(["<think>"])
    model = build_qwen2(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    path = tmp_path_factory.mktemp("other") / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def sequence_logprobs(model, rollout, temperature):
    """log-probs [N, T] of each completion token by a plain padded forward pass of prompt + completion,
    one row at a time, without the trainer's packing, micro-batches or head chunking. On the host, as
    the trainer's advantages are (the model runs on its device: cuda:0 where there is one)."""
    device = next(model.parameters()).device
    out = torch.zeros(rollout.completion_ids.shape)
    for i in range(len(rollout.completion_ids)):
        prompt = rollout.prompt_ids[i][rollout.prompt_mask[i].bool()]
        n = int(rollout.completion_mask[i].sum())
        ids = torch.cat([prompt, rollout.completion_ids[i, :n]])[None]
        with torch.no_grad():
            logits = model(input_ids=ids.to(device)).logits[0, len(prompt) - 1: -1].float().cpu()  # [n, V]
        logits = logits / temperature
        out[i, :n] = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0]
    return out


@pytest.mark.parametrize("algorithm, extra", [("on_policy_distill", {}), ("grpo", {"distill_coef": 0.5})])
def test_the_loss_gets_the_teacher_signal_mixed_with_the_reward_advantages(make_cfg, teacher_dir, monkeypatch,
                                                                           algorithm, extra):
    """Distillation alone (c_R = 0, λ = 1) and mixed (c_R = 1, λ = 0.5): for every completion token,
    A = c_R·A_grpo(rewards) + λ·(log π_T − log π_S) with both log-probs from `sequence_logprobs`, π_S the
    policy before the step's update."""
    seen, to_loss = [], []
    real_policy_loss = update_module.policy_loss

    def spy_loss(logp, old_logp, advantages, mask, **kwargs):
        to_loss.append(advantages.detach().cpu().clone())
        return real_policy_loss(logp, old_logp, advantages, mask, **kwargs)

    monkeypatch.setattr(update_module, "policy_loss", spy_loss)
    cfg = make_cfg(algorithm=algorithm, teacher_model=str(teacher_dir), beta=None, max_steps=2, temperature=1.3,
                   **extra)
    trainer = Trainer(cfg)
    real_update = trainer.update

    def spy_update(batch, advantages, *rest):  # the policy as it sampled: before this step's update
        seen.append((batch, advantages.clone(), sequence_logprobs(trainer.model, batch.rollout, cfg.temperature)))
        return real_update(batch, advantages, *rest)

    trainer.update = spy_update
    trainer.train()
    c_r, lam = (0.0, 1.0) if algorithm == "on_policy_distill" else (1.0, 0.5)
    assert len(seen) == 2
    for batch, adv, student in seen:
        teacher = sequence_logprobs(trainer.teacher.model, batch.rollout, cfg.temperature)  # [N, T]
        mask = batch.rollout.action_mask
        want = c_r * group_advantages(batch.rewards, cfg.num_generations)[:, None] + lam * (teacher - student)
        want = torch.where(mask, want, torch.zeros(()))
        assert adv.shape == mask.shape
        torch.testing.assert_close(adv, want, rtol=0, atol=2e-5)
        assert (teacher - student)[mask].abs().max() > 0.1  # the models differ: a signal to check
    rows = read_metrics(cfg.output_dir)
    assert all(r["distill/reverse_kl"] == pytest.approx(r["distill/student_logp"] - r["distill/teacher_logp"])
               for r in rows)
    assert len(to_loss) >= 2 and all(part.dim() == 2 for part in to_loss)


def test_the_teacher_is_frozen_and_stays_out_of_optimizer_and_checkpoint(make_cfg, teacher_dir):
    cfg = make_cfg(algorithm="on_policy_distill", teacher_model=str(teacher_dir), beta=None, max_steps=2,
                   learning_rate=1e-2)
    trainer = Trainer(cfg)
    teacher = trainer.teacher.model
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    policy_before = next(trainer.model.parameters()).detach().clone()
    trainer.train()
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    assert all(p.grad is None for p in teacher.parameters())
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())  # never trained
    assert not torch.equal(policy_before, next(trainer.model.parameters()))  # the student was
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not optimized & {id(p) for p in teacher.parameters()}
    assert next(teacher.parameters()).dtype == torch.float32  # bf16 off: the compute dtype is fp32
    assert trainer.ref is None  # beta 0: the teacher is the anchor, no reference model
    state = torch.load(checkpoint_path(cfg.output_dir, 2) / "state.pt", weights_only=False)
    assert not any("teacher" in k for k in state)
    resumed = Trainer(make_cfg(algorithm="on_policy_distill", teacher_model=str(teacher_dir), beta=None, max_steps=3))
    resumed.train(resume=True)  # the teacher loads again from teacher_model
    assert all(torch.equal(before[k], v) for k, v in resumed.teacher.model.state_dict().items())


def test_the_teacher_is_held_in_the_compute_dtype(make_cfg, teacher_dir, monkeypatch):
    """Loaded in it, too: a bf16 run's teacher is never whole in fp32 (a 7B teacher would be 28 GB)."""
    from transformers import AutoModelForCausalLM

    real, asked = AutoModelForCausalLM.from_pretrained, []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **kw: asked.append(kw.get("dtype")) or real(*a, **kw))
    cfg = make_cfg(algorithm="on_policy_distill", teacher_model=str(teacher_dir), beta=None).validate()
    teacher = load_teacher(cfg, build_char_tokenizer(), DistContext(), torch.bfloat16)
    assert asked == [torch.bfloat16]
    assert {p.dtype for p in teacher.model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in teacher.model.parameters())


def test_a_tiny_student_learns_from_a_tiny_teacher_without_the_reward(make_cfg, teacher_dir):
    """Distillation alone (c_R = 0: the reward is scored, never learned from) from a tiny teacher that
    answers with digits: the student's reward (the digit fraction) climbs and the per-token reverse KL
    on its own samples falls."""
    cfg = make_cfg(algorithm="on_policy_distill", teacher_model=str(teacher_dir), beta=None, max_steps=10,
                   prompts_per_step=8, micro_batch_size=32, learning_rate=3e-3)
    Trainer(cfg).train()
    rows = read_metrics(cfg.output_dir)
    kl, reward = [r["distill/reverse_kl"] for r in rows], [r["reward/mean"] for r in rows]
    assert sum(reward[-3:]) / 3 > sum(reward[:3]) / 3 + 0.2, reward
    assert sum(kl[-3:]) / 3 < sum(kl[:3]) / 3 - 0.5, kl


@pytest.mark.parametrize("overrides, message", [
    ({"algorithm": "on_policy_distill"}, "distill_coef=1.0 .algorithm=on_policy_distill. distils from a teacher, "
                                         "and teacher_model is unset: set teacher_model to a model that shares"),
    ({"distill_coef": 0.5}, "distill_coef=0.5 .algorithm=grpo. distils from a teacher, and teacher_model is unset"),
    ({"teacher_model": "x"}, "teacher_model='x' with distill_coef=0 .algorithm=grpo.: the teacher would load and "
                             "never count; set distill_coef"),
    ({"distill_reward_coef": 0.5}, "distill_reward_coef=0.5 weighs the reward advantages against a teacher's "
                                   "signal, and there is none"),
    ({"algorithm": "on_policy_distill", "teacher_model": "x", "distill_coef": -1.0}, "distill_coef=-1.0 must be 0"),
    ({"algorithm": "on_policy_distill", "teacher_model": "x", "dynamic_sampling": True},
     "dynamic_sampling with distill_coef=1.0: .* with a teacher those groups still carry its per-token signal; "
     "set dynamic_sampling: false"),
    ({"algorithm": "on_policy_distill", "teacher_model": "x", "prompt_filter": True},
     "prompt_filter with distill_coef=1.0: the prompt filter stops drawing prompts whose groups' rewards were all "
     "equal, and with a teacher those groups still carry its per-token signal; set prompt_filter: false"),
    ({"algorithm": "on_policy_distill", "teacher_model": "x", "distill_signal": "forward_kl"},
     "distill_signal='forward_kl' is not one of: reverse_kl"),
    ({"algorithm": "on_policy_distill", "teacher_model": "./no/teacher"},
     "teacher_model: model='./no/teacher' does not exist: check the path"),
])
def test_config_errors_name_the_fix(make_cfg, no_model_loading, overrides, message):
    with pytest.raises(ConfigError, match=message):
        Trainer(make_cfg(**{"beta": None, **overrides}))


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(make_cfg, other_tokenizer_dir, tiny_model_dir,
                                                                  no_model_loading):
    with pytest.raises(ConfigError) as e:
        Trainer(make_cfg(algorithm="on_policy_distill", teacher_model=str(other_tokenizer_dir), beta=None))
    msg = str(e.value)
    assert f"teacher_model={str(other_tokenizer_dir)!r} does not share the policy's tokenizer" in msg
    assert "has 101 tokens" in msg and f"the policy's ({str(tiny_model_dir)!r})" in msg and "has 100" in msg
    assert "'<think>': id 100 for the teacher, None for the policy" in msg
    assert "pick a teacher of the policy's family" in msg


def test_a_model_folder_without_tokenizer_files_is_refused_naming_the_fix(make_cfg, tmp_path, tiny_model_dir):
    """Weights saved with model.save_pretrained alone: transformers would build an empty tokenizer of the
    config's type from the folder (one token long) and train on it. As the policy, the folder is refused
    with the `tokenizer` setting to use, and accepted with it; as the teacher, refused before it loads."""
    weights = tmp_path / "weights"
    weights.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, weights / name)
    with pytest.raises(ConfigError, match=rf"^model={re.escape(repr(str(weights)))} holds no tokenizer files .* or "
                                          "set tokenizer to the folder"):
        Trainer(make_cfg(model=str(weights)))
    assert len(Trainer(make_cfg(model=str(weights), tokenizer=str(tiny_model_dir))).tokenizer) == 100
    with pytest.raises(ConfigError, match=rf"^tokenizer={re.escape(repr(str(weights)))} holds no tokenizer files .*: "
                                          "set tokenizer to a folder that holds them"):  # not "set tokenizer" alone
        Trainer(make_cfg(model=str(tiny_model_dir), tokenizer=str(weights)))
    with pytest.raises(ConfigError, match=rf"^teacher_model={re.escape(repr(str(weights)))} holds no tokenizer "
                                          "files .* save the tokenizer the teacher was trained with"):
        Trainer(make_cfg(algorithm="on_policy_distill", teacher_model=str(weights), beta=None))


def test_the_command_line_reaches_the_distillation_fields():
    """`grouprl train --algorithm on_policy_distill --teacher_model T` distils on the embedded task (the
    teacher is not a task field; the task's own beta 0.04 stays over the preset's 0, as for any preset),
    and every distillation field is a --field with its help."""
    from grouprl.cli_args import build_config, help_text

    cfg = build_config(None, ["--algorithm", "on_policy_distill", "--teacher_model", "runs/t/model",
                              "--distill_reward_coef", "0.5"]).resolved()
    assert (cfg.teacher_model, cfg.distill_coef, cfg.distill_reward_coef, cfg.beta) == ("runs/t/model", 1.0, 0.5, 0.04)
    assert cfg.train_data == "builtin:arithmetic/train"
    text = help_text()
    assert all(f"--{name} " in text for name in ("teacher_model", "distill_coef", "distill_reward_coef",
                                                  "distill_signal"))


def test_a_registered_signal_is_accepted_and_used(make_cfg, teacher_dir):
    """distill_signal names any function in core's DISTILL_SIGNALS: here twice the reverse-KL signal,
    so with c_R = 0 and λ = 1 every advantage is twice what `reverse_kl` gives on the same batch."""
    from grouprl.core import DISTILL_SIGNALS, reverse_kl_signal

    def doubled(teacher, student, mask):
        return 2 * reverse_kl_signal(teacher, student, mask)

    with DISTILL_SIGNALS.registered("test_doubled", doubled):
        trainer = Trainer(make_cfg(algorithm="on_policy_distill", teacher_model=str(teacher_dir), beta=None,
                                   distill_signal="test_doubled"))
        batch, _ = trainer.sample_batch()
        got = trainer.advantages(batch)
        trainer.cfg = make_cfg(algorithm="on_policy_distill", teacher_model=str(teacher_dir), beta=None).validate()
        want = trainer.advantages(batch)
    torch.testing.assert_close(got, 2 * want)
    assert want.abs().max() > 0


def test_ppo_with_a_teacher_adds_its_signal_to_the_gae_advantages(make_cfg, teacher_dir):
    """PPO and a teacher together: the advantages are the GAE advantages of the rewards and V_old
    (whitened, as PPO's preset does) plus λ·(log π_T − log π_S) on every completion token; both
    terms are nonzero, and the run trains its value head."""
    from grouprl.objective import step_advantages

    cfg = make_cfg(algorithm="ppo", teacher_model=str(teacher_dir), distill_coef=0.5, max_steps=2, temperature=1.3)
    trainer = Trainer(cfg)
    seen, real = [], trainer.advantages

    def spy(batch, values=None, metrics=None):  # the policy as it sampled: before this step's update
        student = sequence_logprobs(trainer.model, batch.rollout, cfg.temperature)
        adv = real(batch, values, metrics)
        seen.append((batch, values, adv.clone(), student))
        return adv

    trainer.advantages = spy
    trainer.train()
    assert len(seen) == 2
    for batch, values, adv, student in seen:
        assert values is not None  # V_old from the value head
        teacher = sequence_logprobs(trainer.teacher.model, batch.rollout, cfg.temperature)  # [N, T]
        mask = batch.rollout.action_mask
        gae = step_advantages(trainer.cfg, batch, values)  # [N, T]
        want = torch.where(mask, gae + 0.5 * (teacher - student), torch.zeros(()))
        torch.testing.assert_close(adv, want, rtol=0, atol=2e-5)
        assert gae[mask].abs().max() > 0.1 and (teacher - student)[mask].abs().max() > 0.1
    assert float(trainer.updater.value_head.linear.weight.abs().sum()) > 0
