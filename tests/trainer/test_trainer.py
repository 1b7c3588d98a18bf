"""End-to-end behaviour of the trainer on a tiny random model: it learns, each path runs, the
micro-batched update equals the full-batch update, and runs leave what they promise."""

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from grouprl.distributed import init_distributed
from grouprl.precision import native_bf16
from grouprl.trainer import Trainer
from tests.trainer.conftest import read_metrics

TIMING = ("time/",)


def test_reward_rises_on_a_dense_task(make_cfg):
    cfg = make_cfg(max_steps=30, learning_rate=5e-3, num_generations=8, prompts_per_step=2,
                   micro_batch_size=16, logging_steps=5, report_to=["tensorboard"])
    summary = Trainer(cfg).train()
    rows = read_metrics(cfg.output_dir)
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.2, (first, last)
    assert summary["reward_last"] > summary["reward_first"]
    out = cfg.output_dir
    for name in ("config.yaml", "metrics.jsonl", "samples.jsonl", "summary.json", "curves.png"):
        assert (tmp := __import__("pathlib").Path(out) / name).is_file() and tmp.stat().st_size > 0, name
    assert any((__import__("pathlib").Path(out) / "tensorboard").iterdir())


def test_metrics_row_has_every_promised_field(make_cfg):
    cfg = make_cfg(max_steps=1, beta=0.04)
    Trainer(cfg).train()
    (row,) = read_metrics(cfg.output_dir)
    for key in ("step", "reward/mean", "reward/std", "rewards/digit_fraction/mean",
                "rewards/digit_fraction/std", "zero_std_frac", "advantage/mean", "advantage/std",
                "kl", "clip_frac_low", "clip_frac_high", "entropy", "completion/length_mean",
                "completion/length_min", "completion/length_max", "completion/truncated_frac", "lr",
                "grad_norm", "time/generate", "time/reward", "time/logprobs", "time/update", "time/step"):
        assert key in row, key
    # step 1: the policy is the reference, so the KL estimate is exactly 0; the ratio is exactly 1
    assert row["kl"] == 0.0
    assert row["ratio_mean"] == 1.0 and row["clip_frac"] == 0.0
    assert row["entropy"] > 0


def test_kl_grows_from_zero_with_beta(make_cfg):
    cfg = make_cfg(max_steps=4, beta=0.1, learning_rate=1e-2)
    trainer = Trainer(cfg)
    assert trainer.ref is not None and trainer.ref.model is not trainer.model
    trainer.train()
    kls = [r["kl"] for r in read_metrics(cfg.output_dir)]
    assert kls[0] == 0.0 and kls[-1] > 1e-4


def test_no_reference_model_without_beta(make_cfg):
    trainer = Trainer(make_cfg(beta=0.0))
    assert trainer.ref is None


def test_mu_gt_1_uses_old_logprobs_and_clips(make_cfg):
    cfg = make_cfg(max_steps=2, num_iterations=3, learning_rate=3e-2, epsilon=0.05)
    trainer = Trainer(cfg)
    calls = []
    original = trainer.updater.logprobs
    trainer.updater.logprobs = lambda model, rollout, cfg: calls.append(model) or original(model, rollout, cfg)
    trainer.train()
    assert len(calls) == 2  # old log-probs once per step, no reference (beta = 0)
    rows = read_metrics(cfg.output_dir)
    # the last of 3 passes sees a policy two optimizer steps away from the sampler
    assert all(abs(r["ratio_mean"] - 1.0) > 1e-4 for r in rows)
    assert any(r["clip_frac"] > 0 for r in rows)
    assert rows[-1]["lr"] == pytest.approx(cfg.learning_rate)


def test_mu_1_makes_no_extra_forward_pass(make_cfg):
    trainer = Trainer(make_cfg(max_steps=1))
    trainer.updater.logprobs = lambda *a: pytest.fail("no old/ref log-probs needed with mu=1, beta=0")
    trainer.train()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("split", [dict(micro_batch_size=4), dict(max_tokens_per_micro_batch=90)])
def test_micro_batches_give_the_full_batch_gradient(make_cfg, agg, split):
    """Same seed, same rollout; one 16-row pass vs 4-row passes, or passes cut by a 90-token budget
    (16-token prompts, completions up to 12: passes of 3, 3, 3, 3, 3 and 1 rows): the gradients agree."""
    grads = []
    for kw in (dict(micro_batch_size=16), {"micro_batch_size": 16, **split}):
        trainer = Trainer(make_cfg(loss_agg=agg, max_grad_norm=None, beta=0.05, **kw))
        step = trainer.optimizer.step
        trainer.optimizer.step = lambda: grads.append(
            torch.cat([p.grad.flatten() for p in trainer.model.parameters()])) or step()
        trainer.train_step()
    full, micro = grads
    assert full.abs().max() > 1e-4
    assert torch.allclose(full, micro, rtol=1e-4, atol=1e-6 * float(full.abs().max()))


