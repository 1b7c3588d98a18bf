"""Micro-batches cut by rows or by a token budget (micro_batches.plan_micro_batches); the trainer's plan."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl.config import ConfigError
from grouprl.micro_batches import plan_micro_batches
from grouprl.rollout import Rollout
from grouprl.trainer import Trainer


def rollout_of(prompt_lens: list[int], completion_lens: list[int]) -> Rollout:
    """Left-padded prompts and right-padded completions of the given lengths (token ids 5)."""
    N, P, T = len(prompt_lens), max(prompt_lens), max(max(completion_lens), 1)
    pm = torch.tensor([[0] * (P - p) + [1] * p for p in prompt_lens])  # [N, P]
    cm = torch.tensor([[True] * t + [False] * (T - t) for t in completion_lens])  # [N, T]
    return Rollout(pm * 5, pm, cm.long() * 5, cm, torch.zeros(N, dtype=torch.bool))


def cost(r: Rollout, rows: torch.Tensor, packed: bool = False) -> int:
    """Tokens a pass computes: padded, rows x (longest prompt + longest completion); packed, each
    distinct prompt once plus every completion."""
    completion = r.completion_mask[rows].sum(-1).clamp(min=1)  # [n]
    prompt = r.prompt_mask[rows].sum(-1)  # [n]
    if packed:
        first = {int(g): int(p) for g, p in zip(r.prompt_groups()[rows], prompt)}
        return sum(first.values()) + int(completion.sum())
    return len(rows) * (int(prompt.max()) + int(completion.max()))


def test_hand_worked_budget():
    """Prompts 4 tokens; completions 2, 3, 3, 6, 10 (sorted). Budget 20: [2, 3] costs 2 x 7 = 14,
    adding the next 3 gives 3 x 7 = 21 > 20; [3, 6] costs 2 x 10 = 20; [10] alone costs 14."""
    r = rollout_of([4] * 5, [2, 3, 3, 6, 10])
    batches, over = plan_micro_batches(r, torch.arange(5), max_rows=8, max_tokens=20)
    assert [b.tolist() for b in batches] == [[0, 1], [2, 3], [4]] and over == 0
    batches, over = plan_micro_batches(r, torch.arange(5), max_rows=8, max_tokens=12)
    assert [b.tolist() for b in batches] == [[0], [1], [2], [3], [4]] and over == 1  # only 4 + 10 > 12
    batches, _ = plan_micro_batches(r, torch.arange(5), max_rows=2, max_tokens=None)
    assert [b.tolist() for b in batches] == [[0, 1], [2, 3], [4]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(0, 60)), min_size=1, max_size=40),
       st.integers(1, 400), st.integers(1, 16), st.booleans())
def test_every_row_once_in_order_within_budget_and_rows(lengths, budget, max_rows, packed):
    """Prompts of equal length are the same prompt here, so packed passes share them."""
    r = rollout_of([p for p, _ in lengths], [t for _, t in lengths])
    order = torch.argsort(r.completion_mask.sum(-1), stable=True)
    batches, over = plan_micro_batches(r, order, max_rows=max_rows, max_tokens=budget, packed=packed)
    assert torch.equal(torch.cat(batches), order)  # nothing dropped, nothing repeated, order kept
    for b in batches:
        assert 1 <= len(b) <= max_rows
        assert len(b) == 1 or cost(r, b, packed) <= budget  # over the budget only a row alone
    alone_over = sum(cost(r, order[i:i + 1]) > budget for i in range(len(order)))
    assert over == alone_over
    for a, b in zip(batches, batches[1:]):  # greedy: the next row did not fit (rows or tokens)
        joined = torch.cat([a, b[:1]])
        assert len(joined) > max_rows or cost(r, joined, packed) > budget


def test_a_completion_longer_than_the_budget_trains_alone_and_is_logged(make_cfg, caplog):
    trainer = Trainer(make_cfg(max_tokens_per_micro_batch=5, micro_batch_size=16))
    with caplog.at_level("WARNING", logger="grouprl.micro_batches"):
        metrics = trainer.train_step()
    assert metrics["grad_norm"] > 0 and metrics["completion/length_mean"] > 0
    warned = [r.getMessage() for r in caplog.records if "max_tokens_per_micro_batch=5" in r.getMessage()]
    assert len(warned) == 1 and "ran alone" in warned[0]
    rollout = trainer.generate(trainer.prompts(["Say numbers 1: "] * 2)).rollout
    plan = trainer.updater.planner.plan(rollout, trainer.cfg)
    assert all(len(rows) == 1 for rows, _ in plan)


def test_bad_budget_is_a_config_error(make_cfg):
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=0 must be at least 1"):
        Trainer(make_cfg(max_tokens_per_micro_batch=0))


@pytest.mark.cpu_rules
def test_auto_checkpointing_applies_to_the_passes_over_the_budget_only(make_cfg):
    """gradient_checkpointing: auto on CPU (grouprl/memory.py). Every decoder-layer call of the
    update records whether the model checkpoints: with a budget no sequence fits, every backward
    pass checkpoints; with a budget every pass fits, none does; checkpointing leaves the gradient as
    it was; after the step the model is back to not checkpointing (generation needs its cache).
    On CUDA `auto` checkpoints every pass, whatever the budget (the test below)."""
    from grouprl.lora import base_model
    from grouprl.policy import is_checkpointing

    grads, seen = [], []
    for budget, mode in ((10_000, "auto"), (12, "auto"), (12, False)):
        trainer = Trainer(make_cfg(max_tokens_per_micro_batch=budget, micro_batch_size=16, gradient_checkpointing=mode))
        if trainer.dist.device.type != "cpu":
            pytest.skip(f"the CPU rule; on {trainer.dist.device.type} auto checkpoints every pass (tested below)")
        base = base_model(trainer.model)
        calls: list[bool] = []
        layer = base.model.layers[0]
        layer.register_forward_pre_hook(lambda *_: calls.append(is_checkpointing(base))
                                        if torch.is_grad_enabled() else None)
        step = trainer.optimizer.step  # the accumulated gradient, as the optimizer gets it
        trainer.optimizer.step = lambda step=step, trainer=trainer: grads.append(
            torch.cat([p.grad.flatten() for p in trainer.model.parameters()])) or step()
        trainer.train_step()
        assert not is_checkpointing(base)
        seen.append(set(calls))
    assert seen == [{False}, {True}, {False}]
    assert (grads[1] - grads[2]).norm() <= 1e-5 * grads[2].norm() and grads[2].norm() > 0


@pytest.mark.parametrize("device, mode, want", [pytest.param("cpu", "auto", "over_budget", marks=pytest.mark.cpu_rules),
                                                ("cuda", "auto", "always"),
                                                ("cpu", True, "always"), ("cuda", True, "always"),
                                                ("cpu", False, "never"), ("cuda", False, "never")])
def test_checkpointing_auto_is_chosen_per_device(device, mode, want):
    from grouprl.memory import checkpoint_mode

    assert checkpoint_mode(mode, torch.device(device)) == want


def test_on_cuda_auto_checkpoints_every_pass(make_cfg, monkeypatch):
    """The CUDA rule, run here on CPU by telling the trainer its device is CUDA-like: the policy
    is loaded checkpointing (every pass, any budget), and a pass over the budget needs nothing more."""
    from grouprl import memory, trainer as trainer_module
    from grouprl.lora import base_model
    from grouprl.policy import is_checkpointing

    monkeypatch.setattr(trainer_module, "checkpoint_mode", lambda setting, device: memory.checkpoint_mode(
        setting, torch.device("cuda")))
    trainer = Trainer(make_cfg(max_tokens_per_micro_batch=10_000, micro_batch_size=16))
    base = base_model(trainer.model)
    calls: list[bool] = []
    base.model.layers[0].register_forward_pre_hook(lambda *_: calls.append(is_checkpointing(base))
                                                   if torch.is_grad_enabled() else None)
    trainer.train_step()
    assert set(calls) == {True} and not trainer.updater.checkpoint_over_budget


def test_bad_checkpointing_mode_is_a_config_error(make_cfg):
    with pytest.raises(ValueError, match="gradient_checkpointing='sometimes' is not one of: auto, true, false"):
        Trainer(make_cfg(gradient_checkpointing="sometimes"))


@pytest.mark.parametrize("device, rows, world, want", [
    ("cpu", 128, 1, 16), ("cpu", 24, 1, 16), ("cpu", 8, 1, 8),   # 16 at most, as the fixed default was
    ("cpu", 17, 2, 16),
    ("cuda", 32, 1, 32), ("cuda", 32, 4, 8), ("cuda", 30, 4, 8),  # one rank's share of the step
    ("cuda", 3, 8, 1)])
def test_micro_batch_size_auto_per_device(device, rows, world, want):
    from grouprl.memory import micro_batch_rows

    assert micro_batch_rows("auto", torch.device(device), rows, world, budget=4096) == want
    assert micro_batch_rows(6, torch.device(device), rows, world, budget=4096) == 6  # a number is taken as given
    no_budget = micro_batch_rows("auto", torch.device(device), rows, world, budget=None)  # nothing else bounds a pass
    assert no_budget == min(16, rows)


def test_auto_rows_reach_the_planner_and_a_bad_value_is_a_config_error(make_cfg, monkeypatch):
    """The planner cuts a 32-completion step into 16-row passes when told its device is the CPU and,
    told it is CUDA, into one pass within the token budget (16 rows again without one); any other
    string is a ConfigError naming the choices. The trainer's own device (cuda:0 on a CUDA machine)
    gets its own cut."""
    from grouprl import micro_batches

    trainer = Trainer(make_cfg(micro_batch_size="auto", max_tokens_per_micro_batch=1000))
    rollout = rollout_of([4] * 32, [3] * 32)  # 32 x 7 = 224 tokens padded, 32 x 3 + 4 packed
    plan = trainer.updater.planner.plan
    own = [32] if trainer.dist.device.type == "cuda" else [16, 16]  # the trainer's own device reaches the rule
    assert [len(rows) for rows, _ in plan(rollout, trainer.cfg)] == own
    real = micro_batches.micro_batch_rows
    for device, want in [("cpu", [16, 16]), ("cuda", [32])]:
        monkeypatch.setattr(micro_batches, "micro_batch_rows",
                            lambda setting, _, *a, device=device: real(setting, torch.device(device), *a))
        assert [len(rows) for rows, _ in plan(rollout, trainer.cfg)] == want, device
    trainer.cfg.max_tokens_per_micro_batch = None
    assert [len(rows) for rows, _ in plan(rollout, trainer.cfg)] == [16, 16]
    with pytest.raises(ConfigError, match="micro_batch_size='most' is not a number of completions per pass or auto"):
        make_cfg(micro_batch_size="most").validate()


def test_a_padding_pass_adds_nothing_whatever_the_other_ranks_rows_hold(make_cfg):
    """Under torchrun a rank with fewer micro-batches pads with a weight-0 pass over micro-batch 0,
    another rank's rows, whose reference log-probs this rank never computed. Seen from such a rank
    (the plan cut by hand, those rows' reference values absurd, as any value there could be): the
    step is not skipped, and its gradient is exactly the one without the padding pass."""
    grads = []
    for padded in (False, True):
        trainer = Trainer(make_cfg(beta=0.04, micro_batch_size=4))
        batch, _ = trainer.sample_batch()
        own, other = torch.arange(4, 16), torch.arange(4)
        trainer.updater.planner.plan = lambda *a: [(own, 1.0)] + [(other, 0.0)] * padded
        logprobs = trainer.logprobs

        def reference_unseen(rollout, *, reference=False, logprobs=logprobs):
            out = logprobs(rollout, reference=reference)
            if reference:
                out[other] = 1e4  # exp(ref - logp) overflows: a NaN gradient if the pass used it
            return out

        trainer.logprobs = reference_unseen
        step = trainer.optimizer.step
        trainer.optimizer.step = lambda step=step, trainer=trainer: grads.append(
            [p.grad.clone() for p in trainer.model.parameters()]) or step()
        metrics = trainer.update(batch, trainer.advantages(batch))
        assert metrics["skipped_nonfinite"] == 0
    assert len(grads) == 2 and all(torch.equal(a, b) for a, b in zip(*grads))


def test_checkpointing_goes_by_the_names_the_installed_transformers_gives_it():
    """transformers 5.24 renamed gradient_checkpointing_* to activation_checkpointing_* (the old names warn
    at every call, and go in v6; seen on a lent GPU machine): the new names where a model has them."""
    from grouprl.policy import checkpointing, is_checkpointing

    calls = []

    class Old:
        is_gradient_checkpointing = True

        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs):
            calls.append(("old on", gradient_checkpointing_kwargs))

        def gradient_checkpointing_disable(self):
            calls.append(("old off",))

    class New(Old):
        is_activation_checkpointing = False

        def activation_checkpointing_enable(self, activation_checkpointing_kwargs):
            calls.append(("new on", activation_checkpointing_kwargs))

        def activation_checkpointing_disable(self):
            calls.append(("new off",))

    for model in (Old(), New()):
        checkpointing(model, True)
        checkpointing(model, False)
    assert calls == [("old on", {"use_reentrant": False}), ("old off",), ("new on", {"use_reentrant": False}),
                     ("new off",)]
    assert is_checkpointing(Old()) and not is_checkpointing(New())
