"""What the trainer builds once at start: the generation engine, reward functions from config
entries, the EOS ids, the learning-rate schedule and the seeds. Kept out of trainer.py so the loop
reads top to bottom."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from grouprl.checkpoint import save_model_folder
from grouprl.config import ConfigError, TrainConfig
from grouprl.policy import resolve_model_path
from grouprl.rewards import resolve_reward_func
from grouprl.rollout import GenerationEngine, HFEngine


def resolve_reward(spec: Any) -> Callable:
    """A reward function from a `reward_funcs` entry: a name, a module:function path, or a mapping
    with `name` and the function's parameters."""
    if isinstance(spec, dict):
        params = dict(spec)
        name = params.pop("name", None)
        if not isinstance(name, str):
            raise ConfigError(f"reward_funcs entry {spec!r} needs a `name` key")
        return resolve_reward_func(name, **params)
    if not isinstance(spec, str):
        raise ConfigError(f"reward_funcs entry {spec!r} must be a name, a module:function path or a mapping")
    return resolve_reward_func(spec)


def make_engine(cfg: TrainConfig, model: torch.nn.Module, tokenizer, rank: int,
                autocast: torch.dtype | None) -> GenerationEngine:
    """The one place that picks the generation engine; the loop only sees GenerationEngine."""
    eos, pad = eos_ids(model, tokenizer), tokenizer.pad_token_id
    if not cfg.use_vllm:
        return HFEngine(model, eos, pad, max_batch_size=cfg.generation_batch_size, autocast_dtype=autocast)
    if cfg.vllm_mode == "server":
        from grouprl.rollout.vllm_server import VLLMServerEngine

        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        engine = VLLMServerEngine(cfg.vllm_server_host, cfg.vllm_server_port, eos_token_ids=eos, pad_token_id=pad,
                                  weight_dir=cfg.vllm_server_weight_dir or str(Path(cfg.output_dir) / "vllm_weights"),
                                  timeout_s=cfg.vllm_server_timeout_s, rank=rank, world_size=world)
        engine.sync_weights(model, 0)  # the server may hold another run's weights: send ours first
        return engine
    from grouprl.rollout.vllm import VLLMEngine

    return VLLMEngine(vllm_start_folder(cfg, model, rank), eos_token_ids=eos, pad_token_id=pad,
                      dtype=cfg.vllm_dtype or ("bfloat16" if autocast is not None else "float32"),
                      gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                      max_model_len=cfg.vllm_max_model_length, enforce_eager=cfg.vllm_enforce_eager,
                      enable_sleep_mode=cfg.vllm_enable_sleep_mode, seed=cfg.seed + rank)


def vllm_start_folder(cfg: TrainConfig, model: torch.nn.Module, rank: int) -> str:
    """The folder a colocated vLLM engine starts from: the model's own, or for a GGUF model (which
    vLLM would read with its own, different dequantizer, if at all) the policy's dequantized
    weights written once as a plain safetensors folder under output_dir/vllm_start/."""
    if not cfg.gguf_file:
        return resolve_model_path(cfg.model)
    folder = Path(cfg.output_dir) / "vllm_start" / f"rank-{rank}"
    save_model_folder(model, folder)  # as a checkpoint's model/ (LoRA merged)
    return str(folder)


def eos_ids(model: torch.nn.Module, tokenizer) -> tuple[int, ...]:
    """Every id that ends a completion: the generation config's and the tokenizer's EOS."""
    ids = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for x in (gen_eos, tokenizer.eos_token_id):
        if isinstance(x, int):
            ids.add(x)
        elif isinstance(x, (list, tuple)):
            ids.update(x)
    if not ids:
        raise ValueError("the tokenizer and model define no EOS token: set tokenizer.eos_token")
    return tuple(sorted(ids))


def lr_schedule(kind: str, warmup: int, total: int) -> Callable[[int], float]:
    """LambdaLR factor: linear warmup over `warmup` steps, then constant, linear or cosine decay."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = (step - warmup) / max(1, total - warmup)
        if kind == "linear":
            return max(0.0, 1.0 - frac)
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))
        return 1.0

    return factor


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_multiturn(cfg: TrainConfig, tools: list[Callable] | None = None) -> tuple[dict, type | None]:
    """The tools (`Trainer(tools=...)` or the config's) and the environment class, imported before
    any model loads."""
    return resolve_tool_specs(tools if tools is not None else cfg.tools), resolve_environment(cfg.environment)


def resolve_tool_specs(specs: list[Any]) -> dict:
    """name -> Tool from `tools` entries (a name, a module:function path, a mapping with `name` and
    the tool's parameters, or a function); ConfigError naming the entry otherwise."""
    from grouprl.tools import resolve_tool

    tools = {}
    for spec in specs:
        try:
            if isinstance(spec, dict):
                params = dict(spec)
                tool = resolve_tool(params.pop("name"), **params)
            else:
                tool = resolve_tool(spec)
        except (ValueError, TypeError, ImportError) as e:
            raise ConfigError(f"tools entry {spec!r}: {e}") from None
        if tool.name in tools:
            raise ConfigError(f"two tools are named {tool.name!r}: the model calls tools by name, so rename one")
        tools[tool.name] = tool
    return tools


def resolve_environment(spec: str | type | None) -> type | None:
    """The environment class from `environment: package.module:Class` (or the class itself)."""
    if spec is None or isinstance(spec, type):
        return spec
    from grouprl.importpath import import_callable

    try:
        env = import_callable(spec, "environment")
    except (ValueError, ImportError) as e:
        raise ConfigError(str(e)) from None
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise ConfigError(f"environment={spec!r} has no {' or '.join(missing)} method: an environment has "
                          "reset(**row) -> first observation and step(assistant_message) -> (observation, done)")
    return env


def make_rollouts(cfg: TrainConfig, model: torch.nn.Module, tokenizer, formatter, tools: dict,
                  environment: type | None):
    """The rollout stage: one engine call (SingleTurn), or the multi-turn driver with tools or an environment."""
    from grouprl.rollout.multiturn import MultiTurnDriver, SingleTurn, TurnLimits

    if not tools and environment is None:
        return SingleTurn()
    parser = None
    if tools:
        from grouprl.tools import get_tool_parser

        try:
            parser = get_tool_parser(tokenizer, tools, cfg.tool_parser)
        except ValueError as e:
            raise ConfigError(f"tools: {e}") from None
    limits = TurnLimits(cfg.max_completion_length, max_turns=cfg.max_turns, max_tool_calls=cfg.max_tool_calls)
    return MultiTurnDriver(tokenizer, limits, tools=tools, parser=parser, environment=environment,
                           encode=formatter.encode, eos_token_ids=eos_ids(model, tokenizer),
                           tool_timeout_s=cfg.tool_timeout_s)
