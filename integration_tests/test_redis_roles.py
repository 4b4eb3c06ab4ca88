"""Least-privilege roles against a real redis-server with the documented ACL users (scd_store.store.redis_acl):
the operator registers and revokes, the producer writes and quarantines its own space, the consumer only
reads; signed blobs; bad blobs are never deleted by readers; TTLs refresh on hits."""

from __future__ import annotations

import time

import pytest
import redis

from integration_tests.redis_servers import RedisServer
from scd_store.service import KVService, ServiceError
from scd_store.service.bundles import register_bundle
from scd_store.store.blob import BlobMeta, encode_blob
from scd_store.store.redis_acl import acl_setuser
from scd_store.store.registry import RedisRegistry
from scd_store.store.signing import Keyring, SigningKey
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier
from scd_store.store.tiers.redis_tier import RedisTier
from tests.bundles import PRODUCER, correlated_state, write_tiny_bundle
from tests.store.test_registry import check_generations_and_revocation

HASHES = [bytes([i + 1]) * 16 for i in range(3)]
TTL_S = 60.0


def chunks(count: int = 3, size: int = 8):
    state = correlated_state(count * size, seed=5)
    return [type(state)(state.keys[:, :, i * size:(i + 1) * size].contiguous(),
                        state.values[:, :, i * size:(i + 1) * size].contiguous(), start=i * size)
            for i in range(count)]


@pytest.fixture
def deployment(tmp_path):
    bundle = tmp_path / "bundle"
    write_tiny_bundle(bundle, consumers=("consumer-a",))
    (tmp_path / "keys").write_text(f"k1 {'ab' * 32}\n")
    with RedisServer(tmp_path / "redis") as server:
        users = {"operator": acl_setuser("operator", "scd-operator", "op-pw"),
                 "producer": acl_setuser("producer", "scd-producer-tiny-space", "prod-pw", "tiny-space"),
                 "consumer": acl_setuser("consumer", "scd-consumer", "cons-pw")}
        for line in users.values():
            assert server.cli(*line).strip() == "OK"
        base = f"127.0.0.1:{server.port}/0"
        urls = {"operator": f"redis://scd-operator:op-pw@{base}",
                "producer": f"redis://scd-producer-tiny-space:prod-pw@{base}",
                "consumer": f"redis://scd-consumer:cons-pw@{base}"}
        admin = redis.Redis(host="127.0.0.1", port=server.port)
        yield {"bundle": bundle, "urls": urls, "admin": admin, "keyring": tmp_path / "keys", "tmp": tmp_path}
        admin.close()


def service_for(deployment, role: str, models: tuple[str, ...], **kwargs) -> KVService:
    url = deployment["urls"][role]
    tiers = [CpuTier(1 << 20)] if role == "producer" else []  # the producer's own copy repairs Redis
    store = TieredStore([*tiers, RedisTier(url, ttl_s=TTL_S)], RedisRegistry(url), chunk_size=8, op_timeout_s=2.0,
                        keyring=Keyring(deployment["keyring"]), registry_refresh_s=0.1, repair_s=0)
    try:
        return KVService(store, [deployment["bundle"]], models=models, discovery_interval_s=0, **kwargs)
    except BaseException:
        store.close()
        raise


def as_user(deployment, role: str) -> redis.Redis:
    return redis.Redis.from_url(deployment["urls"][role])


