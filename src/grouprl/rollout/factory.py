"""The rollout stage built from the config: which generation engine, the single- or multi-turn
driver above it (tools, environment) and the EOS ids. The trainer calls these once at start and
afterwards only sees `GenerationEngine` and the driver's `generate`.

The one module of rollout/ that reads a `TrainConfig`: it wires the engines from above (config,
policy, checkpoint, distributed), and nothing else in rollout/ imports it (tests/test_layering.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from grouprl import distributed as D
from grouprl.checkpoint import save_model_folder
from grouprl.config import ConfigError, TrainConfig
from grouprl.policy import ADAPTER_CONFIG, resolve_model_path
from grouprl.rollout import GenerationEngine, HFEngine
from grouprl.rollout.multiturn import MultiTurnDriver, TurnLimits, resolve_environment
from grouprl.rollout.types import SingleTurn
from grouprl.tools import get_tool_parser, resolve_tools


def make_engine(cfg: TrainConfig, model: torch.nn.Module, tokenizer, dist: D.DistContext,
                autocast: torch.dtype | None) -> GenerationEngine:
    """The one place that picks the generation engine; the loop only sees GenerationEngine."""
    eos, pad = eos_ids(model, tokenizer), tokenizer.pad_token_id
    if not cfg.use_vllm:
        compile_setting = "auto" if cfg.generation_compile == "auto" else bool(cfg.generation_compile)
        return HFEngine(model, eos, pad, max_batch_size=cfg.generation_batch_size, autocast_dtype=autocast,
                        compile=compile_setting, planned_calls=cfg.max_steps,
                        cuda_graphs=cfg.generation_cuda_graphs)
    from grouprl.rollout.vllm import check_adapter

    check_adapter(model)  # before vLLM starts: found at the first sync, the error left it half reloaded
    if cfg.vllm_mode == "server":
        from grouprl.rollout.vllm_server import VLLMServerEngine

        engine = VLLMServerEngine(cfg.vllm_server_host, cfg.vllm_server_port, eos_token_ids=eos, pad_token_id=pad,
                                  weight_dir=cfg.vllm_server_weight_dir or str(Path(cfg.output_dir) / "vllm_weights"),
                                  timeout_s=cfg.vllm_server_timeout_s, rank=dist.rank, world_size=dist.world_size,
                                  barrier=lambda: D.barrier(dist), weight_transfer=cfg.vllm_weight_transfer,
                                  transfer_address=cfg.vllm_weight_transfer_address,
                                  broadcast=lambda obj: D.gather_objects(dist, obj)[0], lora_rank=cfg.lora_r,
                                  lora_sync=cfg.vllm_lora_sync,
                                  keep_adapters=cfg.max_staleness + 2 if cfg.async_rollouts else 2)
        engine.sync_weights(model, 0)  # the server may hold another run's weights: send ours first
        return engine
    from grouprl.rollout.vllm import VLLMEngine

    return VLLMEngine(vllm_start_folder(cfg, model, dist.rank), eos_token_ids=eos, pad_token_id=pad,
                      dtype=cfg.vllm_dtype or ("bfloat16" if autocast is not None else "float32"),
                      gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                      max_model_len=cfg.vllm_max_model_length, enforce_eager=cfg.vllm_enforce_eager,
                      enable_sleep_mode=cfg.vllm_enable_sleep_mode, seed=cfg.seed + dist.rank,
                      external_launcher=dist.enabled, lora_rank=colocated_lora_rank(cfg))


def colocated_lora_rank(cfg: TrainConfig) -> int:
    """The LoRA rank a colocated vLLM runs the adapter at, or 0 to send it merged weights. `auto`:
    the adapter only with a GPU. On CPU vLLM's LoRA kernels cost more per step than a full weight
    copy saves (SmolLM2, rank 16, measured: generation 40.6 s against 20.7 s per 4 x 8 x 64
    tokens, sync 0.13 s against 2.8 s; benchmarks/README.md)."""
    if not cfg.lora_r or cfg.vllm_lora_sync == "merged":
        return 0
    if cfg.vllm_lora_sync == "adapter" or torch.cuda.is_available():
        return cfg.lora_r
    return 0


def vllm_start_folder(cfg: TrainConfig, model: torch.nn.Module, rank: int) -> str:
    """The folder a colocated vLLM engine starts from: the model's own, or for a GGUF model (which
    vLLM would read with its own, different dequantizer, if at all) or a folder holding a PEFT adapter
    (which vLLM would leave out) the policy's weights written once as a plain safetensors folder under
    output_dir/vllm_start/: dequantized, or with the adapter merged in as `load_policy` merged it."""
    folder = resolve_model_path(cfg.model)
    if not cfg.gguf_file and not (Path(folder) / ADAPTER_CONFIG).is_file():
        return folder
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


def resolve_multiturn(cfg: TrainConfig, tools: list[Callable] | None = None) -> tuple[dict, type | None]:
    """The tools (`Trainer(tools=...)` or the config's entries) and the environment class, imported
    before any model loads; ConfigError naming the entry when one cannot be had."""
    try:
        environment = resolve_environment(_environment(cfg.environment))
        return resolve_tools(tools if tools is not None else cfg.tools), environment
    except (ValueError, ImportError) as e:
        raise ConfigError(str(e)) from None


def _environment(spec: Any) -> Any:
    """`openenv:package.module:Class` (or a factory): an OpenEnv environment behind our protocol
    (envs/openenv.py, with its defaults); anything else as it is."""
    if isinstance(spec, str) and spec.startswith("openenv:"):
        from grouprl.envs.openenv import OpenEnvAdapter
        from grouprl.importpath import import_callable

        return OpenEnvAdapter(import_callable(spec.removeprefix("openenv:"), "environment")).environment
    return spec


def make_rollouts(cfg: TrainConfig, model: torch.nn.Module, tokenizer, formatter, tools: dict,
                  environment: type | None) -> Any:
    """The rollout driver: one engine call (SingleTurn), or the multi-turn driver with tools or an environment."""
    if not tools and environment is None:
        return SingleTurn()
    parser = None
    if tools:
        try:
            parser = get_tool_parser(tokenizer, tools, cfg.tool_parser)
        except ValueError as e:
            raise ConfigError(f"tools: {e}") from None
    limits = TurnLimits(cfg.max_completion_length, max_turns=cfg.max_turns, max_tool_calls=cfg.max_tool_calls)
    return MultiTurnDriver(tokenizer, limits, tools=tools, parser=parser, environment=environment,
                           encode=formatter.encode, eos_token_ids=eos_ids(model, tokenizer),
                           tool_timeout_s=cfg.tool_timeout_s, env_timeout_s=cfg.env_timeout_s,
                           max_tool_output_chars=cfg.max_tool_output_chars,
                           template_kwargs=formatter.template_kwargs)
