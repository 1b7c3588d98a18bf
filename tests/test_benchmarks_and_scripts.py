"""Every benchmark and script still runs: each answers --help, and each that can run here in
seconds runs once on a tiny configuration and prints its result. They use only public methods of
the trainer (a standing check in the repository's hooks), and these runs are what keeps them from
rotting when the trainer changes.

Not run here beyond --help, and why: async_rollouts.py, agentic_async.py, vllm_vs_builtin.py and
weight_transfer.py start vLLM (a minute each on this CPU; the vLLM paths they time are tested in
tests/rollout/); vs_trl.py runs its grouprl side only (TRL is the `bench` extra), on a GPU
workload's code path shrunk to a tiny config on CPU; learning_vs_trl.py runs its TRL arm only where
TRL is installed; smollm2_step.py
and fetch_smollm2.py need the SmolLM2 GGUF package from PyPI.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grouprl.tasks.testing import save_tiny_model

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted(p.relative_to(ROOT).as_posix() for d in ("benchmarks", "scripts") for p in (ROOT / d).glob("*.py"))
NO_ARGPARSE = {"scripts/sandbox_report.py"}  # runs as it is: its smoke run is below


def run(*args: str, timeout: float = 300) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src") + os.pathsep + str(ROOT)}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{args[0]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


# Each file is either run for real below or --help only, for the reason in the module docstring.
RUN = {"benchmarks/shared_prompt.py", "benchmarks/process_vs_outcome.py", "benchmarks/multiturn_continuation.py",
       "benchmarks/head_logprobs.py", "benchmarks/generation_memory.py", "benchmarks/long_completions.py",
       "benchmarks/run_health.py", "benchmarks/learning_vs_trl.py", "benchmarks/vs_trl.py", "benchmarks/ppo_vs_grpo.py",
       "benchmarks/step_profile.py", "benchmarks/distillation.py", "benchmarks/decode.py",
       "benchmarks/memory_peak.py", "benchmarks/update_launches.py", "benchmarks/packed_attention.py",
       "benchmarks/decode_launches.py", "benchmarks/crash_false_alarms.py", "benchmarks/math_reward.py",
       "benchmarks/check_every.py", "benchmarks/reward_workers.py",
       "scripts/build_default_policy.py",
       "scripts/build_tool_policy.py", "scripts/sandbox_report.py"}
HELP_ONLY = {"benchmarks/async_rollouts.py", "benchmarks/agentic_async.py", "benchmarks/vllm_vs_builtin.py",
             "benchmarks/weight_transfer.py",
             "benchmarks/smollm2_step.py", "scripts/fetch_smollm2.py"}


def test_every_benchmark_and_script_is_covered():
    """A new file under benchmarks/ or scripts/ fails here until it gets a smoke run or is listed
    as --help only; a run of a file that no longer exists fails too."""
    assert set(FILES) == RUN | HELP_ONLY and not RUN & HELP_ONLY
    this = Path(__file__).read_text()
    assert all(f'run("{path}"' in this for path in RUN)  # each RUN file has its run below


HELP_DRIVER = """
import contextlib, io, json, runpy, sys
out = {}
for path in sys.argv[1:]:
    sys.argv, buf, code = [path, "--help"], io.StringIO(), None
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code
    out[path] = [code, buf.getvalue()[:2000]]
