#!/usr/bin/env bash
# The CUDA checks in one command, on a machine with no network (benchmarks/README.md, "On a GPU"):
#   bash scripts/gpu_check.sh [OUT_DIR]
# Needs, beside the checkout: the wheels the machine lacks in .whl/ (the pip download line in
# benchmarks/README.md) and SmolLM2's tokenizer in models/smollm2 (scripts/fetch_smollm2.py; only
# the tokenizer files are read: tokenizer.json, tokenizer_config.json, chat_template.jinja).
# Runs benchmarks/vs_trl.py's GPU workloads first (each side in its own process), then the suite,
# then the decode benchmark, then grouprl per-sequence for the packed-attention A/B; each has its own
# time limit (BENCH_S, TESTS_S, DECODE_S, AB_S seconds), so one that hangs cannot starve the rest.
# At the defaults the whole takes up to ~14 minutes after setup: on a shorter device budget, lower
# STEPS or skip the last two (AB_S=0, DECODE_S=0).
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
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)" | tee -a "$OUT/gpu.txt"
timeout "${BENCH_S:-300}" python3 benchmarks/vs_trl.py --device cuda --smollm2 "$TOKENIZER" --steps "${STEPS:-5}" \
  --rounds 1 ${WORKLOADS:-} --json "$OUT/vs_trl.json" 2>&1 | grep -v "Warning\|warn(" | tee "$OUT/vs_trl.log"
echo "vs_trl exit: $?" | tee -a "$OUT/vs_trl.log"
timeout "${TESTS_S:-260}" python3 -m pytest -q -n "${WORKERS:-14}" --dist loadfile --timeout 150 -p no:cacheprovider \
  -v -rfEs tests > "$OUT/pytest.log" 2>&1; code=$?
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -40
echo "pytest exit: $code"
# the compiled decode step on CUDA (issue 36): ms per token, eager against compiled and against compiled
# replayed as CUDA graphs, at 16 rows of the 135M and 1.7B SmolLM2 shapes in bf16. DECODE_S=0 skips it.
if [ "${DECODE_S:-150}" -gt 0 ]; then
  timeout "${DECODE_S:-150}" python3 benchmarks/decode.py --device cuda --models smollm2-135m-shape smollm2-1.7b-shape \
    --rows 16 --prompt 16 --dtypes bf16 --reps 2 --smollm2 "$TOKENIZER" --json "$OUT/decode.json" \
    2>&1 | grep -v "Warning\|warn(" | tee "$OUT/decode.log"
fi
# grouprl alone with the packed passes' attention per sequence (CPU's path) against the run above
# (the varlen flash kernel, one call per layer): the update's share is what changes. AB_S=0 skips it.
if [ "${AB_S:-150}" -gt 0 ]; then
  timeout "${AB_S:-150}" python3 benchmarks/vs_trl.py --device cuda --smollm2 "$TOKENIZER" --steps "${STEPS:-5}" \
    --rounds 1 --only grouprl --packed-attention per-sequence ${WORKLOADS:-} --json "$OUT/vs_trl_per_sequence.json" \
    2>&1 | grep -v "Warning\|warn(" | tee "$OUT/vs_trl_per_sequence.log"
fi
exit "$code"
