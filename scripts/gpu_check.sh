#!/usr/bin/env bash
# The CUDA checks in one command, on a machine with no network (benchmarks/README.md, "On a GPU"):
#   bash scripts/gpu_check.sh [OUT_DIR]
# Needs, beside the checkout: the wheels the machine lacks in .whl/ (the pip download line in
# benchmarks/README.md) and SmolLM2's tokenizer in models/smollm2 (scripts/fetch_smollm2.py; only
# the tokenizer files are read: tokenizer.json, tokenizer_config.json, chat_template.jinja). The
# folder also holds the 517 MB weights, too large to travel: copy those three files and config.json
# into a small folder that goes with the checkout, and set TOKENIZER to it.
# Parts, run in the order PARTS names (default: all of these, in this order), each
# under its own time limit in seconds so that one that hangs cannot starve the rest:
#   bench    benchmarks/vs_trl.py's GPU workloads (WORKLOADS), each side in its own process (BENCH_S)
#   tests    the suite, a line per test, each failure's traceback in failures.log, and the
#            benchmark smoke runs (tests/test_benchmarks_and_scripts.py) beside it on 4 workers (TESTS_S)
#   eager    the decode step eager and replayed as graphs, no compile, 64 tokens (EAGER_S)
#   widths   256-token graphed calls (several captures a call) at width buckets of 32 and 128
#   compiled each model's compiled step (DECODE_MODELS, DECODE_S each; qwen3-0.6b-shape also times
#            the generic path, the model's own forward, which Qwen3 models took until 2026-11-27)
#   memory   both sides' memory at 135M, recorded and broken down by code site (MEM_S)
#   mb       grouprl in 16-row passes at 135M (MB_S);  ab  per-sequence attention at 135M (AB_S)
#   cudnn    cuDNN's attention deprioritized against not (CUDNN_S, BENCH_S)
#   multiturn the embedded tool task's multi-turn rollouts, the eager step replayed as graphs against
#            launched kernel by kernel (MT_S); such calls took the plain eager loop until 2026-11-27
#   every    how often the slot loop should read its rows' finished flags on CUDA (EVERY_S)
#   rewards  the reward stage in 4, 8 and 15 worker processes on the machine's 16 cores, 512 completions
#            with LaTeX answers (benchmarks/reward_workers.py; REWARDS_S, ~60 s)
# What each took on one H100 (eighteenth session unless named): setup ~20 s; compiled, both models,
# 250 s (135M 125 s, its first compiled call 122 s; 1.7B 60 s); multiturn ~15 s; bench at 1.7B, both
# sides, ~170 s (at 135M, eleventh session, 150 s); the suite, 11 workers beside 4 for
# tests/test_benchmarks_and_scripts.py, one torch thread each, to its end in 257 s; every 75 s;
# eager, both models, 56 s, and widths ~110 s (tenth and eleventh). A lent machine has 15 minutes in
# all (each start ~40 s included) and 10 a call: put the most wanted first. Measured so far: the
# compiled step on both shapes, multi-turn graphed, the 1.7B step graphed, `every`, the suite.
# The next lease (~870 s in all): (1) PARTS="cudnn compiled" DECODE_MODELS=qwen3-0.6b-shape
# CUDNN_S=80 BENCH_S=200 DECODE_S=200, timeout_s 560 (cuDNN's attention deprioritized against not,
# both sides, the caveat on every TRL ratio here; then Qwen3's fast path against the generic path,
# compiled), then at once, while the machine is warm (30 s), (2) PARTS="rewards tests" TESTS_S=270,
# timeout_s 380 (the reward stage in worker processes on 16 cores; the suite again after this
# session's fixes). At most 8 files come back from a lent machine's output folder: (1) writes 5, (2) 5.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-gpu-out}}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
TOKENIZER=${TOKENIZER:-models/smollm2}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade .whl/*.whl || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
# printed, not written: at most 8 files come back
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)"
bench() {
  # one workload at a time, each under its own limit: on an H100 the 1.7B workload's two sides took
  # ~215 s (models written, 4 steps each), and one shared limit once cut the 135M workload off unrun
  for w in ${WORKLOADS:-gpu-1.7b-256 gpu-135m-256}; do
    timeout "${BENCH_S:-250}" python3 benchmarks/vs_trl.py --device cuda --smollm2 "$TOKENIZER" --steps "${STEPS:-4}" \
      --rounds 1 --workload "$w" --json "$OUT/vs_trl-$w.json" 2>&1 | grep -v "Warning\|warn(" | tee -a "$OUT/vs_trl.log"
    echo "vs_trl $w exit: ${PIPESTATUS[0]}" | tee -a "$OUT/vs_trl.log"
  done
}
code=0
tests() {
  # pytest-xdist and pytest-timeout were on the last lent machine; without them the run goes on serially
  # and without a per-test limit rather than stopping at an unknown option
  local opts=() scripts_opts=() workers=${WORKERS:-15} scripts_code
  if python3 -c "import xdist" 2>/dev/null; then
    # tests/test_benchmarks_and_scripts.py runs a benchmark in a subprocess per test: under loadfile
    # one worker took the whole file, the last still running at the H100's 300 s limit (tenth
    # session). It runs beside the rest, its tests spread over 4 workers of their own.
    opts+=(-n "$((workers > 6 ? workers - 4 : workers))" --dist loadfile)
    scripts_opts+=(-n 4 --dist load)
  fi
  python3 -c "import pytest_timeout" 2>/dev/null && opts+=(--timeout 150) && scripts_opts+=(--timeout 150)
  # -v alone (with -q they cancel out): a line per test with its name as it finishes, so a run cut
  # off by its limit still names each error; the summary (-rfEs) comes only if it ends in time, and
  # each failure's traceback goes to failures.log as it happens (tests/conftest.py; twice on an H100
  # a run cut off by its limit printed none). One torch thread a worker: with torch's default (a
  # thread per core) 14 workers ran ~14x oversubscribed.
  export GROUPRL_FAILURE_LOG="$OUT/failures.log" OMP_NUM_THREADS=${TEST_THREADS:-1} MKL_NUM_THREADS=${TEST_THREADS:-1}
  timeout "${TESTS_S:-260}" python3 -m pytest "${scripts_opts[@]}" -p no:cacheprovider -v -rfEs \
    tests/test_benchmarks_and_scripts.py > "$OUT/pytest-scripts.log" 2>&1 &
  local scripts_pid=$!
  timeout "${TESTS_S:-260}" python3 -m pytest "${opts[@]}" -p no:cacheprovider -v -rfEs --durations 25 \
    --ignore tests/test_benchmarks_and_scripts.py tests > "$OUT/pytest.log" 2>&1; code=$?
  wait "$scripts_pid"; scripts_code=$?
  unset GROUPRL_FAILURE_LOG OMP_NUM_THREADS MKL_NUM_THREADS
  grep -hE "^(FAILED|ERROR)| (FAILED|ERROR) |passed|failed" "$OUT/pytest.log" "$OUT/pytest-scripts.log" | tail -40
  echo "pytest exit: $code (tests/test_benchmarks_and_scripts.py: $scripts_code)"
  [ "$code" -ne 0 ] || code=$scripts_code
}
# the decode step on CUDA (issue 36): ms per token, eager against compiled, and both replayed as CUDA
# graphs, at 16 rows of the 135M and 1.7B SmolLM2 shapes in bf16, one process and limit per model (a
# compile takes 1-2 minutes). Unfiltered: grouprl's own warnings (a compile or capture that failed)
# are RuntimeWarnings, which the other commands' filter would drop.
eager() {
  # eager and eager replayed as graphs alone (~20 s a model: no compile to wait for), so that a
  # compile that runs long cannot cost the graphs' figure
  timeout "${EAGER_S:-120}" python3 benchmarks/decode.py --device cuda --models smollm2-135m-shape smollm2-1.7b-shape --rows 16 \
    --prompt 16 --dtypes bf16 --reps 2 --no-compile --smollm2 "$TOKENIZER" --json "$OUT/decode-eager.json" 2>&1 \
    | tee -a "$OUT/decode.log"
}
widths() {
  # how often a new attended width should make a new captured shape: 256-token calls, buckets of 32
  # against the default 128 (compiled_decode.GRAPH_WIDTH_STEP, an estimate), ~40 s each
  for w in 32 128; do
    timeout 90 python3 benchmarks/decode.py --device cuda --models smollm2-135m-shape --rows 16 --prompt 16 \
      --tokens 256 --dtypes bf16 --reps 2 --no-compile --graph-width-step "$w" --smollm2 "$TOKENIZER" \
      --json "$OUT/decode-width-$w.json" 2>&1 | tee -a "$OUT/decode.log"
  done
}
compiled() {
  for m in ${DECODE_MODELS:-smollm2-135m-shape smollm2-1.7b-shape}; do
    generic=""; [ "$m" = qwen3-0.6b-shape ] && generic="--generic"
    # recompiles logged with their guard: the 135M's first compiled call took 122 s against a 61 s
    # compile (eighteenth session), the 1.7B's 52 against 51; no recompile shows on CPU at that shape
    TORCH_LOGS=${TORCH_LOGS:-recompiles} timeout "${DECODE_S:-150}" python3 benchmarks/decode.py --device cuda --models "$m" --rows 16 --prompt 16 \
      --dtypes bf16 --reps 2 --smollm2 "$TOKENIZER" $generic --json "$OUT/decode-$m.json" 2>&1 | tee -a "$OUT/decode.log"
    echo "decode $m exit: ${PIPESTATUS[0]}" | tee -a "$OUT/decode.log"
  done
}
# where each side's peak memory goes (issue 34: 135M peaked 1.14x TRL's): the allocator's history of
# each side's last step at the 135M shape, and the blocks alive at its peak by code site
memory() {
  timeout "${MEM_S:-150}" python3 benchmarks/vs_trl.py --device cuda --smollm2 "$TOKENIZER" --steps 4 --rounds 1 \
    --workload gpu-135m-256 --memory-snapshot "$OUT/memory" 2>&1 | grep -v "Warning\|warn(" | tail -5
  for f in "$OUT"/memory/*.pickle; do
    [ -e "$f" ] && python3 benchmarks/memory_peak.py "$f" --top 15 --json "${f%.pickle}.report.json" | tee -a "$OUT/memory.log"
  done
}
# grouprl at 135M in the 16-row passes of the old fixed micro_batch_size, against the run above (auto:
# one 32-row pass on one GPU, half the update's launches, benchmarks/README.md "Launches per update"):
# the update's time and the peak memory that one pass costs
mb() {
  timeout "${MB_S:-90}" python3 benchmarks/vs_trl.py --device cuda --smollm2 "$TOKENIZER" --steps "${STEPS:-5}" \
    --rounds 1 --only grouprl --workload gpu-135m-256 --micro-batch 16 --json "$OUT/vs_trl_16_rows.json" \
    2>&1 | grep -v "Warning\|warn(" | tee "$OUT/vs_trl_16_rows.log"
}
# grouprl alone with the packed passes' attention per sequence (CPU's path) against the run above
# (the varlen flash kernel, one call per layer): the update's share is what changes
ab() {
  timeout "${AB_S:-150}" python3 benchmarks/vs_trl.py --device cuda --smollm2 "$TOKENIZER" --steps "${STEPS:-5}" \
    --rounds 1 --only grouprl --packed-attention per-sequence --workload gpu-135m-256 --json "$OUT/vs_trl_per_sequence.json" \
    2>&1 | grep -v "Warning\|warn(" | tee "$OUT/vs_trl_per_sequence.log"
}
# cuDNN's attention on an H100 (eleventh session's reading, not yet measured): torch 2.11 puts it
# first in SDPA's order on sm90/sm100 (unless TORCH_CUDNN_SDPA_DEPRIORITIZED is set), and it builds an
# execution plan for every new shape (batch, key length). The plain eager decode loop attends a new key
# length every token: its first 256-token call took 20-30 s against ~4 s later, which fits. So does
# TRL's generate (transformers' SDPA over the cache with a padding mask: 70 ms a token at 135M). The
# graphed slot loop writes its attention out, and the update takes the varlen flash kernel, so neither
# meets cuDNN; grouprl's prefill (SDPA with a mask) does, once per new prompt shape. Both sides again
# with cuDNN deprioritized, and the plain eager loop's first and later calls both ways (CUDNN_S)
cudnn() {
  for env in "" TORCH_CUDNN_SDPA_DEPRIORITIZED=1; do
    timeout "${CUDNN_S:-100}" env $env python3 benchmarks/decode.py --device cuda --models smollm2-135m-shape \
      --rows 16 --prompt 16 --tokens 128 --dtypes bf16 --reps 2 --no-compile --cuda-graphs off --smollm2 "$TOKENIZER" \
      --json "$OUT/decode-eager${env:+-nocudnn}.json" 2>&1 | tail -3 | tee -a "$OUT/cudnn.log"
  done
  TORCH_CUDNN_SDPA_DEPRIORITIZED=1 timeout "${BENCH_S:-250}" python3 benchmarks/vs_trl.py --device cuda \
    --smollm2 "$TOKENIZER" --steps "${STEPS:-4}" --rounds 1 --workload gpu-135m-256 --json "$OUT/vs_trl-nocudnn.json" \
    2>&1 | grep -v "Warning\|warn(" | tail -6 | tee -a "$OUT/cudnn.log"
}
# multi-turn rollouts (call, tool result, answer) of the embedded tool policy, 16 prompts x 8, each
# turn a generate call inside keep_conversations: replayed as graphs against the plain eager loop
multiturn() {
  timeout "${MT_S:-90}" python3 benchmarks/multiturn_continuation.py --compare graphs --device cuda --rounds 3 \
    2>&1 | grep -v "Warning\|warn(" | tee "$OUT/multiturn.log"
}
# the slot loop's check interval (engine.CHECK_EVERY: every step on CPU, measured; 8 on CUDA, where a
# look is a sync that drains the queue of replayed graphs: an estimate): 64 rows of the 135M shape
# ending after ~125 of at most 256 tokens, graphed eager step, intervals and the plain eager loop
every() {
  timeout "${EVERY_S:-120}" python3 benchmarks/check_every.py --device cuda --model smollm2-135m-shape \
    --smollm2 "$TOKENIZER" --rows 64 --tokens 256 --stop-share 0.008 --bf16 --reps 3 --every 1 4 8 16 32 \
    --json "$OUT/check_every.json" 2>&1 | grep -v "Warning\|warn(" | tee "$OUT/check_every.log"
}
rewards() {
  timeout "${REWARDS_S:-120}" python3 benchmarks/reward_workers.py --prompts 32 --group 16 --workers 4 8 15 \
    --rounds 3 2>&1 | grep -v "Warning\|warn(" | tee "$OUT/reward_workers.log"
}
for part in ${PARTS:-bench tests eager widths compiled memory mb ab cudnn multiturn every rewards}; do
  case "$part" in
    bench|tests|eager|widths|compiled|memory|mb|ab|cudnn|multiturn|every|rewards) echo "== $part ($(date +%T))"; "$part" ;;
    *) echo "unknown part '$part': bench tests eager widths compiled memory mb ab cudnn multiturn every rewards" >&2
       exit 2 ;;
  esac
done
exit "$code"
