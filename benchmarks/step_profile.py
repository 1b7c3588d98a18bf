"""Where one step of a short workload spends its time, stage by stage (benchmarks/README.md,
"Per-step overhead").

    python benchmarks/step_profile.py                       # tiny-32, 5 warm-up + 40 timed steps
    python benchmarks/step_profile.py --steps 60 --json out.json
    python benchmarks/step_profile.py --cprofile prof.out   # cProfile over the timed steps as well
    PYTHONPATH=/other/checkout/src python benchmarks/step_profile.py   # the same profile of another commit

It trains `benchmarks/vs_trl.py`'s workload (by default tiny-32: the tiny Qwen2, 2 prompts x G = 8,
32 tokens, beta 0.04, one thread count) through `Trainer.train()`, so what the loop does between
steps (the alarm check, the tracker call, the progress bar, the stop-signal check, the guard's
rollback snapshot) is timed as well as `train_step`'s stages. Each stage is timed by a wrapper
around the function that runs it; the step's own stages (`time/*`: generate, reward, logprobs,
update, sync_weights) come from the metrics the trainer returns. `other` is what no timer covers:
the loop iteration's wall time less the timed stages. Figures are medians over the timed steps,
in milliseconds.

Only public names and the loop's own objects are wrapped, looked up by name; a name an older
checkout lacks is skipped, so the same script profiles an older commit from its `src` (the
README's before/after table). With `--cprofile FILE` the timed steps also run under cProfile
(which slows Python-heavy stages) and the top functions by own and cumulative time are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import functools
import importlib
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import vs_trl  # noqa: E402  (the workloads, rows and reward functions: identical work)


ORDER = ["iteration", "step", "generate", "  engine.generate", "reward", "  score (reward functions)", "advantages",
         "logprobs", "update", "sync_weights"]  # the table's first rows, in the step's order


class Clock:
    """Wall and CPU seconds per (step, stage) from wrappers; a stage run twice in a step adds up.
    CPU time is this thread's (`time.thread_time`): with one torch thread every op runs on it, and
    unlike wall time it does not count the time another process held the core."""

    def __init__(self):
        self.step = 0
        self.per_step: dict[int, dict[str, tuple[float, float]]] = {}

    def add(self, key: str, wall: float, cpu: float) -> None:
        row = self.per_step.setdefault(self.step, {})
        w, c = row.get(key, (0.0, 0.0))
        row[key] = (w + wall, c + cpu)

    @contextlib.contextmanager
    def timed(self, key: str):
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.add(key, time.perf_counter() - w0, time.thread_time() - c0)

    def wrap(self, owner, name: str, key: str) -> bool:
        fn = getattr(owner, name, None)
        if fn is None:
            return False

        @functools.wraps(fn)
        def timed(*a, **k):
            with self.timed(key):
                return fn(*a, **k)

        setattr(owner, name, timed)
        return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="tiny-32", help="a CPU workload of vs_trl.py (default tiny-32)")
    ap.add_argument("--steps", type=int, default=40, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="steps run first, not timed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cprofile", help="also run cProfile over the timed steps and write its stats here")
    ap.add_argument("--top", type=int, default=35, help="functions printed from cProfile")
    ap.add_argument("--json", help="write the per-step figures here")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="config settings over the workload's (YAML values: padding_free=false)")
    ap.add_argument("--table", nargs="+", metavar="LABEL=GLOB",
                    help="no run: a markdown table of the --json files of each label (the median over the files "
                         "of each file's median), wall and CPU ms per stage")
    args = ap.parse_args()
    if args.table:
        return print_table(args.table)

    import torch

    import grouprl
    import grouprl.trainer as trainer_module
    from datasets import Dataset
    from grouprl.config import TrainConfig
    from grouprl.trainer import Trainer

    try:
        from grouprl.tasks.testing import save_tiny_model
    except ImportError:  # checkouts before the rename
        from grouprl.tasks.tiny import save_tiny_model

    w = vs_trl.WORKLOADS[args.workload]
    torch.set_num_threads(args.threads)
    clock = Clock()
    prof = cProfile.Profile() if args.cprofile else None
    total = args.warmup + args.steps

    # the trainer's own stages (`time/*`): its Timings class, wherever this checkout keeps it
    timings_cls = next(getattr(m, "Timings") for m in (_module("grouprl.timings"), _module("grouprl.stats"),
                                                      trainer_module) if m is not None and hasattr(m, "Timings"))

    @contextlib.contextmanager
    def stage(self, name):
        w0 = time.perf_counter()
        with clock.timed(name):
            try:
                yield
            finally:
                self.add(name, time.perf_counter() - w0)

    timings_cls.stage = stage

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(save_tiny_model(Path(tmp) / "model", w.size))
        names, weights = vs_trl.REWARDS[w.task]
        settings = dict(
            model=model_dir, train_data="<in memory>", reward_funcs=[getattr(f, "__name__", f) for f in names],
            reward_weights=weights, algorithm="grpo", beta=w.beta, num_generations=8,
            prompts_per_step=w.prompts, max_completion_length=w.max_tokens, temperature=1.0,
            learning_rate=w.lr, num_iterations=1, bf16=w.bf16, ignore_eos=w.fixed, max_steps=total,
            output_dir=str(Path(tmp) / "run"), progress=False, report_to=[], num_logged_samples=0,
            num_threads=args.threads, seed=0, reward_timeout_s=None, micro_batch_size=w.micro_batch,
            save_steps=0)
        settings.update({k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.set)})
        known = {f.name for f in dataclasses.fields(TrainConfig)}  # an older checkout lacks some settings
        cfg = TrainConfig(**{k: v for k, v in settings.items() if k in known})
        trainer = Trainer(cfg, train_dataset=Dataset.from_list(vs_trl.make_rows(w.task)),
                          reward_funcs=vs_trl.reward_funcs(w.task))

        # between the stages of train_step, and the loop around it (the names of every checkout)
        clock.wrap(trainer, "advantages", "advantages")
        guard = getattr(trainer, "guard", None)  # older checkouts: no run guard
        clock.wrap(guard, "check", "guard.check (health, audits)")
        clock.wrap(guard, "snapshot", "guard.snapshot")
        clock.wrap(guard, "respond", "guard.respond (alarms)")
        clock.wrap(trainer, "_log_samples", "log_samples")
        clock.wrap(trainer_module, "batch_metrics", "batch_metrics")
        clock.wrap(trainer.engine, "generate", "  engine.generate")
        clock.wrap(trainer, "score", "  score (reward functions)")
        for module, cls, name, key in [("runlog", "RunLogger", "log", "logger.log (trackers)"),
                                       ("logging", "RunLogger", "log", "logger.log (trackers)"),
                                       ("runlog", "Progress", "update", "progress.update"),
                                       ("logging", "Progress", "update", "progress.update"),
                                       ("signals", "StopSignals", "requested", "stop.requested (signals)")]:
            m = _module(f"grouprl.{module}")  # older checkouts: grouprl.logging, no signals.py
            if m is not None:
                clock.wrap(getattr(m, cls, None), name, key)
        save, step_fn = trainer.save, trainer.train_step
        marks: list[tuple[float, float]] = []  # (wall, cpu) at the start of each iteration

        def train_step():
            clock.step = trainer.step + 1
            if clock.step == args.warmup + 1 and prof is not None:
                prof.enable()
            marks.append((time.perf_counter(), time.thread_time()))
            return step_fn()

        def final_save():  # the loop's end: the last iteration ends here
            if prof is not None:
                prof.disable()
            marks.append((time.perf_counter(), time.thread_time()))
            clock.step = total + 1
            return save()

        trainer.train_step, trainer.save = train_step, final_save
        trainer.train()

    rows = []  # per timed step: stage -> (wall, cpu) seconds
    for i in range(args.warmup, total):
        (w0, c0), (w1, c1) = marks[i], marks[i + 1]
        rows.append({"iteration": (w1 - w0, c1 - c0), **clock.per_step.get(i + 1, {})})
    keys = list(dict.fromkeys(k for r in rows for k in r))
    # `other`: the iteration less the top-level stages (indented keys and `step` hold others)
    top = [k for k in keys if not k.startswith(" ") and k not in ("iteration", "step", "generate_engine")]
    for r in rows:
        r["other"] = tuple(r["iteration"][j] - sum(r.get(k, (0.0, 0.0))[j] for k in top) for j in (0, 1))
    keys.append("other")
    med = {k: tuple(1e3 * statistics.median(r.get(k, (0.0, 0.0))[j] for r in rows) for j in (0, 1)) for k in keys}
    print(f"grouprl {getattr(grouprl, '__version__', '?')} from {Path(grouprl.__file__).parent}, "
          f"torch {torch.__version__}, {args.threads} threads, workload {w.name}, "
          f"{args.steps} timed steps after {args.warmup}; load {os.getloadavg()[0]:.2f}")
    print(f"{'stage (ms, median of steps)':32s} {'wall':>8s} {'cpu':>8s} {'cpu min':>8s} {'cpu max':>8s}")
    for k in [k for k in ORDER if k in med] + [k for k in keys if k not in ORDER]:
        cpu = [1e3 * r.get(k, (0.0, 0.0))[1] for r in rows]
        print(f"{k:32s} {med[k][0]:8.2f} {med[k][1]:8.2f} {min(cpu):8.2f} {max(cpu):8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"workload": w.name, "threads": args.threads, "rows": rows,
                                               "median_ms": med, "src": str(Path(grouprl.__file__).parent)},
                                              indent=1))
    if prof is not None:
        prof.dump_stats(args.cprofile)
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(args.top)
        st.sort_stats("cumulative").print_stats(args.top)


def print_table(specs: list[str]) -> None:
    """Per stage and label: the median over runs of each run's median, CPU ms (wall ms)."""
    import glob

    labels, runs = [], {}
    for spec in specs:
        label, pattern = spec.split("=", 1)
        labels.append(label)
        runs[label] = [json.loads(Path(f).read_text())["median_ms"] for f in sorted(glob.glob(pattern))]
    keys = list(dict.fromkeys(k for k in ORDER + [k for label in labels for r in runs[label] for k in r]
                              if any(k in r for label in labels for r in runs[label])))
    print("| stage | " + " | ".join(f"{label} ({len(runs[label])} runs): CPU (wall) ms" for label in labels) + " |")
    print("|---|" + "---|" * len(labels))
    for k in keys:
        cells = []
        for label in labels:
            vals = [r[k] for r in runs[label] if k in r]
            cells.append(f"{statistics.median(v[1] for v in vals):.2f} ({statistics.median(v[0] for v in vals):.2f})"
                         if vals else "—")
        print(f"| {k.strip()} | " + " | ".join(cells) + " |")


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


if __name__ == "__main__":
    main()
