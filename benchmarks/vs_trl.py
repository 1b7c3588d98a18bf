"""grouprl against TRL's GRPOTrainer on identical GRPO work, on this machine's CPU or GPU.

    python benchmarks/vs_trl.py                      # every default workload (CPU)
    python benchmarks/vs_trl.py --device cuda --smollm2 models/smollm2   # the GPU workloads (below)
    python benchmarks/vs_trl.py --workload tiny-32   # one workload; last line: ratio_steps_per_s=.. ratio_peak_rss=..
    python benchmarks/vs_trl.py --list
    python benchmarks/vs_trl.py --workload smollm2-135m --smollm2 models/smollm2   # a real model

`smollm2-*` workloads train SmolLM2-135M-Instruct (the folder scripts/fetch_smollm2.py writes) on
`builtin:chat_arithmetic` chat prompts with the example's rewards (`math_accuracy` weight 1,
`chat_arithmetic:boxed_accuracy` weight 0.5), 64 tokens, beta 0, lr 2e-5. bf16 workloads run only
where the CPU multiplies bf16 natively (grouprl.precision); elsewhere they are skipped with a line
that says so.

Each side runs in its own subprocess (so peak RSS is per side), the two alternate (grouprl, TRL,
grouprl, TRL, ... for `--rounds`), and each run waits for an idle CPU first. A run trains
`--steps` steps (default 12) and the figure per run is the median seconds per step over steps
3..12; over rounds the figure is the median of the per-run medians.

Identical work on both sides: the same random-init Qwen2 (built locally by
`grouprl.tasks.testing`), the same prompts "What is {a}+{b}? Answer: " and the same Python reward
functions (`grouprl.rewards.math_accuracy` weight 1.0, `grouprl.tasks.arithmetic.format_reward`
weight 0.1), G = 8, 2 prompts per step, temperature 1, lr 1e-5, mu = 1, the GRPO loss
(`loss_type="grpo"` = grouprl's `seq-mean-token-mean`), group-std advantage scaling, clip 0.2,
grad-norm clip 1.0, AdamW. bf16 workloads run TRL with `bf16=True` and grouprl with `bf16: true`.
"Fixed" workloads make every completion exactly max_completion_length tokens on both sides
(grouprl: `ignore_eos`; TRL: `min_new_tokens`), so both compute the same number of tokens.

On a GPU (`--device cuda`, or `auto` where CUDA is available): `gpu-*` workloads train random-init
Llama models of the SmolLM2-135M and SmolLM2-1.7B shapes (`SHAPES`; or any `--model-config
config.json`), built from a config on the machine (no download), with SmolLM2's tokenizer (the
`--smollm2` folder: only its tokenizer is read), 256 fixed-length tokens, G = 8, beta 0, bf16
autocast over fp32 master weights on both sides, each side at its own defaults otherwise (grouprl's
`auto` checkpointing and token budget; TRL's own). A random-init model never answers a sum, so the
reward is `text_variety` (distinct characters over characters): it varies within a group, so no
side can skip a zero-advantage group and both do the same update. Memory is each side's
`torch.cuda.max_memory_allocated` in its own process; the matmul peak is a bf16 8192^3 product on
the same GPU in the same run.

Model-FLOPs utilisation (MFU) counts the useful work of a step (`model_flops`): each prompt once
per group and each completion token once, 2 FLOPs per weight per token to generate, 6 to update
(forward and backward), 2 more for the reference forward when beta > 0, the LM head at completion
positions only, plus causal attention -- against a matmul peak measured in the same run with the
same thread count and precision. Work a side repeats (a prompt run once per completion) is not
useful work and lowers its MFU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
PROMPT = "What is {a}+{b}? Answer: "
FORMAT_WEIGHT = 0.1


@dataclass(frozen=True)
class Workload:
    name: str
    size: str            # a key of grouprl.tasks.testing.TINY_SIZES
    max_tokens: int
    beta: float = 0.04
    bf16: bool = False
    fixed: bool = False  # every completion exactly max_tokens long
    micro_batch: int = 4  # grouprl's micro_batch_size (same gradient for any value; smaller = less memory)
    task: str = "sum"    # "sum": "What is a+b? Answer: " text prompts; "chat": builtin:chat_arithmetic
    lr: float = 1e-5
    prompts: int = 2     # prompts per step (B); completions per step: 8 B
    gpu: bool = False    # a `gpu-*` workload: random-init SHAPES model with SmolLM2's tokenizer, on CUDA


WORKLOADS = {w.name: w for w in [
    Workload("tiny-32", "tiny", 32, micro_batch=16),
    Workload("tiny-32-fixed", "tiny", 32, fixed=True, micro_batch=16),
    Workload("tiny-32-b0", "tiny", 32, beta=0.0, micro_batch=16),
    Workload("tiny-32-bf16", "tiny", 32, bf16=True, micro_batch=16),
    Workload("10m-128", "10m", 128),
    Workload("10m-128-fixed", "10m", 128, fixed=True),
    Workload("50m-128", "50m", 128, micro_batch=2),
    Workload("50m-128-bf16", "50m", 128, bf16=True, micro_batch=2),
    Workload("50m-128-fixed", "50m", 128, fixed=True, micro_batch=2),
    Workload("50m-128-bf16-fixed", "50m", 128, bf16=True, fixed=True, micro_batch=2),
] + [Workload(f"smollm2-135m{'-bf16' * bf16}{'-fixed' * fixed}", "smollm2", 64, beta=0.0, bf16=bf16, fixed=fixed,
              micro_batch=16, task="chat", lr=2e-5) for bf16 in (False, True) for fixed in (False, True)
] + [Workload("gpu-135m-256", "smollm2-135m-shape", 256, beta=0.0, bf16=True, fixed=True, micro_batch=0,
              task="variety", lr=1e-6, prompts=4, gpu=True),
     Workload("gpu-1.7b-256", "smollm2-1.7b-shape", 256, beta=0.0, bf16=True, fixed=True, micro_batch=0,
              task="variety", lr=1e-6, prompts=2, gpu=True)]}
DEFAULT = ["tiny-32", "10m-128", "50m-128", "50m-128-bf16"]
DEFAULT_GPU = ["gpu-1.7b-256", "gpu-135m-256"]

# Llama shapes of the SmolLM2 family (their published config.json values), random-init on the machine
_SMOLLM2 = dict(vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192, rms_norm_eps=1e-5,
                hidden_act="silu", attention_bias=False, mlp_bias=False)
SHAPES = {
    "smollm2-135m-shape": dict(_SMOLLM2, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                               num_key_value_heads=3, intermediate_size=1536, rope_theta=100000.0),
    "smollm2-1.7b-shape": dict(_SMOLLM2, hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
                               num_key_value_heads=32, intermediate_size=8192, rope_theta=130000.0),
}


def build_shape_model(path: Path, shape: dict, tokenizer_dir: str, device: str) -> str:
    """A random-init LlamaForCausalLM of `shape` with the tokenizer of `tokenizer_dir`, saved (bf16
    on disk; both sides load fp32 master weights) into `path`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tok.eos_token_id
    config = LlamaConfig(**{**shape, "vocab_size": max(shape.get("vocab_size", 0), len(tok))},
                         bos_token_id=tok.bos_token_id, eos_token_id=eos,
                         pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos)
    torch.manual_seed(0)
    with torch.device(device):  # on a GPU: seconds for 1.7 B weights instead of a minute of CPU init
        model = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


