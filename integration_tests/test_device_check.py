"""The prepared GPU run (``benchmarks/device_check.sh``) works before it meets a GPU: its dry mode runs every step
on this machine's CPU at toy sizes, from an installed copy, in a venv of the GPU machine's package set
(``.venv-gpuset``, ``make gpuset``: no cryptography, constriction, redis or engine; Triton 3.6 with a NumPy its
interpreter breaks on), and writes the summary the device run writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device_check.sh"
GPUSET = Path(os.environ.get("DEVICE_CHECK_PYTHON", ROOT / ".venv-gpuset" / "bin" / "python"))
CARRIED = GPUSET.parent.parent / "wheels"
STEPS = ["pytest_cuda", "pytest_engines", "decode_smollm2_bf16", "decode_llama3_8b_bf16", "calibrate_models",
         "calibrate_cuda", "decode_smollm2_fp32", "decode_smollm2_ecsq"]
NO_GPUSET = "no venv of the GPU machine's package set: `make gpuset` builds .venv-gpuset (`make test` does)"
needs_gpuset = pytest.mark.skipif(not GPUSET.is_file(), reason=NO_GPUSET)


def dry_run(out: Path, python: Path | str, **env: str) -> dict:
    """The dry mode into ``out`` (no carried wheels unless ``DEVICE_CHECK_WHEELS`` is given); its summary."""
    env = {**os.environ, "DEVICE_CHECK_DRY": "1", "OUT": str(out), "PYTHON": str(python),
           "DEVICE_CHECK_WHEELS": str(out / "no-wheels"), **env}
    env.pop("PYTHONPATH", None)
    env.pop("SCD_STORE_SIGNING_KEYS", None)  # integration_tests' session keys: the GPU machine has none set
    # under make test's 900 s per test, so a stuck script is reported with its output
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "device_check.json").read_text())


@needs_gpuset
def test_the_dry_run_in_the_gpu_package_set_runs_every_step_and_notes_what_is_missing(tmp_path):
    summary = dry_run(tmp_path, GPUSET)
    assert [s["name"] for s in summary["steps"]] == STEPS
    assert summary["ok"], summary["steps"]
    assert {"cryptography", "constriction", "redis", "vllm"} <= set(summary["packages"]["missing"])
    ecsq = summary["steps"][-1]
    assert ecsq["skipped"] == "no constriction" and ecsq["optional"]  # a note, not a failure
    assert any(n.startswith("missing cryptography") for n in summary["notes"])
    assert all(s["rc"] == 0 for s in summary["steps"][:-1])
    cuda, engines = summary["pytest"]["pytest_cuda"], summary["pytest"]["pytest_engines"]
    assert cuda["passed"] > 20 and engines["passed"] > 0 and not cuda.get("failed") and not engines.get("failed")
    reasons = " ".join(cuda["skip_reasons"])
    assert "cryptography" in reasons  # the signed GPU-tier tests, with their reason
    assert "interpreter does not work with NumPy" in reasons  # Triton 3.6 beside NumPy 2.4
    assert set(summary["decode"]) == {"decode_smollm2_bf16", "decode_llama3_8b_bf16", "decode_smollm2_fp32"}
    for report in summary["decode"].values():
        assert report["results"] and all(row["decode_best_ms"] > 0 for row in report["results"])
        assert report["fused_kernel"].startswith("not timed") and report["fit_s"] > 0
    assert set(summary["fused_kernel"]) == set(summary["decode"])
    (consumer,) = summary["calibrate"]["consumers"].values()
    assert consumer["steps"] == 2 and consumer["kl_last"] is not None


@needs_gpuset
@pytest.mark.skipif(not CARRIED.is_dir(), reason="no carried wheels in .venv-gpuset/wheels (`make gpuset`)")
def test_carried_wheels_are_installed_and_their_steps_run(tmp_path):
    """A .whl folder's wheels go into the run's install: constriction's range-coded step then runs, and with
    cryptography the stores sign again (the steps' env keeps SCD_STORE_ALLOW_UNSIGNED unset)."""
    summary = dry_run(tmp_path, GPUSET, DEVICE_CHECK_WHEELS=str(CARRIED), DEVICE_CHECK_ONLY="decode_smollm2_ecsq")
    assert len(summary["packages"]["carried_wheels"]) == len(list(CARRIED.glob("*.whl")))
    assert {"cryptography", "constriction"} <= set(summary["packages"]["present"])
    assert not {"cryptography", "constriction"} & set(summary["packages"]["missing"])
    assert summary["ok"] and [s["name"] for s in summary["steps"] if s["rc"] == 0] == ["decode_smollm2_ecsq"]
    assert all(row["packing"] == "ans-1" for row in summary["decode"]["decode_smollm2_ecsq"]["results"])


def test_a_spent_budget_skips_the_remaining_steps_and_still_summarises(tmp_path):
    summary = dry_run(tmp_path, GPUSET if GPUSET.is_file() else sys.executable, DEVICE_CHECK_BUDGET_S="1")
    skipped = [s for s in summary["steps"] if not s.get("optional")]
    assert skipped and all(s.get("skipped") == "budget spent" for s in skipped) and not summary["ok"]
    assert "present" in summary["packages"]  # the census comes first, whatever the budget


def test_the_summary_reads_pytest_counts_and_notes_skipped_steps(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from device_check_summary import summarise
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    steps = [{"name": "pytest_cuda", "rc": 0, "seconds": 3},
             {"name": "decode_smollm2_ecsq", "rc": None, "seconds": 0, "skipped": "no constriction", "optional": True}]
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (tmp_path / "pytest_cuda.log").write_text(
        "SKIPPED [2] tests/store/test_gpu_tier.py:119: signs or verifies blobs: needs the 'cryptography' package\n"
        "SKIPPED [1] tests/codecs/test_scd_fused.py:75: needs CUDA\n"
        "12 passed, 3 skipped, 40 deselected in 9.1s\n")
    (tmp_path / "packages.json").write_text(json.dumps(
        {"present": {"torch": "2.11.0"}, "missing": {"constriction": {"why": "x", "without it": "the ecsq step"}},
         "carried_wheels": []}))
    (tmp_path / "decode_smollm2_bf16.json").write_text(json.dumps(
        {"geometry": "smollm2-135m", "fused_kernel": "fallback: TypeError", "fit_s": 1.0,
         "results": [{"prefix_tokens": 448, "decode_best_ms": 1.0, "fused_kernel": "fallback: TypeError"}]}))
    summary = summarise(tmp_path)
    assert summary["ok"]
    assert summary["pytest"]["pytest_cuda"] == {
        "passed": 12, "skipped": 3, "deselected": 40,
        "skip_reasons": {"signs or verifies blobs: needs the 'cryptography' package": 2, "needs CUDA": 1}}
    assert summary["notes"] == ["missing constriction: the ecsq step",
                                "step decode_smollm2_ecsq skipped: no constriction"]
    assert summary["fused_kernel"] == {"decode_smollm2_bf16": "fallback: TypeError"}
    assert summary["decode"]["decode_smollm2_bf16"]["results"][0]["fused_kernel"] == "fallback: TypeError"
    (tmp_path / "steps.jsonl").write_text(json.dumps({**steps[1], "optional": False}) + "\n")  # a core package
    assert not summarise(tmp_path)["ok"]


def test_the_bench_says_which_decode_the_fused_variant_ran(monkeypatch):
    """``fused_kernel``: unavailable where the kernel cannot run, the fallback and its reason where it raised
    (the codec goes on with the PyTorch decode, so the time alone does not tell), triton where it ran."""
    pytest.importorskip("triton")
    from scd_store.bench import decode as bench
    from scd_store.codecs.scd import codec as codec_module
    from scd_store.codecs.scd.codec import ScdCodec
    from tests.codecs.test_scd_fused import space_and_decoder, state

    space, decoder = space_and_decoder()
    payload = ScdCodec(space, decoder).encode(state(20, 0, seed=0))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert bench.fused_kernel_state(ScdCodec(space, decoder, fused_kernel=True), "cpu", []).startswith("unavailable")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # available on the CPU: the stand-ins below are what "runs"

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel today")

    def stand_in(sorted_codes, rows, matrix, offset, cos, sin, keys, values):
        keys.zero_(), values.zero_()

    for kernel, want in ((broken, "fallback: fused SCD decode kernel unavailable (no kernel today)"),
                         (stand_in, "triton")):
        monkeypatch.setattr(codec_module.fused, "fused_decode", kernel)
        codec = ScdCodec(space, decoder, cuda_graphs=False, fused_kernel=True)
        warnings = bench._KernelWarnings()
        codec_module.log.addHandler(warnings)
        try:
            with torch.no_grad():
                codec.decode(payload, device="cpu")
        finally:
            codec_module.log.removeHandler(warnings)
        assert bench.fused_kernel_state(codec, "cpu", warnings.messages).startswith(want)
    assert bench.kernels_summary([{"fused_kernel": "triton"}, {"fused_kernel": "triton"}], True) == "triton"
    assert bench.kernels_summary([], False).startswith("not timed")
