"""What the 2-process vLLM test runs under torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.distributed._vllm_worker \\
        MODEL_DIR DATA OUT_DIR STRATEGY

Each rank trains 2 steps with its own colocated vLLM engine, then measures how far its engine's
greedy log-probs are from the trained policy's, and writes OUT_DIR/vllm-STRATEGY-rankR.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grouprl import distributed as D
from grouprl.trainer import Trainer
from tests.distributed._worker import config
from tests.rollout._vllm import max_logp_gap


def main(model_dir: str, data: str, out: str, strategy: str) -> None:
    cfg = config(model_dir, data, str(Path(out) / f"run-{strategy}"), use_vllm=True, vllm_enforce_eager=True,
                 max_steps=2, prompts_per_step=2, beta=0.0, distributed_strategy=strategy)
    trainer = Trainer(cfg)
    trainer.train()
    prompts = [trainer.tokenizer(p)["input_ids"] for p in ("Say numbers 3: ", "xyz")]
    with D.full_weights(trainer.model):  # FSDP2: the trainer's forward needs the whole weights
        gap = max_logp_gap(trainer.engine, trainer.model, prompts)
    rank = trainer.dist.rank
    result = {"gap": gap, "engine_version": trainer.engine.version, "world_size": trainer.dist.world_size}
    (Path(out) / f"vllm-{strategy}-rank{rank}.json").write_text(json.dumps(result))
    trainer.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
