#!/usr/bin/env bash
# One prepared device run for the lent GPU machine (Python 3.12, PyTorch 2.11 + CUDA, Triton 3.6, NumPy 2.5,
# transformers; no cryptography, cffi, redis, constriction, vLLM, LMCache, SGLang or NIXL, and nothing can be
# fetched there). First, every time (a rerun on a warm machine reinstalls; PYTHONPATH is kept, the target first):
#   - the project from a clean copy of its sources into a fresh pip --target directory, and the carried wheels
#     ($DEVICE_CHECK_WHEELS, default .whl/ in the repository: *.whl built for that Python, e.g. cryptography +
#     cffi for the signed-blob tests, constriction for the range-coded step; carry it, 64 MiB in all with the tree);
#   - a census of the packages (benchmarks/device_check_packages.py): the missing ones are listed up front with
#     what each costs, the steps that need one are skipped with a note, and where cryptography is missing the
#     steps' stores run unsigned (SCD_STORE_ALLOW_UNSIGNED=1; the tests that sign skip with their reason).
# Then, within a total budget (DEVICE_CHECK_BUDGET_S, default 520 s: each step's timeout is cut to what is left):
#   1. the CUDA unit tests: device decodes, tensor payloads, CUDA-graph replay, the GPU tier, the paged fused
#      decode against its eager reference (graph capture included), the head shares, the device staging;
#   2. the engines' GPU hand-offs that need no engine build: vLLM's pinned save copy under a competing kernel,
#      SGLang's and LMCache's decode_device;
#   3. `bench decode --device cuda` at 448 / 2k / 8k tokens on SmolLM2-135M's geometry (bf16, then fp32) and on
#      Llama-3-8B's (bf16), random-init weights (speed does not depend on them; model files do not travel; the
#      code space is fitted once per run); each report says which decode the fused variant ran (fused_kernel);
#   4. where constriction is installed, `bench decode --quantiser ecsq` (range-coded payloads, beside planes);
#   5. a few distillation steps of `scd-store calibrate --device cuda` on random-init checkpoints of
#      SmolLM2-135M's geometry (benchmarks/device_models.py: a byte tokenizer, a perturbed consumer).
# Writes logs and JSON under $OUT, and $OUT/device_check.json: the packages, each step's rc and seconds, the
# pytest counts and skip reasons, the decode figures and which kernel ran, the calibration's figures.
# DEVICE_CHECK_DRY=1: the same steps on this machine's CPU at toy sizes, from the same kind of install, the tests
# executed (those that need CUDA skip); `make device-check-dry` runs it in .venv-gpuset, a venv of the GPU
# machine's package set (integration_tests/test_device_check.py, in `make test`). PYTHON: the interpreter to use.
# DEVICE_CHECK_ONLY="step ...": run only these steps (the others are recorded as not selected).
# Usage there: bash benchmarks/device_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
DRY=${DEVICE_CHECK_DRY:-0}
BUDGET=${DEVICE_CHECK_BUDGET_S:-520}
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=${DEVICE_CHECK_WHEELS:-$ROOT/.whl}
ONLY=${DEVICE_CHECK_ONLY:-}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # the steps run elsewhere: absolute paths
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY");; esac
case $WHEELS in /*) ;; *) WHEELS=$PWD/$WHEELS;; esac
WORK=$(mktemp -d "${TMPDIR:-/tmp}/scd-device-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
rm -rf "$OUT/models" "$OUT"/decode_*.json "$OUT"/*.log "$OUT/calibrate_cuda.json" "$OUT/packages.json" \
  "$OUT/device_check.json" "$OUT/gpu.txt" "$OUT/versions.txt"  # a rerun into the same OUT reads nothing stale
: > "$OUT/steps.jsonl"
export PYTHONUNBUFFERED=1

skipped() {  # skipped NAME WHY [optional]: one JSON line for a step that did not run
  echo "{\"name\": \"$1\", \"rc\": null, \"seconds\": 0, \"skipped\": \"$2\"${3:+, \"optional\": true}}" \
    >> "$OUT/steps.jsonl"
  echo "== $1: skipped ($2)"
}

# step NAME TIMEOUT_S "NEEDS" CMD...: run CMD (stdout+stderr to $OUT/NAME.log) within the budget left, where every
# package in NEEDS imports (else skipped, with a note); one JSON line per step
step() {
  local name=$1 limit=$2 needs=$3; shift 3
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then skipped "$name" "not selected" optional; return; fi
  local pkg
  for pkg in $needs; do
    if [[ " $MISSING " == *" $pkg "* ]]; then
      # a missing package the machine is known to lack is a note; a missing core package fails the check
      case " $OPTIONAL " in *" $pkg "*) skipped "$name" "no $pkg" optional;; *) skipped "$name" "no $pkg";; esac
      return
    fi
  done
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt 15 ]; then skipped "$name" "budget spent"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "{\"name\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0)), \"limit_s\": $limit}" >> "$OUT/steps.jsonl"
  echo "== $name: rc $rc in $((SECONDS - t0)) s"; tail -4 "$OUT/$name.log"
}

# the install: never what a previous run left (pip --target keeps an existing target's files)
SITE=$WORK/site
mkdir -p "$WORK/src"
cp -r "$ROOT/pyproject.toml" "$ROOT/README.md" "$ROOT/scd_store" "$ROOT/codecs" "$ROOT/adapters" "$WORK/src/"
"$PY" -m pip install -q --no-deps --no-build-isolation --no-index --target "$SITE" "$WORK/src" \
  > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
CARRIED=()
if compgen -G "$WHEELS/*.whl" > /dev/null; then  # carried wheels, into the same target (they win over the image's)
  CARRIED=("$WHEELS"/*.whl)
  echo "== installing ${#CARRIED[@]} carried wheel(s) from $WHEELS"
  "$PY" -m pip install -q --no-deps --no-index --target "$SITE" "${CARRIED[@]}" >> "$OUT/install.log" 2>&1 \
    || echo "== carried wheels: install failed (install.log); the census below says what imports"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# the tests run from a copy, away from the source tree (whose scd_store/ lacks the mapped codecs/ and adapters/)
mkdir -p "$WORK/tw" && cp -r "$ROOT/tests" "$ROOT/pyproject.toml" "$WORK/tw/"  # pyproject: pytest's settings

# the census: what is missing, up front
MISSING=$(cd "$WORK/tw" && "$PY" "$ROOT/benchmarks/device_check_packages.py" "$OUT" "${CARRIED[@]}" \
  2> "$OUT/packages.log") || { cat "$OUT/packages.log"; exit 1; }
OPTIONAL="cryptography cffi constriction redis gguf accelerate rich hypothesis vllm lmcache sglang nixl triton"
echo "== missing: ${MISSING:-nothing}"; cat "$OUT/packages.log"
if [[ " $MISSING " == *" cryptography "* ]]; then export SCD_STORE_ALLOW_UNSIGNED=1; fi

if [ "$DRY" = 1 ]; then
  # one thread: on a shared 2-core machine OpenMP's barriers wait on a core another process holds (seen on
  # cpu-avx2-2c: 60 eigendecompositions of 192 x 192 took 18 s on 2 threads, 0.2 s on one); timings mean nothing here
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  DEV=cpu; SIZES=(24 40); BIG=(24); REPEATS=1; BIG_REPEATS=1; TINY=(--tiny)
  CAL=(--steps 2 --windows 2 --prefix-tokens 64 --continuation-tokens 16)
else
  DEV=cuda; SIZES=(448 2048 8192); BIG=(448 2048 8192); REPEATS=20; BIG_REPEATS=5; TINY=()
  CAL=(--steps 20 --windows 8 --prefix-tokens 448 --continuation-tokens 64)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
fi
cd "$WORK/tw"
"$PY" -c "import sys, numpy, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'transformers', transformers.__version__, 'numpy', numpy.__version__, 'cuda', torch.cuda.is_available())" \
  2>&1 | tee "$OUT/versions.txt"

step pytest_cuda 170 "scd_store pytest" "$PY" -m pytest -q -p no:cacheprovider -rs tests/codecs \
  tests/adapters/transformers/test_runner.py tests/store/test_gpu_tier.py tests/bench/test_decode_bench.py \
  tests/service/test_gpu_decode.py tests/service/test_device_staging.py tests/service/test_get_paged.py \
  -k "cuda or gpu or graph or tensor_payload or paged or share or staging"
step pytest_engines 90 "scd_store pytest" "$PY" -m pytest -q -p no:cacheprovider -rs \
  tests/adapters/vllm/test_host_copy.py tests/adapters/sglang/test_reads_cuda.py \
  tests/adapters/lmcache/test_device_decode.py
step decode_smollm2_bf16 100 scd_store "$PY" -m scd_store.cli.main bench decode --device "$DEV" \
  --geometry smollm2-135m --dtype bfloat16 --prefix-tokens "${SIZES[@]}" --repeats "$REPEATS" \
  --json "$OUT/decode_smollm2_bf16.json"
step decode_llama3_8b_bf16 200 scd_store "$PY" -m scd_store.cli.main bench decode --device "$DEV" \
  --geometry "$([ "$DRY" = 1 ] && echo smollm2-135m || echo llama3-8b)" --dtype bfloat16 \
  --prefix-tokens "${BIG[@]}" --repeats "$BIG_REPEATS" --decodes-per-round 3 --json "$OUT/decode_llama3_8b_bf16.json"
step calibrate_models 60 "torch transformers tokenizers" "$PY" "$ROOT/benchmarks/device_models.py" "$OUT/models" \
  "${TINY[@]}"
step calibrate_cuda 120 "scd_store tqdm" sh -c "\"$PY\" -m scd_store.cli.main calibrate \
  --producer \"$OUT/models/producer\" --consumer \"$OUT/models/consumer\" --text \"$OUT/models/text.txt\" \
  --device $DEV --out \"$OUT/models/bundle\" ${CAL[*]} > \"$OUT/calibrate_cuda.json\""
step decode_smollm2_fp32 90 scd_store "$PY" -m scd_store.cli.main bench decode --device "$DEV" --geometry smollm2-135m \
  --dtype float32 --prefix-tokens "${SIZES[@]}" --repeats "$REPEATS" --json "$OUT/decode_smollm2_fp32.json"
step decode_smollm2_ecsq 60 "scd_store constriction" "$PY" -m scd_store.cli.main bench decode --device "$DEV" \
  --geometry smollm2-135m --dtype bfloat16 --quantiser ecsq --budget 0.115 --prefix-tokens "${SIZES[@]}" \
  --repeats "$BIG_REPEATS" --json "$OUT/decode_smollm2_ecsq.json"
rm -rf "$OUT/models/producer" "$OUT/models/consumer" "$OUT/models/bundle"  # large, and nothing to read back
"$PY" "$ROOT/benchmarks/device_check_summary.py" "$OUT" && echo "wrote $OUT/device_check.json"
