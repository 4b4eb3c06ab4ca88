#!/usr/bin/env bash
# One prepared device run (GPU machine): install the package without deps into /tmp/site, run the
# CUDA unit tests (device decodes, tensor payloads, CUDA-graph replay, GPU tier, the bench), then the
# decode-vs-prefill bench on CUDA (fp32 and bf16; random-init SmolLM2-135M geometry: the model files
# are too large to travel, and speed does not depend on the weights).
# Usage there: bash benchmarks/device_check.sh   (writes logs and JSON under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . > "$OUT/install.log" 2>&1 \
  || { tail -20 "$OUT/install.log"; exit 1; }
export PYTHONPATH=/tmp/site
# run away from the source tree, whose scd_store/ lacks the mapped codecs/ and adapters/ subpackages
rm -rf /tmp/tw && mkdir -p /tmp/tw && cp -r tests /tmp/tw/ && cd /tmp/tw
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/codecs tests/adapters/transformers/test_runner.py \
  tests/store/test_gpu_tier.py tests/bench/test_decode_bench.py -k "cuda or gpu or graph or tensor_payload" 2>&1 \
  | tee "$OUT/pytest.log" | tail -15
# the engines' GPU hand-offs that need no engine build: vLLM's pinned save copy, SGLang's and LMCache's decode_device
timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/adapters/vllm/test_host_copy.py \
  tests/adapters/sglang/test_reads_cuda.py tests/adapters/lmcache/test_device_decode.py 2>&1 \
  | tee "$OUT/pytest_engines.log" | tail -15
for dtype in float32 bfloat16; do
  timeout 150 python3 -m scd_store.cli.main bench decode --device cuda --dtype $dtype --prefix-tokens 448 2048 8192 \
    --repeats 20 --json "$OUT/decode_cuda_$dtype.json" 2>&1 | tail -25
done
