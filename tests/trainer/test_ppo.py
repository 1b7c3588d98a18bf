"""PPO with a value head (value.py): the values come from the hidden state that predicts each token
on every forward path, the head and the trunk get the gradient the formula says, the config errors
name the fix, a checkpoint carries the head (resume reproduces the run), and PPO learns the
embedded task."""

import json

import pytest
import torch

from grouprl.cli import main
from grouprl.cli_args import build_config
from grouprl.config import ConfigError
from grouprl.core import value_loss
from grouprl.micro_batches import MicroBatch
from grouprl.policy import completion_forward, load_policy
from grouprl.trainer import Trainer
from grouprl.value import ValueHead
from tests.trainer.conftest import read_metrics
from tests.trainer.test_shared_prompt import ragged_rollout


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_policy(str(tiny_model_dir)).train()  # packing enabled


def random_head(model, seed=0):
    head = ValueHead(model.config.hidden_size)
    with torch.no_grad():
        head.linear.weight.copy_(torch.randn(head.linear.weight.shape, generator=torch.Generator().manual_seed(seed)))
        head.linear.bias.fill_(0.3)
    return head


def reference_values(model, head, rollout):
    """Row by row, unpadded: the head on the last hidden state at position len(prompt) + t − 1, the
    one whose logits predict completion token t."""
    out = torch.zeros(rollout.completion_ids.shape)
    with torch.no_grad():
        for i in range(len(rollout)):
            p = rollout.prompt_ids[i][rollout.prompt_mask[i].bool()]
            c = rollout.completion_ids[i][rollout.completion_mask[i]]
            h = model(input_ids=torch.cat([p, c])[None], output_hidden_states=True).hidden_states[-1][0]  # [S, H]
            out[i, : len(c)] = head(h[len(p) - 1: len(p) - 1 + len(c)]).squeeze(-1)
    return out


@pytest.mark.parametrize("packed, share, limit", [(False, False, None), (False, True, None), (True, True, None),
                                                  (False, False, 1)])  # limit 1: the chunked LM-head path
def test_values_are_the_head_on_the_hidden_state_that_predicts_each_token(policy, packed, share, limit):
    rollout = ragged_rollout([3, 9, 5], G=2)
    head = random_head(policy)
    mb = MicroBatch.from_rollout(rollout, torch.arange(len(rollout)), 0 if share else None)
    with torch.no_grad():
        logp, _, values = completion_forward(policy, mb, temperature=1.0, packed=packed, value_head=head,
                                             max_logits_elements=limit)
    assert values.shape == logp.shape == mb.completion_ids.shape
    expected = reference_values(policy, head, rollout)[:, : values.shape[1]]
    m = mb.completion_mask
    torch.testing.assert_close(values[m], expected[m], rtol=1e-4, atol=1e-5)
    assert (values[~m] == 0).all()


@pytest.mark.parametrize("packed, share", [(False, False), (False, True), (True, True)])
def test_the_values_only_pass_gives_the_same_values_and_runs_the_lm_head_at_one_position(policy, packed, share):
    """PPO's V_old pass (`logprobs=False`): the values of the full pass, no log-probs, and the LM head's
    output is one position per row, not every completion token."""
    rollout = ragged_rollout([3, 9, 5], G=2)
    head = random_head(policy, seed=1)
    mb = MicroBatch.from_rollout(rollout, torch.arange(len(rollout)), 0 if share else None)
    head_rows = []
    hook = policy.get_output_embeddings().register_forward_hook(lambda m, i, o: head_rows.append(o.shape[:-1]))
    try:
        with torch.no_grad():
            full = completion_forward(policy, mb, temperature=1.0, packed=packed, value_head=head)[2]
            full_rows, head_rows[:] = sum(shape.numel() for shape in head_rows), []
            logp, entropy, values = completion_forward(policy, mb, temperature=1.0, packed=packed, value_head=head,
                                                       logprobs=False)
    finally:
        hook.remove()
    assert logp is None and entropy is None
    torch.testing.assert_close(values, full, rtol=0, atol=0)
    assert full_rows >= int(mb.completion_mask.sum())  # the full pass: every completion token
    assert head_rows and all(shape[-1] == 1 for shape in head_rows)  # the values pass: one position per row
    with pytest.raises(ValueError, match="pass value_head"):
        completion_forward(policy, mb, temperature=1.0, logprobs=False)