print(json.dumps(out))
"""


def test_help():
    """Every file with an argparse interface answers --help (exit 0, a usage line). All in one process:
    a process per file spent most of its time importing torch and transformers again."""
    paths = [f for f in FILES if f not in NO_ARGPARSE]
    answers = json.loads(run("-c", HELP_DRIVER, *paths, timeout=300).strip().splitlines()[-1])
    bad = {p: a for p, a in answers.items() if a[0] not in (0, None) or "usage:" not in a[1]}
    assert set(answers) == set(paths) and not bad, bad


def test_ppo_vs_grpo_benchmark_memory_on_the_tiny_model_and_one_learning_run():
    out = run("benchmarks/ppo_vs_grpo.py", "memory", "--workload", "tiny", "--steps", "1")
    assert "| grpo |" in out and "| ppo |" in out and "separate critic" in out
    out = run("benchmarks/ppo_vs_grpo.py", "learning", "--arms", "ppo", "--seeds", "1", "--steps", "1")
    assert "| ppo | 1 |" in out


def test_shared_prompt_benchmark_one_round():
    out = run("benchmarks/shared_prompt.py", "--size", "tiny", "--prompts", "1", "--group", "2", "--prompt-len", "6",
              "--completion-len", "5", "--micro-batch", "2", "--repeats", "1", "--threads", "1")
    assert "share_prompt_forward=True" in out and "share_prompt_forward=False" in out
    assert "speed-up" in out


def test_process_vs_outcome_benchmark_one_step(tmp_path):
    out = run("benchmarks/process_vs_outcome.py", "--seeds", "0", "--steps", "1", "--eval-every", "1", "--arms",
              "process", "outcome", "--warmup-steps", "2", "--policy-dir", str(tmp_path / "policy"),
              "--out", str(tmp_path / "runs"), "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "p.png"))
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    assert [r["arm"] for r in results] == ["process", "outcome"]
    assert all([c["step"] for c in r["curve"]] == [0, 1] for r in results)
    assert (tmp_path / "p.png").stat().st_size > 0 and "process" in out
    out = run("benchmarks/process_vs_outcome.py", "--preflight-check", "--seeds", "0", "--steps", "1", "--arms",
              "process", "--policy-dir", str(tmp_path / "policy"), "--out", str(tmp_path / "runs"),
              "--json", str(tmp_path / "pf.json"))
    (check,) = json.loads((tmp_path / "pf.json").read_text())["preflight"]
    assert 0 <= check["predicted"] <= 1 and len(check["observed"]) == 1 and "predicted" in out


def test_distillation_benchmark_one_step(tmp_path):
    out = run("benchmarks/distillation.py", "--seeds", "0", "--steps", "1", "--eval-every", "1", "--teacher-steps",
              "1", "--teacher-dir", str(tmp_path / "teacher"), "--out", str(tmp_path / "runs"),
              "--json", str(tmp_path / "r.json"))
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    assert [r["arm"] for r in results] == ["grpo", "distill", "mixed"]
    assert all([c["step"] for c in r["curve"]] == [0, 1] for r in results)
    assert (tmp_path / "teacher" / "config.json").is_file() and "distill: gain/step" in out


def test_multiturn_continuation_benchmark_one_round():
    out = run("benchmarks/multiturn_continuation.py", "--rounds", "1")
    rounds = [line for line in out.splitlines() if line.startswith("round ")]
    assert len(rounds) == 2 and all(line.endswith("same tokens: True") for line in rounds)  # continuation is exact
    assert "median ratio continue/prefill" in out


def test_check_every_benchmark_one_round(tmp_path):
    """Two intervals and the eager loop on the tiny model, compiled: rows of several lengths, the
    same on every side."""
    out = run("benchmarks/check_every.py", "--rows", "16", "--tokens", "24", "--stop-share", "0.1", "--every", "1",
              "8", "--reps", "1", "--json", str(tmp_path / "e.json"))
    assert "same lengths on every side: True" in out
    result = json.loads((tmp_path / "e.json").read_text())
    assert set(result["sides"]) == {"every-1", "every-8", "eager-loop"} and result["compile"] is True
    assert 1 <= result["length_mean"] < result["length_max"] <= 24
    assert {(side["length_mean"], side["length_max"]) for side in result["sides"].values()} == {
        (result["length_mean"], result["length_max"])}  # each side's, the same here


def test_multiturn_benchmark_refuses_graphs_without_cuda():
    """`--compare graphs` (gpu_check.sh's multiturn part) times CUDA graphs: on CPU both sides would
    be the same eager loop, so it stops with the reason instead of printing a ratio of 1."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src") + os.pathsep + str(ROOT)}
    proc = subprocess.run([sys.executable, "benchmarks/multiturn_continuation.py", "--compare", "graphs"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "needs --device cuda" in proc.stderr


def test_build_default_policy_and_its_rl_check(tmp_path):
    out = run("scripts/build_default_policy.py", "--out", str(tmp_path / "p"), "--steps", "2", "--log-every", "1",
              "--check-rl", "--rl-steps", "1")
    assert (tmp_path / "p" / "config.json").is_file() and "[rl] before" in out and "saved to" in out


def test_build_tool_policy_and_its_rl_check(tmp_path):
    out = run("scripts/build_tool_policy.py", "--out", str(tmp_path / "p"), "--steps", "2", "--log-every", "1",
              "--check-rl", "--rl-steps", "1", "--rl-out", str(tmp_path / "run"))
    assert (tmp_path / "p" / "config.json").is_file() and "[rl]" in out


def test_math_reward_benchmark():
    out = run("benchmarks/math_reward.py", "--prompts", "2", "--group", "4", "--reps", "1")
    assert out.startswith("8 completions: parsed afresh") and "remembered" in out


def test_reward_workers_benchmark_one_round():
    out = run("benchmarks/reward_workers.py", "--prompts", "2", "--group", "4", "--workers", "1", "--rounds", "1")
    lines = out.strip().splitlines()
    assert lines[0].startswith("8 completions (2 x 4)") and "in the trainer's process" in lines[1]
    assert "1 worker(s) (started in" in lines[2]  # its totals equal the trainer's: the script checks


def test_sandbox_report():
    out = run("scripts/sandbox_report.py")
    rows = [line for line in out.splitlines() if line.startswith("| ") and "hostile program" not in line]
    assert len(rows) >= 5
    assert "the host listener saw no connection" in out


@pytest.mark.parametrize("bonus", [[], ["--entropy-bonus"]])
def test_head_logprobs_benchmark_one_round(bonus):
    out = run("benchmarks/head_logprobs.py", "--lengths", "8", "--rows", "2", "--layers", "1", "--vocab", "64",
              "--hidden", "18", "--repeats", "1", "--rounds", "1", "--threads", "1", *bonus)
    row = [line for line in out.splitlines() if line.startswith("| 8 |")]
    assert len(row) == 1 and row[0].count("|") == 6
    assert ("entropy bonus" in out) == bool(bonus)


def test_generation_memory_benchmark_one_call_per_mode(tmp_path):
    model = str(save_tiny_model(tmp_path / "tiny"))
    args = ("--model", model, "--rows", "4", "--group", "2", "--max-new-tokens", "8")
    every = json.loads(run("benchmarks/generation_memory.py", *args, "--ignore-eos").splitlines()[-1])
    assert every["tokens"] == 4 * 8 and every["peak_rss_mib"] >= every["rss_before_mib"] > 0
    early = json.loads(run("benchmarks/generation_memory.py", *args, "--stop-early").splitlines()[-1])
    assert early["mode"] == "stop_early" and 4 <= early["tokens"] <= 4 * 8


def test_long_completions_benchmark_update_only_and_a_real_step(tmp_path):
    """Both grouprl modes on the tiny model, 4 completions of 8 tokens, the second padded: each
    prints one JSON line per length with the step's stages and its peak RSS."""
    model = str(save_tiny_model(tmp_path / "tiny"))
    args = ("--model", model, "--rows", "4", "--lengths", "8", "--train-data", "builtin:arithmetic/train",
            "--threads", "1")
    update = json.loads(run("benchmarks/long_completions.py", *args, "--update-only").splitlines()[-1])
    assert update["tokens"] == 32 and update["update_only"] and update["peak_rss_gib"] > 0
    assert set(update["stages"]) >= {"update", "logprobs"}  # beta 0.04: the reference pass
    step = json.loads(run("benchmarks/long_completions.py", *args, "--set", "padding_free=false").splitlines()[-1])
    assert step["set"] == {"padding_free": False} and {"generate", "update", "step"} <= set(step["stages"])


def test_run_health_benchmark_the_tiny_hack_one_seed(tmp_path):
    """The seconds-long arm: the gameable reward on the tiny policy is flagged, its line and the
    table say so."""
    out = run("benchmarks/run_health.py", "--arms", "hack-tiny", "--seeds", "1", "--steps", "8",
              "--out", str(tmp_path / "r.jsonl"))
    line = json.loads((tmp_path / "r.jsonl").read_text().splitlines()[0])
    assert line["arm"] == "hack-tiny" and line["steps"] == 8 and line["first_alarm_step"] is not None
    assert {a["kind"] for a in line["alarms"]} & {"audit_divergence", "component_dominance"}
    assert "| hack-tiny | 1 | 1 of 1 |" in out


def test_crash_false_alarms_benchmark_a_few_runs():
    out = run("benchmarks/crash_false_alarms.py", "--prompts", "1", "2", "--runs", "3", "--steps", "6")
    rows = [line for line in out.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert len(rows) == 2 and all(line.startswith(f"| {b} | 3 | ") for b, line in zip((1, 2), rows))


def test_run_health_table_precision_and_recall_from_a_jsonl(tmp_path):
    """--table trains nothing: from a jsonl written here, the newest line of each arm and seed, and
    per alarm TP / FN / FP / precision / recall by the rule in run_health.py's docstring (held-out
    accuracy fell: >= 5 points below the sound reference's median last eval, 5 points exactly
    included; an arm without a reference counts every seed)."""
    def line(arm, seed, after, *kinds):
        return {"arm": arm, "seed": seed, "eval_after": after,
                "alarms": [{"kind": k, "function": None, "step": 9, "statistic": 1.0} for k in kinds]}

    rows = [line("hack-tiny", 1, None),  # replaced by the rerun below
            line("sound-tool", 1, 0.80), line("sound-tool", 2, 0.90, "length_hacking"),  # a false alarm
            line("sound-tool", 3, 0.85),  # sound median 0.85: fell means <= 0.80
            line("hack-length-tool", 1, 0.50, "length_hacking", "eval_divergence"),  # caught twice
            line("hack-length-tool", 2, 0.80),  # fell by exactly 5 points, missed by both
            line("hack-length-tool", 3, 0.84, "length_hacking"),  # did not fall: 'other'
            line("hack-format-tool", 1, 0.60, "eval_divergence"),  # fell; audit_divergence missed
            line("hack-tiny", 1, None, "audit_divergence", "template_collapse")]  # no eval: positive
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = run("benchmarks/run_health.py", "--table", str(tmp_path / "r.jsonl"))
    assert out.startswith("8 runs (the newest of each arm and seed; 1 older lines replaced)")
    for row in ("| audit_divergence | 1 | 1 | 0 | 1.00 | 0.50 | 0 |",
                "| eval_divergence | 2 | 1 | 0 | 1.00 | 0.67 | 0 |",
                "| component_dominance | 0 | 1 | 0 | - | 0.00 | 0 |",
                "| template_collapse | 0 | 0 | 0 | - | - | 1 |",
                "| length_hacking | 1 | 1 | 1 | 0.50 | 0.50 | 1 |",
                "| reward_crash | 0 | 0 | 0 | - | - | 0 |",
                "| kl_spike | 0 | 0 | 0 | - | - | 0 |",
                "| sound-tool | none (sound) | 3 (1, 2, 3) | 85.0 | - | - | 1 of 3 | length_hacking (1) |",
                "| hack-length-tool | length_hacking, eval_divergence | 3 (1, 2, 3) | 80.0 | 2 of 3 | 1 of 2 | "
                "2 of 3 | eval_divergence (1), length_hacking (2) |",
                "| hack-format-tool | audit_divergence, eval_divergence | 1 (1) | 60.0 | 1 of 1 | 1 of 1 | 1 of 1 | "
                "eval_divergence (1) |",
                "| hack-tiny | audit_divergence, component_dominance | 1 (1) | - | 1 of 1 (by construction) | 1 of 1 | "
                "1 of 1 | audit_divergence (1), template_collapse (1) |"):
        assert row in out, row
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 9  # read, not appended to


def test_learning_vs_trl_benchmark_one_step_grouprl(tmp_path):
    """One grouprl step on the embedded task, scored by the benchmark's one evaluator: the starting
    model's 24.5 % (the README's figure) and a line for the arm. Runs without TRL installed."""
    out = run("benchmarks/learning_vs_trl.py", "--task", "embedded", "--arms", "grouprl", "--seeds", "1",
              "--steps", "1", "--out", str(tmp_path / "r.jsonl"), timeout=600)
    lines = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [r["arm"] for r in lines] == ["grouprl"] and lines[0]["steps"] == 1
    assert lines[0]["eval_before"] == 0.245 and 0 <= lines[0]["eval_after"] <= 1
    assert "held-out accuracy of the starting model: 0.245" in out and "| grouprl | 1 |" in out


def test_learning_vs_trl_benchmark_one_step_trl(tmp_path):
    """The TRL side, one step under the same evaluator. TRL is the `bench` extra, which `make test`
    does not install (CI time); this runs where it is installed."""
    pytest.importorskip("trl", reason="TRL is the bench extra: pip install -e '.[bench]'")
    out = run("benchmarks/learning_vs_trl.py", "--task", "embedded", "--arms", "trl", "--seeds", "1",
              "--steps", "1", "--out", str(tmp_path / "r.jsonl"), timeout=600)
    lines = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [r["arm"] for r in lines] == ["trl"] and lines[0]["steps"] == 1
    assert lines[0]["eval_before"] == 0.245 and 0 <= lines[0]["eval_after"] <= 1
    assert "| trl | 1 |" in out


def test_vs_trl_gpu_workload_path_on_a_tiny_config(tmp_path):
    """The GPU workloads' code path (a random-init model built from a config with a named tokenizer,
    the variety reward, the defaults grouprl picks for the device) run on CPU at a tiny size, grouprl
    side only: 4 steps of 32 fixed-length completions, the report and the JSON it writes."""
    tok = save_tiny_model(tmp_path / "tok", "tiny")
    config = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=64, vocab_size=104, tie_word_embeddings=True, max_position_embeddings=512)
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = run("benchmarks/vs_trl.py", "--device", "cpu", "--workload", "gpu-135m-256", "--only", "grouprl",
              "--model-config", str(tmp_path / "config.json"), "--smollm2", str(tok), "--fp32", "--steps", "4",
              "--rounds", "1", "--max-load", "1000", "--json", str(tmp_path / "r.json"), timeout=600)
    res = json.loads((tmp_path / "r.json").read_text())["workloads"]["gpu-135m-256"]["grouprl"]
    assert res["length_mean"] == 256.0 and len(res["runs"]) == 1 and 0 < res["mfu"] < 1
    assert "== gpu-135m-256" in out and "device=cpu" in out


def test_packed_attention_times_both_paths_and_names_the_pick(tmp_path):
    """Two shapes, one on each side of MASKED_CALL_WORK: both paths timed, the pick as the rule says."""
    run("benchmarks/packed_attention.py", "--shape", "4,4,32,2,8,7,3", "--shape", "9,3,64,2,8,20,64", "--reps", "2",
        "--rounds", "1", "--threads", "1", "--json", str(tmp_path / "rows.json"))
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["picked"] for r in rows] == ["masked", "per_segment"]
    assert [(r["tokens"], r["segments"]) for r in rows] == [(62, 18), (1064, 18)]
    assert all(r["per_segment_ms"] > 0 and r["masked_ms"] > 0 for r in rows)


def test_update_launches_counts_one_varlen_op_per_layer_and_pass_direction(tmp_path):
    """grouprl's side on a one-layer model: 32 completions in one pass (micro_batch_size 32) run the
    varlen stand-in three times (forward, checkpointed recompute, backward), in two 16-row passes six
    times, and the two passes dispatch more ops in all."""
    tok = save_tiny_model(tmp_path / "tok", "tiny")
    config = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=64, vocab_size=104, tie_word_embeddings=True, max_position_embeddings=512)
    (tmp_path / "config.json").write_text(json.dumps(config))
    counts = {}
    for rows in (32, 16):
        out = run("benchmarks/update_launches.py", "--sides", "grouprl", "--smollm2", str(tok), "--tokens", "4",
                  "--model-config", str(tmp_path / "config.json"), "--fp32", "--micro-batch", str(rows),
                  "--json", str(tmp_path / f"{rows}.json"), timeout=600)
        counts[rows] = json.loads((tmp_path / f"{rows}.json").read_text())["grouprl"]
        assert "| grouprl |" in out
    one = "varlen attention (one kernel on a GPU)"
    assert counts[32]["by_op"][one] == 3 and counts[16]["by_op"][one] == 6
    assert counts[16]["ops"] > counts[32]["ops"] > counts[32]["views"] > 0


