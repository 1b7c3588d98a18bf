"""Where a CUDA run's peak allocated memory went: the live allocations at the peak of a memory
snapshot, grouped by the code that made them.

    python benchmarks/vs_trl.py --device cuda --memory-snapshot OUT ...   # writes OUT/<side>-<workload>.pickle
    python benchmarks/memory_peak.py OUT/grouprl-gpu-135m-256.pickle [--top 25] [--json F]

The snapshot is torch's (`torch.cuda.memory._record_memory_history`, then `_dump_snapshot`): every
allocation and free of the caching allocator with the Python stack that made it. This replays its
trace: allocated bytes go up at an `alloc` and down at the `free_requested` of the same block (the
count `torch.cuda.max_memory_allocated` keeps), and at the highest point the blocks still alive are
the peak's contents. Each is charged to a *site*: the innermost frame in this project's code
(grouprl/, benchmarks/) or, failing that, in transformers, TRL, PEFT or accelerate, or else the
innermost Python frame; the report lists the sites by bytes at the peak, with the stage a site's
stack passes through (the trainer's stage functions) and one sample stack.

Blocks allocated before the recording began appear only through their frees, which are ignored:
`vs_trl.py --memory-snapshot` records a side's last step only (a whole run's trace outgrows the
allocator's ring buffer) and writes, beside the pickle, the bytes allocated when it began (.json):
the weights, the optimizer state and whatever else lives across steps. The report adds them as one
row, so its peak is comparable with `torch.cuda.max_memory_allocated`. The file can be read on any
machine: it is a pickle of plain Python objects (load only snapshots you made).
"""

from __future__ import annotations

import argparse
import json
import pickle
from collections import defaultdict
from pathlib import Path

OWN = ("/grouprl/", "/benchmarks/")
LIBRARIES = ("/transformers/", "/trl/", "/peft/", "/accelerate/")
STAGES = ("generate", "update", "logprobs", "reference", "reward", "score", "train_step", "optimizer_step",
          "training_step", "_generate_and_score_completions", "compute_loss", "_get_per_token_logps_and_entropies")


def site_of(frames: list[dict]) -> str:
    """The innermost frame of this project's code, else of a training library, else the innermost
    Python frame (frames are innermost first, as torch records them)."""
    python = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    for group in (OWN, LIBRARIES):
        for f in python:
            if any(part in f["filename"] for part in group):
                return f"{_short(f['filename'])}:{f['line']} {f['name']}"
    if python:
        f = python[0]
        return f"{_short(f['filename'])}:{f['line']} {f['name']}"
    return "(no Python frame)"


def stage_of(frames: list[dict]) -> str:
    """The outermost frame whose function is one of the trainers' stages, or '-'."""
    for f in reversed(frames):
        if f.get("name") in STAGES:
            return f["name"]
    return "-"


def _short(path: str) -> str:
    for marker in ("site-packages/", "/src/", "/benchmarks/"):
        if marker in path:
            return ("benchmarks/" if marker == "/benchmarks/" else "") + path.split(marker, 1)[1]
    return path


def peak_contents(trace: list[dict]) -> dict:
    """Replay one device's trace; returns the peak bytes, the trace index where it was reached and the
    blocks alive there (addr -> entry)."""
    live: dict[int, dict] = {}
    total = peak = 0
    at = -1
    peak_live: dict[int, dict] = {}
    for i, e in enumerate(trace):
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > peak:
                peak, at = total, i
                peak_live = dict(live)
        elif action in ("free_requested", "free_completed"):
            freed = live.pop(e["addr"], None)  # free_completed of a block already requested: nothing left
            if freed is not None:
                total -= freed["size"]
    return {"peak_bytes": peak, "index": at, "events": len(trace), "live": peak_live}


def report(snapshot: dict, top: int = 25, before: int = 0) -> dict:
    """The peak of the snapshot's busiest device, `before` bytes (allocated when the recording
    began) included, and its contents by site."""
    traces = snapshot.get("device_traces") or []
    device = max(range(len(traces)), key=lambda d: len(traces[d]), default=None)
    if device is None or not traces[device]:
        raise SystemExit("this snapshot has no allocator trace: record with "
                         "torch.cuda.memory._record_memory_history() before the run (vs_trl.py --memory-snapshot)")
    got = peak_contents(traces[device])
    by_site: dict[str, dict] = defaultdict(lambda: {"bytes": 0, "blocks": 0, "stages": set(), "stack": None})
    for e in got["live"].values():
        frames = e.get("frames") or []
        s = by_site[site_of(frames)]
        s["bytes"] += e["size"]
        s["blocks"] += 1
        s["stages"].add(stage_of(frames))
        if s["stack"] is None:
            s["stack"] = [f"{_short(f['filename'])}:{f['line']} {f['name']}" for f in frames
                          if str(f.get("filename", "")).endswith(".py")][:8]
    sites = sorted(by_site.items(), key=lambda kv: -kv[1]["bytes"])
    last = traces[device][got["index"]] if got["index"] >= 0 else {}
    return {"device": device, "peak_gib": (before + got["peak_bytes"]) / 2**30, "before_gib": before / 2**30,
            "events": got["events"],
            "peak_event": got["index"], "peak_stage": stage_of(last.get("frames") or []),
            "peak_site": site_of(last.get("frames") or []),
            "sites": [{"site": k, "gib": v["bytes"] / 2**30, "blocks": v["blocks"], "stages": sorted(v["stages"]),
                       "stack": v["stack"]} for k, v in sites[:top]],
            "other_gib": sum(v["bytes"] for _, v in sites[top:]) / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("snapshot", help="a pickle from torch.cuda.memory._dump_snapshot")
    ap.add_argument("--top", type=int, default=25, help="sites listed (default 25)")
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args()
    with open(args.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    side = Path(args.snapshot).with_suffix(".json")
    before = json.loads(side.read_text())["allocated_before_bytes"] if side.exists() else 0
    r = report(snapshot, args.top, before)
    print(f"{Path(args.snapshot).name}: peak {r['peak_gib']:.3f} GiB allocated at event {r['peak_event']} of "
          f"{r['events']} (device {r['device']}), in {r['peak_stage']}, reached by {r['peak_site']}")
    print("| GiB at the peak | blocks | site | stages |\n|---|---|---|---|")
    if before:
        print(f"| {r['before_gib']:.3f} | | (allocated before the recorded step: weights, optimizer state) | |")
    for s in r["sites"]:
        print(f"| {s['gib']:.3f} | {s['blocks']} | {s['site']} | {', '.join(s['stages'])} |")
    if r["other_gib"]:
        print(f"| {r['other_gib']:.3f} | | (other sites) | |")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()