def test_value_head_and_trunk_get_the_formula_gradient(policy):
    """For L = Σ_t c_t·v_t with v_t = w·h_t + b: ∂L/∂w = Σ_t c_t·h_t, ∂L/∂b = Σ_t c_t; the trunk gets a
    gradient through w (none when w = 0, the head's start). Then the clipped value loss reaches the head."""
    rollout = ragged_rollout([4, 6], G=2, seed=1)
    mb = MicroBatch.from_rollout(rollout, torch.arange(len(rollout)))
    m = mb.completion_mask
    head = random_head(policy, seed=2)
    policy.zero_grad(set_to_none=True)
    _, _, v = completion_forward(policy, mb, temperature=1.0, value_head=head)
    c = torch.linspace(-1, 1, m.numel()).view(m.shape) * m
    (c * v).sum().backward()
    hidden = torch.zeros(*m.shape, policy.config.hidden_size)
    with torch.no_grad():  # h_t where v_t = w·h_t + b: recover it from the reference path
        for i in range(len(rollout)):
            p = rollout.prompt_ids[i][rollout.prompt_mask[i].bool()]
            cc = rollout.completion_ids[i][rollout.completion_mask[i]]
            h = policy(input_ids=torch.cat([p, cc])[None], output_hidden_states=True).hidden_states[-1][0]
            hidden[i, : len(cc)] = h[len(p) - 1: len(p) - 1 + len(cc)]
    torch.testing.assert_close(head.linear.weight.grad[0], (c[..., None] * hidden).sum((0, 1)), rtol=1e-4,
                               atol=1e-5)
    torch.testing.assert_close(head.linear.bias.grad[0], c.sum())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())

    zero = ValueHead(policy.config.hidden_size)  # w = 0: the head learns, the trunk gets nothing yet
    policy.zero_grad(set_to_none=True)
    _, _, v = completion_forward(policy, mb, temperature=1.0, value_head=zero)
    loss, _ = value_loss(v, torch.zeros_like(v), torch.ones_like(v), m, cliprange_value=0.2, agg="token-mean")
    loss.backward()
    assert zero.linear.weight.grad.abs().sum() > 0 and zero.linear.bias.grad.item() == pytest.approx(-1.0)
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in policy.parameters())


def test_config_errors_name_the_fix(make_cfg):
    with pytest.raises(ConfigError, match="set value_head: true"):
        make_cfg(algorithm="ppo", value_head=False).validate()
    with pytest.raises(ConfigError, match="set advantage_estimator: gae"):
        make_cfg(value_head=True).validate()
    with pytest.raises(ConfigError, match="scale_rewards: batch"):
        make_cfg(algorithm="ppo", scale_rewards="group").validate()
    with pytest.raises(ConfigError, match=r"lam=1.5 must be in \[0, 1\]"):
        make_cfg(algorithm="ppo", lam=1.5).validate()
    with pytest.raises(ConfigError, match="vf_coef=0"):
        make_cfg(algorithm="ppo", vf_coef=0.0).validate()
    with pytest.raises(ConfigError, match="GAE's baseline is the value function, not the group's mean, so those "
                                          "groups still teach; set dynamic_sampling: false"):
        make_cfg(algorithm="ppo", dynamic_sampling=True).validate()
    with pytest.raises(ConfigError, match="prompt_filter with advantage_estimator=gae .PPO.: the prompt filter stops "
                                          "drawing .* so those groups still teach; set prompt_filter: false"):
        make_cfg(algorithm="ppo", prompt_filter=True).validate()