def test_decode_launches_counts_the_layers_once_each_and_rms_norm_as_one(tmp_path):
    """The 135M shape on meta: a step is its ops outside the layers plus 30 layers' worth; each layer
    has its two RMSNorms as one kernel each (none of their six CPU ops is counted), its four
    matmuls and its two cache writes; a greedy step draws with none of the sampling ops."""
    out = run("benchmarks/decode_launches.py", "--shapes", "smollm2-135m-shape", "--json", str(tmp_path / "d.json"))
    sampled, greedy = json.loads((tmp_path / "d.json").read_text())
    assert "| smollm2-135m-shape | sampled |" in out and not sampled["greedy"] and greedy["greedy"]
    for row in (sampled, greedy):
        assert row["per_step"] == row["outside"] + 30 * row["per_layer"] == row["outside"] + 30 * sum(
            row["layer_ops"].values())
        layer = row["layer_ops"]
        assert layer["rms_norm"] == 2 and layer["mm"] == 4 and layer["index_copy_"] == 2
        assert not {"pow", "rsqrt", "mean", "view", "transpose"} & set(layer)
    assert {"topk", "sort", "searchsorted", "cumsum"} <= set(sampled["outside_ops"])
    assert not {"topk", "sort", "searchsorted"} & set(greedy["outside_ops"]) and greedy["outside"] < sampled["outside"]


