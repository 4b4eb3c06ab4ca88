"""The prepared GPU run (``benchmarks/device_check.sh``) works before it meets a GPU: its dry mode runs every
step on this machine's CPU at toy sizes and writes the summary the device run writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["pytest_cuda", "pytest_engines", "decode_smollm2_bf16", "decode_llama3_8b_bf16", "calibrate_models",
         "calibrate_cuda", "decode_smollm2_fp32", "decode_smollm2_ecsq"]


def test_the_dry_run_runs_every_step_and_writes_the_summary(tmp_path):
    env = {**os.environ, "DEVICE_CHECK_DRY": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "device_check.sh")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "device_check.json").read_text())
    assert [s["name"] for s in summary["steps"]] == STEPS
    assert summary["ok"], summary["steps"]
    assert set(summary["decode"]) == {"decode_smollm2_bf16", "decode_llama3_8b_bf16", "decode_smollm2_fp32",
                                      "decode_smollm2_ecsq"}
    assert all(row["packing"] == "ans-1" for row in summary["decode"]["decode_smollm2_ecsq"]["results"])
    for report in summary["decode"].values():
        assert report["results"] and all(row["decode_best_ms"] > 0 for row in report["results"])
    (consumer,) = summary["calibrate"]["consumers"].values()
    assert consumer["steps"] == 2 and consumer["kl_last"] is not None


def test_a_spent_budget_skips_the_remaining_steps_and_still_summarises(tmp_path):
    env = {**os.environ, "DEVICE_CHECK_DRY": "1", "OUT": str(tmp_path), "PYTHON": sys.executable,
           "DEVICE_CHECK_BUDGET_S": "10"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "device_check.sh")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "device_check.json").read_text())
    assert all(s.get("skipped") == "budget spent" for s in summary["steps"]) and not summary["ok"]