def test_custom_reward_by_import_path_gets_columns(make_cfg, tmp_path, monkeypatch):
    mod = tmp_path / "my_rewards.py"
    mod.write_text(
        "seen = {}\n"
        "def answer_len(prompts, completions, answer, completion_lengths, **kw):\n"
        "    seen['answer'] = list(answer); seen['lengths'] = list(completion_lengths)\n"
        "    return [float(len(a)) for a in answer]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = make_cfg(max_steps=1, reward_funcs=["my_rewards:answer_len", "tests.trainer.conftest:short_reward"],
                   reward_weights=[1.0, 0.0])
    Trainer(cfg).train()
    import my_rewards

    assert len(my_rewards.seen["answer"]) == 16  # 4 prompts x 4 completions
    assert my_rewards.seen["answer"][0] == my_rewards.seen["answer"][3]  # a group shares its row
    (row,) = read_metrics(cfg.output_dir)
    mean_len = sum(len(a) for a in my_rewards.seen["answer"]) / 16
    assert row["reward/mean"] == pytest.approx(mean_len)


def test_lora_trains_only_the_adapter_and_exports_a_loadable_model(make_cfg):
    cfg = make_cfg(max_steps=2, lora_r=4, beta=0.04, learning_rate=1e-2)
    trainer = Trainer(cfg)
    assert trainer.ref.uses_adapter and trainer.ref.model is None  # no second copy
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    trainer.train()
    for n, p in trainer.model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base_before[n]), n
    rows = read_metrics(cfg.output_dir)
    assert rows[0]["kl"] == 0.0 and rows[1]["kl"] > 0  # reference = adapter disabled
    exported = AutoModelForCausalLM.from_pretrained(f"{cfg.output_dir}/checkpoints/step-000002/model")
    device = trainer.dist.device  # cuda:0 where there is one: both models run there
    ids = torch.tensor([[5, 6, 7, 8]], device=device)
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
        got = exported.to(device)(input_ids=ids).logits
    assert torch.allclose(want, got, atol=1e-5)
    # the adapter alone, in PEFT's format, over the base model it was trained on (a review found none saved)
    from peft import PeftModel

    adapter = f"{cfg.output_dir}/checkpoints/step-000002/adapter"
    assert (Path(adapter) / "adapter_config.json").is_file() and (Path(adapter) / "tokenizer_config.json").is_file()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(cfg.model), adapter).to(device)
    with torch.no_grad():
        assert torch.allclose(want, peft(input_ids=ids).logits, atol=1e-5)


def test_lora_on_a_tied_lm_head_is_refused_before_training(make_cfg):
    """The tiny model ties its head to its embedding: the exported model could not be what was trained."""
    from grouprl.config import ConfigError

    with pytest.raises(ConfigError, match=r"lora_target_modules=\['q_proj', 'lm_head'\] puts LoRA on lm_head, "
                                          r"and model=.* ties its LM head to its input embedding.* Leave lm_head and "
                                          r"the embedding out of lora_target_modules"):
        Trainer(make_cfg(max_steps=1, lora_r=4, lora_target_modules=["q_proj", "lm_head"]))


def test_dapo_dynamic_sampling_drops_flat_groups(make_cfg, tmp_path, monkeypatch):
    mod = tmp_path / "flaky_reward.py"
    mod.write_text(
        "def first_prompt_flat(prompts, completions, **kw):\n"
        "    return [0.0 if p.startswith('Say numbers 1') else float(len(c) % 2) "
        "for p, c in zip(prompts, completions)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = make_cfg(algorithm="dapo", max_steps=3, reward_funcs=["flaky_reward:first_prompt_flat"],
                   max_sampling_rounds=3, num_generations=4, prompts_per_step=4)
    trainer = Trainer(cfg)
    assert trainer.cfg.dynamic_sampling and trainer.cfg.loss_agg == "token-mean"
    assert trainer.cfg.epsilon_high == pytest.approx(0.28)
    trainer.train()
    for row in read_metrics(cfg.output_dir):
        assert 1 <= row["dynamic_sampling/rounds"] <= 3
        assert row["dynamic_sampling/kept_groups"] <= 4
        if row["dynamic_sampling/kept_groups"] == 4:
            assert row["advantage/std"] > 0