def test_step_profile_times_every_stage_and_tabulates_runs(tmp_path):
    """Two timed steps of tiny-32 through Trainer.train(): each row holds the trainer's stages and
    the loop's calls between them, as (wall, CPU) pairs; --table reads the files back by label."""
    run("benchmarks/step_profile.py", "--steps", "2", "--warmup", "1", "--threads", "1",
        "--json", str(tmp_path / "a.json"), timeout=600)
    res = json.loads((tmp_path / "a.json").read_text())
    assert len(res["rows"]) == 2 and res["threads"] == 1
    stages = {"iteration", "step", "generate", "  engine.generate", "reward", "logprobs", "update", "sync_weights",
              "guard.check (health, audits)", "logger.log (trackers)", "stop.requested (signals)", "other"}
    assert all(stages <= set(row) and all(len(v) == 2 for v in row.values()) for row in res["rows"])
    table = run("benchmarks/step_profile.py", "--table", f"x={tmp_path / 'a.json'}")
    assert "| stage | x (1 runs): CPU (wall) ms |" in table and "| update |" in table


def test_decode_benchmark_reports_eager_and_compiled_ms_per_token(tmp_path):
    """One cell of benchmarks/decode.py (tiny, 8 rows): both sides timed, the compile time of the
    model's first cell reported apart, the table printed. The figures are a difference of two timed
    calls (T tokens less 1), which at 6 tokens and one repetition on a busy machine can come out below
    0: they are checked to be numbers, not to have a sign."""
    out = run("benchmarks/decode.py", "--models", "tiny", "--rows", "8", "--prompt", "16", "--tokens", "6",
              "--reps", "1", "--json", str(tmp_path / "d.json"), timeout=900)
    (cell,) = json.loads((tmp_path / "d.json").read_text())
    assert cell["model"] == "tiny" and cell["rows"] == 8 and cell["prompt"] == 16
    assert all(math.isfinite(cell[k]) for k in ("eager_ms", "compiled_ms", "compile_s"))
    assert cell["compile_failed"] is None
    assert "| tiny | fp32 | 8 | 16 |" in out
    run("benchmarks/decode.py", "--models", "tiny", "--rows", "8", "--prompt", "16", "--tokens", "6", "--reps", "1",
        "--no-compile", "--json", str(tmp_path / "e.json"), timeout=300)
    (eager_only,) = json.loads((tmp_path / "e.json").read_text())  # --no-compile: no compiled side, no compile
    assert math.isfinite(eager_only["eager_ms"]) and "compiled_ms" not in eager_only and "compile_s" not in eager_only


