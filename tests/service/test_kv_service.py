import logging

import pytest
import torch

from scd_store.codecs.scd.bundle import load_space
from scd_store.codecs.scd.codec import ScdCodec
from scd_store.codecs.scd.decoder import PairDecoder
from scd_store.service import KVService, ServiceError
from tests.bundles import PRODUCER, correlated_state, write_tiny_bundle

HASHES = [bytes([i]) * 16 for i in range(3)]


@pytest.fixture
def bundle(tmp_path):
    path = tmp_path / "bundle"
    write_tiny_bundle(path, consumers=("consumer-a", "consumer-b"))
    return path


def chunks(count=3, size=8):
    state = correlated_state(count * size, seed=5)
    return state, [type(state)(state.keys[:, :, i * size:(i + 1) * size].contiguous(),
                               state.values[:, :, i * size:(i + 1) * size].contiguous(), start=i * size)
                   for i in range(count)]


def test_consumer_gets_its_own_decode_of_the_producer_chunks(store, bundle):
    service = KVService(store, [bundle])
    assert service.models() == {"consumer-a": "consumer", "consumer-b": "consumer", PRODUCER: "producer"}
    _, parts = chunks()
    assert service.put(PRODUCER, HASHES, parts) == 3
    assert service.contains("consumer-b", HASHES) == 3
    got = service.get("consumer-b", HASHES)
    codec = ScdCodec(service.binding("consumer-b").space, service.binding("consumer-b").codec.decoder)
    for state, part in zip(got, parts, strict=True):
        want = codec.decode(codec.encode(part))
        assert state.start == part.start
        assert torch.equal(state.keys, want.keys) and torch.equal(state.values, want.values)
    # consumer-b's decoder scales by 1.1: it differs from consumer-a's KV
    a = service.get("consumer-a", HASHES)
    assert not torch.allclose(a[1].values, got[1].values)


def test_unknown_models_and_producers_miss_and_consumers_cannot_write(store, bundle, caplog):
    service = KVService(store, [bundle])
    _, parts = chunks()
    with caplog.at_level(logging.INFO, logger="scd_store.service"):
        assert service.put("consumer-a", HASHES, parts) == 0
        assert service.put("stranger", HASHES, parts) == 0
    assert "not a registered producer" in caplog.text
    service.put(PRODUCER, HASHES, parts)
    assert service.get("stranger", HASHES) == [] and service.contains("stranger", HASHES) == 0
    assert service.get(PRODUCER, HASHES) == []  # the producer's own cache is raw, not coded
    assert store.stats.value("refused_requests") == 4


def test_aliases_and_leading_run(store, bundle):
    service = KVService(store, [bundle], aliases={"served/consumer": "consumer-a"})
    _, parts = chunks()
    service.put(PRODUCER, HASHES[:2], parts[:2])
    assert service.contains("served/consumer", HASHES) == 2
    assert len(service.get("served/consumer", [HASHES[0], HASHES[2], HASHES[1]])) == 1


def test_a_codec_refusal_ends_the_run_and_is_counted(store, bundle, tmp_path):
    service = KVService(store, [bundle])
    _, parts = chunks()
    service.put(PRODUCER, HASHES, parts)
    other = tmp_path / "other"
    write_tiny_bundle(other, consumers=("consumer-a",), budget=0.2)  # same ids, another space fingerprint
    bad = ScdCodec(load_space(other))
    producer = store.producer("tiny-space", PRODUCER, service.binding(PRODUCER).space.fingerprint)
    # overwrite chunk 1 with a payload of another space under a valid blob header of this space
    producer.put([HASHES[1]], [bad.encode(parts[1])], [8], codec_id=bad.codec_id)
    assert len(service.get("consumer-a", HASHES)) == 1
    assert store.stats.value("refused_chunks", pair="tiny-space/consumer-a") == 1
    # a payload that decodes to another token count than its blob header says is refused too
    good = service.binding(PRODUCER).codec
    producer.put([HASHES[1]], [good.encode(parts[1])], [4], codec_id=good.codec_id)
    assert len(service.get("consumer-a", HASHES)) == 1
    assert store.stats.value("refused_chunks", pair="tiny-space/consumer-a") == 2


def test_bad_configuration_fails_loudly(store, bundle, tmp_path):
    with pytest.raises(ServiceError, match="not a calibration bundle"):
        KVService(store, [tmp_path / "nowhere"])
    with pytest.raises(ServiceError, match="bound twice"):
        KVService(store, [bundle, bundle])
    other = tmp_path / "other"
    write_tiny_bundle(other, consumers=("consumer-a",), budget=0.2)
    with pytest.raises(ServiceError, match="bound twice"):
        KVService(store, [bundle, other])  # two generations of one space in one process


