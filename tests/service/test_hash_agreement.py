"""Producers record how their engine hashes chunks; a consumer that hashes differently fails loudly."""

from __future__ import annotations

import pytest

from scd_store.service import KVService
from scd_store.service.hash_agreement import HashCanary, HashMismatch, canary_tokens, mismatch_message
from scd_store.store.registry import FileRegistry
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier
from tests.bundles import PRODUCER, write_tiny_bundle

HASHES = [bytes([i]) * 16 for i in range(2)]
SEEDED = {"PYTHONHASHSEED": "0", "pre_caching_hash_algorithm": "builtin"}


def canary(value="aa", chunk=256, engine="lmcache", **settings) -> HashCanary:
    return HashCanary(engine, chunk, value, {**SEEDED, **settings})


@pytest.fixture
def services(tmp_path):
    write_tiny_bundle(tmp_path / "bundle")
    registry = FileRegistry(tmp_path / "registry.json")
    stores = [TieredStore([CpuTier(1 << 20)], registry, chunk_size=8) for _ in range(2)]
    yield [KVService(store, [tmp_path / "bundle"]) for store in stores]
    for store in stores:
        store.close()


def test_a_consumer_that_hashes_like_its_producer_passes(services):
    producer, consumer = services
    producer.check_hashing(PRODUCER, canary())
    consumer.check_hashing("consumer-a", canary())
    assert consumer.hashing.ok(consumer.binding("consumer-a"))


def test_another_chunk_size_fails_at_start_names_the_fix_and_counts(services):
    producer, consumer = services
    producer.check_hashing(PRODUCER, canary(chunk=256))
    with pytest.raises(HashMismatch, match="chunk size: producer 256, here 512"):
        consumer.check_hashing("consumer-a", canary(value="bb", chunk=512))
    assert consumer.store.stats.value("hash_mismatch") == 1
    assert consumer.contains("consumer-a", HASHES, tokens=16) == 0 and consumer.get("consumer-a", HASHES) == []
    assert consumer.store.stats.value("requested_tokens") == 0  # nothing asked that could be answered


def test_a_consumer_that_starts_first_is_checked_on_its_lookups(services):
    producer, consumer = services
    consumer.hashing.recheck_s = 0.0
    consumer.check_hashing("consumer-a", canary(value="bb", PYTHONHASHSEED="7"))  # no producer record yet
    assert consumer.contains("consumer-a", HASHES) == 0  # nothing stored, but not refused either
    producer.check_hashing(PRODUCER, canary(value="aa"))
    binding = consumer.binding("consumer-a")
    assert not consumer.hashing.ok(binding) and not consumer.hashing.ok(binding)
    assert consumer.store.stats.value("hash_mismatch") == 1  # counted once


def test_messages_say_what_differs():
    mine = canary(value="bb", engine="sglang")
    assert "stores through lmcache" in mismatch_message("s", mine, canary().record("p"))
    seed = mismatch_message("s", canary(value="bb", PYTHONHASHSEED="1"), canary().record("p"))
    assert "PYTHONHASHSEED: producer '0', here '1'" in seed
    random = mismatch_message("s", canary(value="bb"), canary().record("p"))
    assert "random per process" in random
    assert mismatch_message("s", canary(), canary().record("p")) is None
    assert len(canary_tokens(16)) == 32 and canary_tokens(16) == canary_tokens(16)
