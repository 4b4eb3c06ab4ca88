"""Fine-tune the consumers' LoRA adapters on a CUDA machine and measure their drift, in one run.

For machines that cannot download the producer wheel: the GGUF file and the corpora are given
as local files. Usage (on the GPU machine, package installed, SCD_STORE_HOME set):

    python benchmarks/train_consumers_cuda.py GGUF_FILE OUT_DIR

Writes each candidate adapter and a JSON line per candidate (recipe, training stats, quality
table on the held-out windows) into OUT_DIR.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

from scd_store.bench.quality import QualityConfig, run_quality
from scd_store.models import catalog
from scd_store.models.finetune import FinetuneRecipe, train_adapter
from scd_store.models.fingerprint import file_fingerprint
from scd_store.models.prepare import build_consumer_checkpoint, build_producer_checkpoint, load_local, read_manifest
from scd_store.paths import models_dir

# Measured on 2 CPU cores, Shakespeare, 100 x 4 x 256 tokens (raw-reuse ppl drift): LoRA r8 + full-rank
# k/v + norms +2.1%; full-rank k/v only lr 1e-3 +3.0%, lr 3e-3 +1.6%; full-rank q/k/v lr 1e-3 +2.9%.
# The committed LoRA r16 (600 x 16 x 256 on an H200) gives +3.7%. Python, LoRA r16, 160 steps, 164k tokens:
# 256-token sequences +3.4%; 512-token sequences (the positions a 448 + 64 window reaches) +4.3% at lr 2e-3,
# and at lr 4e-3 a worse specialist with less drift. Next: 512-token sequences and many more tokens.
CANDIDATES: dict[str, list[FinetuneRecipe]] = {
    "smollm2-135m-shakespeare": [
        FinetuneRecipe("shakespeare", seed=1, lr=1e-3, seq_len=512, batch_size=8, steps=1500),
        FinetuneRecipe("shakespeare", seed=1, lr=2e-3, seq_len=512, batch_size=8, steps=1500),
        FinetuneRecipe("shakespeare", seed=1, lr=2e-3, seq_len=512, batch_size=8, steps=1500, full=("norm",),
                       full_lr=1e-3),
    ],
    "smollm2-135m-python": [
        FinetuneRecipe("python", seed=2, lr=2e-3, seq_len=512, batch_size=8, steps=1500),
        FinetuneRecipe("python", seed=2, lr=1e-3, seq_len=512, batch_size=8, steps=1500),
    ],
}


def main(gguf: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    producer = build_producer_checkpoint(gguf, catalog.PRODUCER_REQUIREMENT, file_fingerprint(gguf),
                                         models_dir() / catalog.PRODUCER)
    print(f"producer ready in {time.perf_counter() - start:.1f}s", flush=True)
    producer_fp = read_manifest(producer)["weights_fingerprint"]
    log = out / "candidates.jsonl"
    for name, recipes in CANDIDATES.items():
        for i, recipe in enumerate(recipes):
            model, tokenizer = load_local(producer)
            adapter = out / f"{name}-{i}.safetensors"
            stats = train_adapter(model, tokenizer, recipe, adapter, {"consumer": name,
                                  "producer_fingerprint": producer_fp}, device="cuda")
            spec = replace(catalog.consumer(name), recipe=recipe)
            spec.adapter_path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(adapter, spec.adapter_path)
            build_consumer_checkpoint(producer, spec, models_dir() / name)
            report = run_quality(QualityConfig(name, windows=20, device="cuda"), progress=False)
            line = {"consumer": name, "candidate": i, "recipe": json.loads(recipe.to_json()), "train": stats,
                    "methods": report.methods}
            with log.open("a") as handle:
                handle.write(json.dumps(line) + "\n")
            table = {m["name"]: (m["ppl"], m["ppl_rel"], m["kl"], m["top1"]) for m in report.methods}
            print(name, i, json.dumps(stats), json.dumps(table), f"t={time.perf_counter() - start:.0f}s", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
