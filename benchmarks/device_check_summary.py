"""Summarise a device check's run into ``OUT/device_check.json``: each step's rc and seconds (``steps.jsonl``),
the machine (``gpu.txt``, ``versions.txt``), per decode bench its geometry and per prefix length the best
decode and prefill times and their ratio, and the calibration's distillation figures.

    python benchmarks/device_check_summary.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DECODE_FIELDS = ("prefix_tokens", "payload_ratio", "decode_best_ms", "prefill_best_ms", "decode_vs_prefill",
                 "decode_into_best_ms", "decode_eager_best_ms", "decode_fused_best_ms", "decode_from_host_best_ms",
                 "graph_replays", "packing", "decode_planes-2_best_ms", "payload_planes-2_ratio")


def _json_tail(path: Path) -> dict | None:
    """The JSON object a command printed last (from its last line that is a lone ``{``), or None."""
    if not path.is_file():
        return None
    lines = path.read_text(errors="replace").splitlines()
    starts = [i for i, line in enumerate(lines) if line == "{"]
    for start in reversed(starts):
        try:
            return json.loads("\n".join(lines[start:]))
        except json.JSONDecodeError:
            continue
    return None


def _decode(report: dict) -> dict:
    return {"geometry": report.get("geometry"), "dtype": report.get("dtype"), "device": report.get("device"),
            "products": report.get("products"),
            "results": [{k: row[k] for k in DECODE_FIELDS if k in row} for row in report.get("results", [])]}


def _calibration(report: dict) -> dict:
    out = {"seconds": report.get("seconds")}
    for bundle in report.get("bundles", {}).values():
        out["payload_ratio"] = bundle.get("payload_ratio")
        out["consumers"] = {name: {k: c.get(k) for k in ("steps", "windows", "device", "kl_first", "kl_last",
                                                         "train_seconds")}
                            for name, c in bundle.get("consumers", {}).items()}
    return out


def summarise(out: Path) -> dict:
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines() if line.strip()]
    summary: dict = {"steps": steps, "ok": all(s.get("rc") == 0 for s in steps if not s.get("optional"))}
    for name in ("gpu", "versions"):
        if (out / f"{name}.txt").is_file():
            summary[name] = (out / f"{name}.txt").read_text().strip()
    summary["decode"] = {p.stem: _decode(json.loads(p.read_text())) for p in sorted(out.glob("decode_*.json"))}
    calibration = _json_tail(out / "calibrate_cuda.json")
    if calibration is not None:
        summary["calibrate"] = _calibration(calibration)
    return summary


if __name__ == "__main__":
    target = Path(sys.argv[1])
    (target / "device_check.json").write_text(json.dumps(summarise(target), indent=2) + "\n")
