"""Bad input anywhere at the store's faces: a clear error naming the problem, and nothing stored."""

from __future__ import annotations

import pytest
import torch

from scd_store.codecs.kv_state import KVState
from scd_store.codecs.scd.bundle import BundleError, load_space
from scd_store.service import KVService, ServiceError
from scd_store.store.config import ConfigError, StoreConfig
from scd_store.store.keys import KeyError_, chunk_hashes
from scd_store.store.redis_url import RedisURLError, parse_redis_url
from scd_store.store.registry import FileRegistry, NotAuthorized, NotRegistered
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier
from tests.bundles import PRODUCER, correlated_state, write_tiny_bundle

HASH = [b"\x01" * 16]


@pytest.fixture
def service(tmp_path):
    write_tiny_bundle(tmp_path / "bundle")
    store = TieredStore([CpuTier(1 << 20)], FileRegistry(tmp_path / "reg.json"), chunk_size=8)
    yield KVService(store, [tmp_path / "bundle"])
    store.close()


def assert_nothing_stored(service: KVService) -> None:
    assert service.store.tiers[0].usage().items == 0
    assert service.store.stats.value("puts") == 0


@pytest.mark.parametrize("make_state, match", [
    (lambda s: KVState(s.keys[:1].contiguous(), s.values[:1].contiguous()), r"\(layers, kv_heads, head_dim\)"),
    (lambda s: KVState(s.keys[:, :1].contiguous(), s.values[:, :1].contiguous()), "calibrated for"),
    (lambda s: KVState(s.keys.masked_fill(s.keys > 2, float("inf")), s.values), "NaN or inf"),
])
def test_kv_the_space_cannot_code(service, make_state, match):
    with pytest.raises(ValueError, match=match):
        service.put(PRODUCER, HASH, [make_state(correlated_state(8))])
    assert_nothing_stored(service)


def test_state_construction_names_the_problem():
    keys = correlated_state(8).keys
    with pytest.raises(ValueError, match="floating point"):
        KVState(keys.long(), keys.long())
    with pytest.raises(ValueError, match="differ in shape"):
        KVState(keys, keys[:, :, :4])
    with pytest.raises(ValueError, match=r"\[layers, kv_heads, tokens, head_dim\]"):
        KVState(keys[0], keys[0])
    with pytest.raises(ValueError, match="start position"):
        KVState(keys, keys, start=-1)


def test_mismatched_hashes_and_states(service):
    with pytest.raises(ValueError, match="hashes for"):
        service.put(PRODUCER, HASH * 2, [correlated_state(8)])
    assert_nothing_stored(service)


def test_tokens_unknown_pairs_and_writers(service):
    store = service.store
    for tokens, match in (([1, "2"], "ints"), ([[1, 2]], "ints"), ([-1, 2], ">= 0"), ("abc", "sequence of ints")):
        with pytest.raises(KeyError_, match=match):
            chunk_hashes(tokens, 8)
    fingerprint = service.binding(PRODUCER).space.fingerprint
    with pytest.raises(KeyError_, match="16 bytes"):
        store.producer("tiny-space", PRODUCER, fingerprint).put([b"short"], [b"x"], [8], codec_id="raw")
    with pytest.raises(NotRegistered, match="nope"):
        store.consumer("nope", "consumer-a", fingerprint)
    with pytest.raises(NotAuthorized, match="may not write"):
        store.producer("tiny-space", "consumer-a", fingerprint)
    assert_nothing_stored(service)


def test_bundles_for_another_model_or_without_a_producer(tmp_path):
    write_tiny_bundle(tmp_path / "b")
    with pytest.raises(BundleError, match="calibrated for producer"):
        load_space(tmp_path / "b", producer_fingerprint="another-model")
    (tmp_path / "b" / "space.json").write_text((tmp_path / "b" / "space.json").read_text().replace(
        '"producer": "producer-a"', '"producer": ""'))
    store = TieredStore([CpuTier(1 << 20)], FileRegistry(tmp_path / "reg.json"))
    try:
        with pytest.raises(ServiceError, match="names no producer"):
            KVService(store, [tmp_path / "b"])
    finally:
        store.close()


@pytest.mark.parametrize("data, match", [
    ({"tiers": [{"kind": "ssd"}]}, "unknown tier kind"),
    ({"tiers": [{"kind": "disk"}, {"kind": "cpu"}]}, "fastest first"),
    ({"tiers": [{"kind": "cpu", "max_bytes": "lots"}]}, "not a byte size"),
    ({"tiers": [{"kind": "redis"}]}, "needs a url"),
    ({"chunk_size": 0}, "chunk_size"),
    ({"colour": "blue"}, "unknown store config keys"),
])
def test_malformed_configs(data, match):
    with pytest.raises(ConfigError, match=match):
        StoreConfig.from_dict(data)


@pytest.mark.parametrize("url, match", [
    ("http://h:1", "unsupported Redis URL scheme"), ("redis://h:port", "bad port"), ("redis://", "no host"),
    ("redis+sentinel://h:1", "service name"), ("redis://h:1/zero", "database number"),
])
def test_malformed_urls(url, match):
    with pytest.raises(RedisURLError, match=match):
        parse_redis_url(url)


def test_devices_other_than_present_ones_are_refused(service):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="CUDA is not available"):
        service.get("consumer-a", HASH, device="cuda")
