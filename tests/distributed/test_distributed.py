"""Data-parallel GRPO on 2 CPU processes (gloo), launched with torchrun as a user would
(test_train_cli.py runs `grouprl train` itself).

- the update on 2 ranks equals the update on 1 rank for every loss_agg and scale_rewards, with DDP
  and with FSDP2 (gradients to 1e-6 relative, given the same rollouts), and with the sampler/trainer
  importance-sampling correction, whose mismatch metrics cover the whole batch on every rank;
- PPO on 2 ranks equals PPO on 1: V_old of the whole batch on every rank, the value head's gradient
  averaged like the model's;
- every rank takes the least rank's automatic token budget (free memory differs between devices), and
  `train()` returns rank 0's summary on every rank;
- FSDP2 also generates, checkpoints (whole weights, optimizer state) and resumes;
- the pieces that need no second process: the micro-batch plan and the prompts_per_step check.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from grouprl import distributed as D
from grouprl.config import ConfigError
from grouprl.micro_batches import rank_share
from grouprl.trainer import Trainer
from tests.distributed._worker import config, fixed_batch, ppo_update, update_grads
from tests.distributed.launch import torchrun

def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir, digits_data, tmp_path_factory):
    """What a worker function (`update_grads`, `ppo_update`) gives in one process, with or without
    the shared-prompt forward (FSDP2 runs without). On the CPU, as the 2 ranks are (launch.py hides
    the GPUs from them): on a CUDA machine the trainer in this process would otherwise take cuda:0,
    and fp32 on two devices agrees to float rounding, not to the 1e-6 the comparison asks."""
    done = {}

    def get(work, share_prompts: bool):
        key = (work.__name__, share_prompts)
        if key not in done:
            out = tmp_path_factory.mktemp("one_rank")
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(D, "init_distributed", lambda *a, **k: D.DistContext(device=torch.device("cpu")))
                done[key] = work(config(str(tiny_model_dir), str(digits_data), str(out),
                                        share_prompt_forward=share_prompts))
        return done[key]
    return get


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_update_two_ranks_equals_one_rank(strategy, one_rank, tiny_model_dir, digits_data, tmp_path):
    torchrun("-m", "tests.distributed._worker", str(tiny_model_dir), str(digits_data), str(tmp_path), strategy)
    result = torch.load(tmp_path / f"grads-{strategy}.pt", weights_only=False)
    assert result["world_size"] == 2
    (budget0, summary0, said0), (budget1, summary1, said1) = result["budgets_and_summaries"]
    assert budget0 == budget1 == 4096  # the least rank's budget: the same micro-batches on each
    assert said0 == ["max_tokens_per_micro_batch=auto: 4096 on every rank, the least over the ranks (this rank's "
                     "own: 8192)"] and said1 == []  # rank 0's log, which alone is shown, says what is used
    assert summary1 == summary0 and "reward_last" in summary0  # rank 0's summary (it reads the metrics), on both
    one_rank_grads = one_rank(update_grads, strategy == "ddp")  # 4 aggs x 3 scales, 2 IS modes
    assert result["grads"].keys() == one_rank_grads.keys() and len(one_rank_grads) == 14
    for case, (expected, stats1) in one_rank_grads.items():
        got, stats2 = result["grads"][case]
        loss1, loss2 = stats1["loss"], stats2["loss"]
        assert got.keys() == expected.keys()
        for name, g in expected.items():
            assert g.norm() > 0, (case, name)
            assert relative_error(got[name], g) < 1e-6, (case, name, relative_error(got[name], g))
        assert abs(loss2 - loss1) <= 1e-6 * max(1.0, abs(loss1)), (case, loss1, loss2)
        mismatch = {k: v for k, v in stats1.items() if k.startswith("is/")}
        assert bool(mismatch) == (case[0] == "is")  # the whole batch's metrics, on every rank
        assert {k: stats2[k] for k in mismatch} == pytest.approx(mismatch, rel=1e-6), case
    # PPO: V_old of the whole batch on every rank, and the value head's gradient averaged like the model's
    ppo, ppo1 = result["ppo"], one_rank(ppo_update, strategy == "ddp")
    m = ppo1["values"] != 0
    assert m.sum() == fixed_batch().rollout.completion_mask.sum()  # every real token has its value
    assert torch.allclose(ppo["values"], ppo1["values"], rtol=1e-6, atol=1e-7)
    assert ppo["grads"].keys() == ppo1["grads"].keys() and "value_head.linear.weight" in ppo1["grads"]
    for name, g in ppo1["grads"].items():
        err = relative_error(ppo["grads"][name], g)
        assert g.norm() > 0 and err < 1e-6, (name, err)
    assert ppo["stats"]["loss"] == pytest.approx(ppo1["stats"]["loss"], rel=1e-6)
    assert ppo["stats"]["value_loss"] == pytest.approx(ppo1["stats"]["value_loss"], rel=1e-6)
    frac = one_rank_grads[("is", "sequence_mask")][1]["is/frac_corrected"]
    assert 0 < frac < 1, frac  # the mask drops some completions and keeps others
    if strategy == "fsdp2":  # one sampled step with the sharded model, its checkpoint, its resume
        train = result["train"]
        assert train["step"] == 1 and train["same_after_resume"] and train["num_state"] > 0
        assert train["budget_after_sharding"]
        assert train["reads_by_rank"] == [1, 0]  # rank 0 reads it whole; rank 1 takes its shards from rank 0's
        charge = train["budget_state"]  # FSDP2: each rank is charged its shards' gradients and AdamW state
        assert charge["charged"] == charge["shards"] < charge["whole"], charge
        refusals = train["refused_by_rank"]  # rank 0 alone met the error; rank 1 waited for its broadcast
        assert len(set(refusals)) == 1 and "was written without a value head" in refusals[0], refusals
        ckpt = Path(train["checkpoint"])
        whole = AutoModelForCausalLM.from_pretrained(ckpt / "model")  # save_pretrained output, whole
        trained = load_file(ckpt / "trainable.safetensors")
        params = dict(whole.named_parameters())
        assert trained.keys() == params.keys()
        for name, w in trained.items():
            assert torch.equal(params[name], w), name
        assert (ckpt / "ref.safetensors").is_file()  # ref_update_steps: the sharded reference is saved whole
        assert set(train["rollback"].values()) == {True}, train["rollback"]  # on_collapse: rollback, twice
        ppo = result["train_ppo"]  # the optimizer also steps the value head, outside the sharded model
        assert ppo["step"] == 1 and ppo["same_after_resume"] and ppo["num_state"] > train["num_state"]
        assert ppo["value_head_moved"] > 0


@pytest.mark.parametrize("max_norm", [None, 0.5, 100.0])
def test_clip_grad_norm_over_groups_equals_torch_over_all(max_norm):
    """D.clip_grad_norm (FSDP2's DTensor gradients beside PPO's plain head cannot share one torch call)
    on plain tensors: the same norm and the same clipped gradients as torch's one call over all."""
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in [(4, 3), (5,), (2, 2), (1,)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c, p in zip(copies, params):
        c.grad = p.grad.clone()
    want = float(torch.nn.utils.clip_grad_norm_(copies, max_norm or float("inf")))
    got = D.clip_grad_norm([params[:3], params[3:]], max_norm)
    assert got == pytest.approx(want, rel=1e-6) and got > 0.5
    for p, c in zip(params, copies):
        assert torch.allclose(p.grad, c.grad, rtol=1e-6, atol=0)


@pytest.mark.parametrize("num_micro_batches", [1, 2, 3, 5, 6])
def test_rank_share_covers_each_micro_batch_once_with_equal_pass_counts(num_micro_batches):
    micro = list(torch.arange(4 * num_micro_batches).split(4))
    plans = [rank_share(D.DistContext(rank=r, world_size=3), micro) for r in range(3)]
    assert len({len(p) for p in plans}) == 1  # every rank runs the same number of passes
    real = sorted(int(rows[0]) for plan in plans for rows, w in plan if w == 1.0)
    assert real == [int(m[0]) for m in micro]  # each micro-batch exactly once, with weight 1
    assert all(w in (0.0, 1.0) for plan in plans for _, w in plan)


def test_prompts_per_step_must_split_over_ranks(make_cfg, monkeypatch):
    timeouts = []
    monkeypatch.setattr(D, "init_distributed", lambda timeout_s: timeouts.append(timeout_s) or D.DistContext(
        rank=0, world_size=3))
    with pytest.raises(ConfigError, match="prompts_per_step=4 does not split over 3 processes"):
        Trainer(make_cfg(ddp_timeout=90))
    assert timeouts == [90]  # the collective timeout the config sets


def test_the_process_group_takes_ddp_timeout(monkeypatch):
    """Under torchrun (WORLD_SIZE > 1) the process group is made with the timeout given."""
    made = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(D.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(D.dist, "init_process_group", lambda backend, timeout: made.update(timeout=timeout) or 1 / 0)
    monkeypatch.setattr(D.torch.cuda, "is_available", lambda: False)
    with pytest.raises(ZeroDivisionError):
        D.init_distributed(90.0)
    assert made["timeout"].total_seconds() == 90


def test_optimizer_state_by_name_is_torchs_whole_state_dict_and_converts_back():
    """An unsharded checkpoint's optimizer state (by index) keyed by parameter name equals torch's whole
    (FSDP2-style) optimizer state dict, with AdamW's decay and no-decay groups; and back again: how a
    checkpoint moves between one process or DDP and FSDP2 on several processes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and n != "1.weight"]
    rest = [p for p in model.parameters() if all(p is not q for q in decay)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}])
    model(torch.randn(5, 3)).pow(2).sum().backward()
    optimizer.step()
    by_index = optimizer.state_dict()
    by_name = D.optimizer_state_by_name(optimizer, model, by_index)
    torchs = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    assert by_name["param_groups"] == torchs["param_groups"] and by_name["state"].keys() == torchs["state"].keys()
    for name, moments in torchs["state"].items():
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(by_name["state"][name][k]))
                   for k, v in moments.items()), name
    back = D.optimizer_state_by_index(optimizer, model, by_name)
    assert back["param_groups"] == by_index["param_groups"] and back["state"].keys() == by_index["state"].keys()
    assert all(back["state"][i] is by_index["state"][i] for i in by_index["state"])


def test_single_process_helpers_are_no_ops():
    ctx = D.init_distributed()
    assert (ctx.rank, ctx.world_size, ctx.is_main, ctx.enabled) == (0, 1, True, False)
    assert D.gather_objects(ctx, {"a": 1}) == [{"a": 1}]
    assert D.all_reduce_sums(ctx, {"x": 2.5}) == {"x": 2.5}
    assert torch.equal(D.all_reduce_tensor(ctx, torch.ones(2, 3)), torch.ones(2, 3))
    assert D.shard_prompts(ctx, [5, 3, 9]) == [5, 3, 9]
    model = torch.nn.Linear(2, 2)
    assert D.wrap_model(model, ctx, "fsdp2") is model


def test_a_checkpoint_of_another_group_layout_is_refused_before_either_conversion(make_cfg, tmp_path):
    """weight_decay 0 -> 0.1 between the save and the resume: one optimizer group then two (decay and
    no-decay). Converting the state to names read the groups pairwise and failed with a bare KeyError (or,
    had the sizes lined up, put moments on the wrong parameters); the layout is now checked first, with
    the advice the unsharded resume gives, and the conversion refuses a mismatch outright."""
    from grouprl.config import ConfigError
    from grouprl.optim import check_group_layout, make_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    saved, _ = make_optimizer(make_cfg(weight_decay=0.0), model)
    model(torch.randn(5, 3)).pow(2).sum().backward()
    saved.step()
    state = saved.state_dict()
    optimizer, _ = make_optimizer(make_cfg(weight_decay=0.1), model)
    assert len(state["param_groups"]) == 1 and len(optimizer.param_groups) == 2
    with pytest.raises(ConfigError, match=r"parameter groups of \[6\] parameters, this run's optimizer \[2, 4\]"):
        check_group_layout(optimizer, state)
    with pytest.raises(ValueError, match="zip"):
        D.optimizer_state_by_name(optimizer, model, state)
