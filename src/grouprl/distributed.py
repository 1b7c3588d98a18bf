"""Data-parallel (DDP) and sharded (FSDP2) training on torch.distributed, launched by torchrun.

How one step is split over K ranks (K = WORLD_SIZE), and why the update does not depend on K:
- every rank's PromptSampler is seeded alike, so all draw the same B prompts; rank r generates the
  G completions of prompts r·B/K .. (r+1)·B/K − 1 (whole groups on one rank) with its own sampling
  generator (seed + r) and scores them with the reward functions locally;
- the scored completions (token ids, masks, rewards: small next to a model) are all-gathered, so
  every rank holds the global batch in the order one process would: group and batch statistics,
  the zero-std fraction and DAPO's keep/drop decisions are computed on it unchanged;
- the update splits the global batch into the length-sorted micro-batches one process would form,
  and rank r runs micro-batches r, r+K, r+2K, ...; each loss is normalised by the global count
  (`normalizer`) and gradients are summed over ranks (DDP and FSDP2 average them, so each loss is
  multiplied by K), which makes the summed gradient the single-process gradient;
- DDP and FSDP2 need every rank to run the same number of forward/backward passes: a rank short of
  micro-batches repeats one with its loss multiplied by 0 (`micro_batches.rank_share`).

FSDP2 (`fully_shard` on each decoder layer, then the root) shards parameters, gradients and
optimizer state. Generation and the no-grad log-prob passes run at different lengths on different
ranks, so they run inside `full_weights`: every rank gathers the whole model once, in lockstep,
decodes without any collective, then reshards.

Without torchrun (no WORLD_SIZE in the environment) the context is a single process and every
helper here is a no-op.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import inspect
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

STRATEGIES = ("ddp", "fsdp2")
_OWNED_GROUP: list[Any] = []  # the default group init_distributed created in this process, if any


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        """Rank 0 writes logs, samples and checkpoints."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(timeout_s: float = 1800.0) -> DistContext:
    """The process group from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK): NCCL on CUDA,
    gloo on CPU. Idempotent (the first call's timeout holds); a single-process context when not
    launched by torchrun. The timeout (`ddp_timeout`) bounds how long the other ranks wait in a
    collective: for one that failed, and for rank 0 writing a checkpoint alone."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if world_size == 1 and not dist.is_initialized():
        return DistContext(device=device)
    if cuda:
        check_rank_has_gpu(local_rank, torch.cuda.device_count())
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
        _OWNED_GROUP.append(dist.group.WORLD)
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, device)


def check_rank_has_gpu(local_rank: int, gpus: int) -> None:
    """Each rank of a CUDA job takes the GPU of its LOCAL_RANK: a rank with none would fail inside
    torch with "invalid device ordinal", which names neither the ranks nor the GPUs."""
    if local_rank >= gpus:
        raise RuntimeError(
            f"LOCAL_RANK={local_rank} but this node has {gpus} visible GPU(s): each rank trains on "
            f"its own GPU. Start at most {gpus} process(es) per node (torchrun --nproc-per-node {gpus}), "
            "or train on CPU with gloo by hiding the GPUs (CUDA_VISIBLE_DEVICES= torchrun ...)")


def destroy_distributed() -> None:
    """Destroy the process group init_distributed created, and only that one: a group another
    library set up in this process (vLLM colocated initialises a one-process gloo world of its own)
    is its to close, and destroying it under that library left its next engine unable to start
    ("Invalid process group specified").

    Garbage is collected first. A finished Trainer sits in reference cycles, and its DDP or FSDP
    wrappers hold the group's C++ object, so `destroy_process_group` alone left that object to some
    later collection, possibly during interpreter shutdown, where gloo's teardown aborted a rank
    ("terminate called without an active exception", once in a CI run of a 2-rank test). Callers
    drop their last reference to the trainer before calling this."""
    if _OWNED_GROUP and dist.is_initialized() and dist.group.WORLD is _OWNED_GROUP[-1]:
        gc.collect()
        dist.destroy_process_group()
    _OWNED_GROUP.clear()


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        dist.barrier()


def gather_objects(ctx: DistContext, obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable; tensors travel on CPU), in rank order, on every rank."""
    if not ctx.enabled:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(ctx: DistContext, obj: Any) -> Any:
    """Rank 0's `obj` (picklable) on every rank; what the other ranks pass is ignored."""
    if not ctx.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_sums(ctx: DistContext, values: dict[str, float]) -> dict[str, float]:
    """Sum each named float over ranks (every rank must pass the same keys)."""
    if not ctx.enabled or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=_comm_device(ctx))
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return dict(zip(keys, t.cpu().tolist()))


