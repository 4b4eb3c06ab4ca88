"""The real producer and a real consumer: runner exactness and the quality harness end to end."""

import json
import subprocess
import sys

import pytest
import torch

from scd_store.adapters.transformers import continue_with_prefix, prefill_capture
from scd_store.bench.quality import QualityConfig, run_quality
from scd_store.models import catalog
from scd_store.models.prepare import model_dir, read_manifest
from scd_store.models.windows import eval_windows

pytestmark = pytest.mark.slow


def test_prepared_models_are_distinct_and_fingerprinted():
    manifests = {name: read_manifest(model_dir(name)) for name in catalog.ALL_MODELS}
    assert manifests[catalog.PRODUCER]["role"] == "producer"
    fingerprints = {m["weights_fingerprint"] for m in manifests.values()}
    assert len(fingerprints) == len(catalog.ALL_MODELS)
    for name in catalog.CONSUMERS:
        assert manifests[name]["producer_fingerprint"] == manifests[catalog.PRODUCER]["weights_fingerprint"]


def test_injecting_the_consumers_own_kv_reproduces_its_forward(shakespeare):
    window = eval_windows(shakespeare.tokenizer, "shakespeare", 1, 320, seed=3)[0]
    with torch.no_grad():
        direct = shakespeare.model(input_ids=window[None]).logits[0]
    state, _ = prefill_capture(shakespeare.model, window[:256], hidden_layers=[5, 20])
    assert state.keys.shape == (30, 3, 256, 64) and state.hidden[20].shape == (256, 576)
    continued = continue_with_prefix(shakespeare.model, state, window[256:])
    assert (continued - direct[256:]).abs().max() < 1e-4


def test_producer_kv_drifts_in_the_consumer(producer, shakespeare):
    window = eval_windows(shakespeare.tokenizer, "shakespeare", 1, 160, seed=4)[0]
    own, _ = prefill_capture(shakespeare.model, window[:128])
    foreign, _ = prefill_capture(producer.model, window[:128])
    assert float((foreign.values - own.values).norm() / own.values.norm()) > 0.05
    a = continue_with_prefix(shakespeare.model, own, window[128:])
    b = continue_with_prefix(shakespeare.model, foreign, window[128:])
    assert (a - b).abs().max() > 1e-2


def test_quality_report_shape_and_invariants():
    config = QualityConfig("smollm2-135m-python", windows=2, prefix_tokens=128, continuation_tokens=16)
    report = run_quality(config, progress=False)
    methods = {m["name"]: m for m in report.methods}
    assert list(methods) == list(config.methods)
    assert methods["oracle"]["kl"] == 0 and methods["oracle"]["top1"] == 1 and methods["oracle"]["ppl_rel"] == 0
    assert methods["none"]["ppl"] > methods["oracle"]["ppl"]
    assert methods["raw"]["kl"] > 0
    assert 0.99 < methods["raw"]["payload_ratio"] < 1.02
    assert methods["int4"]["payload_ratio"] < methods["int8"]["payload_ratio"] < methods["raw"]["payload_ratio"]
    # droidspeak: 24 of 30 layers raw plus one fp16 hidden state per token, group chosen on calibration text
    start, stop = methods["droidspeak"]["layers"]
    assert stop - start == config.droidspeak_layers
    assert 0.80 < methods["droidspeak"]["payload_ratio"] < 0.90
    assert report.windows == 2 and report.prefix_tokens == 128


def test_cli_writes_the_quality_json(tmp_path):
    out = tmp_path / "q.json"
    cmd = [sys.executable, "-m", "scd_store.cli.main", "bench", "quality", "--consumer", "smollm2-135m-shakespeare",
           "--windows", "1", "--prefix-tokens", "64", "--continuation-tokens", "8", "--json", str(out),
           "--methods", "raw,int8,int4"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    data = json.loads(out.read_text())
    assert set(data) >= {"producer", "consumer", "prefix_tokens", "continuation_tokens", "windows", "methods"}
    assert {m["name"] for m in data["methods"]} == {"oracle", "raw", "int8", "int4"}  # --methods; oracle always
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    for m in data["methods"]:
        assert set(m) == {"name", "ppl", "ppl_rel", "kl", "top1", "bytes_per_token", "payload_ratio", "intervals"}
        if m["name"] != "oracle":  # every other method's measures carry their interval over the windows
            assert set(m["intervals"]) == {"kl", "top1", "ppl_rel"} and m["intervals"]["kl"]["n"] == data["windows"]
    assert {(p["a"], p["b"]) for p in data["paired"]} == set()  # no scd bundle in this run: nothing paired


def test_cli_reports_an_unknown_consumer_clearly():
    cmd = [sys.executable, "-m", "scd_store.cli.main", "bench", "quality", "--consumer", "nope"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "unknown model 'nope'" in proc.stderr and "checkpoint directory" in proc.stderr
