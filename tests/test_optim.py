"""`grouprl.optim`: weight decay skips biases and normalisation gains (HF Trainer's and TRL's rule),
each module keeps its learning rate, and a checkpoint's optimizer state of another group layout is
refused with the fix named."""

import pytest
import torch

from grouprl.config import ConfigError, TrainConfig
from grouprl.optim import make_optimizer, scale_learning_rate
from grouprl.tasks.testing import build_tiny_model
from grouprl.value import ValueHead

LR, VALUE_LR, WD = 0.1, 0.5, 0.2


def _cfg(weight_decay: float = WD) -> TrainConfig:
    return TrainConfig(model="unused", learning_rate=LR, value_learning_rate=VALUE_LR, weight_decay=weight_decay,
                       max_steps=10, lr_scheduler_type="constant", warmup_steps=0)


def _model_and_head() -> tuple[torch.nn.Module, ValueHead]:
    model = build_tiny_model()[0]
    head = ValueHead(model.config.hidden_size)
    with torch.no_grad():  # biases start at 0, where decay could not move them: 1.5 instead
        for p in model.parameters():
            if p.ndim == 1:
                p.fill_(1.5)
        head.linear.weight.fill_(2.0)
        head.linear.bias.fill_(1.0)
    return model, head


def test_weight_decay_shrinks_matrices_only():
    """A step with zero gradients: Adam's moments stay 0, so the update is the decoupled decay
    alone, w <- w - lr·wd·w, at each module's rate. Biases (Qwen2's q_proj bias, the value head's)
    and RMSNorm gains stay put."""
    model, head = _model_and_head()
    params = {**dict(model.named_parameters()), **{f"value.{n}": p for n, p in head.named_parameters()}}
    before = {n: p.detach().clone() for n, p in params.items()}
    optimizer, _ = make_optimizer(_cfg(), model, head)
    for p in params.values():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    kept = ["model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.bias",
            "value.linear.bias"]
    for name in kept:
        assert params[name].ndim == 1 and before[name].abs().sum() > 0
        assert torch.equal(params[name], before[name]), name
    for name, lr in [("model.embed_tokens.weight", LR), ("model.layers.1.mlp.up_proj.weight", LR),
                     ("value.linear.weight", VALUE_LR)]:
        want = before[name] - lr * WD * before[name]  # value head: 2.0 - 0.5·0.2·2.0 = 1.8
        torch.testing.assert_close(params[name], want, atol=1e-7, rtol=1e-6, msg=name)
    assert all(torch.equal(p, before[n]) or p.ndim >= 2 for n, p in params.items())  # no 1-D parameter moved
    resumed, _ = make_optimizer(_cfg(), model, head)  # a checkpoint (or rollback snapshot) of this layout loads
    resumed.load_state_dict(optimizer.state_dict())
    assert resumed.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]


def test_groups_keep_each_modules_rate_and_follow_the_schedule():
    model, head = _model_and_head()
    optimizer, scheduler = make_optimizer(_cfg(), model, head)
    groups = [(g["lr"], g["weight_decay"], {p.ndim >= 2 for p in g["params"]}) for g in optimizer.param_groups]
    assert groups == [(LR, WD, {True}), (LR, 0.0, {False}), (VALUE_LR, WD, {True}), (VALUE_LR, 0.0, {False})]
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters())) + 2
    scale_learning_rate(optimizer, scheduler, 0.5)  # a rollback's lower rate reaches every group
    assert [g["lr"] for g in optimizer.param_groups] == [LR / 2, LR / 2, VALUE_LR / 2, VALUE_LR / 2]
    assert scheduler.get_last_lr() == [LR / 2, LR / 2, VALUE_LR / 2, VALUE_LR / 2]


def test_without_weight_decay_each_module_is_one_group():
    """weight_decay 0: the layout of checkpoints written before the split, which still resume."""
    model, head = _model_and_head()
    optimizer, _ = make_optimizer(_cfg(0.0), model, head)
    assert [(g["lr"], g["weight_decay"], len(g["params"])) for g in optimizer.param_groups] == [
        (LR, 0.0, len(list(model.parameters()))), (VALUE_LR, 0.0, 2)]
    old = torch.optim.AdamW([{"params": list(model.parameters())}, {"params": list(head.parameters()),
                                                                   "lr": VALUE_LR}], lr=LR, weight_decay=0.0)
    optimizer.load_state_dict(old.state_dict())


def test_a_checkpoint_of_another_group_layout_is_refused_with_the_fix():
    """The state an older grouprl wrote with weight_decay > 0: one group over every parameter."""
    model, _ = _model_and_head()
    old = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    optimizer, _ = make_optimizer(_cfg(), model)
    with pytest.raises(ConfigError, match=r"biases and norm gains .* start a new run from its model folder"):
        optimizer.load_state_dict(old.state_dict())
