"""Least-privilege roles against a real redis-server with the documented ACL users (scd_store.store.redis_acl):
the operator registers and revokes, the producer writes and quarantines its own space only and records only its
own space's canary, the consumer only reads (no command it may run deletes, expires or writes a blob); signed
blobs (the producer holds the private key, the consumer the public one). The reports readers make and the
producer takes (hits, suspects: published, never stored) are in test_redis_reports.py."""

from __future__ import annotations

import time

import pytest
import redis
from redis.exceptions import NoPermissionError

from integration_tests.redis_servers import RedisServer
from scd_store.service import KVService, ServiceError
from scd_store.service.bundles import register_bundle
from scd_store.store.keyring import Keyring
from scd_store.store.keys import generation_of, make_key
from scd_store.store.redis_acl import acl_setuser
from scd_store.store.registry import RedisRegistry
from scd_store.store.signing import SigningKey, write_key_file
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier
from scd_store.store.tiers.redis_tier import RedisTier
from tests.bundles import PRODUCER, correlated_state, write_tiny_bundle
from tests.store.test_registry import check_generations_and_revocation

HASHES = [bytes([i + 1]) * 16 for i in range(3)]
TTL_S = 60.0
USERS = {"operator": ("scd-operator", "op-pw", None),
         "producer": ("scd-producer-tiny-space", "prod-pw", "tiny-space"),
         "other": ("scd-producer-other-space", "other-pw", "other-space"),  # another space's producer
         "consumer": ("scd-consumer", "cons-pw", None)}


def chunks(count: int = 3, size: int = 8):
    state = correlated_state(count * size, seed=5)
    return [type(state)(state.keys[:, :, i * size:(i + 1) * size].contiguous(),
                        state.values[:, :, i * size:(i + 1) * size].contiguous(), start=i * size)
            for i in range(count)]


@pytest.fixture
def deployment(tmp_path):
    bundle = tmp_path / "bundle"
    write_tiny_bundle(bundle, consumers=("consumer-a",))
    key = SigningKey.generate("k1", spaces=("tiny-space",))  # made for its space only
    assert key.public is not None
    write_key_file(tmp_path / "private.keys", [key.line()], private=True)  # the producer's
    write_key_file(tmp_path / "public.keys", [key.public.line()], private=False)  # the consumer's
    with RedisServer(tmp_path / "redis", extra=("--notify-keyspace-events", "Ee")) as server:
        for role, (user, password, space) in USERS.items():
            line = acl_setuser("producer" if role == "other" else role, user, password, space)
            assert server.cli(*line).strip() == "OK"
        base = f"127.0.0.1:{server.port}/0"
        urls = {role: f"redis://{user}:{password}@{base}" for role, (user, password, _) in USERS.items()}
        admin = redis.Redis(host="127.0.0.1", port=server.port)
        yield {"bundle": bundle, "urls": urls, "admin": admin, "server": server, "key": key,
               "keyrings": {"producer": tmp_path / "private.keys", "consumer": tmp_path / "public.keys"}}
        admin.close()


def service_for(deployment, role: str, models: tuple[str, ...], **kwargs) -> KVService:
    url = deployment["urls"][role]
    tiers = [CpuTier(1 << 20)] if role == "producer" else []  # the producer's own copy repairs Redis
    store = TieredStore([*tiers, RedisTier(url, ttl_s=TTL_S)], RedisRegistry(url), chunk_size=8, op_timeout_s=2.0,
                        keyring=Keyring(deployment["keyrings"][role]), registry_refresh_s=0.1, repair_s=0)
    try:
        return KVService(store, [deployment["bundle"]], models=models, discovery_interval_s=0, **kwargs)
    except BaseException:
        store.close()
        raise


def as_user(deployment, role: str) -> redis.Redis:
    return redis.Redis.from_url(deployment["urls"][role])


def refused(client: redis.Redis, *command: str | bytes) -> None:
    """The real server refuses ``command`` to ``client``'s user (NOPERM), whatever its arguments."""
    with pytest.raises(NoPermissionError):
        client.execute_command(*command)


