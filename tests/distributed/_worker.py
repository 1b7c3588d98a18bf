"""What the 2-process tests run under torchrun (and, for the 1-rank reference, in the test process).

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.distributed._worker \\
        MODEL_DIR DATA OUT_DIR STRATEGY

Rank 0 writes OUT_DIR/grads-STRATEGY.pt: {(loss_agg, scale_rewards): (grads, stats)} for one update
on `fixed_batch()`, and the same for ("is", mode): the batch with the sampler's log-probs, corrected.
"ppo" holds PPO's V_old, gradients (value head included) and stats for one update on the same
batch. With STRATEGY=fsdp2 it then trains one step (GRPO, then PPO) on sampled rollouts, saves a checkpoint, resumes it
into a fresh trainer and records whether every weight came back; with GRPO, also whether a rollback
snapshot of the sharded model, taken then and put back after one more step, brings every weight
and the optimizer state back.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

from grouprl import distributed as D
from grouprl.config import ConfigError, TrainConfig
from grouprl.core import LOSS_AGGREGATIONS
from grouprl.rollout import Rollout
from grouprl.batch import StepBatch
from grouprl.trainer import Trainer

SCALES = ("group", "batch", "none")
B, G, P, T = 6, 4, 7, 9  # prompts, group size, prompt and completion width


def config(model_dir: str, data: str, output_dir: str, **kw) -> TrainConfig:
    values = dict(model=model_dir, train_data=data, reward_funcs=["tests.trainer.conftest:digit_fraction"],
                  num_generations=G, prompts_per_step=B, micro_batch_size=8, max_completion_length=T,
                  learning_rate=1e-2, max_steps=1, output_dir=output_dir, progress=False, seed=0,
                  report_to=[], beta=0.04, max_grad_norm=None, num_threads=1,
                  share_prompt_min_tokens=0,  # every micro-batch shares its prompts when sharing is on
                  bf16=False)  # the same numbers on every CPU
    values.update(kw)
    return TrainConfig(**values)


def fixed_batch() -> StepBatch:
    """N = 24 completions of random tokens with lengths 1..T, left-padded prompts of lengths 2..P,
    rewards with distinct group spreads and one all-equal group. The same on every process."""
    g = torch.Generator().manual_seed(1234)
    N = B * G
    prompt_len = torch.randint(2, P + 1, (B,), generator=g).repeat_interleave(G)  # [N]
    lengths = torch.randint(1, T + 1, (N,), generator=g)  # [N]
    prompt_mask = (torch.arange(P)[None, :] >= P - prompt_len[:, None]).long()  # [N, P]
    completion_mask = torch.arange(T)[None, :] < lengths[:, None]  # [N, T]
    prompt_ids = torch.randint(4, 100, (B, P), generator=g).repeat_interleave(G, 0) * prompt_mask  # [N, P]
    completion_ids = torch.randint(4, 100, (N, T), generator=g) * completion_mask  # [N, T]
    rollout = Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, lengths == T)
    rewards = torch.rand(N, generator=g) * torch.arange(1, B + 1).repeat_interleave(G)  # [N]
    rewards[G:2 * G] = 0.5  # a group with no signal
    return StepBatch(rollout, ["p"] * N, ["c"] * N, rewards, {"r": rewards.clone()}, {})


def with_sampling_logp(batch: StepBatch) -> StepBatch:
    """The batch as if a separate sampler had drawn it: log-probs in [-5.4, -3.9] on real tokens
    (the tiny model gives these random tokens -4.6 +- 0.2)."""
    r = batch.rollout
    q = -3.9 - 1.5 * torch.rand(r.completion_ids.shape, generator=torch.Generator().manual_seed(99))  # [N, T]
    rollout = Rollout(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, r.truncated,
                      q * r.completion_mask)
    return StepBatch(rollout, batch.prompts, batch.completions, batch.rewards, batch.per_func, batch.reward_metrics)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every rank must call this (FSDP2 gathers each DTensor gradient)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name] = g.detach().cpu().clone()
    return out


def update_grads(cfg: TrainConfig) -> dict[tuple[str, str], tuple[dict[str, torch.Tensor], dict[str, float]]]:
    """For every loss_agg and scale_rewards, and for the importance-sampling correction: the gradient
    and stats of one update on `fixed_batch()`. Plain SGD with lr 0 leaves the weights alone, so every
    case starts from the same model."""
    trainer = Trainer(cfg)
    trainer.optimizer = torch.optim.SGD([p for p in trainer.model.parameters() if p.requires_grad], lr=0.0)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda _: 1.0)
    grads = []  # the accumulated gradient as the optimizer gets it (the update frees it after its step)
    step = trainer.optimizer.step
    trainer.optimizer.step = lambda: grads.append(full_grads(trainer.model)) or step()
    batch = fixed_batch()
    results = {}
    for agg in sorted(LOSS_AGGREGATIONS):
        for scale in SCALES:
            trainer.cfg = replace(cfg.resolved(), loss_agg=agg, scale_rewards=scale)
            stats = trainer.update(batch, trainer.advantages(batch))
            results[(agg, scale)] = (grads.pop(), stats)
    for mode in ("token_truncate", "sequence_mask"):
        trainer.cfg = replace(cfg.resolved(), vllm_importance_sampling_mode=mode, vllm_importance_sampling_cap=2.0)
        stats = trainer.update(with_sampling_logp(batch), trainer.advantages(batch))
        results[("is", mode)] = (grads.pop(), stats)
    return results


def ppo_update(cfg: TrainConfig) -> dict[str, object]:
    """PPO on `fixed_batch()`: V_old (each rank computes its own rows), GAE advantages from it, one
    update; the values, the gradients of the model and of the value head as the optimizer gets them,
    and the stats. The head starts from the same random weights on every process (at zero its
    gradient would not reach the trunk)."""
    trainer = Trainer(replace(cfg, algorithm="ppo"))
    head = trainer.updater.value_head
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        head.linear.weight.copy_(0.1 * torch.randn(head.linear.weight.shape, generator=g))
        head.linear.bias.fill_(0.2)
    params = [p for m in (trainer.model, head) for p in m.parameters() if p.requires_grad]
    trainer.optimizer = torch.optim.SGD(params, lr=0.0)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda _: 1.0)
    grads = []
    step = trainer.optimizer.step
    trainer.optimizer.step = lambda: grads.append(
        {**full_grads(trainer.model), **{f"value_head.{n}": p.grad.detach().cpu().clone()
                                         for n, p in head.named_parameters()}}) or step()
    batch = fixed_batch()
    values = trainer.updater.values(batch.rollout, trainer.cfg)  # [N, T]
    stats = trainer.update(batch, trainer.advantages(batch, values), values=values)
    return {"values": values, "grads": grads.pop(), "stats": stats}


def fsdp2_train_save_resume(cfg: TrainConfig, algorithm: str = "grpo") -> dict[str, object]:
    """One sampled FSDP2 step (generation with gathered weights, AdamW), a checkpoint, and a resume.
    With PPO the optimizer also holds the value head, outside the sharded model."""
    cfg = replace(cfg, distributed_strategy="fsdp2", ref_update_steps=1, num_logged_samples=0, algorithm=algorithm)
    if algorithm != "grpo":
        cfg = replace(cfg, output_dir=f"{cfg.output_dir}-{algorithm}", beta=0.04)
    import grouprl.trainer as trainer_module

    sized, own = [], trainer_module.token_budget  # the automatic budget is sized after sharding (free memory
    trainer_module.token_budget = lambda setting, model, *a, **k: (  # then counts the shards, not the whole)
        sized.append(D.is_sharded(model)) or own(setting, model, *a, **k))
    try:
        trainer = Trainer(replace(cfg, max_tokens_per_micro_batch="auto"))
    finally:
        trainer_module.token_budget = own
    metrics = trainer.train_step()
    path = trainer.save()
    resumed = Trainer(cfg)
    import grouprl.training_state as training_state

    reads, read = [], training_state.read_checkpoint  # who reads the whole checkpoint: rank 0 alone
    training_state.read_checkpoint = lambda *args, **kwargs: reads.append(1) or read(*args, **kwargs)
    try:
        resumed._resume()
    finally:
        training_state.read_checkpoint = read
    a = D.full_state(trainer.model, trainer.optimizer, trainer.updater.trainable)
    b = D.full_state(resumed.model, resumed.optimizer, resumed.updater.trainable)
    ra, rb = D.full_state(trainer.ref.model)[0], D.full_state(resumed.ref.model)[0]
    opt_a, opt_b = a[1].get("state", {}), b[1].get("state", {})
    same = (all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and all(torch.equal(ra[k], rb[k]) for k in ra)
            and opt_a.keys() == opt_b.keys()
            and all(torch.equal(torch.as_tensor(opt_a[k][s]), torch.as_tensor(opt_b[k][s]))
                    for k in opt_a for s in opt_a[k]))
    refused = None
    if algorithm == "grpo":  # a check that fails on rank 0 (which alone reads the checkpoint) fails every rank
        try:
            Trainer(replace(cfg, algorithm="ppo", beta=0.04))._resume()
        except ConfigError as e:
            refused = str(e)
    heads = [t.updater.value_head for t in (trainer, resumed)]
    if heads[0] is not None:
        same = same and all(torch.equal(x, y) for x, y in zip(heads[0].state_dict().values(),
                                                              heads[1].state_dict().values()))
    return {"loss": metrics["loss"], "step": resumed.step, "same_after_resume": same, "checkpoint": str(path),
            "reads_by_rank": D.gather_objects(resumed.dist, len(reads)), "budget_after_sharding": sized == [True],
            "refused_by_rank": D.gather_objects(resumed.dist, refused), "budget_state": budget_state(trainer),
            "num_state": len(a[1].get("state", {})),
            "value_head_moved": None if heads[0] is None else float(heads[0].linear.weight.abs().sum()),
            "rollback": rollback(trainer) if algorithm == "grpo" else None}


def budget_state(trainer: Trainer) -> dict[str, int]:
    """What the automatic token budget charges this rank for gradients and AdamW state under FSDP2 (the CUDA
    path, its free memory faked), against 12 bytes a parameter of this rank's shards and of the whole model."""
    from grouprl import memory

    seen, own_budget, own_info = {}, memory.cuda_budget, torch.cuda.mem_get_info
    memory.cuda_budget = lambda free, state, per_token: seen.setdefault("state", state) and 4096
    torch.cuda.mem_get_info = lambda device=None: (60 << 30, 80 << 30)
    try:
        memory.token_budget("auto", trainer.model, torch.device("cuda", 0), True)
    finally:
        memory.cuda_budget, torch.cuda.mem_get_info = own_budget, own_info
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    head = memory._head_backward_bytes(trainer.model, False)
    return {"charged": seen["state"] - head, "shards": 12 * sum(p.to_local().numel() for p in params),
            "whole": 12 * sum(p.numel() for p in params)}


