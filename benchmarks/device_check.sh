#!/usr/bin/env bash
# One prepared device run (GPU machine: PyTorch, Triton, CUDA, transformers; no vLLM / LMCache / SGLang, and
# nothing to install beyond the working tree). Installs the package without deps into /tmp/site, then, within
# a total budget (DEVICE_CHECK_BUDGET_S, default 520 s: each step's timeout is cut to what is left):
#   1. the CUDA unit tests: device decodes, tensor payloads, CUDA-graph replay, the GPU tier, the paged fused
#      decode against its eager reference (graph capture included), the head shares, the device staging;
#   2. the engines' GPU hand-offs that need no engine build: vLLM's pinned save copy under a competing kernel,
#      SGLang's and LMCache's decode_device;
#   3. `bench decode --device cuda` at 448 / 2k / 8k tokens on SmolLM2-135M's geometry (bf16, then fp32) and on
#      Llama-3-8B's (bf16), random-init weights (speed does not depend on them; model files do not travel);
#   4. where constriction is installed, `bench decode --quantiser ecsq` (range-coded payloads, beside planes);
#   5. a few distillation steps of `scd-store calibrate --device cuda` on random-init checkpoints of
#      SmolLM2-135M's geometry (benchmarks/device_models.py: a byte tokenizer, a perturbed consumer).
# Writes logs and JSON under $OUT, and $OUT/device_check.json (each step's rc and seconds, the key figures).
# DEVICE_CHECK_DRY=1: the same steps on this machine's CPU at toy sizes, tests collected only, nothing
# installed (PYTHON: the interpreter with scd-store installed); what tests/bench/test_device_check.py runs.
# Usage there: bash benchmarks/device_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
DRY=${DEVICE_CHECK_DRY:-0}
BUDGET=${DEVICE_CHECK_BUDGET_S:-520}
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
: > "$OUT/steps.jsonl"
export PYTHONUNBUFFERED=1

# step NAME TIMEOUT_S CMD...: run CMD (stdout+stderr to $OUT/NAME.log) within the budget left; one JSON line
step() {
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt 15 ]; then
    echo "{\"name\": \"$name\", \"rc\": null, \"seconds\": 0, \"skipped\": \"budget spent\"}" >> "$OUT/steps.jsonl"
    echo "== $name: skipped (budget spent)"; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "{\"name\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0)), \"limit_s\": $limit}" >> "$OUT/steps.jsonl"
  echo "== $name: rc $rc in $((SECONDS - t0)) s"; tail -4 "$OUT/$name.log"
}

if [ "$DRY" = 1 ]; then
  DEV=cpu; COLLECT=(--collect-only); SIZES=(24 40); BIG=(24); REPEATS=1; BIG_REPEATS=1; TINY=(--tiny)
  CAL=(--steps 2 --windows 2 --prefix-tokens 64 --continuation-tokens 16)
  cd "$ROOT"
else
  DEV=cuda; COLLECT=(); SIZES=(448 2048 8192); BIG=(448 2048 8192); REPEATS=20; BIG_REPEATS=5; TINY=()
  CAL=(--steps 20 --windows 8 --prefix-tokens 448 --continuation-tokens 64)
  "$PY" -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site "$ROOT" > "$OUT/install.log" 2>&1 \
    || { tail -20 "$OUT/install.log"; exit 1; }
  export PYTHONPATH=/tmp/site
  # run away from the source tree, whose scd_store/ lacks the mapped codecs/ and adapters/ subpackages
  rm -rf /tmp/tw && mkdir -p /tmp/tw && cp -r "$ROOT/tests" /tmp/tw/ && cd /tmp/tw
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'cuda', torch.cuda.is_available())" | tee "$OUT/versions.txt"

step pytest_cuda 170 "$PY" -m pytest -q -p no:cacheprovider -rs "${COLLECT[@]}" tests/codecs \
  tests/adapters/transformers/test_runner.py tests/store/test_gpu_tier.py tests/bench/test_decode_bench.py \
  tests/service/test_gpu_decode.py tests/service/test_device_staging.py tests/service/test_get_paged.py \
  -k "cuda or gpu or graph or tensor_payload or paged or share or staging"
step pytest_engines 90 "$PY" -m pytest -q -p no:cacheprovider -rs "${COLLECT[@]}" \
  tests/adapters/vllm/test_host_copy.py tests/adapters/sglang/test_reads_cuda.py tests/adapters/lmcache/test_device_decode.py
step decode_smollm2_bf16 100 "$PY" -m scd_store.cli.main bench decode --device "$DEV" --geometry smollm2-135m \
  --dtype bfloat16 --prefix-tokens "${SIZES[@]}" --repeats "$REPEATS" --json "$OUT/decode_smollm2_bf16.json"
step decode_llama3_8b_bf16 200 "$PY" -m scd_store.cli.main bench decode --device "$DEV" \
  --geometry "$([ "$DRY" = 1 ] && echo smollm2-135m || echo llama3-8b)" --dtype bfloat16 \
  --prefix-tokens "${BIG[@]}" --repeats "$BIG_REPEATS" --decodes-per-round 3 --json "$OUT/decode_llama3_8b_bf16.json"
step calibrate_models 60 "$PY" "$ROOT/benchmarks/device_models.py" "$OUT/models" "${TINY[@]}"
step calibrate_cuda 120 sh -c "\"$PY\" -m scd_store.cli.main calibrate --producer \"$OUT/models/producer\" \
  --consumer \"$OUT/models/consumer\" --text \"$OUT/models/text.txt\" --device $DEV --out \"$OUT/models/bundle\" \
  ${CAL[*]} > \"$OUT/calibrate_cuda.json\""
step decode_smollm2_fp32 90 "$PY" -m scd_store.cli.main bench decode --device "$DEV" --geometry smollm2-135m \
  --dtype float32 --prefix-tokens "${SIZES[@]}" --repeats "$REPEATS" --json "$OUT/decode_smollm2_fp32.json"
if "$PY" -c "import constriction" 2> /dev/null; then  # range-coded payloads: only where the coder is installed
  step decode_smollm2_ecsq 60 "$PY" -m scd_store.cli.main bench decode --device "$DEV" --geometry smollm2-135m \
    --dtype bfloat16 --quantiser ecsq --budget 0.115 --prefix-tokens "${SIZES[@]}" --repeats "$BIG_REPEATS" \
    --json "$OUT/decode_smollm2_ecsq.json"
else
  echo '{"name": "decode_smollm2_ecsq", "rc": null, "seconds": 0, "optional": true, "skipped": "no constriction"}' \
    >> "$OUT/steps.jsonl"
fi
rm -rf "$OUT/models/producer" "$OUT/models/consumer" "$OUT/models/bundle"  # large, and nothing to read back
"$PY" "$ROOT/benchmarks/device_check_summary.py" "$OUT" && echo "wrote $OUT/device_check.json"