def started(deployment) -> tuple[KVService, KVService, list[str]]:
    """The operator registers the bundle; a producer and a consumer service; the producer's three blobs stored."""
    operator = RedisRegistry(deployment["urls"]["operator"])
    register_bundle(deployment["bundle"], operator, chunk_size=8)
    operator.close()
    producer = service_for(deployment, "producer", (PRODUCER,), register_bundles=False)
    consumer = service_for(deployment, "consumer", ("consumer-a",), register_bundles=False)
    assert producer.put(PRODUCER, HASHES, chunks()) == 3
    producer.drain(10)
    return producer, consumer, producer._access.producer(producer.binding(PRODUCER)).keys(HASHES)


def test_each_role_does_its_job_and_nothing_else(deployment):
    operator = RedisRegistry(deployment["urls"]["operator"])
    register_bundle(deployment["bundle"], operator, chunk_size=8)  # `scd-store register`, as the operator
    check_generations_and_revocation(operator)  # generations, revocation and the version, on Redis
    producer = service_for(deployment, "producer", (PRODUCER,), register_bundles=False)
    consumer = service_for(deployment, "consumer", ("consumer-a",), register_bundles=False)
    try:
        assert producer.put(PRODUCER, HASHES, chunks()) == 3
        producer.drain(10)
        keys = producer._access.producer(producer.binding(PRODUCER)).keys(HASHES)
        assert all(deployment["admin"].exists(k) for k in keys)
        assert len(consumer.get("consumer-a", HASHES)) == 3
        assert consumer.store.stats.value("tier_errors") == 0
    finally:
        producer.close(), consumer.close()
        operator.close()


def test_a_consumer_can_neither_delete_nor_expire_nor_write_a_blob(deployment):
    """PEXPIRE key 0 (or a negative TTL) deleted any blob with the old recipe: now every command that could
    change a blob is refused to the consumer, and the blob is left whole with its TTL."""
    producer, consumer, keys = started(deployment)
    admin, reader = deployment["admin"], as_user(deployment, "consumer")
    key = keys[0]
    blob = admin.get(key)
    gen = key.split(":")[2]
    try:
        for command in (("PEXPIRE", key, "0"), ("PEXPIRE", key, "-1"), ("PEXPIRE", key, "1"), ("EXPIRE", key, "0"),
                        ("EXPIRE", key, "-5"), ("PEXPIREAT", key, "1"), ("EXPIREAT", key, "1"), ("PERSIST", key),
                        ("DEL", key), ("UNLINK", key), ("GETDEL", key), ("GETEX", key, "PX", "1"),
                        ("SET", key, "x"), ("SET", key, "x", "KEEPTTL"), ("SETRANGE", key, "0", "x"),
                        ("APPEND", key, "x"), ("RENAME", key, key + "0"), ("COPY", key, key + "0"),
                        ("HSET", key, "f", "v"), ("EVAL", "return redis.call('del', KEYS[1])", "1", key),
                        ("FLUSHALL",), ("CONFIG", "SET", "maxmemory", "1")):
            refused(reader, *command)
        # nor the registry, a canary, nor any key at all: counters live on an instance of their own, reports are
        # published (the flood that made Redis evict every blob wrote hashes here)
        for command in (("HSET", "scd:__registry__:spaces", "x", "y"), ("HSETNX", "scd:__registry__:pairs", "x", "y"),
                        ("HSET", "scd:__registry__:canaries:tiny-space", "vllm", "{}"),
                        ("HSET", f"scd:__stats__:suspects:tiny-space:{gen}", "x", "1"),
                        ("HSET", "scd:__stats__:flood", "f", "x" * 1024), ("HINCRBY", "scd:__stats__", "puts", "1"),
                        ("EXPIRE", "scd:__stats__", "60"), ("SET", "scd:__stats__:x", "1"), ("LPUSH", "scd:x", "1"),
                        ("XADD", "scd:x", "*", "f", "v"), ("SUBSCRIBE", f"scd:__reports__:tiny-space:{gen}")):
            refused(reader, *command)
        assert admin.get(key) == blob and TTL_S * 1000 - 10_000 < admin.pttl(key) <= TTL_S * 1000
        # what it may do: read, and publish reports (to whoever subscribes; Redis keeps none of them)
        assert reader.get(key) == blob and reader.publish(f"scd:__reports__:tiny-space:{gen}", "{}") >= 0
        assert len(consumer.get("consumer-a", HASHES)) == 3
    finally:
        reader.close()
        producer.close(), consumer.close()


