"""The device check's package census, taken before any step runs: which of the packages scd-store and its steps use
import here (with their versions), which do not and what that costs, and the carried wheels installed. Writes
``OUT/packages.json`` and prints the missing names on one line (what ``benchmarks/device_check.sh`` skips by).

    python benchmarks/device_check_packages.py OUT [WHEEL ...]
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path

# import name -> (distribution, what is lost without it); the GPU machine lacks cryptography (and cffi), redis,
# constriction and the engines (docs/research/machines.md; DESIGN.md 11b)
PACKAGES: dict[str, tuple[str, str]] = {
    "scd_store": ("scd-store", "every step (the install into the target failed: install.log)"),
    "torch": ("torch", "every step"),
    "transformers": ("transformers", "every step"),
    "numpy": ("numpy", "every step"),
    "safetensors": ("safetensors", "every step"),
    "tokenizers": ("tokenizers", "every step"),
    "yaml": ("pyyaml", "every step"),
    "xxhash": ("xxhash", "every step"),
    "pytest": ("pytest", "the pytest steps"),
    "triton": ("triton", "the fused kernel: its tests skip, bench decode's fused variant reports 'unavailable'"),
    "cryptography": ("cryptography", "signed blobs: the tests that sign or verify skip; the steps' stores run "
                                     "unsigned (SCD_STORE_ALLOW_UNSIGNED=1)"),
    "cffi": ("cffi", "nothing scd-store uses directly (cryptography's companion)"),
    "constriction": ("constriction", "range-coded (ans-1) payloads: the decode_smollm2_ecsq step skips"),
    "redis": ("redis", "the Redis tier (no step uses it)"),
    "gguf": ("gguf", "loading the GGUF producer (no step uses it: the models are random-init)"),
    "accelerate": ("accelerate", "nothing the steps use"),
    "tqdm": ("tqdm", "calibration's progress bars: the calibrate step fails"),
    "rich": ("rich", "the CLI's tables"),
    "hypothesis": ("hypothesis", "property tests (none in the steps' selections)"),
    "vllm": ("vllm", "vLLM's own classes (their tests skip)"),
    "lmcache": ("lmcache", "LMCache's own classes (their tests skip)"),
    "sglang": ("sglang", "SGLang's own classes (their tests skip)"),
    "nixl": ("nixl", "the NIXL transfer (no step uses it)"),
}


# imported as these modules (what scd-store imports of them); the engines only looked up, not imported (slow)
PROBES = {"scd_store": "scd_store.cli.main", "cryptography": "cryptography.hazmat.primitives.asymmetric.ed25519"}
LOOKED_UP = ("vllm", "lmcache", "sglang", "nixl")


def census(wheels: list[str]) -> dict:
    present, missing = {}, {}
    for module, (dist, cost) in PACKAGES.items():
        try:
            if module in LOOKED_UP:
                if importlib.util.find_spec(module) is None:
                    raise ModuleNotFoundError(f"No module named {module!r}")
            else:
                importlib.import_module(PROBES.get(module, module))
        except Exception as exc:  # noqa: BLE001 - an import that fails in any way counts as missing
            missing[module] = {"why": f"{type(exc).__name__}: {exc}"[:200], "without it": cost}
            continue
        try:
            present[module] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            present[module] = getattr(sys.modules[module], "__version__", "unknown")
    return {"python": sys.version.split()[0], "present": present, "missing": missing,
            "carried_wheels": [Path(w).name for w in wheels]}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    report = census(sys.argv[2:])
    (out / "packages.json").write_text(json.dumps(report, indent=2) + "\n")
    for module, info in report["missing"].items():
        print(f"missing {module}: {info['without it']}", file=sys.stderr)
    print(" ".join(report["missing"]))