def test_each_role_does_its_job_and_nothing_else(deployment):
    operator = RedisRegistry(deployment["urls"]["operator"])
    register_bundle(deployment["bundle"], operator, chunk_size=8)  # `scd-store register`, as the operator
    check_generations_and_revocation(operator)  # generations, revocation and the version, on Redis
    producer = service_for(deployment, "producer", (PRODUCER,), register_bundles=False)
    consumer = service_for(deployment, "consumer", ("consumer-a",), register_bundles=False)
    try:
        assert producer.put(PRODUCER, HASHES, chunks()) == 3
        producer.drain(10)
        keys = producer._producer(producer.binding(PRODUCER)).keys(HASHES)
        assert all(deployment["admin"].exists(k) for k in keys)
        assert len(consumer.get("consumer-a", HASHES)) == 3
        assert consumer.store.stats.value("tier_errors") == 0
        # the consumer's user may read, never write or delete a blob, nor touch the registry
        reader = as_user(deployment, "consumer")
        for attempt in (lambda: reader.set(keys[0], b"x"), lambda: reader.delete(keys[0]),
                        lambda: reader.hset("scd:__registry__:spaces", "x", "y"),
                        lambda: reader.hsetnx("scd:__registry__:pairs", "x", "y")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
        # nor may the producer write another space or the registry's records
        writer = as_user(deployment, "producer")
        for attempt in (lambda: writer.set(keys[0].replace("tiny-space", "other-space"), b"x"),
                        lambda: writer.hset("scd:__registry__:pairs", "x", "y")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
        reader.close(), writer.close()
    finally:
        producer.close(), consumer.close()
        operator.close()


def test_readers_never_delete_and_the_producer_quarantines(deployment):
    register_bundle(deployment["bundle"], RedisRegistry(deployment["urls"]["operator"]), chunk_size=8)
    producer = service_for(deployment, "producer", (PRODUCER,))  # records already there: nothing written
    consumer = service_for(deployment, "consumer", ("consumer-a",), register_bundles=False)
    admin = deployment["admin"]
    try:
        producer.put(PRODUCER, HASHES, chunks())
        producer.drain(10)
        keys = producer._producer(producer.binding(PRODUCER)).keys(HASHES)
        good = admin.get(keys[1])
        forged = encode_blob(BlobMeta("scd-reuse", producer.binding(PRODUCER).space.fingerprint, 8), b"kv" * 100,
                             key=keys[1], signer=SigningKey("k1", b"\x01" * 32))
        admin.set(keys[1], forged)
        assert len(consumer.get("consumer-a", HASHES)) == 1  # a miss from the forged chunk on
        stats = consumer.store.stats
        assert stats.value("bad_signatures") == 1 and stats.value("tier_errors") == 0
        assert admin.get(keys[1]) == forged  # the reader left it (and could not have deleted it)
        admin.set(keys[2], good)  # a genuine blob moved to another chunk's key
        assert len(consumer.get("consumer-a", HASHES)) == 1 and stats.value("bad_signatures") == 1 + 2
        # the reader reported both keys; the producer verifies them itself, deletes and rewrites them
        suspects = admin.hkeys(f"scd:__stats__:suspects:tiny-space:{keys[0].split(':')[2]}")
        assert sorted(k.decode() for k in suspects) == sorted(keys[1:])
        assert producer.store.repair_now() == (2, 2)
        assert admin.get(keys[1]) == good and admin.get(keys[2]) != good
        assert producer.store.stats.value("repaired_blobs") == 2
        assert len(consumer.get("consumer-a", HASHES)) == 3
        # a blob the producer no longer holds: it deletes the bad copy, so its engine stores the chunk again
        admin.set(keys[2], forged)
        producer.store.tiers[0].delete_now(keys[2])
        assert len(consumer.get("consumer-a", HASHES)) == 2
        assert producer.store.repair_now() == (1, 0) and admin.get(keys[2]) is None
        assert producer.contains(PRODUCER, HASHES) == 2
        # verified hits refresh the blobs' TTL (PEXPIRE), with the consumer's read-only user; bad ones do not
        admin.pexpire(keys[0], 5_000)
        admin.set(keys[1], forged, px=5_000)
        consumer.get("consumer-a", HASHES)
        deadline = time.monotonic() + 5
        while admin.pttl(keys[0]) < 50_000 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert admin.pttl(keys[0]) > 50_000 and admin.pttl(keys[1]) <= 5_000
    finally:
        producer.close(), consumer.close()


def test_an_unregistered_bundle_is_a_clear_error_for_a_read_only_engine(deployment):
    with pytest.raises(ServiceError, match="may not write the registry"):
        service_for(deployment, "consumer", ("consumer-a",))
    consumer = service_for(deployment, "consumer", ("consumer-a",), register_bundles=False)
    try:
        assert consumer.models() == {}  # nothing registered yet: nothing bound, nothing guessed
    finally:
        consumer.close()


def test_revocation_reaches_a_running_consumer(deployment):
    operator = RedisRegistry(deployment["urls"]["operator"])
    register_bundle(deployment["bundle"], operator, chunk_size=8)
    producer = service_for(deployment, "producer", (PRODUCER,), register_bundles=False)
    consumer = service_for(deployment, "consumer", ("consumer-a",), register_bundles=False)
    try:
        producer.put(PRODUCER, HASHES, chunks())
        producer.drain(10)
        assert len(consumer.get("consumer-a", HASHES)) == 3
        operator.revoke("tiny-space/consumer-a")
        deadline = time.monotonic() + 5
        while consumer.get("consumer-a", HASHES) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert consumer.get("consumer-a", HASHES) == []
        assert consumer.store.stats.value("revoked_requests") >= 1
        assert producer.contains(PRODUCER, HASHES) == 3  # the space and its producer are untouched
    finally:
        producer.close(), consumer.close()
        operator.close()