def test_a_second_bundle_generation_coexists_in_the_registry(store, bundle, tmp_path):
    """A recalibrated bundle of the same space id is a new generation (a rollout), not a conflict: both are
    registered, each process serves the one it was given, and their blobs never share a key."""
    first = KVService(store, [bundle])
    other = tmp_path / "other"
    write_tiny_bundle(other, consumers=("consumer-a",), budget=0.2)
    second = KVService(store, [other])
    old, new = (s.binding(PRODUCER).space for s in (first, second))
    assert old.fingerprint != new.fingerprint
    assert {s.fingerprint for s in store.registry.spaces()} == {old.fingerprint, new.fingerprint}
    _, parts = chunks()
    first.put(PRODUCER, HASHES, parts)
    assert len(first.get("consumer-a", HASHES)) == len(HASHES) and second.get("consumer-a", HASHES) == []
    second.put(PRODUCER, HASHES, parts)  # the new generation's producer writes while the old one is served
    assert len(first.get("consumer-a", HASHES)) == len(HASHES) == len(second.get("consumer-a", HASHES))
    assert store.stats.value("foreign_blobs") == store.stats.value("corrupt_blobs") == 0


def test_identity_decoder_roundtrip_is_close(store, bundle):
    service = KVService(store, [bundle])
    state, parts = chunks()
    service.put(PRODUCER, HASHES, parts)
    got = service.get("consumer-a", HASHES)
    keys = torch.cat([s.keys for s in got], dim=2)
    assert float((keys - state.keys).norm() / state.keys.norm()) < 0.1
    assert isinstance(service.binding("consumer-a").codec.decoder, PairDecoder)


def test_chunks_decode_into_engine_buffers_and_a_refused_chunk_ends_the_run(store, bundle):
    service = KVService(store, [bundle])
    _, parts = chunks()
    service.put(PRODUCER, HASHES, parts)
    fresh = service.get("consumer-a", HASHES)
    # one preallocated prefix buffer, [layers, heads, 3 chunks x 8 tokens, dim]: chunk i decodes into its slice
    keys = torch.full((2, 2, 24, 8), float("nan"))
    values = torch.full_like(keys, float("nan"))
    asked = []

    def into(i, tokens):
        asked.append((i, tokens))
        return keys[:, :, 8 * i:8 * i + tokens], values[:, :, 8 * i:8 * i + tokens]

    got = service.get("consumer-a", HASHES, into=into)
    assert asked == [(0, 8), (1, 8), (2, 8)] and not keys.isnan().any()
    assert torch.equal(keys, torch.cat([s.keys for s in fresh], 2))
    assert torch.equal(values, torch.cat([s.values for s in fresh], 2))
    assert [s.start for s in got] == [0, 8, 16] and got[1].keys.data_ptr() == keys[:, :, 8:].data_ptr()
    # a caller out of room ends the run; buffers of the wrong token count are a refused chunk (counted)
    assert len(service.get("consumer-a", HASHES, into=lambda i, n: None if i == 1 else into(i, n))) == 1
    before = store.stats.value("refused_chunks")
    assert service.get("consumer-a", HASHES, into=lambda i, n: (keys[:, :, :n - 1], values[:, :, :n - 1])) == []
    assert store.stats.value("refused_chunks") == before + 1


def test_submitted_puts_are_stored_off_the_callers_thread(store, bundle):
    service = KVService(store, [bundle])
    state, parts = chunks()
    released, built_on = [], []

    def states():
        import threading

        built_on.append(threading.current_thread().name)
        return parts

    assert service.submit_put(PRODUCER, HASHES, states, release=lambda: released.append(1))
    assert service.drain(timeout=10) and released == [1] and built_on == ["scd-store-put"]
    assert service.contains("consumer-a", HASHES) == 3
    assert not service.submit_put("consumer-a", HASHES, states, release=lambda: released.append(2))
    assert released == [1, 2] and store.stats.value("refused_requests") == 1  # consumers never write
    bad = [type(state)(p.keys[:1].contiguous(), p.values[:1].contiguous(), start=p.start) for p in parts]
    assert service.submit_put(PRODUCER, [bytes([9]) * 16] * 3, lambda: bad) and service.drain(timeout=10)
    assert store.stats.value("uncodable_chunks") == 3  # counted, logged once, nothing stored
    service.close()