def test_a_producer_writes_only_its_own_space(deployment):
    producer, consumer, keys = started(deployment)
    admin = deployment["admin"]
    writer, other = as_user(deployment, "producer"), as_user(deployment, "other")
    theirs = keys[0].replace("tiny-space", "other-space")
    admin.set(theirs, b"other-space blob", px=60_000)
    gen = keys[0].split(":")[2]
    try:
        for command in (("SET", theirs, "x"), ("DEL", theirs), ("PEXPIRE", theirs, "0"), ("EXPIRE", theirs, "1"),
                        ("PERSIST", theirs), ("HSET", "scd:__registry__:pairs", "x", "y"),
                        ("HSET", "scd:__registry__:spaces", "x", "y"),
                        ("HSET", "scd:__registry__:canaries:other-space", "vllm", "{}"),
                        ("HSET", "scd:__registry__:canaries", "other-space|vllm", "{}"),  # the old shared hash
                        ("HSET", "scd:__stats__", "puts", "1"), ("PUBLISH", f"scd:__reports__:tiny-space:{gen}", "x"),
                        ("SUBSCRIBE", f"scd:__reports__:other-space:{gen}")):
            refused(writer, *command)
        assert admin.get(theirs) == b"other-space blob" and admin.pttl(theirs) > 50_000
        # the other space's producer cannot touch this space's blobs either
        for command in (("SET", keys[0], "x"), ("DEL", keys[0]), ("PEXPIRE", keys[0], "0")):
            refused(other, *command)
        # what it may do in its own space: refresh a TTL, hear its reports and evictions, write its canary
        assert writer.pexpire(keys[0], 120_000) and admin.pttl(keys[0]) > 100_000
        listener = writer.pubsub()
        listener.subscribe(f"scd:__reports__:tiny-space:{gen}", "__keyevent@0__:evicted")
        listener.close()
        assert writer.hset("scd:__registry__:canaries:tiny-space", "probe", "{}") == 1
    finally:
        writer.close(), other.close()
        producer.close(), consumer.close()


def test_canaries_are_per_space_and_only_its_producer_writes_one(deployment):
    """One space's producer used to be able to overwrite every space's canary in one shared hash, making
    another space's consumers refuse their lookups (hash_mismatch)."""
    mine, theirs = RedisRegistry(deployment["urls"]["producer"]), RedisRegistry(deployment["urls"]["other"])
    reader = RedisRegistry(deployment["urls"]["consumer"])
    try:
        mine.record_canary("tiny-space", "vllm", {"engine": "vllm", "value": "a", "chunk_size": 8})
        theirs.record_canary("other-space", "vllm", {"engine": "vllm", "value": "b", "chunk_size": 8})
        with pytest.raises(NoPermissionError):
            theirs.record_canary("tiny-space", "vllm", {"engine": "vllm", "value": "evil", "chunk_size": 8})
        with pytest.raises(NoPermissionError):
            reader.record_canary("tiny-space", "vllm", {"engine": "vllm", "value": "evil", "chunk_size": 8})
        deployment["admin"].hset("scd:__registry__:canaries:tiny-space", "broken", b"{not json")  # skipped
        assert reader.canaries("tiny-space") == {"vllm": {"engine": "vllm", "value": "a", "chunk_size": 8}}
        assert reader.canaries("other-space") == {"vllm": {"engine": "vllm", "value": "b", "chunk_size": 8}}
        assert deployment["admin"].exists("scd:__registry__:canaries:tiny-space", "scd:__registry__:canaries:"
                                          "other-space") == 2
        assert not deployment["admin"].exists("scd:__registry__:canaries")
    finally:
        mine.close(), theirs.close(), reader.close()


def test_another_generations_blobs_are_reachable_by_their_spaces_producer_only(deployment):
    """A rollout: both generations of a space share the space's producer user (one per space), and no other."""
    admin, other = deployment["admin"], as_user(deployment, "other")
    new = make_key("tiny-space", generation_of("the-next-bundle"), "ab" * 16)
    admin.set(new, b"next generation", px=60_000)
    try:
        refused(other, "DEL", new)
        writer = as_user(deployment, "producer")
        assert writer.get(new) == b"next generation"
        writer.close()
    finally:
        other.close()


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
    producer, consumer, _ = started(deployment)
    try:
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
