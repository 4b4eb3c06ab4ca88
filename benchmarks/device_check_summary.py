"""Summarise a device check's run into ``OUT/device_check.json``: the packages (``packages.json``: versions, what
is missing and what that costs, the carried wheels), each step's rc and seconds (``steps.jsonl``), the machine
(``gpu.txt``, ``versions.txt``), per pytest step its counts and skip reasons, per decode bench its geometry, which
decode its fused variant ran (``fused_kernel``: the Triton kernel, or the PyTorch fallback and why) and per prefix
length the best decode and prefill times and their ratio, and the calibration's distillation figures. ``ok``: every
step ran and passed, but those skipped for a package the machine is known to lack or left out by
``DEVICE_CHECK_ONLY`` (``notes`` lists them).

    python benchmarks/device_check_summary.py OUT
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

DECODE_FIELDS = ("prefix_tokens", "payload_ratio", "decode_best_ms", "prefill_best_ms", "decode_vs_prefill",
                 "decode_into_best_ms", "decode_eager_best_ms", "decode_fused_best_ms", "fused_kernel",
                 "decode_fused_error", "decode_from_host_best_ms", "graph_replays", "packing",
                 "decode_planes-2_best_ms", "payload_planes-2_ratio")
COUNTS = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)")
SKIP = re.compile(r"^SKIPPED \[(\d+)\] [^:]+:\d+: (.*)$")


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
            "products": report.get("products"), "fused_kernel": report.get("fused_kernel"),
            "fit_s": report.get("fit_s"),
            "results": [{k: row[k] for k in DECODE_FIELDS if k in row} for row in report.get("results", [])]}


def _calibration(report: dict) -> dict:
    out = {"seconds": report.get("seconds")}
    for bundle in report.get("bundles", {}).values():
        out["payload_ratio"] = bundle.get("payload_ratio")
        out["consumers"] = {name: {k: c.get(k) for k in ("steps", "windows", "device", "kl_first", "kl_last",
                                                         "train_seconds")}
                            for name, c in bundle.get("consumers", {}).items()}
    return out


def pytest_counts(log: Path) -> dict:
    """A pytest run's closing counts (``passed``, ``skipped``, ...) and its skip reasons with their counts."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    counts: dict = {}
    for line in reversed(lines):
        found = COUNTS.findall(line)
        if found and (" in " in line or line.startswith("=")):
            counts = {("errors" if kind.startswith("error") else kind): int(n) for n, kind in found}
            break
    reasons: dict[str, int] = {}
    for line in lines:
        match = SKIP.match(line)
        if match:
            reasons[match.group(2)[:240]] = reasons.get(match.group(2)[:240], 0) + int(match.group(1))
    return {**counts, "skip_reasons": reasons}


def _notes(steps: list[dict], packages: dict | None) -> list[str]:
    notes = []
    for name, info in (packages or {}).get("missing", {}).items():
        notes.append(f"missing {name}: {info.get('without it')}")
    for s in steps:
        if s.get("skipped"):
            notes.append(f"step {s['name']} skipped: {s['skipped']}")
    return notes


def summarise(out: Path) -> dict:
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines() if line.strip()]
    packages = json.loads((out / "packages.json").read_text()) if (out / "packages.json").is_file() else None
    summary: dict = {"ok": bool(steps) and all(s.get("rc") == 0 or (s.get("skipped") and s.get("optional"))
                                               for s in steps),
                     "steps": steps}
    for name in ("gpu", "versions"):
        if (out / f"{name}.txt").is_file():
            summary[name] = (out / f"{name}.txt").read_text().strip()
    if packages is not None:
        summary["packages"] = packages
    summary["notes"] = _notes(steps, packages)
    summary["pytest"] = {s["name"]: pytest_counts(out / f"{s['name']}.log") for s in steps
                         if s["name"].startswith("pytest") and s.get("rc") is not None}
    summary["decode"] = {p.stem: _decode(json.loads(p.read_text())) for p in sorted(out.glob("decode_*.json"))}
    summary["fused_kernel"] = {name: report["fused_kernel"] for name, report in summary["decode"].items()}
    calibration = _json_tail(out / "calibrate_cuda.json")
    if calibration is not None:
        summary["calibrate"] = _calibration(calibration)
    return summary


if __name__ == "__main__":
    target = Path(sys.argv[1])
    (target / "device_check.json").write_text(json.dumps(summarise(target), indent=2) + "\n")