def rollback(trainer: Trainer) -> dict[str, bool]:
    """`on_collapse: rollback`'s snapshot of the sharded model (each rank keeps its own shards, where
    they are), one more step, and the snapshot put back: every weight and the optimizer state as
    when the snapshot was taken; and again after one more step, to the same snapshot."""
    from torch.utils._pytree import tree_map

    from grouprl.checkpoint import memory_snapshot, restore_snapshot

    def state() -> tuple[dict, dict]:  # copies: full_state may hand out the optimizer's own step tensors
        model, optim = D.full_state(trainer.model, trainer.optimizer, trainer.updater.trainable)
        return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, (model, optim.get("state", {})))

    def same(a: tuple[dict, dict], b: tuple[dict, dict]) -> bool:  # rank 0 holds the whole optimizer state
        return (all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and a[1].keys() == b[1].keys()
                and all(torch.equal(torch.as_tensor(a[1][k][s]), torch.as_tensor(b[1][k][s]))
                        for k in a[1] for s in a[1][k]))

    before, snap = state(), memory_snapshot(trainer.model, trainer.optimizer)
    out = {"sharded": all(hasattr(v, "full_tensor") for v in snap["weights"].values())}
    for attempt in ("first", "second"):
        trainer.train_step()
        out[f"moved before the {attempt} rollback"] = not same(state(), before)
        restore_snapshot(trainer.model, trainer.optimizer, snap)
        out[f"back after the {attempt} rollback"] = same(state(), before)
    return out