def test_a_get_past_its_deadline_returns_what_it_decoded(store, bundle):
    service = KVService(store, [bundle], get_deadline_s=1e-9)
    _, parts = chunks()
    service.put(PRODUCER, HASHES, parts)
    assert service.get("consumer-a", HASHES) == []  # the deadline passed before the first decode
    assert store.stats.value("deadline_chunks", pair="tiny-space/consumer-a") == 3
    with pytest.raises(ValueError, match="get_deadline_s"):
        KVService(store, [bundle], get_deadline_s=0)


def test_positions_past_the_engine_context_are_refused_before_decoding(store, bundle):
    """A stored chunk reaching past the engine's context (``max_positions``) is a refused miss: no RoPE
    table or buffer is sized for it, however large its header says its start is."""
    from scd_store.codecs.scd.space import PACKING
    from scd_store.codecs.tensor_pack import PayloadError

    service = KVService(store, [bundle], max_positions=20)
    _, parts = chunks()  # starts 0, 8, 16: the third reaches position 24
    service.put(PRODUCER, HASHES, parts)
    assert len(service.get("consumer-a", HASHES)) == 2
    assert store.stats.value("refused_chunks", pair="tiny-space/consumer-a") == 1
    space = service.binding(PRODUCER).space
    with pytest.raises(PayloadError, match="past this process's bound"):
        space.counts({"space": space.fingerprint, "packing": PACKING, "start": 2**40, "tokens": 8, "sinks": 0})


def test_a_store_call_that_fails_as_a_whole_is_a_miss_never_an_exception_in_the_engine(store, bundle, monkeypatch):
    """A tier walk past its deadline raises TimeoutError out of the store's loop: the engine's scheduler or worker
    thread would die of it. The service answers a miss, counts it, logs once."""
    service = KVService(store, [bundle])
    _, parts = chunks()
    service.put(PRODUCER, HASHES, parts)

    def walk_past_its_deadline(*args, **kwargs):
        raise TimeoutError("the store's loop did not answer")

    monkeypatch.setattr(store.read, "lookup", walk_past_its_deadline)
    monkeypatch.setattr(store.read, "get", walk_past_its_deadline)
    assert service.contains("consumer-a", HASHES) == 0 and service.contains(PRODUCER, HASHES) == 0
    assert service.get("consumer-a", HASHES) == []
    assert store.stats.value("store_errors") == 3


def test_a_registry_lookup_that_fails_is_a_miss_counted_as_a_store_error(store, bundle, monkeypatch):
    """The registry unreachable on the engine's first lookup (a Redis registry down, a file unreadable) is not
    ``NotRegistered``: it must still be a miss, not an exception in the engine's thread."""
    service = KVService(store, [bundle])
    _, parts = chunks()
    service.put(PRODUCER, HASHES, parts)
    store.forget_registry_cache()

    def registry_down(*args, **kwargs):
        raise ConnectionError("registry unreachable")

    monkeypatch.setattr(store.registry_cache, "pair", registry_down)
    monkeypatch.setattr(store.registry_cache, "space", registry_down)
    assert service.contains("consumer-a", HASHES) == 0 and service.get("consumer-a", HASHES) == []
    assert service.contains(PRODUCER, HASHES) == 0 and service.stored_bytes("consumer-a", HASHES) == 0
    assert store.stats.value("store_errors") == 4 and store.stats.value("revoked_requests") == 0


def test_stored_bytes_is_zero_when_the_store_call_fails(store, bundle, monkeypatch):
    service = KVService(store, [bundle])
    _, parts = chunks()
    service.put(PRODUCER, HASHES, parts)
    assert service.stored_bytes("consumer-a", HASHES) > 0

    def walk_past_its_deadline(*args, **kwargs):
        raise TimeoutError("the store's loop did not answer")

    monkeypatch.setattr(store.read, "get", walk_past_its_deadline)
    assert service.stored_bytes("consumer-a", HASHES) == 0 and store.stats.value("store_errors") == 1


def test_the_process_stats_name_the_models_its_engine_asked_for_by_role(store, bundle):
    service = KVService(store, [bundle])
    assert store.stats.serves() == {}  # bound is not served: nothing asked yet
    _, parts = chunks()
    service.put("consumer-a", HASHES, parts)  # a consumer cannot write: not what this process serves
    assert store.stats.serves() == {}
    service.put(PRODUCER, HASHES, parts)
    service.contains("consumer-b", HASHES, tokens=24)
    service.contains("stranger", HASHES, tokens=24)
    assert store.stats.serves() == {PRODUCER: "producer", "consumer-b": "consumer"}
    service.note_served("consumer-a")  # an engine says what it serves before any request
    service.note_served("stranger")
    assert store.stats.serves() == {PRODUCER: "producer", "consumer-a": "consumer", "consumer-b": "consumer"}