def test_the_cli_reaches_ppo():
    cfg = build_config(None, ["--algorithm", "ppo", "--gamma", "0.99", "--lam", "0.9", "--vf_coef", "0.5",
                              "--cliprange_value", "null"]).validate()
    assert (cfg.advantage_estimator, cfg.value_head, cfg.scale_rewards) == ("gae", True, "batch")
    assert (cfg.gamma, cfg.lam, cfg.vf_coef, cfg.cliprange_value) == (0.99, 0.9, 0.5, None)


def _strip_timing(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def test_resume_restores_the_value_head_and_reproduces_the_run(make_cfg, tmp_path):
    kw = dict(algorithm="ppo", max_steps=4, save_steps=2, num_iterations=2, beta=None, value_learning_rate=1e-2)
    full = make_cfg(output_dir=str(tmp_path / "full"), **kw)
    Trainer(full).train()
    rows = read_metrics(full.output_dir)
    assert all(r["value_loss"] > 0 for r in rows)

    cut = make_cfg(output_dir=str(tmp_path / "cut"), **{**kw, "max_steps": 2})
    Trainer(cut).train()
    resumed = Trainer(make_cfg(output_dir=str(tmp_path / "cut"), **kw))
    resumed.train(resume=True)
    assert _strip_timing(read_metrics(cut.output_dir)) == _strip_timing(rows)
    state = torch.load(tmp_path / "full/checkpoints/step-000004/state.pt", weights_only=False)
    assert torch.equal(state["value_head"]["linear.weight"], resumed.updater.value_head.linear.weight.detach())
    assert state["value_head"]["linear.weight"].abs().sum() > 0  # it trained


def test_a_grpo_checkpoint_cannot_resume_as_ppo(make_cfg, tmp_path):
    cfg = make_cfg(max_steps=1)
    Trainer(cfg).train()
    with pytest.raises(ConfigError, match="written without a value head"):
        Trainer(make_cfg(algorithm="ppo", max_steps=2, beta=None)).train(resume=True)


def test_ppo_learns_the_embedded_task_and_its_value_head_tracks_the_return(tmp_path):
    out = tmp_path / "ppo"
    code = main(["train", "--algorithm", "ppo", "--max_steps", "20", "--eval_steps", "0", "--output_dir", str(out),
                 "--progress", "false", "--report_to", "[]"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["eval_before"]["accuracy"], summary["eval_after"]["accuracy"]
    assert after - before >= 0.2, (before, after)
    rows = [r for r in read_metrics(out) if "value_mean" in r]  # the training steps (not the eval rows)
    assert len(rows) == 20
    first, last = rows[0], rows[-1]
    assert first["value_mean"] == 0.0
    gap = [abs(r["return_mean"] - r["value_mean"]) for r in (first, last)]
    assert gap[1] < 0.75 * gap[0], gap


def test_a_rollback_puts_the_value_head_back_with_the_policy(make_cfg):
    """on_collapse: rollback restores the value head's weights with the policy's and the optimizer
    state (its Adam moments are in the same optimizer): the snapshot before step 1 is the target."""
    trainer = Trainer(make_cfg(algorithm="ppo", on_collapse="rollback", max_steps=3, learning_rate=1e-2))
    start = {n: p.detach().clone() for n, p in trainer.updater.trainable.named_parameters()}
    trainer.train()
    head = trainer.updater.value_head.linear
    assert float(head.weight.abs().sum()) > 0  # the head learned (it starts at zero)
    assert trainer.rollback()["rollback/to_step"] == 0
    assert float(head.weight.abs().sum()) == 0 and float(head.bias.abs().sum()) == 0
    for name, p in trainer.updater.trainable.named_parameters():
        assert torch.equal(p.detach(), start[name]), name
