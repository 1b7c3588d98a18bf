"""What grouprl adds inside a vLLM server's worker processes (`grouprl vllm-serve` names it with
`--worker-extension-cls`). Imported only there, and by vLLM: importing it imports vLLM.

- `WeightReceiver` is mixed into every vLLM worker, so `/collective_rpc` reaches each
  tensor-parallel shard and data-parallel replica: the start-up probe and the file weight path;
- importing this module registers grouprl's `gloo` weight-transfer engine in vLLM's registry,
  before vLLM builds the engine the server was started with (`--weight-transfer-config`).
"""

from __future__ import annotations

import uuid

from grouprl.rollout.vllm import is_moe, repack_tied_head
from grouprl.rollout.weight_transfer import register

register()
SERVER_ID = uuid.uuid4().hex  # this worker process's: a restarted server answers the probe with new ones


class WeightReceiver:
    """vLLM worker extension (`--worker-extension-cls`)."""

    def grouprl_weights_probe(self) -> dict:
        """Answers the client's start-up check that the extension is installed, with the weight
        transfer the server was started with (`file` when none), its LoRA rank (0: no LoRA), the
        log-probs it returns (`processed_logprobs`: of the distribution it sampled from) and whether
        it serves a mixture-of-experts model on CPU, which no weight sync reaches (MOE_ON_CPU), and
        the served model's shape (`model_shape`: the trainer compares it with the policy's), and
        `server_id`, new at each start of the server: the trainer checks it before each rollout and
        each sync, and a restarted server gets all the weights again."""
        from vllm.platforms import current_platform

        from grouprl.rollout.vllm_server import model_shape

        config, lora = self.vllm_config.weight_transfer_config, self.vllm_config.lora_config
        model_config = self.vllm_config.model_config
        return {"weight_transfer": config.backend if config is not None else "file",
                "lora_rank": lora.max_lora_rank if lora is not None else 0,
                "logprobs_mode": model_config.logprobs_mode,
                "moe_on_cpu": bool(current_platform.is_cpu() and is_moe(model_config.hf_config)),
                "model": model_shape(model_config.hf_config), "server_id": SERVER_ID}

    def grouprl_release_weight_transfer(self) -> None:
        """A new trainer takes the server over: end whatever a previous one left (a trainer that
        died between vLLM's start_weight_update and its update leaves the session marked active,
        and vLLM refuses the next start) and leave its transfer group."""
        _end_weight_update_session(self)
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None:
            engine.reset_weight_update_target()
            engine.shutdown()

    def grouprl_load_weights(self, path: str) -> int:
        """Load the weights in the safetensors file `path` (checkpoint names and shapes) into this
        worker's model with vLLM's loader, which keeps this worker's shard of each tensor."""
        from safetensors import safe_open
        from vllm.platforms import current_platform

        with safe_open(path, framework="pt", device="cpu") as f:
            names = list(f.keys())
            self.reload_weights(weights_iterator=((n, f.get_tensor(n)) for n in names),
                                is_checkpoint_format=True)
        if current_platform.is_cpu():
            repack_tied_head(self.get_model())
        return len(names)


def _end_weight_update_session(worker) -> None:
    """Mark the worker's weight-update session ended. vLLM's worker keeps that mark in a private
    flag, `_weight_update_active`, which only its own `finish_weight_update` and a failed
    `update_weights` clear; no public call clears it without a session to finish (checked on
    vLLM 0.32.0, `vllm/v1/worker/gpu_worker.py`, which the CPU worker inherits): the one place
    grouprl writes it."""
    worker._weight_update_active = False