# ---------------------------------------------------------------------------- shared pieces
def make_rows(task: str = "sum", n: int = 512, seed: int = 0) -> list[dict]:
    if task == "chat":  # [{"role": "user", "content": "What is 37+48? Put the final answer in \\boxed{}."}]
        from grouprl.tasks.chat_arithmetic import train_rows

        return train_rows()[:n]
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        rows.append({"prompt": PROMPT.format(a=a, b=b), "answer": str(a + b)})
    return rows


def text_variety(completions, **kwargs) -> list[float]:
    """Distinct characters over characters: a reward that varies within a group of a random-init
    model's completions (the `gpu-*` workloads), so every group has a nonzero advantage."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [len(set(t)) / max(len(t), 1) for t in texts]


REWARDS = {  # task -> (reward functions, weights): the same on both sides
    "sum": (["math_accuracy", "grouprl.tasks.arithmetic:format_reward"], [1.0, FORMAT_WEIGHT]),
    "chat": (["math_accuracy", "grouprl.tasks.chat_arithmetic:boxed_accuracy"], [1.0, 0.5]),
    "variety": ([text_variety], [1.0]),
}


def reward_funcs(task: str):
    from grouprl.rewards import resolve_reward_func

    return [f if callable(f) else resolve_reward_func(f) for f in REWARDS[task][0]]


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def model_flops(model_dir: str, prompt_tokens: float, completion_tokens: list[float], beta: float,
                group_size: int) -> float:
    """Useful FLOPs of one step (module docstring): prompts of `prompt_tokens` once per group of
    `group_size` completions, completions of the given lengths, GQA-aware weights, the LM head at
    completion positions, causal attention over prompt + completion."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    d, L, f, V = c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size
    H = c.num_attention_heads
    D = getattr(c, "head_dim", None) or d // H
    kv = (getattr(c, "num_key_value_heads", None) or H) * D
    body = L * (2 * d * H * D + 2 * d * kv + 3 * d * f)  # weights per token: q, o; k, v; gate, up, down
    groups = len(completion_tokens) / group_size
    P = prompt_tokens
    tokens = groups * P + sum(completion_tokens)
    attn = 2 * L * H * D * (groups * P * P + sum(2 * T * P + T * T for T in completion_tokens))  # 4·HD per causal pair
    forward = 2 * body * tokens + 2 * d * V * sum(completion_tokens) + attn
    return forward * (1 + 3 + (1 if beta > 0 else 0))  # generate, update (forward + backward), reference