def test_memory_peak_finds_the_blocks_alive_at_the_highest_point_by_site(tmp_path):
    """A hand-made allocator trace (torch's snapshot format): the peak is the highest running sum of
    allocations less requested frees (a later free_completed of the same block subtracts nothing),
    its contents are the blocks alive there, charged to their innermost grouprl frame (else the
    innermost Python frame), and the bytes allocated before the recording are added from the .json
    beside the pickle."""
    import pickle

    torch_f = {"filename": "/x/site-packages/torch/nn/functional.py", "line": 7, "name": "softmax"}
    update = {"filename": "/x/src/grouprl/update.py", "line": 9, "name": "update"}
    generate = {"filename": "/x/src/grouprl/trainer.py", "line": 3, "name": "generate"}
    trace = [
        {"action": "alloc", "addr": 1, "size": 300, "frames": [torch_f, update]},       # 300
        {"action": "alloc", "addr": 2, "size": 500, "frames": [generate]},              # 800
        {"action": "free_requested", "addr": 2, "size": 500, "frames": []},             # 300
        {"action": "free_completed", "addr": 2, "size": 500, "frames": []},             # 300, not -200
        {"action": "alloc", "addr": 3, "size": 600, "frames": [update]},                # 900
        {"action": "alloc", "addr": 4, "size": 250, "frames": [torch_f]},               # 1150: the peak
        {"action": "free_requested", "addr": 1, "size": 300, "frames": []},             # 850
        {"action": "alloc", "addr": 5, "size": 100, "frames": [update]},                # 950
    ]
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[], trace]}))
    (tmp_path / "s.json").write_text(json.dumps({"allocated_before_bytes": 2**30}))
    out = run("benchmarks/memory_peak.py", str(path), "--json", str(tmp_path / "r.json"))
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["device"] == 1 and r["peak_event"] == 5 and r["events"] == len(trace)
    assert round(r["peak_gib"] * 2**30) == 2**30 + 1150 and r["before_gib"] == 1.0
    sites = {x["site"]: (x["blocks"], round(x["gib"] * 2**30), x["stages"]) for x in r["sites"]}
    assert sites == {"grouprl/update.py:9 update": (2, 900, ["update"]),
                     "torch/nn/functional.py:7 softmax": (1, 250, ["-"])}
    assert r["peak_site"] == "torch/nn/functional.py:7 softmax"
    assert "| 1.000 | | (allocated before the recorded step" in out


