"""What re-prefilling the conversation at each turn costs the built-in engine, on the embedded tool task.

The multi-turn driver passes the whole conversation as the prompt of each later turn, and the
built-in engine prefills it again (it keeps no KV cache between calls). This measures, for one
rollout of the tool task (16 prompts x 8 trajectories: call, tool result, answer):

    rollout   MultiTurnDriver.generate, start to end (both turns, tool calls included)
    prefill   the later turns' prefill alone: engine.generate over the same conversations with
              max_new_tokens=1 (prefill + one sampled token), i.e. what a KV-cache continuation saves

alternating the two, `--rounds` times, and prints medians and the median ratio.

    HF_HUB_OFFLINE=1 python benchmarks/multiturn_prefill.py --model runs/tool_task/checkpoints/step-000030/model
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grouprl.rollout import HFEngine, SamplingParams
from grouprl.rollout.multiturn import MultiTurnDriver, TurnLimits
from grouprl.tasks import TOOL_POLICY_DIR, TOOL_TASK
from grouprl.tasks.products import mul, train_rows
from grouprl.tools import get_tool_parser, resolve_tools


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(TOOL_POLICY_DIR))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tools = resolve_tools([mul])
    engine = HFEngine(model, (tok.eos_token_id,), tok.pad_token_id)
    T = TOOL_TASK["max_completion_length"]
    driver = MultiTurnDriver(tok, TurnLimits(T, max_turns=2, max_tool_calls=1), tools=tools,
                             parser=get_tool_parser(tok, tools), eos_token_ids=(tok.eos_token_id,))
    rows = train_rows()[:16]
    ids = [tok.apply_chat_template(r["prompt"], tokenize=True, return_dict=False) for r in rows]
    params = SamplingParams(T, temperature=1.0)
    times = {"rollout": [], "prefill": []}
    for r in range(args.rounds + 1):
        g = torch.Generator().manual_seed(r)
        t0 = time.perf_counter()
        traj = driver.generate(engine, ids, 8, params, g)
        rollout_s = time.perf_counter() - t0
        ro = traj.rollout
        # the later turns' prompts: prompt + everything up to the last action block's start
        later = []
        for i in range(len(ro)):
            act = ro.action_mask[i][ro.completion_mask[i]].tolist()
            starts = [t for t in range(1, len(act)) if act[t] and not act[t - 1]]  # first token of turn k >= 2
            prompt = ro.prompt_ids[i][ro.prompt_mask[i].bool()].tolist()
            comp = ro.completion_ids[i][ro.completion_mask[i]].tolist()
            later += [prompt + comp[:s] for s in starts]
        t0 = time.perf_counter()
        if later:
            engine.generate(later, 1, replace(params, max_new_tokens=1), g)
        prefill_s = time.perf_counter() - t0
        if r == 0:
            continue  # warm-up
        times["rollout"].append(rollout_s)
        times["prefill"].append(prefill_s)
        print(f"round {r}: rollout {rollout_s:.3f} s, later-turn prefill {prefill_s:.3f} s "
              f"({len(later)} of {len(ro)} trajectories took a second turn)", flush=True)
    ratios = [p / t for p, t in zip(times["prefill"], times["rollout"])]
    print(f"median rollout {statistics.median(times['rollout']):.3f} s, median later-turn prefill "
          f"{statistics.median(times['prefill']):.3f} s, median share {100 * statistics.median(ratios):.1f} %")


if __name__ == "__main__":
    main()
