"""2-rank runs in which the ranks do different work between collectives, under torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.distributed._lockstep_worker \\
        CASE MODEL_DIR DATA OUT_DIR

CASE `ddp_paths`: one DDP update on `mixed_paths_batch()`, whose two groups run the update's forward
differently (one pass on rank 0, the shared-prompt forward's two passes on rank 1); rank 0 writes
OUT_DIR/ddp_paths.pt with the gradient and each rank's count of DDP forwards.
CASE `fsdp2_eval`: `Trainer.evaluate` under FSDP2 on 3 prompts with batch_size 1 (rank 0 has 2 batches,
rank 1 one); rank 0 writes OUT_DIR/fsdp2_eval.pt with the result, what each rank scored and how many
times each generated.

The process group times out after `TIMEOUT_S`: a rank left waiting in a collective the other never
enters fails the run in seconds, where the default (600 s) would hang the test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from datasets import Dataset

from grouprl import distributed as D
from grouprl.batch import StepBatch
from grouprl.config import TrainConfig
from grouprl.rollout import Rollout
from grouprl.trainer import Trainer
from tests.distributed._worker import config, full_grads

TIMEOUT_S = 20
G, P, T = 8, 12, 5  # group size, prompt and completion width
SHORT_PROMPT = 4  # group 0's prompt length: 8 x 4 - 3 = 29 tokens saved by sharing, under the 64 asked


def ddp_paths_config(model_dir: str, data: str, output_dir: str, **kw) -> TrainConfig:
    """Padded passes, one group per micro-batch, prompts shared when that saves 64 tokens or more."""
    return config(model_dir, data, output_dir, distributed_strategy="ddp", prompts_per_step=2, num_generations=G,
                  micro_batch_size=G, padding_free=False, share_prompt_forward=True, share_prompt_min_tokens=64,
                  max_tokens_per_micro_batch=None, beta=0.0, gradient_checkpointing=False, **kw)


def mixed_paths_batch() -> StepBatch:
    """Two groups of G = 8: group 0's prompt has 4 tokens (sharing saves 29 tokens: one forward over
    prompt and completion), group 1's has 12 (saves 85: the prompts' pass, then the completions')."""
    g = torch.Generator().manual_seed(0)
    prompt_len = torch.tensor([SHORT_PROMPT, P]).repeat_interleave(G)  # [N]
    prompt_mask = (torch.arange(P)[None] >= P - prompt_len[:, None]).long()  # [N, P]
    prompt_ids = torch.randint(4, 90, (2, P), generator=g).repeat_interleave(G, 0) * prompt_mask  # [N, P]
    lengths = torch.tensor([3, 4, 5, 2]).repeat(2 * G // 4)  # [N]
    completion_mask = torch.arange(T)[None] < lengths[:, None]  # [N, T]
    completion_ids = torch.randint(4, 90, (2 * G, T), generator=g) * completion_mask  # [N, T]
    rewards = torch.tensor([0.0, 1.0]).repeat(G)  # [N]
    rollout = Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, lengths == T)
    return StepBatch(rollout, ["p"] * 2 * G, ["c"] * 2 * G, rewards, {"r": rewards.clone()}, {})


def mixed_paths_update(cfg: TrainConfig) -> dict[str, object]:
    """The gradient of one update on `mixed_paths_batch()` as the optimizer gets it (SGD at lr 0), and
    how many forwards this process ran through the module the update trains (the DDP wrapper)."""
    trainer = Trainer(cfg)
    trainer.optimizer = torch.optim.SGD([p for p in trainer.model.parameters() if p.requires_grad], lr=0.0)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda _: 1.0)
    grads = []
    step = trainer.optimizer.step
    trainer.optimizer.step = lambda: grads.append(full_grads(trainer.model)) or step()
    forwards = []
    trainer.train_model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    batch = mixed_paths_batch()
    trainer.update(batch, trainer.advantages(batch))
    return {"grads": grads.pop(), "forwards": len(forwards)}


def eval_prompts() -> Dataset:
    return Dataset.from_list([{"prompt": f"Say numbers {i}: ", "answer": str(i)} for i in range(3)])


def fsdp2_eval(model_dir: str, data: str, output_dir: str) -> dict[str, object]:
    """`Trainer.evaluate(eval_prompts(), batch_size=1)` under FSDP2, greedy and 2 samples per prompt;
    what this rank scored ((prompt, completions per prompt, scores) per `score` call) and its
    `generate` calls."""
    cfg = config(model_dir, data, output_dir, distributed_strategy="fsdp2", eval_metrics=["greedy", "mean@2"],
                 num_generations_eval=2)
    trainer = Trainer(cfg)
    scored, generated = [], []
    score, generate = trainer.score, trainer.generate

    def recorded_score(prompts, trajectories):
        part = score(prompts, trajectories)
        scored.append((prompts.prompts, len(part.completions) // len(prompts.prompts),
                       part.per_func[trainer.reward_names[0]].tolist()))
        return part

    trainer.score = recorded_score
    trainer.generate = lambda *a, **k: generated.append(1) or generate(*a, **k)
    result = trainer.evaluate(eval_prompts(), batch_size=1)
    return {"result": result, "scored": scored, "generate_calls": len(generated)}


def main(case: str, model_dir: str, data: str, out_dir: str) -> None:
    ctx = D.init_distributed(timeout_s=TIMEOUT_S)  # the trainer joins this group
    if case == "ddp_paths":
        mine = mixed_paths_update(ddp_paths_config(model_dir, data, f"{out_dir}/run"))
        result = {"grads": mine["grads"], "forwards": D.gather_objects(ctx, mine["forwards"])}
    else:
        mine = fsdp2_eval(model_dir, data, f"{out_dir}/run")
        result = {"result": mine["result"], "scored": D.gather_objects(ctx, mine["scored"]),
                  "generate_calls": D.gather_objects(ctx, mine["generate_calls"])}
    if ctx.is_main:
        torch.save(result, Path(out_dir) / f"{case}.pt")
    D.barrier(ctx)  # the ranks leave together, as the CLI's do
    D.destroy_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:5])