def test_vs_trl_reports_why_the_decode_step_fell_back(monkeypatch):
    """A compile or a graph capture that failed is in the grouprl side's result and its report line
    (grouprl's one warning is dropped by the log filters callers use; an H100 run lost it so)."""
    import importlib.util

    from grouprl.rollout import compiled_decode as cd

    spec = importlib.util.spec_from_file_location("vs_trl", ROOT / "benchmarks" / "vs_trl.py")
    vs_trl = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "vs_trl", vs_trl)  # its dataclasses look their module up
    spec.loader.exec_module(vs_trl)
    monkeypatch.setattr(cd, "_FAILED", {})
    why = "RuntimeError: operation not permitted when stream is capturing"
    monkeypatch.setattr(cd, "_GRAPHS_FAILED", {"cuda": why})
    run_ = {"times": [3.0, 2.0, 1.0], "stages": [{"generate": 1.0}] * 3, "lengths": [8] * 3, "peak_rss_mib": 1.0,
            **vs_trl.decode_fallbacks()}
    side = {**vs_trl.summarize([run_]), "mfu": 0.01}
    assert side["graphs_failed"] == {"cuda": why}
    assert "compile_failed" not in side
    text = vs_trl.report("w", {"max_load": 0.1, "grouprl": side}, ["grouprl"])
    assert f"decode graphs failed: {{'cuda': '{why}'}}" in text
