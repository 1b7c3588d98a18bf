"""Later turns of a multi-turn rollout on the built-in engine: continuing from the KV cache against
prefilling the whole conversation again, on the embedded tool task.

One rollout = `MultiTurnDriver.generate` over 16 prompts x 8 trajectories (call, tool result,
answer). `continue`: the engine as the trainer uses it (`HFEngine.keep_conversations`: a later
turn copies the row's kept keys/values and prefills only the new tokens); `prefill`: the same
engine behind a wrapper without `keep_conversations`, so each later turn prefills prompt +
conversation so far. Same seeds on both sides; the two produce the same tokens (checked each
round). The sides alternate, `--rounds` times each; medians and the median of the paired ratios.

`--compare compile`: both sides continue from the cache; `compiled` decodes every turn with the
compiled step (`generation_compile: true`; the warm-up round pays the compile), `eager` in the
plain eager loop. `--compare graphs` (CUDA): `graphs` replays the eager step as CUDA graphs
(`generation_cuda_graphs: true`, no compile), `eager` launches it kernel by kernel. Multi-turn
calls took the plain eager loop whatever the settings until 2026-11-27.

    HF_HUB_OFFLINE=1 python benchmarks/multiturn_continuation.py --model runs/tool_task/checkpoints/step-000030/model
    HF_HUB_OFFLINE=1 python benchmarks/multiturn_continuation.py --compare compile
    HF_HUB_OFFLINE=1 python benchmarks/multiturn_continuation.py --compare graphs --device cuda
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
    ap.add_argument("--compare", choices=["prefill", "compile", "graphs"], default="prefill",
                    help="prefill: continuing against prefilling each turn; compile: compiled against eager "
                         "decoding; graphs (CUDA): the eager step replayed as graphs against launched")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    if args.compare == "graphs" and not args.device.startswith("cuda"):
        raise SystemExit("--compare graphs replays CUDA graphs: it needs --device cuda")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device)
    tools = resolve_tools([mul])
    engine = HFEngine(model, (tok.eos_token_id,), tok.pad_token_id)
    T = TOOL_TASK["max_completion_length"]
    driver = MultiTurnDriver(tok, TurnLimits(T, max_turns=2, max_tool_calls=1), tools=tools,
                             parser=get_tool_parser(tok, tools), eos_token_ids=(tok.eos_token_id,))
    ids = [tok.apply_chat_template(r["prompt"], tokenize=True, return_dict=False) for r in train_rows()[:16]]
    params = SamplingParams(T, temperature=1.0)
    if args.compare == "prefill":
        sides = {"continue": engine, "prefill": Prefilling(engine)}
    else:
        name = "compiled" if args.compare == "compile" else "graphs"
        sides = {name: HFEngine(model, (tok.eos_token_id,), tok.pad_token_id, compile=args.compare == "compile",
                                cuda_graphs=args.compare == "graphs"),
                 "eager": HFEngine(model, (tok.eos_token_id,), tok.pad_token_id, compile=False, cuda_graphs=False)}
    first, second = sides
    times: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(args.rounds + 1):
        out = {}
        for name, eng in (sides.items() if r % 2 else reversed(sides.items())):
            t0 = time.perf_counter()
            out[name] = driver.generate(eng, ids, 8, params, torch.Generator().manual_seed(r))
            if r:  # round 0 warms up
                times[name].append(time.perf_counter() - t0)
        same = torch.equal(out[first].rollout.completion_ids, out[second].rollout.completion_ids)
        turns = out[first].counts["turns"]
        print(f"round {r}: {first} {times[first][-1] if r else 0:.3f} s, {second} "
              f"{times[second][-1] if r else 0:.3f} s, {turns:.0f} turns, same tokens: {same}", flush=True)
    ratio = statistics.median(a / b for a, b in zip(times[first], times[second]))
    print(f"median rollout: {first} {statistics.median(times[first]):.3f} s, {second} "
          f"{statistics.median(times[second]):.3f} s; median ratio {first}/{second} {ratio:.2f}")


if __name__ == "__main__":
    main()