# ---------------------------------------------------------------------------- workers
def memory_figures(device: str) -> dict:
    """Peak RSS always; on CUDA also the process's `torch.cuda.max_memory_allocated`."""
    out = {"peak_rss_mib": peak_rss_mib()}
    if device == "cuda":
        import torch

        out["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


class LastStepSnapshot:
    """`--memory-snapshot DIR` on CUDA: the allocator's trace of a side's last step, with the Python
    stack of every allocation, dumped to DIR/<side>-<workload>.pickle (benchmarks/memory_peak.py
    reads it), and the bytes allocated when the recording began beside it (.json): the weights,
    optimizer state and whatever else lives across steps. Only the last step is recorded, so the
    trace stays a size a ring buffer holds whole."""

    def __init__(self, side: str, w: Workload, device: str):
        folder = os.environ.get("VS_TRL_MEMORY_SNAPSHOT")
        self.path = Path(folder) / f"{side}-{w.name}.pickle" if folder and device == "cuda" else None
        self.recording = False

    def start(self) -> None:
        if self.path is None or self.recording:
            return
        import torch

        self.before = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=2_000_000)
        self.recording = True

    def stop(self) -> None:
        if not self.recording:
            return
        import torch

        self.path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(self.path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self.path.with_suffix(".json").write_text(json.dumps({
            "allocated_before_bytes": self.before, "max_allocated_bytes": torch.cuda.max_memory_allocated()}))
        self.recording = False


def worker_grouprl(w: Workload, model_dir: str, steps: int, threads: int, device: str = "cpu") -> dict:
    import torch
    from datasets import Dataset

    from grouprl.config import TrainConfig
    from grouprl.trainer import Trainer

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as out:
        names, weights = REWARDS[w.task]
        extra = {"micro_batch_size": w.micro_batch} if w.micro_batch else {}  # 0: grouprl's defaults
        setting = os.environ.get("VS_TRL_GENERATION_COMPILE")  # --generation-compile
        if setting:
            extra["generation_compile"] = {"true": True, "false": False}.get(setting, setting)
        extra.update(json.loads(os.environ.get("VS_TRL_GROUPRL_SET", "{}")))  # a caller's settings (update_launches.py)
        if os.environ.get("VS_TRL_PACKED_ATTENTION") == "per-sequence":  # --packed-attention
            from grouprl import packing

            packing.VARLEN["enabled"] = False
        cfg = TrainConfig(
            model=model_dir, train_data="<in memory>", reward_funcs=[getattr(f, "__name__", f) for f in names],
            reward_weights=weights, algorithm="grpo", beta=w.beta, num_generations=8,
            prompts_per_step=w.prompts, max_completion_length=w.max_tokens, temperature=1.0,
            learning_rate=w.lr, num_iterations=1, bf16=w.bf16, ignore_eos=w.fixed, max_steps=steps,
            output_dir=out, progress=False, report_to=[], num_logged_samples=0,
            num_threads=threads, seed=0, reward_timeout_s=None, **extra)
        trainer = Trainer(cfg, train_dataset=Dataset.from_list(make_rows(w.task)), reward_funcs=reward_funcs(w.task))
        times, stages, lengths = [], [], []
        snapshot = LastStepSnapshot("grouprl", w, device)
        for i in range(steps):
            if i == steps - 1:
                snapshot.start()
            t0 = time.perf_counter()
            m = trainer.train_step()
            times.append(time.perf_counter() - t0)
            stages.append({k.removeprefix("time/"): v for k, v in m.items()  # generate_engine is part of generate
                           if k.startswith("time/") and k not in ("time/step", "time/generate_engine")})
            lengths.append(m["completion/length_mean"])
        snapshot.stop()
    return {"times": times, "stages": stages, "lengths": lengths, **memory_figures(device), **decode_fallbacks()}


def decode_fallbacks() -> dict:
    """Why the decode step fell back, if it did: a compile or a graph capture that failed (grouprl
    warns once; the callers' log filters drop warnings, and an H100 run lost the reason so)."""
    from grouprl.rollout import compiled_decode as cd

    return {k: v for k, v in (("compile_failed", dict(cd._FAILED)), ("graphs_failed", dict(cd._GRAPHS_FAILED))) if v}


def worker_trl(w: Workload, model_dir: str, steps: int, threads: int, device: str = "cpu") -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    clock = {"generate": 0.0, "reward": 0.0}

    def timed(fn, key):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                clock[key] += time.perf_counter() - t0
        wrapper.__name__ = getattr(fn, "__name__", key)
        return wrapper

    model.generate = timed(model.generate, "generate")
    funcs = [timed(f, "reward") for f in reward_funcs(w.task)]
    times, stages, lengths = [], [], []
    snapshot = LastStepSnapshot("trl", w, device)

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == steps - 1:
                snapshot.start()
            self.t0 = time.perf_counter()
            clock.update(generate=0.0, reward=0.0)

        def on_step_end(self, args, state, control, **kw):
            dt = time.perf_counter() - self.t0
            times.append(dt)
            stages.append({"generate": clock["generate"], "reward": clock["reward"],
                           "other": dt - clock["generate"] - clock["reward"]})

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, per_device_train_batch_size=8 * w.prompts, num_generations=8,
            generation_batch_size=8 * w.prompts,
            gradient_accumulation_steps=1, max_completion_length=w.max_tokens, temperature=1.0,
            learning_rate=w.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            max_grad_norm=1.0, beta=w.beta, epsilon=0.2, num_iterations=1, loss_type="grpo",
            scale_rewards="group", reward_weights=REWARDS[w.task][1], bf16=w.bf16, use_cpu=device == "cpu",
            use_vllm=False, max_steps=steps, logging_steps=1, save_strategy="no", report_to="none",
            disable_tqdm=True, seed=0, dataloader_num_workers=0, log_completions=False,
            generation_kwargs={"min_new_tokens": w.max_tokens} if w.fixed else None)
        trainer = GRPOTrainer(model=model, reward_funcs=funcs, args=args,
                              train_dataset=Dataset.from_list(make_rows(w.task)), processing_class=tok,
                              callbacks=[Clock()])
        trainer.train()
        snapshot.stop()
    return {"times": times, "stages": stages, "lengths": lengths, **memory_figures(device)}


