"""The store's faces: only a space's producer writes, only registered consumers read."""

from __future__ import annotations

import pytest

from scd_store.store.registry import NotAuthorized, NotRegistered
from tests.store.conftest import HASHES, PAYLOADS, put_all


def test_only_the_producer_writes_its_space(store) -> None:
    with pytest.raises(NotAuthorized, match="consumer-m"):
        store.producer("space-a", "consumer-m", "space-fp")
    with pytest.raises(NotRegistered):
        store.producer("space-b", "producer-m", "space-fp")
    view = store.consumer("pair-a", "consumer-m", "space-fp")
    assert not hasattr(view, "put")


def test_unregistered_consumer_gets_clear_error(store) -> None:
    with pytest.raises(NotRegistered, match="pair 'nope' .*is not registered"):
        store.consumer("nope", "consumer-m", "space-fp")
    with pytest.raises(NotRegistered, match="'intruder' is not registered for pair 'pair-a'"):
        store.consumer("pair-a", "intruder", "space-fp")


def test_producer_view_and_mismatched_payloads(store, consumer) -> None:
    view = store.producer("space-a", "producer-m", "space-fp")
    view.put(HASHES[:2], PAYLOADS[:2], [4, 4], codec_id="raw")
    assert view.contains(HASHES) == 2
    assert consumer.get(HASHES)[0].meta.codec_id == "raw"
    with pytest.raises(ValueError, match="6 keys, 7 payloads and 6 token counts must match"):
        view.put(HASHES, PAYLOADS + [b"x"], [4] * 6, codec_id="raw")


def test_a_partial_last_chunk_keeps_its_token_count(store, consumer) -> None:
    store.producer("space-a", "producer-m", "space-fp").put(HASHES[:2], PAYLOADS[:2], [4, 3], codec_id="raw")
    assert [c.token_count for c in consumer.get(HASHES)] == [4, 3]


def test_views_count_lookups_per_pair(store, consumer) -> None:
    put_all(store, 2)
    consumer.contains(HASHES)
    assert store.stats.value("lookups", pair="pair-a") == 1
    assert store.stats.value("miss_chunks", pair="pair-a") == 4


def test_views_hold_the_read_path_and_the_writer_not_the_store(store) -> None:
    producer = store.producer("space-a", "producer-m", "space-fp")
    consumer = store.consumer("pair-a", "consumer-m", "space-fp")
    assert producer.read is store.read and producer.writer is store.writer and consumer.read is store.read
    assert not hasattr(producer, "store") and not hasattr(consumer, "store") and not hasattr(consumer, "writer")
