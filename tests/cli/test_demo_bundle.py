"""The demo's bundle: the one kept with scd-store when it fits the models' weights; otherwise one calibrated at
the defaults, once, and cached by the models' fingerprints. A stale or tampered bundle is never served."""

from __future__ import annotations

import json
import types

import pytest
from rich.console import Console

from scd_store.cli.demo import run as demo
from scd_store.models.catalog_bundle import bundle_misfit
from tests.bundles import write_tiny_bundle

CONSUMERS = ("consumer-a", "consumer-b")


def _models(producer_fp: str = "producer-fp", suffix: str = "-fp"):
    producer = types.SimpleNamespace(name="producer", fingerprint=producer_fp)
    return producer, [types.SimpleNamespace(name=name, fingerprint=name + suffix) for name in CONSUMERS]


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    path = tmp_path / "shipped"
    write_tiny_bundle(path, CONSUMERS)
    monkeypatch.setattr(demo, "CATALOG_BUNDLE", path)
    monkeypatch.setenv("SCD_STORE_HOME", str(tmp_path / "home"))
    calls: list = []

    def calibrate(producer, consumers, out):  # stands in for the 900-step calibration at the defaults
        calls.append((producer, list(consumers)))
        write_tiny_bundle(out, tuple(consumers), fingerprint_suffix="-retrained")

    monkeypatch.setattr("scd_store.adapters.transformers.calibration.calibrate", calibrate)
    return path, calls


def _bundle(producer, consumers):
    return demo.demo_bundle(demo.DemoConfig(), producer, consumers, Console(quiet=True))


def test_the_kept_bundle_is_served_when_it_fits_the_weights(shipped):
    path, calls = shipped
    assert _bundle(*_models()) == path and calls == []


def test_a_stale_kept_bundle_is_not_served_a_calibrated_one_is_once(shipped):
    path, calls = shipped
    producer, consumers = _models(suffix="-retrained")  # other consumer weights than the bundle's
    assert "calibrated for consumer weights" in bundle_misfit(path, producer.fingerprint,
                                                              {c.name: c.fingerprint for c in consumers})
    first = _bundle(producer, consumers)
    assert first != path and calls == [("producer", list(CONSUMERS))]
    assert _bundle(producer, consumers) == first and len(calls) == 1  # cached: no second calibration
    assert "calibrated for producer" in bundle_misfit(path, "other-producer", {})


def test_a_tampered_kept_bundle_is_not_served(shipped):
    path, calls = shipped
    manifest = path / "pairs" / "consumer-b.json"
    data = json.loads(manifest.read_text())
    data["content_fingerprint"] = "0" * 32
    manifest.write_text(json.dumps(data))
    assert _bundle(*_models()) != path and len(calls) == 1
    (path / "pairs" / "consumer-a.safetensors").unlink()
    assert bundle_misfit(path, "producer-fp", {"consumer-a": "consumer-a-fp"}) is not None