def least_over_ranks(ctx: DistContext, value: int | None, said: str | None = None) -> int | None:
    """The smallest of every rank's `value` (None stays None: every rank passes None or a number). For
    what each rank sizes from its own device, as the automatic token budget from its free memory: every
    rank must cut the batch into the same micro-batches, or DDP averages mismatched passes and FSDP2's
    collectives hang. `said`: rank 0 (whose log is the one shown) logs the least under this name where
    its own value, which it may have logged, is not it."""
    if not ctx.enabled or value is None:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_comm_device(ctx))
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    least = int(t.item())
    if said and ctx.is_main and least != value:
        logger.info("%s: %d on every rank, the least over the ranks (this rank's own: %d)", said, least, value)
    return least


def all_reduce_tensor(ctx: DistContext, x: torch.Tensor) -> torch.Tensor:
    """Elementwise sum of a CPU tensor over ranks, as a new tensor (e.g. log-probs each rank
    filled for its own rows: the sum is the whole batch)."""
    if not ctx.enabled:
        return x
    t = x.to(_comm_device(ctx), copy=True)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu()


def average_gradients(ctx: DistContext, params: Iterable[torch.nn.Parameter]) -> None:
    """Average the gradients of parameters outside DDP/FSDP2 (PPO's value head) over ranks, in one
    all-reduce, as DDP averages the model's: each rank scaled its loss by the world size, so the
    average is the whole batch's gradient. A rank whose passes left a gradient unset sends zeros."""
    params = [p for p in params if p.requires_grad]
    if not ctx.enabled or not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads]).to(_comm_device(ctx))
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat = flat.to(params[0].device) / ctx.world_size
    for p, piece in zip(params, flat.split([p.numel() for p in params])):
        p.grad = piece.view_as(p).to(p.dtype)


def _comm_device(ctx: DistContext) -> torch.device:
    return ctx.device if dist.get_backend() == "nccl" else torch.device("cpu")


def shard_prompts(ctx: DistContext, indices: list[int]) -> list[int]:
    """This rank's contiguous slice of the step's B prompt indices (whole groups on one rank)."""
    per_rank = len(indices) // ctx.world_size
    return indices[ctx.rank * per_rank:(ctx.rank + 1) * per_rank]


# ---------------------------------------------------------------------- models
def wrap_model(model: torch.nn.Module, ctx: DistContext, strategy: str) -> torch.nn.Module:
    """The module the update runs forward/backward through. DDP wraps `model` (which stays the
    plain module for generation and saving); FSDP2 shards `model` in place and returns it."""
    if strategy not in STRATEGIES:
        raise ValueError(f"distributed_strategy={strategy!r} is unknown: use one of {STRATEGIES}")
    if not ctx.enabled:
        return model
    if strategy == "fsdp2":
        shard_model(model)
        return model
    from torch.nn.parallel import DistributedDataParallel

    # No buffers synced before each forward: DDP's default broadcasts rank 0's buffers in each synced forward,
    # a collective per forward, but a micro-batch takes one forward or two (policy.completion_forward: the
    # shared-prompt pass runs the prompts first), chosen by its content, so ranks on different paths wait in
    # mismatched collectives until the timeout. A language model has no buffers to keep in step (no running
    # statistics; rotary tables are computed alike on every rank). torch >= 2.13 names it forward_sync_buffers
    # (and warns on every run at broadcast_buffers); it still syncs the buffers once at the start, which is harmless.
    no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(
        DistributedDataParallel).parameters else {"broadcast_buffers": False}
    # gradient_as_bucket_view: each gradient is a view into DDP's all-reduce buckets, which DDP holds anyway,
    # rather than a second copy beside them (4 bytes a trainable parameter less in the update; torch's docs)
    return DistributedDataParallel(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None,
                                   gradient_as_bucket_view=True, **no_sync)


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2: `fully_shard` every decoder layer (the classes a transformers model lists in
    `_no_split_modules`), then the root, which holds the embeddings and the head."""
    from torch.distributed.fsdp import fully_shard

    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in layer_classes:
            fully_shard(module)
    fully_shard(model)
    return model


def is_sharded(model: torch.nn.Module | None) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def full_weights(*models: torch.nn.Module | None) -> Iterator[None]:
    """Gather FSDP2-sharded models whole for passes whose length differs across ranks (decoding,
    no-grad log-probs): one all-gather per module on entry, none inside, reshard on exit."""
    from torch.distributed.fsdp import FSDPModule

    groups = [m for model in models if is_sharded(model) for m in model.modules() if isinstance(m, FSDPModule)]
    for m in groups:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in groups:
            m.set_reshard_after_forward(True, recurse=False)
            m.reshard()


@contextlib.contextmanager
def grad_sync(train_model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Gradient accumulation: reduce gradients across ranks only on the last micro-batch."""
    if enabled:
        yield
    elif hasattr(train_model, "no_sync"):  # DDP
        with train_model.no_sync():
            yield
    elif is_sharded(train_model):
        train_model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            train_model.set_requires_gradient_sync(True)
    else:
        yield