def test_dapo_judges_a_group_flat_by_its_reward_before_overlong_shaping(make_cfg, monkeypatch):
    """Every completion is right (reward 1), and the overlong penalty differs row by row (as lengths on
    its ramp do): DAPO drops groups whose accuracy is all 0 or all 1, so every group is flat, every
    round is drawn, and none is kept; the penalty alone is not a signal to keep a group for."""
    import grouprl.scoring as scoring

    monkeypatch.setattr(scoring, "overlong_penalty", lambda lengths, *a: -0.01 * torch.arange(len(lengths)).float())
    cfg = make_cfg(algorithm="dapo", max_steps=1, reward_funcs=["tests.trainer.conftest:always_one"],
                   max_sampling_rounds=3, num_generations=4, prompts_per_step=4)
    trainer = Trainer(cfg)
    batch, metrics = trainer.sample_batch()
    assert not torch.equal(batch.rewards, batch.unshaped) and (batch.unshaped == 1).all()
    assert metrics["dynamic_sampling/rounds"] == 3 and metrics["dynamic_sampling/kept_groups"] == 0
    assert metrics["zero_std_frac"] == 1.0


@pytest.mark.parametrize("algorithm", ["dr_grpo", "gspo", "rloo"])
def test_each_preset_runs(make_cfg, algorithm):
    cfg = make_cfg(algorithm=algorithm, max_steps=1, beta=None)
    trainer = Trainer(cfg)
    trainer.train()
    (row,) = read_metrics(cfg.output_dir)
    assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])


def test_eval_before_and_after_and_iterative_reference(make_cfg, tmp_path, digits_data):
    cfg = make_cfg(max_steps=4, eval_data=str(digits_data), max_eval_samples=8, eval_steps=2,
                   beta=0.1, ref_update_steps=2)
    trainer = Trainer(cfg)
    summary = trainer.train()
    for key in ("eval_before", "eval_after"):
        assert set(summary[key]) >= {"accuracy", "reward_mean"}
        assert 0.0 <= summary[key]["accuracy"] <= 1.0
    rows = read_metrics(cfg.output_dir)
    kls = {r["step"]: r["kl"] for r in rows if "kl" in r}
    assert kls[1] == 0.0 and kls[3] == 0.0  # the reference was reset to the policy after step 2
    assert kls[2] > 0.0
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2, 4]
    # with ref_update_steps the reference weights are saved for resume
    assert (__import__("pathlib").Path(cfg.output_dir) / "checkpoints/step-000004/ref.safetensors").is_file()


def test_bf16_and_gradient_checkpointing_run(make_cfg):
    device = init_distributed().device  # the trainer's: cuda:0 on a CUDA machine, else the CPU
    native, why = native_bf16(device)
    if not native:
        pytest.skip(f"bf16: true is refused where bf16 is not native ({why})")
    cfg = make_cfg(max_steps=1, bf16=True, gradient_checkpointing=True, beta=0.04)
    Trainer(cfg).train()
    (row,) = read_metrics(cfg.output_dir)
    assert math.isfinite(row["loss"]) and row["kl"] == pytest.approx(0.0, abs=1e-6)


def test_chat_prompts_in_memory_dataset_and_callable_rewards(make_cfg, tiny_model_dir, tmp_path):
    import shutil

    from datasets import Dataset
    from transformers import AutoTokenizer

    model_dir = tmp_path / "chat_model"
    shutil.copytree(tiny_model_dir, model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
    tok.save_pretrained(model_dir)
    seen = {}

    def record(prompts, completions, topic, **kw):
        seen.update(prompts=prompts, completions=completions, topic=topic)
        return [1.0] * len(completions)

    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": f"count {i}"}], "topic": f"t{i}"}
                            for i in range(8)])
    cfg = replace(make_cfg(max_steps=1, model=str(model_dir)), train_data="", reward_funcs=[])
    Trainer(cfg, train_dataset=ds, reward_funcs=[record]).train()
    assert seen["prompts"][0][0]["role"] == "user"
    assert all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in seen["completions"])
    assert seen["topic"][0] == seen["topic"][3] and len(seen["topic"]) == 16


