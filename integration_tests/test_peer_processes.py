"""The peer tier between OS processes over NIXL: a consumer process reads the code blobs a producer
process holds in its registered memory, through its store's tier walk; when the producer is gone,
reads are misses within their timeout, never a hang."""

from __future__ import annotations

import json
import time

import pytest
import torch
import yaml
from safetensors.torch import load_file

from integration_tests.engine_processes import chunks_of
from integration_tests.processes import JsonLineProcess
from scd_store.codecs.scd.bundle import load_pair, load_space
from scd_store.codecs.scd.codec import ScdCodec
from scd_store.store.transfer.factory import nixl_available
from tests.bundles import PRODUCER, write_tiny_bundle

TOKENS, CHUNK = 40, 8


def store_yaml(path, peers, publish: bool) -> str:
    path.write_text(yaml.safe_dump({
        "chunk_size": CHUNK, "registry_path": str(peers.parent / "registry.json"),
        "tiers": [{"kind": "cpu", "max_bytes": "16MiB"},
                  {"kind": "peer", "path": str(peers), "max_bytes": "16MiB", "publish": publish,
                   "transfer": "nixl"}]}))
    return str(path)


def process(role: str, bundle, yaml_path: str, env: dict) -> JsonLineProcess:
    settings = {"bundles": [str(bundle)], "store_config": yaml_path}
    return JsonLineProcess("integration_tests.engine_processes", [role, "--settings", json.dumps(settings)], env)


def producer_and_consumer(tmp_path, signing_keys):
    """A producer process publishing into a peer directory and a consumer process holding the public key only
    (it verifies the producer's entries and blobs, and can sign nothing)."""
    bundle = tmp_path / "bundle"
    write_tiny_bundle(bundle, consumers=("consumer-a",))
    peers = tmp_path / "peers"
    env = {"SCD_STORE_HOME": str(tmp_path / "home")}
    producer = process("producer", bundle, store_yaml(tmp_path / "producer.yaml", peers, True), env)
    consumer = process("consumer", bundle, store_yaml(tmp_path / "consumer.yaml", peers, False),
                       {**env, "SCD_STORE_SIGNING_KEYS": str(signing_keys["public"])})
    return bundle, peers, producer, consumer


@pytest.mark.skipif(not nixl_available(), reason="NIXL with UCX is installed by make test")
def test_a_consumer_process_reads_a_producer_process_memory_over_nixl(tmp_path, signing_keys):
    bundle, peers, producer, consumer = producer_and_consumer(tmp_path, signing_keys)
    try:
        assert producer.ask({"put": {"model": PRODUCER, "tokens": TOKENS, "seed": 2, "chunk": CHUNK}})["drained"]
        (log,) = peers.glob("*.jsonl")
        entries = [json.loads(line) for line in log.read_text().splitlines()]
        assert len(entries) == TOKENS // CHUNK and all(e[5] == "integration" and len(e[6]) == 128 for e in entries)
        out = str(tmp_path / "got.safetensors")
        got = consumer.ask({"get": {"model": "consumer-a", "tokens": TOKENS, "chunk": CHUNK, "out": out}})
        assert got["chunks"] == TOKENS // CHUNK and got["hits_by_tier"]["peer"] == TOKENS // CHUNK
        space = load_space(bundle)
        codec = ScdCodec(space, load_pair(bundle, "consumer-a", space))
        want = [codec.decode(codec.encode(part)) for part in chunks_of(TOKENS, CHUNK, seed=2)]
        assert torch.allclose(load_file(out)["keys"], torch.cat([s.keys for s in want], 2), atol=1e-5)

        assert producer.ask({"put": {"model": PRODUCER, "tokens": 2 * TOKENS, "seed": 3, "chunk": CHUNK}})["drained"]
        producer.close()  # its memory is gone; the directory still names it
        t0 = time.monotonic()
        gone = consumer.ask({"get": {"model": "consumer-a", "tokens": 2 * TOKENS, "chunk": CHUNK,
                                     "out": str(tmp_path / "gone.safetensors")}})
        # the first chunks were promoted into the consumer's CPU tier; the producer's new ones are misses
        assert gone["chunks"] == TOKENS // CHUNK and gone["hits_by_tier"]["peer"] == TOKENS // CHUNK
        assert time.monotonic() - t0 < 30  # within the read timeout, not a hang
    finally:
        producer.close(), consumer.close()


@pytest.mark.skipif(not nixl_available(), reason="NIXL with UCX is installed by make test")
def test_a_consumer_process_refuses_a_source_info_swapped_to_another_agent(tmp_path, signing_keys):
    from scd_store.store.transfer import SourceInfo
    from scd_store.store.transfer.nixl_transfer import NixlBlobSource

    _, peers, producer, consumer = producer_and_consumer(tmp_path, signing_keys)
    attacker = NixlBlobSource(1 << 20)  # an agent of whoever can write the directory
    try:
        assert producer.ask({"put": {"model": PRODUCER, "tokens": TOKENS, "seed": 2, "chunk": CHUNK}})["drained"]
        (info_path,) = peers.glob("*.info")
        genuine, evil = info_path.read_bytes(), attacker.info()
        info_path.write_bytes(SourceInfo(info_path.stem, "nixl", "DRAM", evil.base, evil.size, 0,
                                         evil.agent_metadata).to_bytes())
        ask = {"model": "consumer-a", "tokens": TOKENS, "chunk": CHUNK, "out": str(tmp_path / "got.safetensors")}
        refused = consumer.ask({"get": ask})
        assert refused["chunks"] == 0 and refused["hits_by_tier"]["peer"] == 0
        info_path.write_bytes(genuine)
        assert consumer.ask({"get": ask})["hits_by_tier"]["peer"] == TOKENS // CHUNK
    finally:
        producer.close(), consumer.close()
        attacker.close()