def local_value(x: torch.Tensor) -> float:
    """A scalar that may be a DTensor (e.g. FSDP2's gradient norm) as a float."""
    return float(x.full_tensor() if hasattr(x, "full_tensor") else x)


def clip_grad_norm(groups: list[list[torch.nn.Parameter]], max_norm: float | None) -> float:
    """The gradient norm of every group together, clipped to `max_norm` (None: not clipped), as a
    float on every rank. One group is torch's `clip_grad_norm_`. Several are groups that one torch call
    cannot take together (FSDP2's DTensor gradients beside PPO's plain value head): every group is
    scaled by the same factor, min(1, max_norm / (norm + 1e-6)), as torch scales them."""
    if len(groups) == 1:
        return local_value(torch.nn.utils.clip_grad_norm_(groups[0], max_norm or math.inf))
    grads = [[p.grad for p in g if p.grad is not None] for g in groups]
    total = math.sqrt(sum(local_value(torch.nn.utils.get_total_norm(g)) ** 2 for g in grads if g))
    if max_norm is not None and max_norm / (total + 1e-6) < 1.0:
        for g in grads:
            for x in g:
                x.mul_(max_norm / (total + 1e-6))
    return total


# ---------------------------------------------------------------------- state
def checkpoint_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ref_model: torch.nn.Module | None,
                      optimized: torch.nn.Module | None = None) -> tuple[dict | None, dict, dict | None]:
    """(model state, optimizer state, reference state) to write. Unsharded: the model's own tensors
    are written (None, None) and the optimizer's usual state dict. FSDP2: whole state dicts keyed
    by parameter name, gathered to rank 0 (a collective: every rank calls it). `optimized`: the
    module holding every parameter the optimizer steps, when that is more than `model` (PPO's
    value head beside it: update.PolicyUpdate.trainable)."""
    if not is_sharded(model):
        return None, optimizer.state_dict(), None
    model_state, optimizer_state = full_state(model, optimizer, optimized)
    return model_state, optimizer_state, full_state(ref_model)[0] if ref_model is not None else None


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
               optimized: torch.nn.Module | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """FSDP2: the whole model (and optimizer) state on rank 0's CPU, keyed by parameter name (the
    optimizer's by their names in `optimized`, default `model`). A collective: every rank calls it;
    other ranks get empty dicts."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, get_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if optimizer is None:
        return get_model_state_dict(model, options=options), None
    if optimized is None or optimized is model:
        return get_state_dict(model, optimizer, options=options)
    # the optimizer also steps parameters outside `model`: torch maps each one to a name in one module
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(optimized, optimizer,
                                                                                  options=options)


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, module: torch.nn.Module,
                            state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict as torch's `Optimizer.state_dict` writes it (parameters by their index in
    the optimizer's groups: an unsharded run's checkpoint) keyed instead by each parameter's name in
    `module`, as FSDP2's whole state dicts are (`full_state`): how a checkpoint written by one process,
    or under DDP, resumes under FSDP2. The indices are read against `optimizer`'s own groups, which the
    same settings build in the same order."""
    names = {id(p): name for name, p in module.named_parameters()}
    by_index = {i: names[id(p)] for saved, group in zip(state["param_groups"], optimizer.param_groups, strict=True)
                for i, p in zip(saved["params"], group["params"], strict=True)}  # (optim.check_group_layout first)
    return {"state": {by_index[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [by_index[i] for i in g["params"]]} for g in state["param_groups"]]}


def optimizer_state_by_index(optimizer: torch.optim.Optimizer, module: torch.nn.Module,
                             state: dict[str, Any]) -> dict[str, Any]:
    """The converse of `optimizer_state_by_name`: FSDP2's whole optimizer state (by parameter name) as
    `optimizer.load_state_dict` takes it, for a run that resumes it in one process or under DDP."""
    names = {id(p): name for name, p in module.named_parameters()}
    index = {names[id(p)]: i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    return {"state": {index[name]: s for name, s in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}


def load_full_state(model: torch.nn.Module, model_state: dict[str, torch.Tensor],
                    optimizer: torch.optim.Optimizer | None = None,
                    optimizer_state: dict[str, Any] | None = None, optimized: torch.nn.Module | None = None) -> None:
    """FSDP2: load whole (unsharded) state dicts, each rank keeping its shard (`optimized`: as in
    full_state). Only rank 0 passes them (the others pass empty dicts): each rank takes its shard from
    rank 0's by broadcast, so no other rank reads, or holds, the whole state (8 ranks of a 7B model's
    weights and AdamW state would be 8 x 84 GB of host memory)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, strict=False, broadcast_from_rank0=True)
    set_model_state_dict(model, model_state, options=options)
    if optimizer is not None and optimizer_state is not None:
        set_optimizer_state_dict(optimized or model, optimizer, optimizer_state, options=options)
