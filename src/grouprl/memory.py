"""Per-device memory defaults: `gradient_checkpointing: auto`, `max_tokens_per_micro_batch: auto` and
`micro_batch_size: auto`.

The update's activations grow with the tokens of one pass (the budget); checkpointing keeps only
each layer's input and recomputes the rest in the backward. Which trade pays depends on the device:

- **CPU** (measured on SmolLM2-135M, 4 x 1,024 tokens, benchmarks/README.md "Long completions"):
  checkpointing every pass cost 6-9 % more update time for 42 % less peak memory, and the update is
  a large share of a CPU step, while host memory is rarely the limit at the model sizes a CPU
  trains. So `auto` checkpoints only a pass over the budget (one sequence longer than it, which
  runs alone), and the budget is 4,096 tokens.
- **CUDA** (one H200, bf16, random-init SmolLM2 shapes, issue 34's run): the update is 10-20 % of a
  step (generation is most of it), so a third more update time is a few percent of the step, and
  device memory is what limits the model size. At 1.7B, checkpointing off added ~7 GiB of
  activations; checkpointing on with a 16k budget was both faster and leaner. So `auto`
  checkpoints every pass, and the budget is sized from the free device memory (`cuda_budget`).

Explicit values (`true`/`false`, a number, null) are always taken as given.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

CPU_BUDGET = 4096  # tokens per pass on CPU (`auto`)
CPU_MICRO_BATCH = 16  # completions per pass on CPU at most (`micro_batch_size: auto`)
CUDA_BUDGET_RANGE = (4096, 65536)  # `auto` on CUDA stays within these (a power of two)
CUDA_BUDGET_SHARE = 0.25  # of the device memory free once the weights, gradients and AdamW state are in


def checkpoint_mode(setting: bool | str, device: torch.device) -> str:
    """"always" (every pass), "over_budget" (only a pass above the token budget) or "never"."""
    if setting == "auto":
        return "always" if device.type == "cuda" else "over_budget"
    return "always" if setting else "never"


def micro_batch_rows(setting: int | str, device: torch.device, step_rows: int, world_size: int,
                     budget: int | None) -> int:
    """`micro_batch_size` made definite for `device` and a batch of `step_rows` completions: on CPU
    CPU_MICRO_BATCH rows at most (the fixed default it was measured as); on CUDA with a token
    `budget`, one rank's share of the batch, so that the budget alone cuts the passes (an update on
    a GPU waits on launching each pass's kernels: benchmarks/update_launches.py counted 18,558 ops
    for two 16-row passes of the 135M shape against 9,746 for one 32-row pass). Without a budget
    (`max_tokens_per_micro_batch: null`) nothing else bounds a pass, so CUDA takes CPU's rows too."""
    if setting != "auto":
        return int(setting)
    if device.type == "cuda" and budget is not None:
        return max(1, -(-step_rows // world_size))
    return max(1, min(CPU_MICRO_BATCH, step_rows))


def activation_bytes_per_token(config, checkpointing: bool) -> int:
    """Bytes of update activations one token holds at the peak of a pass (an estimate).

    With checkpointing, each layer keeps its input (the fp32 residual stream: 4·d bytes) and one
    layer at a time is recomputed (its projections, attention and MLP: about 8·d + 3·I values at
    2-4 bytes, rounded up to 16·d + 12·I). Without it, every layer holds that much. The LM head's
    logits are chunked above a fixed size (core/head_logprobs.py), so they add no per-token term."""
    d, L = config.hidden_size, config.num_hidden_layers
    inter = getattr(config, "intermediate_size", None) or 4 * d
    layer = 16 * d + 12 * inter
    return 4 * L * d + layer if checkpointing else L * (4 * d + layer)


def cuda_budget(free_bytes: int, state_bytes: int, per_token: int) -> int:
    """`auto` on CUDA: a quarter of the memory left once the optimizer state to come is counted
    (`state_bytes`), in tokens of `per_token` bytes, rounded down to a power of two within
    CUDA_BUDGET_RANGE. The other three quarters stay for generation's KV cache, the reference
    pass and the allocator's slack."""
    lo, hi = CUDA_BUDGET_RANGE
    tokens = int(CUDA_BUDGET_SHARE * max(free_bytes - state_bytes, 0) / max(per_token, 1))
    if tokens < lo:
        return lo
    return min(hi, 1 << (tokens.bit_length() - 1))


def token_budget(setting: int | str | None, model: torch.nn.Module, device: torch.device,
                 checkpointing: bool, *, vllm_share: float = 0.0, autocast: bool = False) -> int | None:
    """`max_tokens_per_micro_batch` made definite for `device` (module docstring). Call it with the
    model (and the reference copy) on the device and before the optimizer has state: the gradients and
    AdamW moments to come (12 bytes per trainable fp32 parameter) are counted, not yet allocated, and
    so is what comes after: the share of the device a colocated vLLM takes (`vllm_share`), and with bf16
    `autocast` the bf16 copy of the weights it caches in each forward (2 bytes a parameter)."""
    if setting != "auto":
        return setting  # type: ignore[return-value]
    if device.type != "cuda":
        return CPU_BUDGET
    free, total = torch.cuda.mem_get_info(device)
    # this rank's own share (FSDP2: a DTensor's numel() is the whole parameter's, its gradient and AdamW
    # moments are sharded); autocast's bf16 copies below are of the whole weights each layer gathers
    trainable = sum(_local(p).numel() for p in model.parameters() if p.requires_grad)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "hidden_size"):
        return CUDA_BUDGET_RANGE[0]
    weights = sum(p.numel() for p in model.parameters())
    state = 12 * trainable + int(vllm_share * total) + (2 * weights if autocast else 0) + _head_backward_bytes(
        model, autocast)
    per_token = activation_bytes_per_token(config, checkpointing)
    budget = cuda_budget(free, state, per_token)
    logger.info("max_tokens_per_micro_batch=auto: %d tokens per pass on %s (a quarter of the %.1f GiB free after "
                "gradients, AdamW state%s, at ~%d KiB of activations a token%s)", budget, device,
                (free - state) / 2**30, (", colocated vLLM" if vllm_share else "") + (", autocast's bf16 weights"
                                                                                        if autocast else ""),
                per_token // 1024, " with checkpointing" if checkpointing else "")
    return budget


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter as this rank holds it: an FSDP2 shard's local tensor, else the parameter."""
    return p.to_local() if hasattr(p, "to_local") else p


def _head_backward_bytes(model: torch.nn.Module, autocast: bool) -> int:
    """What the chunked LM head's backward holds beside the activations (core/head_logprobs.py): an fp32
    [V, H] gradient it accumulates over the chunks when the head trains (4 bytes a weight), and under
    bf16 autocast a bf16 copy of the head it multiplies with (2). At V = 152k and H = 4096: 3.7 GB."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is None:
        return 0
    return weight.numel() * (4 * int(weight.requires_grad) + 2 * int(autocast))


def is_out_of_memory(error: BaseException) -> bool:
    """A device allocation that failed: CUDA's `torch.OutOfMemoryError`, or the CPU allocator's
    RuntimeError ("DefaultCPUAllocator: can't allocate memory"), or Python's MemoryError. (A process
    the kernel's OOM killer ends raises nothing: it is gone.) Also the CUDA failures that come from
    outside the caching allocator, as RuntimeErrors (torch.AcceleratorError) that say so: the driver's
    "CUDA error: out of memory" (a graph's instantiation, cuDNN's set-up), cuBLAS's
    CUBLAS_STATUS_ALLOC_FAILED, NCCL's "Cuda failure 'out of memory'"."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(error) if isinstance(error, RuntimeError) else ""
    return any(s in text for s in ("can't allocate memory", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED",
                                   "Cuda failure 'out of memory'"))


def out_of_memory_advice(stage: str | None, cfg, *, budget: int | None = None, checkpointing: str | None = None) -> str:
    """What to lower when the run ran out of memory in `stage` (a `Timings` stage: "generate",
    "logprobs", "update", ...; None: outside a step, e.g. loading), with each setting's value now:
    generation holds the KV cache of the rows decoded together; a pass of the log-prob and update
    passes holds the activations of its tokens (`budget`, resolved; `checkpointing`: checkpoint_mode's
    answer)."""
    evaluating = stage == "eval"
    n = 64 * cfg.num_generations_eval if evaluating else cfg.prompts_per_step * cfg.num_generations
    group = cfg.num_generations_eval if evaluating else cfg.num_generations  # decoded together whatever the setting
    rows = max(cfg.generation_batch_size or n, group)
    every = f"null, all {n} of an eval batch of 64 prompts" if evaluating else f"null, all {n} of a step"
    halve = max(group, (rows // 2) // group * group)  # whole groups
    generate = [f"generation decodes {rows} rows together (generation_batch_size: "
                f"{cfg.generation_batch_size or every}), each with a KV cache of prompt + "
                f"max_completion_length ({cfg.max_completion_length}) tokens: "
                + (f"set generation_batch_size to {halve}, or lower max_completion_length" if halve < rows else
                   f"lower max_completion_length (a group of {group} is decoded together at the least)")]
    if cfg.use_vllm and cfg.vllm_mode == "colocate":
        generate.append(f"colocated vLLM takes vllm_gpu_memory_utilization ({cfg.vllm_gpu_memory_utilization}) "
                        f"of the GPU for itself: lower it, or serve vLLM on its own GPU (vllm_mode: server)")
    given = cfg.max_tokens_per_micro_batch
    shown = ("auto: " if given == "auto" else "") + f"{budget} tokens" if budget else "null: no limit"
    update = [f"each forward/backward pass holds the activations of max_tokens_per_micro_batch ({shown}): "
              + (f"set it to {max(1, budget // 2)}" if budget else "set it, e.g. to 4096")
              + (f", or micro_batch_size ({cfg.micro_batch_size} completions) to {max(1, cfg.micro_batch_size // 2)}"
                 if isinstance(cfg.micro_batch_size, int) and cfg.micro_batch_size > 1 else "")]
    if checkpointing != "always":
        update.append(f"gradient_checkpointing: true keeps only each layer's input and recomputes the rest "
                      f"(now {cfg.gradient_checkpointing!r}" + (f", checkpointing {checkpointing.replace('_', ' ')}"
                                                                  if checkpointing else "") + ")")
    if stage in ("generate", "eval"):
        tips = generate
    elif stage == "reward":
        tips = ["a reward model (process_reward_model, a judge) holds its own weights and the activations of the "
                "completions it scores at once: score fewer at a time in the reward function, load it in bf16, or "
                "put it on another device"]
    elif stage in ("logprobs", "update"):
        tips = update
    else:
        tips = generate + update + (["bf16: true halves what activations take where the device supports it"]
                                    if cfg.bf16 is False else [])
    where = {"generate": "while generating", "eval": "while generating for the eval",
             "logprobs": "in the log-prob passes", "update": "in the update",
             "reward": "in a reward function", "sync_weights": "while sending weights to the engine"}
    return (f"out of memory {where.get(stage or '', 'outside a training step (loading, or an eval)')}. "
            f"To fit:\n" + "\n".join(f"  - {t}" for t in tips))