def test_grouprl_eval_prints_accuracy_of_a_model(tiny_model_dir, digits_data, capsys, tmp_path):
    import json

    from grouprl.cli import main

    code = main(["eval", "--model", str(tiny_model_dir), "--eval_data", str(digits_data),
                 "--reward_funcs", "[tests.trainer.conftest:digit_fraction]", "--max_eval_samples", "4",
                 "--max_completion_length", "6", "--output_dir", str(tmp_path / "ev")])
    assert code == 0
    result = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert result["num_samples"] == 4 and 0.0 <= result["accuracy"] <= 1.0
    greedy = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("greedy ")]
    assert greedy == [["greedy", f"{result['accuracy']:.4f}"]]


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum",
                                      "seq-mean-token-sum-norm"])
def test_mask_truncated_completions_removes_them_from_the_loss(make_cfg, loss_agg):
    """Every completion is marked truncated and masked: the gradient is exactly zero, under every
    aggregation (token-mean's whole-batch count is then 0 tokens: the step is a zero step, not an error)."""
    trainer = Trainer(make_cfg(mask_truncated_completions=True, beta=0.0, loss_agg=loss_agg))
    generate = trainer.engine.generate

    def all_truncated(*args, **kwargs):
        rollout = generate(*args, **kwargs)
        rollout.truncated[:] = True
        return rollout

    trainer.engine.generate = all_truncated
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.train_step()
    assert metrics["completion/truncated_frac"] == 1.0 and metrics["advantage/std"] > 0
    assert metrics["grad_norm"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_gpt2_model_whose_tokenizer_has_no_pad_token(make_cfg, tmp_path):
    """Another architecture (the generic HF decode path) and a tokenizer without a pad token."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from grouprl.tasks.testing import build_char_tokenizer

    tok = build_char_tokenizer()
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=2, n_head=2, n_positions=128,
                                       eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id))
    tok.pad_token = None
    path = tmp_path / "gpt2"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    trainer = Trainer(make_cfg(model=str(path), max_steps=2, beta=0.04))
    assert trainer.tokenizer.pad_token_id == trainer.tokenizer.eos_token_id
    trainer.train()
    rows = read_metrics(trainer.cfg.output_dir)
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    # GPT-2's configs carry dropout 0.1: switched off by default, so step 1 has KL exactly 0
    assert rows[0]["kl"] == 0.0 and trainer.model.config.resid_pdrop == 0.1  # the saved config keeps it
    noisy = Trainer(make_cfg(model=str(path), max_steps=1, beta=0.04, disable_dropout=False,
                             output_dir=str(tmp_path / "noisy")))
    noisy.train()
    assert read_metrics(noisy.cfg.output_dir)[0]["kl"] > 0.0  # dropout on: the policy's log-probs are random


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen3", "smollm3"])
def test_each_fast_decoded_architecture_trains_from_a_folder(make_cfg, tmp_path, kind):
    """A saved Llama, Mistral, Qwen3 or SmolLM3 (Qwen2 is every other test's) trains through the fast
    decoder and padding-free passes, with a reference: loadable, taken by both, and finite."""
    from grouprl import packing
    from grouprl.rollout.llama_decoder import FastDecoder
    from grouprl.tasks.testing import build_tiny_architecture

    model, tok = build_tiny_architecture(kind, seed=1)
    model.save_pretrained(tmp_path / kind)
    tok.save_pretrained(tmp_path / kind)
    trainer = Trainer(make_cfg(model=str(tmp_path / kind), max_steps=2, beta=0.04))
    assert type(trainer.model).__name__.lower().startswith(kind) and packing.supports_packing(trainer.model)
    with torch.no_grad():
        assert isinstance(trainer.engine._decoder(torch.device("cpu")), FastDecoder)
    trainer.train()
    rows = read_metrics(trainer.cfg.output_dir)
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    assert rows[0]["kl"] == 0.0 and rows[1]["kl"] > 0.0  # the reference pass ran, the update moved the policy


def test_switch_off_dropout_makes_train_mode_deterministic(tiny_model_dir, tmp_path):
    """nn.Dropout layers and transformers' float `attention_dropout` attributes both go to 0."""
    from grouprl.policy import load_policy

    AutoModelForCausalLM.from_pretrained(tiny_model_dir, attention_dropout=0.5).save_pretrained(tmp_path / "m")
    ids = torch.randint(4, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    for disable in (True, False):
        model = load_policy(str(tmp_path / "m"), disable_dropout=disable).train()
        a, b = (model(input_ids=ids).logits for _ in range(2))
        assert torch.equal(a, b) == disable
        assert model.config.attention_dropout == 0.5  # what gets saved is unchanged


def test_disable_dropout_reaches_the_lora_adapters_dropout_and_says_so(tiny_model_dir, caplog):
    """As TRL's disable_dropout: the adapter's dropout too, or the update's forward is noisy against the
    engine's (vLLM's merged weights have none: log-probs 0.37 apart) and the fast decoder cannot merge it."""
    from grouprl.lora import mergeable
    from grouprl.policy import load_policy

    ids = torch.randint(4, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    for disable in (True, False):
        with caplog.at_level("WARNING", logger="grouprl.policy"):
            model = load_policy(str(tiny_model_dir), lora_r=4, lora_dropout=0.3, disable_dropout=disable).train()
        rates = {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}
        assert rates == ({0.0} if disable else {0.3}) and mergeable(model) == disable
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.fill_(0.1)  # PEFT starts B at 0, where dropout on the adapter's input changes nothing
        a, b = (model(input_ids=ids).logits for _ in range(2))
        assert torch.equal(a, b) == disable
    assert [r.getMessage() for r in caplog.records] == [
        "lora_dropout=0.3 is switched off with the model's other dropout (disable_dropout: true); set "
        "disable_dropout: false to keep it"]


def test_switch_off_dropout_reaches_float_dropout_attributes(tmp_path):
    """OPT's decoder, layers and attention pass float `dropout` rates to F.dropout themselves (no
    nn.Dropout module): they go to 0 too, and two train-mode passes agree."""
    from transformers import OPTConfig, OPTForCausalLM

    from grouprl.policy import load_policy

    OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                             max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.5,
                             attention_dropout=0.5)).save_pretrained(tmp_path / "opt")
    ids = torch.randint(4, 60, (2, 10), generator=torch.Generator().manual_seed(0))
    for disable in (True, False):
        model = load_policy(str(tmp_path / "opt"), disable_dropout=disable).train()
        rates = {(type(m).__name__, n): v for m in model.modules() for n, v in vars(m).items()
                 if isinstance(v, float) and (n == "dropout" or n.endswith("_dropout"))}
        assert {("OPTDecoder", "dropout"), ("OPTDecoderLayer", "dropout"), ("OPTAttention", "dropout")} <= rates.keys()
        assert all(v == (0.0 if disable else 0.5) for v in rates.values()), rates
        a, b = (model(input_ids=ids).logits for _ in range(2))
        assert torch.equal(a, b) == disable
        assert model.config.dropout == 0.5  # what gets saved is unchanged


@pytest.mark.parametrize("lora_r", [0, 4])
def test_checkpointing_pass_by_pass_leaves_no_hook_behind(tiny_model_dir, lora_r):
    """`gradient_checkpointing: auto` checkpoints pass by pass: each pass hooks the embedding
    (transformers' enable_input_require_grads), and leaving it takes the hook away again."""
    from grouprl.lora import base_model
    from grouprl.policy import activation_checkpointing, is_checkpointing, load_policy

    model = load_policy(str(tiny_model_dir), lora_r=lora_r)
    embedding = model.get_input_embeddings()
    ids = torch.tensor([[5, 9, 14, 30, 2]])  # [1, 5]
    counts = []
    for _ in range(3):
        with activation_checkpointing(model):
            assert is_checkpointing(base_model(model))
            model(input_ids=ids).logits.sum().backward()
        counts.append(len(embedding._forward_hooks))
    assert counts == [0, 0, 0]
    assert any(p.grad is not None for p in model.parameters())  # the checkpointed passes had gradients


def test_reward_workers_give_the_run_the_same_rewards_and_end_with_it(make_cfg, tmp_path):
    funcs = ["tests.trainer.conftest:digit_fraction", "think_format", {"name": "regex_match", "pattern": r"\d"}]
    base = make_cfg(max_steps=2, reward_funcs=funcs, audit_funcs=["tests.trainer.conftest:short_reward"])
    Trainer(base).train()
    trainer = Trainer(replace(base, reward_workers=2, output_dir=str(tmp_path / "workers")))
    processes = [w.process for w in trainer.reward_workers._workers]
    assert len(processes) == 2 and all(p.is_alive() for p in processes)
    assert all(trainer.reward_workers.runs(f) for f in trainer.reward_funcs + trainer.audit_funcs)
    trainer.train()
    trainer.close()
    assert not any(p.is_alive() for p in processes)
    keys = ["reward/mean", "rewards/digit_fraction/mean", "rewards/regex_match/mean", "audit/short_reward/mean"]
    for alone, pooled in zip(read_metrics(base.output_dir), read_metrics(tmp_path / "workers"), strict=True):
        assert [alone.get(k) for k in keys] == [pooled.get(k) for k in keys]
        assert alone["rewards/digit_fraction/mean"] > 0
