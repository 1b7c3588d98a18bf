"""Later turns of a multi-turn rollout on the built-in engine: continuing from the KV cache against
prefilling the whole conversation again, on the embedded tool task.

One rollout = `MultiTurnDriver.generate` over 16 prompts x 8 trajectories (call, tool result,
answer). `continue`: the engine as the trainer uses it (`HFEngine.keep_conversations`: a later
turn copies the row's kept keys/values and prefills only the new tokens); `prefill`: the same
engine behind a wrapper without `keep_conversations`, so each later turn prefills prompt +
conversation so far. Same seeds on both sides; the two produce the same tokens (checked each
round). The sides alternate, `--rounds` times each; medians and the median of the paired ratios.

    HF_HUB_OFFLINE=1 python benchmarks/multiturn_continuation.py --model runs/tool_task/checkpoints/step-000030/model
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grouprl.rollout import GenerationEngine, HFEngine, SamplingParams
from grouprl.rollout.multiturn import MultiTurnDriver, TurnLimits
from grouprl.tasks import TOOL_POLICY_DIR, TOOL_TASK
from grouprl.tasks.products import mul, train_rows
from grouprl.tools import get_tool_parser, resolve_tools


class Prefilling(GenerationEngine):
    """The engine with GenerationEngine's default keep_conversations (nothing kept): every later
    turn prefills the whole conversation."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, *args, **kwargs):
        return self.engine.generate(*args, **kwargs)


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
    ids = [tok.apply_chat_template(r["prompt"], tokenize=True, return_dict=False) for r in train_rows()[:16]]
    params = SamplingParams(T, temperature=1.0)
    sides = {"continue": engine, "prefill": Prefilling(engine)}
    times: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(args.rounds + 1):
        out = {}
        for name, eng in (sides.items() if r % 2 else reversed(sides.items())):
            t0 = time.perf_counter()
            out[name] = driver.generate(eng, ids, 8, params, torch.Generator().manual_seed(r))
            if r:  # round 0 warms up
                times[name].append(time.perf_counter() - t0)
        same = torch.equal(out["continue"].rollout.completion_ids, out["prefill"].rollout.completion_ids)
        turns = out["continue"].counts["turns"]
        print(f"round {r}: continue {times['continue'][-1] if r else 0:.3f} s, prefill "
              f"{times['prefill'][-1] if r else 0:.3f} s, {turns:.0f} turns, same tokens: {same}", flush=True)
    ratio = statistics.median(c / p for c, p in zip(times["continue"], times["prefill"]))
    print(f"median rollout: continue {statistics.median(times['continue']):.3f} s, prefill "
          f"{statistics.median(times['prefill']):.3f} s; median ratio continue/prefill {ratio:.2f}")


if __name__ == "__main__":
    main()
