"""What the 2-process server-mode test runs under torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.distributed._vllm_server_worker \\
        MODEL_DIR DATA OUT_DIR PORT

Both ranks are clients of one vLLM server on 127.0.0.1:PORT. They train 2 steps (checkpoint at
step 2), then a fresh trainer resumes the run to step 3. Each rank then measures how far the
server's greedy log-probs are from the trained policy's and writes OUT_DIR/server-rankR.json.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from grouprl.trainer import Trainer
from tests.distributed._worker import config
from tests.rollout._vllm import max_logp_gap


def main(model_dir: str, data: str, out: str, port: str) -> None:
    cfg = config(model_dir, data, str(Path(out) / "run"), use_vllm=True, vllm_mode="server",
                 vllm_server_port=int(port), vllm_server_timeout_s=120, max_steps=2, prompts_per_step=2,
                 beta=0.0, async_rollouts=True)
    first = Trainer(cfg)
    first.train()
    first.close()
    trainer = Trainer(replace(cfg, max_steps=3))
    trainer.train(resume=True)
    prompts = [trainer.tokenizer(p)["input_ids"] for p in ("Say numbers 3: ", "xyz")]
    result = {"gap": max_logp_gap(trainer.engine, trainer.model, prompts), "world_size": trainer.dist.world_size,
              "engine_version": trainer.engine.version}
    (Path(out) / f"server-rank{trainer.dist.rank}.json").write_text(json.dumps(result))
    trainer.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
