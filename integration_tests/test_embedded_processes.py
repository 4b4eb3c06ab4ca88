"""The embedded default (CPU + disk + file registry) across OS processes on one host: a consumer
process that started before the producer wrote finds the producer's codes, both processes may name
the same metrics port, and ``scd-store stats`` shows both."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from integration_tests.engine_processes import chunks_of
from integration_tests.processes import ROOT, JsonLineProcess
from scd_store.bench.vllm_server import free_port
from scd_store.codecs.scd.bundle import load_pair, load_space
from scd_store.codecs.scd.codec import ScdCodec
from tests.bundles import PRODUCER, write_tiny_bundle

TOKENS, CHUNK = 40, 8


def EngineProcess(role: str, settings: dict, env: dict) -> JsonLineProcess:  # noqa: N802 - reads like a class
    """One ``integration_tests.engine_processes`` process."""
    return JsonLineProcess("integration_tests.engine_processes", [role, "--settings", json.dumps(settings)], env)


@pytest.fixture
def deployment(tmp_path):
    bundle = tmp_path / "bundle"
    write_tiny_bundle(bundle, consumers=("consumer-a",))
    store_yaml = tmp_path / "store.yaml"
    store_yaml.write_text(yaml.safe_dump({
        "chunk_size": CHUNK, "metrics_port": free_port(),  # one port for both: the second cannot bind it
        "tiers": [{"kind": "cpu", "max_bytes": "16MiB"}, {"kind": "disk", "path": str(tmp_path / "disk"),
                                                           "max_bytes": "64MiB"}],
        "registry_path": str(tmp_path / "registry.json")}))
    env = {**os.environ, "SCD_STORE_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)}  # for the CLI runs too
    settings = {"bundles": [str(bundle)], "store_config": str(store_yaml)}
    return bundle, settings, env, tmp_path


def test_a_consumer_process_reads_what_a_producer_process_wrote_after_it_started(deployment):
    bundle, settings, env, tmp = deployment
    consumer = EngineProcess("consumer", settings, env)  # starts first: its disk index is empty
    producer = EngineProcess("producer", settings, env)
    try:
        assert producer.ready["models"][PRODUCER] == "producer"
        assert producer.ask({"put": {"model": PRODUCER, "tokens": TOKENS, "seed": 4, "chunk": CHUNK}}) == {
            "queued": True, "drained": True}
        got = consumer.ask({"get": {"model": "consumer-a", "tokens": TOKENS, "chunk": CHUNK,
                                    "out": str(tmp / "got.safetensors")}})
        assert {k: got[k] for k in ("found", "chunks", "starts")} == {"found": 5, "chunks": 5,
                                                                      "starts": [0, 8, 16, 24, 32]}
        assert got["hits_by_tier"]["disk"] == 5
    finally:
        errors = [producer.close(), consumer.close()]
    space = load_space(bundle)
    codec = ScdCodec(space, load_pair(bundle, "consumer-a", space))
    want = [codec.decode(codec.encode(part)) for part in chunks_of(TOKENS, CHUNK, seed=4)]
    decoded = load_file(str(tmp / "got.safetensors"))
    assert torch.allclose(decoded["keys"], torch.cat([s.keys for s in want], 2), atol=1e-5)
    assert torch.allclose(decoded["values"], torch.cat([s.values for s in want], 2), atol=1e-5)
    assert sum("cannot serve metrics on port" in e for e in errors) == 1  # the second process warned, and worked

    stats = subprocess.run([sys.executable, "-m", "scd_store.cli.main", "stats", "--config",
                            settings["store_config"], "--json"], cwd=ROOT, env=env, capture_output=True,
                           text=True, check=True)
    view = json.loads(stats.stdout)
    assert len(view["processes"]) == 2
    (pair,) = view["summary"]["pairs"]
    assert (pair["requested_tokens"], pair["hit_tokens"], pair["hit_rate"]) == (TOKENS, TOKENS, 1.0)
    table = subprocess.run([sys.executable, "-m", "scd_store.cli.main", "stats", "--config",
                            settings["store_config"]], cwd=ROOT, env={**env, "COLUMNS": "200"},
                           capture_output=True, text=True, check=True).stdout
    assert "per engine process" in table and "100.0%" in table