def matmul_peak_cuda() -> dict:
    """bf16 and fp32 (TF32 off) FLOP/s of an 8192^3 product on the GPU: the mean of 10 timed
    products after 3 warm-ups, timed with CUDA events."""
    import torch

    out, n = {}, 8192
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = (torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(2))
        for _ in range(3):
            a @ b
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            a @ b
        end.record()
        torch.cuda.synchronize()
        out[name] = 2 * n ** 3 * 10 / (start.elapsed_time(end) / 1e3)
        del a, b
    torch.cuda.empty_cache()
    return out


def matmul_peak(threads: int, budget_s: float = 1.0) -> dict:
    """Best FLOP/s of a square matmul (n = 512, 1024) in fp32 and bf16 with `threads` threads,
    about `budget_s` seconds per size (a CPU without bf16 instructions is very slow in bf16)."""
    import torch

    torch.set_num_threads(threads)
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        best = 0.0
        for n in (512, 1024):
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            t0 = time.perf_counter()
            a @ b  # warm-up, and a first estimate
            first = time.perf_counter() - t0
            if first > budget_s:
                best = max(best, 2 * n ** 3 / first)
                break
            reps = max(1, int(budget_s / 3 / max(first, 1e-6)))
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(reps):
                    a @ b
                best = max(best, 2 * n ** 3 * reps / (time.perf_counter() - t0))
        out[name] = best
    return out


