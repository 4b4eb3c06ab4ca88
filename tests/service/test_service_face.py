"""What adapters need of the store, on the service's face: chunk size and key chain, counters, pending puts;
and a put's bug (hashes and states that differ in count) is no uncodable KV."""

from __future__ import annotations

import logging
import threading

import pytest

from scd_store.service import KVService, UncodableChunks
from scd_store.service.hashing import chunk_hashes
from scd_store.store import keys
from tests.bundles import PRODUCER, correlated_state, write_tiny_bundle
from tests.service.test_kv_service import HASHES, chunks


@pytest.fixture
def service(store, tmp_path):
    write_tiny_bundle(tmp_path / "bundle", consumers=("consumer-a",))
    service = KVService(store, [tmp_path / "bundle"])
    yield service
    service.close()


def test_the_chunk_size_and_key_chain_are_the_stores(service):
    tokens = list(range(3 * 8 + 2))
    assert service.chunk_size == 8
    assert service.chunk_hashes(tokens) == chunk_hashes(tokens, 8) == keys.chunk_hashes(tokens, 8)
    assert service.chunk_hashes(tokens, 4) == keys.chunk_hashes(tokens, 4)


def test_counters_and_histograms_go_to_the_stores_stats(service, caplog):
    service.count("unpositioned_chunks", 3, space="tiny-space")
    assert service.stat("unpositioned_chunks") == 3 == service.stat("unpositioned_chunks", space="tiny-space")
    incidents = service.incidents(logging.getLogger("scd_store.adapters.test"))
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            incidents.count("unkeyable_requests", "scd-store: unkeyable (counted as unkeyable_requests)")
    assert service.stat("unkeyable_requests") == 2 and caplog.text.count("unkeyable (counted") == 1
    service.observe("vllm_load", 0.01)
    snapshot = service.stats_snapshot()
    assert any(c["name"] == "unpositioned_chunks" and c["value"] == 3 for c in snapshot["counters"])


def test_pending_puts_are_seen_until_stored(service):
    _, parts = chunks()
    gate = threading.Event()
    assert service.submit_put(PRODUCER, HASHES, lambda: (gate.wait(10), parts)[1])
    assert service.pending_put(HASHES[0]) and service.queued_chunks() == 3
    gate.set()
    assert service.drain(timeout=10)
    assert not service.pending_put(HASHES[0]) and service.queued_chunks() == 0
    assert service.stored_bytes("consumer-a", HASHES) > 0
    assert service.stored_bytes(PRODUCER, HASHES) == service.stored_bytes("stranger", HASHES) == 0


def test_kv_the_space_cannot_code_is_uncodable(service):
    state = correlated_state(8)
    one_head = type(state)(state.keys[:, :1].contiguous(), state.values[:, :1].contiguous())
    with pytest.raises(UncodableChunks, match="calibrated for"):
        service.put(PRODUCER, HASHES[:1], [one_head])


def test_a_hash_count_that_differs_from_the_state_count_is_a_failed_put_not_uncodable_kv(service, caplog):
    _, parts = chunks()
    done = []
    with caplog.at_level(logging.WARNING, logger="scd_store.service"):
        assert service.submit_put(PRODUCER, HASHES, lambda: parts[:2], done=done.append)
        assert service.drain(timeout=10)
    assert done == [0] and service.stat("uncodable_chunks") == 0 and service.stat("puts") == 0
    assert service.stat("failed_puts") == 3
    assert ("storing 3 chunks of 'producer-a' failed (counted as failed_puts; logged once per model and error): "
            "3 hashes for 2 states") in caplog.text
    with caplog.at_level(logging.WARNING, logger="scd_store.service"):
        assert service.submit_put(PRODUCER, HASHES, lambda: parts[:2], done=done.append)
        assert service.drain(timeout=10)
    assert service.stat("failed_puts") == 6 and caplog.text.count("failed (counted as failed_puts") == 1