def budgets_and_summaries(cfg: TrainConfig) -> list[tuple[int, dict]]:
    """Each rank's automatic token budget when each rank's device has a different amount of memory free
    (here: rank r's budget would be 4096 * (2 - r), rank 0's the larger), what `train()` (one step) returns
    on each rank, and what rank 0 logs of the budget taken (its log is the one shown)."""
    import logging

    import grouprl.trainer as trainer_module

    rank = D.init_distributed().rank
    own = trainer_module.token_budget
    trainer_module.token_budget = lambda setting, *a, **k: 4096 * (2 - rank) if setting == "auto" else setting
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("grouprl.distributed")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        trainer = Trainer(replace(cfg, max_tokens_per_micro_batch="auto"))
    finally:
        trainer_module.token_budget = own
        log.removeHandler(handler)
    summary = trainer.train()
    return D.gather_objects(trainer.dist, (trainer.updater.planner.auto_budget, summary, said))


def main(model_dir: str, data: str, out_dir: str, strategy: str) -> None:
    ctx = D.init_distributed()
    cfg = config(model_dir, data, f"{out_dir}/run-{strategy}", distributed_strategy=strategy)
    result: dict[str, object] = {"world_size": ctx.world_size, "grads": update_grads(cfg), "ppo": ppo_update(cfg),
                                 "budgets_and_summaries": budgets_and_summaries(cfg)}
    if strategy == "fsdp2":
        result["train"] = fsdp2_train_save_resume(cfg)
        result["train_ppo"] = fsdp2_train_save_resume(cfg, "ppo")
    if ctx.is_main:
        torch.save(result, Path(out_dir) / f"grads-{strategy}.pt")
    D.barrier(ctx)  # the ranks leave together, as the CLI's do
    D.destroy_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:5])
