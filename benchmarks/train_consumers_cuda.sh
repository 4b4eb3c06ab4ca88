#!/usr/bin/env bash
# Device run: reassemble the carried GGUF file, install the package and gguf, then train and measure
# the consumer candidates on CUDA. Carry: .xfer (gguf.part*, shakespeare.tar.xz, stdlib311.tar.xz, whl/).
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1 SCD_STORE_HOME=/tmp/scdhome SCD_STORE_PYTHON_STDLIB=/tmp/stdlib311
mkdir -p "$OUT" $SCD_STORE_HOME/corpora /tmp/stdlib311 /tmp/gguf
cat /tmp/gguf.partaa .xfer/gguf.partab > /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
tar xJf .xfer/shakespeare.tar.xz -C $SCD_STORE_HOME/corpora && tar xJf .xfer/stdlib311.tar.xz -C /tmp/stdlib311
python3 -m pip install -q --no-deps --no-index --target /tmp/site .xfer/whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
cp benchmarks/train_consumers_cuda.py /tmp/ && cd /tmp
python3 /tmp/train_consumers_cuda.py /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf "$OUT" 2>&1 | grep -v "it/s\]\|step/s\]\|s/step\]" | tail -40