# ---------------------------------------------------------------------------- driver
def wait_idle(max_load: float, timeout_s: float) -> float:
    t0 = time.time()
    while True:
        load = os.getloadavg()[0]
        if load <= max_load or time.time() - t0 > timeout_s:
            return load
        time.sleep(10)


def run_side(side: str, w: Workload, model_dir: str, steps: int, threads: int, device: str) -> dict:
    with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
        cmd = [sys.executable, __file__, "--worker", side, "--workload", w.name, "--model-dir", model_dir,
               "--steps", str(steps), "--threads", str(threads), "--out", f.name, "--device", device,
               "--micro-batch", str(w.micro_batch)] + (["--fp32"] if not w.bf16 else [])
        hide = {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}  # the trainer takes any GPU it sees
        env = {**os.environ, **hide}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL if side == "trl" else None)
        return json.loads(Path(f.name).read_text())


def summarize(runs: list[dict]) -> dict:
    meds = [statistics.median(r["times"][2:]) for r in runs]
    stage_keys = sorted({k for r in runs for s in r["stages"] for k in s})
    stages = {k: statistics.median([statistics.median([s.get(k, 0.0) for s in r["stages"][2:]]) for r in runs])
              for k in stage_keys}
    lengths = [x for r in runs for x in r["lengths"][2:]]
    cuda = [r["peak_cuda_mib"] for r in runs if "peak_cuda_mib" in r]
    fallbacks = {k: r[k] for r in runs for k in ("compile_failed", "graphs_failed") if r.get(k)}
    return {"s_per_step": statistics.median(meds), "runs": meds, "stages": stages, **fallbacks,
            "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
            **({"peak_cuda_mib": max(cuda)} if cuda else {}),
            "length_mean": statistics.mean(lengths) if lengths else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", action="append", help="workload name (repeatable); default: "
                    + ", ".join(DEFAULT))
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2, help="alternations of grouprl and TRL per workload")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-load", type=float, default=0.5, help="wait for a 1-min load average below this")
    ap.add_argument("--idle-timeout", type=float, default=120.0, help="give up waiting after this many seconds")
    ap.add_argument("--only", choices=["grouprl", "trl"], help="run one side only (development)")
    ap.add_argument("--micro-batch", type=int, help="grouprl's micro_batch_size (default: the workload's)")
    ap.add_argument("--json", help="write all results to this file")
    ap.add_argument("--generation-compile", choices=["auto", "true", "false"],
                    help="grouprl's generation_compile (default: the config's, auto); with true the first "
                         "step compiles, which the median over steps 3.. leaves out")
    ap.add_argument("--memory-snapshot", metavar="DIR",
                    help="on CUDA: record each side's last step with the allocator's history and dump it to "
                         "DIR/<side>-<workload>.pickle (read it with benchmarks/memory_peak.py)")
    ap.add_argument("--packed-attention", choices=["auto", "per-sequence"], default="auto",
                    help="grouprl's packed passes: auto takes the varlen flash kernel on CUDA in bf16 "
                         "(one call per layer); per-sequence is one SDPA call per sequence, as on CPU")
    ap.add_argument("--smollm2", default="models/smollm2",
                    help="the SmolLM2-135M-Instruct folder for smollm2-* workloads (scripts/fetch_smollm2.py)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="auto: cuda where available; the gpu-* workloads are the default there")
    ap.add_argument("--model-config", help="a config.json (any Llama/Qwen2 shape) replacing the gpu-* "
                    "workloads' SmolLM2 shape; only its architecture is read, weights are random")
    ap.add_argument("--fp32", action="store_true", help="run bf16 workloads in fp32 (a smoke run on a CPU "
                    "without native bf16)")
    ap.add_argument("--worker", choices=["grouprl", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.generation_compile:
        os.environ["VS_TRL_GENERATION_COMPILE"] = args.generation_compile  # the workers inherit it
    os.environ["VS_TRL_PACKED_ATTENTION"] = args.packed_attention
    if args.memory_snapshot:
        os.environ["VS_TRL_MEMORY_SNAPSHOT"] = str(Path(args.memory_snapshot).resolve())
    if args.micro_batch is not None:
        WORKLOADS.update({k: replace(w, micro_batch=args.micro_batch) for k, w in WORKLOADS.items()})
    if args.fp32:
        WORKLOADS.update({k: replace(w, bf16=False) for k, w in WORKLOADS.items()})
    if args.worker:
        w = WORKLOADS[args.workload[0]]
        fn = worker_grouprl if args.worker == "grouprl" else worker_trl
        Path(args.out).write_text(json.dumps(fn(w, args.model_dir, args.steps, args.threads, args.device)))
        return
    if args.list:
        for w in WORKLOADS.values():
            print(w.name, asdict(w))
        return
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device here")
    names = args.workload or (DEFAULT_GPU if args.device == "cuda" else DEFAULT)
    for n in names:
        if n not in WORKLOADS:
            sys.exit(f"--workload {n!r} is unknown: choose from {', '.join(WORKLOADS)}")
    if args.steps < 4:
        sys.exit(f"--steps {args.steps}: medians use steps 3.., so run at least 4 steps")

    import transformers

    from grouprl.precision import native_bf16
    from grouprl.tasks.testing import save_tiny_model

    native, why = native_bf16(torch.device(args.device))
    for n in [n for n in names if WORKLOADS[n].bf16 and not native]:
        print(f"skipping {n}: {why}; bf16 would not be a fair comparison here", flush=True)
        names.remove(n)
    if any(WORKLOADS[n].gpu for n in names) and not (Path(args.smollm2) / "tokenizer_config.json").is_file():
        sys.exit(f"--smollm2 {args.smollm2}: no tokenizer there (the gpu-* workloads use SmolLM2's); run "
                 f"python scripts/fetch_smollm2.py {args.smollm2} first, or name another folder")
    if any(WORKLOADS[n].size == "smollm2" for n in names) and not (Path(args.smollm2) / "config.json").is_file():
        sys.exit(f"--smollm2 {args.smollm2}: no converted model there; run "
                 f"python scripts/fetch_smollm2.py {args.smollm2} first")

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    sides = [args.only] if args.only else ["grouprl", "trl"]
    if "trl" in sides:
        try:
            import trl
        except ImportError:
            sys.exit("TRL is not installed: pip install -e '.[bench]' (or --only grouprl)")
        versions["trl"] = trl.__version__
    if args.device == "cuda":
        versions["gpu"] = torch.cuda.get_device_name(0)
        # torch reads it once: set, SDPA does not try cuDNN's attention first on sm90/sm100, whose
        # execution plan is built anew for every new shape (batch, key length) -- every decode step
        # of an attention over the whole cache, as transformers' generate runs it
        versions["TORCH_CUDNN_SDPA_DEPRIORITIZED"] = os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "")
    print(f"versions: {versions}, threads={args.threads}, cpus={os.cpu_count()}, device={args.device}, "
          f"packed attention={args.packed_attention}", flush=True)
    peak = {"fp32": 0.0, "bf16": 0.0}

    def wait(device: str) -> float:  # a CPU run waits for an idle CPU; a GPU run does not
        return wait_idle(args.max_load, args.idle_timeout) if device == "cpu" else os.getloadavg()[0]

    def measure_peak() -> None:
        """The best of every measurement so far: a slow reading means another process held the machine."""
        load = wait(args.device)
        got = matmul_peak_cuda() if args.device == "cuda" else matmul_peak(args.threads)
        for k, v in got.items():
            peak[k] = max(peak[k], v)
        where = torch.cuda.get_device_name(0) if args.device == "cuda" else f"{args.threads} threads"
        print(f"matmul peak ({where}): fp32 {peak['fp32'] / 1e12:.3f} TFLOP/s, "
              f"bf16 {peak['bf16'] / 1e12:.3f} TFLOP/s (best so far; load {load:.2f})", flush=True)

    results = {"versions": versions, "peak": peak, "workloads": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            w = WORKLOADS[name]
            if w.gpu:
                shape = json.loads(Path(args.model_config).read_text()) if args.model_config else SHAPES[w.size]
                shape = {k: v for k, v in shape.items() if k not in ("architectures", "model_type", "torch_dtype",
                                                                     "dtype", "transformers_version")}
                model_dir = build_shape_model(Path(tmp) / w.name, shape, str(Path(args.smollm2).resolve()),
                                              args.device)
            elif w.size == "smollm2":
                model_dir = str(Path(args.smollm2).resolve())
            elif (Path(tmp) / w.size).exists():
                model_dir = str(Path(tmp) / w.size)
            else:
                model_dir = str(save_tiny_model(Path(tmp) / w.size, w.size, seed=0))
            measure_peak()
            runs: dict[str, list[dict]] = {s: [] for s in sides}
            loads = []
            for r in range(args.rounds):
                for side in sides if r % 2 == 0 else sides[::-1]:
                    loads.append(wait(args.device))
                    runs[side].append(run_side(side, w, model_dir, args.steps, args.threads, args.device))
                    print(f"  {name} round {r + 1} {side}: "
                          f"{statistics.median(runs[side][-1]['times'][2:]):.3f} s/step "
                          f"(load {loads[-1]:.2f})", flush=True)
            measure_peak()
            res = {s: summarize(v) for s, v in runs.items()}
            n_prompt = prompt_tokens(w, model_dir)
            for s, v in res.items():
                T = w.max_tokens if w.fixed else v["length_mean"]
                flops = model_flops(model_dir, n_prompt, [T] * (8 * w.prompts), w.beta, group_size=8)
                v["mfu"] = flops / v["s_per_step"] / peak["bf16" if w.bf16 else "fp32"]
            res["max_load"] = max(loads)
            res["peak"] = dict(peak)
            results["workloads"][name] = res
            print(report(name, res, sides), flush=True)
            if args.json:  # after every workload: a run cut off by a time limit keeps the ones it finished
                Path(args.json).write_text(json.dumps(results, indent=1))
    if len(sides) == 2 and len(names) == 1:
        g, t = results["workloads"][names[0]]["grouprl"], results["workloads"][names[0]]["trl"]
        mem = "peak_cuda_mib" if "peak_cuda_mib" in g else "peak_rss_mib"
        print(f"ratio_steps_per_s={t['s_per_step'] / g['s_per_step']:.2f} "
              f"ratio_{mem.removesuffix('_mib')}={g[mem] / t[mem]:.2f}")


def prompt_tokens(w: Workload, model_dir: str) -> float:
    """Mean prompt length in tokens of the workload's rows (chat prompts through the chat template)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = make_rows(w.task)[:64]
    if w.task == "chat":
        lengths = [len(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]) for r in rows]
    else:
        lengths = [len(tok(r["prompt"])["input_ids"]) for r in rows]
    return statistics.mean(lengths)


def report(name: str, res: dict, sides: list[str]) -> str:
    lines = [f"== {name} (max load during runs {res['max_load']:.2f})"]
    for s in sides:
        v = res[s]
        total = sum(v["stages"].values()) or 1.0
        share = ", ".join(f"{k} {100 * x / total:.0f}%" for k, x in v["stages"].items())
        cuda = f"peak CUDA {v['peak_cuda_mib'] / 1024:.2f} GiB, " if "peak_cuda_mib" in v else ""
        lines.append(f"  {s:8s} {v['s_per_step']:.3f} s/step (runs {', '.join(f'{x:.3f}' for x in v['runs'])}), "
                     f"{cuda}peak RSS {v['peak_rss_mib']:.0f} MiB, MFU {100 * v['mfu']:.1f}%, "
                     f"mean length {v['length_mean']:.1f}; {share}")
        for k in ("compile_failed", "graphs_failed"):
            if k in v:
                lines.append(f"    decode {k.replace('_', ' ')}: {v[k]}")
    if len(sides) == 2:
        g, t = res["grouprl"], res["trl"]
        mem, label = (("peak_cuda_mib", "peak CUDA memory") if "peak_cuda_mib" in g else ("peak_rss_mib", "peak RSS"))
        lines.append(f"  grouprl/TRL: {t['s_per_step'] / g['s_per_step']:.2f}x steps/s, "
                     f"{g[mem] / t[mem]:.2f}x {label}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
