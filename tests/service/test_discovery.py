"""Pairs registered after a service started (``scd-store register``) are bound when first asked for."""

import json
import time

import torch

from scd_store.cli.main import main
from scd_store.service import KVService
from scd_store.service.bundles import register_bundle
from scd_store.store.registry import FileRegistry
from tests.bundles import PRODUCER, chunked, write_tiny_bundle

HASHES = [bytes([i]) * 16 for i in range(2)]


def counter(service, name):
    return sum(c["value"] for c in service.store.stats.snapshot()["counters"] if c["name"] == name)


def parts():
    return chunked(2, 8, seed=3)


def test_a_pair_registered_later_is_bound_on_its_models_first_request(store, tmp_path):
    first, later = tmp_path / "first", tmp_path / "later"
    write_tiny_bundle(first, consumers=("consumer-a",))
    service = KVService(store, [first], discovery_interval_s=0)  # rounds driven by hand
    assert service.put(PRODUCER, HASHES, parts()) == 2
    assert service.contains("newcomer", HASHES) == 0 and service.discovery.poll_once() == []  # not registered
    # the same space, with a decoder for a fine-tune that came later, in its own bundle directory
    write_tiny_bundle(later, consumers=("consumer-a", "newcomer"))
    register_bundle(later, FileRegistry(tmp_path / "reg.json"), chunk_size=8)
    assert service.discovery.poll_once() == ["newcomer"]
    assert service.contains("newcomer", HASHES) == 2 and len(service.get("newcomer", HASHES)) == 2
    assert service.binding("newcomer").space is service.binding(PRODUCER).space  # the space is not loaded twice
    assert counter(service, "discovered_models") == 1
    service.close()


def test_discovery_runs_on_its_own_thread_within_its_interval(store, tmp_path):
    bundle = tmp_path / "b"
    write_tiny_bundle(bundle, consumers=("consumer-a",))
    service = KVService(store, [bundle], models=(), discovery_interval_s=0.05)
    assert service.models() == {PRODUCER: "producer"}  # models=(): no decoder loaded at start
    assert service.binding("consumer-a") is None  # asked for: discovery loads this one decoder
    deadline = time.monotonic() + 5
    while service.binding("consumer-a") is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert service.models() == {PRODUCER: "producer", "consumer-a": "consumer"}
    service.close()


def test_a_moved_or_altered_bundle_is_not_bound(store, tmp_path):
    bundle = tmp_path / "b"
    write_tiny_bundle(bundle, consumers=("consumer-a",))
    register_bundle(bundle, store.registry, chunk_size=8)
    service = KVService(store, [], discovery_interval_s=0)
    pair = bundle / "pairs" / "consumer-a.safetensors"
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(pair))
    tensors["bias"] = tensors["bias"] + torch.ones_like(tensors["bias"])
    save_file(tensors, str(pair))  # no longer the registered decoder
    assert service.binding("consumer-a") is None and service.discovery.poll_once() == []
    assert counter(service, "discovery_errors") == 1
    assert service.binding(PRODUCER) is None and service.discovery.poll_once() == [PRODUCER]  # its space is intact
    service.close()


def registered_bundle(tmp_path):
    """A tiny bundle of two pairs, registered with ``scd-store register`` in a file registry; its store config."""
    bundle = tmp_path / "b"
    write_tiny_bundle(bundle, consumers=("consumer-a", "consumer-b"))
    config = tmp_path / "store.yaml"
    config.write_text(json.dumps({"tiers": [{"kind": "cpu"}], "registry_path": str(tmp_path / "reg.json")}))
    assert main(["register", str(bundle), "--store-config", str(config)]) == 0
    return bundle, config


def test_register_and_pairs_commands(tmp_path, capsys):
    bundle, config = registered_bundle(tmp_path)
    assert main(["pairs", "--store-config", str(config), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out.split("\n", 3)[-1])
    (space,) = listed["spaces"]
    assert space["producer"] == PRODUCER and space["bundle"] == str(bundle.resolve())
    assert [p["consumer"] for p in space["pairs"]] == ["consumer-a", "consumer-b"]
    assert all(p["fingerprint"] and p["bundle"] == str(bundle.resolve()) for p in space["pairs"])
    assert main(["register", str(tmp_path), "--store-config", str(config)]) == 2  # not a bundle: a clear error


def test_revoke_command(tmp_path, capsys):
    _, config = registered_bundle(tmp_path)
    registry = FileRegistry(tmp_path / "reg.json")
    version = registry.version()
    assert main(["revoke", "tiny-space/consumer-a", "--store-config", str(config)]) == 0
    assert "revoked tiny-space/consumer-a@v3." in capsys.readouterr().out
    assert [p.consumer_model_id for p in registry.pairs()] == ["consumer-b"] and registry.version() > version
    assert main(["revoke", "tiny-space", "--fingerprint", "not-this-one", "--store-config", str(config)]) == 1
    assert main(["revoke", "tiny-space", "--store-config", str(config)]) == 0  # the space and its last pair
    assert registry.spaces() == [] and registry.pairs() == [] and registry.locations() == {}
