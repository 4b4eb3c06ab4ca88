"""The reports readers publish and the producer takes, against a real redis-server with the documented ACL users:
verified hits (the producer refreshes the TTL of blobs it wrote, within their lifetime: readers cannot), bad keys
(the producer verifies them, deletes and rewrites what is bad), both bounded, both refused outside the producer's
space generation; nothing a reader reports is stored in Redis, so no reader can flood the blobs' instance into
evicting blobs; and what Redis evicts or refuses of the producer's writes is counted."""

from __future__ import annotations

import time

import pytest
from redis.exceptions import NoPermissionError

from integration_tests.test_redis_roles import HASHES, TTL_S, as_user, chunks, deployment, started  # noqa: F401
from scd_store.store.blob import BlobMeta, encode_blob
from scd_store.store.keys import generation_of, make_key
from scd_store.store.signing import SigningKey
from scd_store.store.tiers.redis_reports import channel_of, report_messages


def wait_for(check, timeout: float = 5.0) -> bool:
    """Whether ``check()`` came true within ``timeout`` (it is called until it does, never after)."""
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def inbox(producer):
    """The producer's report inbox (its Redis tier's subscription), once it listens."""
    tier = producer.store.tiers[-1]
    assert wait_for(lambda: tier.inbox is not None and tier.inbox.subscribed(scope_of(producer)))
    return tier.inbox


def scope_of(producer) -> str:
    return producer.binding("producer-a").space.space_id + ":" + generation_of(
        producer.binding("producer-a").space.fingerprint)


def forged_for(producer, key: str) -> bytes:
    """Well formed, signed with the real key id and another private key: a bad signature."""
    fingerprint = producer.binding("producer-a").space.fingerprint
    return encode_blob(BlobMeta("scd-reuse", fingerprint, 8), b"kv" * 100, key=key,
                       signer=SigningKey("k1", b"\x01" * 32))


def publish(where: dict, scope: str, kind: str, keys: list[str]) -> None:
    """A consumer's report, sent by hand (as a rogue reader would)."""
    reader = as_user(where, "consumer")
    for message in report_messages(kind, keys):
        reader.publish(channel_of(scope), message)
    reader.close()


def test_readers_never_delete_and_the_producer_quarantines(deployment):  # noqa: F811
    producer, consumer, keys = started(deployment)
    admin = deployment["admin"]
    scope = scope_of(producer)
    reports = inbox(producer)
    try:
        good = admin.get(keys[1])
        forged = forged_for(producer, keys[1])
        admin.set(keys[1], forged)
        assert len(consumer.get("consumer-a", HASHES)) == 1  # a miss from the forged chunk on
        stats = consumer.store.stats
        assert stats.value("bad_signatures") == 1 and stats.value("tier_errors") == 0
        assert admin.get(keys[1]) == forged  # the reader left it (and could not have deleted it)
        admin.set(keys[2], good)  # a genuine blob moved to another chunk's key
        assert len(consumer.get("consumer-a", HASHES)) == 1 and stats.value("bad_signatures") == 1 + 2
        # the reader published both keys; nothing of it is stored in Redis; the producer heard them
        assert wait_for(lambda: sorted(reports.take("suspects", scope, 10)) == sorted(keys[1:]))
        assert not admin.keys("scd:__stats__*") and not admin.keys("scd:__reports__*")
        assert producer.store.repair_now() == (2, 2)
        assert admin.get(keys[1]) == good and admin.get(keys[2]) != good and not reports.take("suspects", scope, 10)
        assert producer.store.stats.value("repaired_blobs") == 2
        assert len(consumer.get("consumer-a", HASHES)) == 3
        # a blob the producer no longer holds: it deletes the bad copy, so its engine stores the chunk again
        admin.set(keys[2], forged)
        producer.store.tiers[0].delete_now(keys[2])
        assert len(consumer.get("consumer-a", HASHES)) == 2
        assert wait_for(lambda: reports.take("suspects", scope, 10) == [keys[2]])
        assert producer.store.repair_now() == (1, 0) and admin.get(keys[2]) is None
        assert producer.contains("producer-a", HASHES) == 2
    finally:
        producer.close(), consumer.close()


def test_verified_hits_refresh_the_ttl_through_the_producer_only(deployment):  # noqa: F811
    producer, consumer, keys = started(deployment)
    admin = deployment["admin"]
    scope = scope_of(producer)
    reports = inbox(producer)
    try:
        for key in (keys[0], keys[2]):
            admin.pexpire(key, 5_000)
        producer.store.tiers[0].delete_now(keys[1])  # no good copy: the bad blob is deleted, never kept alive
        admin.set(keys[1], forged_for(producer, keys[1]), px=5_000)
        written = time.time()
        producer.store.births.clock = lambda: written + TTL_S / 2  # the TTLs it wrote are half spent
        assert len(consumer.get("consumer-a", HASHES)) == 1
        # the consumer reported the blobs it verified (chunk 2 too: good, though past the served run)...
        assert wait_for(lambda: sorted(reports.take("hits", scope, 10)) == [keys[0], keys[2]])
        time.sleep(0.2)
        assert admin.pttl(keys[0]) <= 5_000 and admin.pttl(keys[2]) <= 5_000  # ...and refreshed nothing (it cannot)
        assert producer.store.repair_now() == (1, 0)
        assert min(admin.pttl(keys[0]), admin.pttl(keys[2])) > TTL_S * 1000 - 10_000 and not admin.exists(keys[1])
        assert producer.store.stats.value("ttl_refreshes", tier="redis", space="tiny-space") == 2
        assert not reports.take("hits", scope, 10)  # processed: removed
        # a reported hit of a key that is gone brings nothing back
        publish(deployment, scope, "hits", [keys[1]])
        assert wait_for(lambda: reports.take("hits", scope, 10) == [keys[1]])
        assert producer.store.repair_now() == (0, 0) and not admin.exists(keys[1])
        assert producer.store.stats.value("ttl_refreshes") == 2
        # reported for ever, a blob still ends: never refreshed past its lifetime (8 TTLs from its write)
        producer.store.births.clock = lambda: written + 8 * TTL_S + 1
        publish(deployment, scope, "hits", [keys[0]])
        assert wait_for(lambda: reports.take("hits", scope, 10) == [keys[0]])
        admin.pexpire(keys[0], 5_000)
        assert producer.store.repair_now() == (0, 0) and admin.pttl(keys[0]) <= 5_000
        assert producer.store.stats.value("refused_refreshes", tier="redis") >= 1
    finally:
        producer.close(), consumer.close()


def test_reports_outside_the_producers_space_generation_are_refused(deployment):  # noqa: F811
    """The rollout DoS: a reader listed another generation's keys in a generation's report and that generation's
    producer deleted them. Only keys of the repairing space generation are processed; the rest is counted, dropped
    and left alone, and a blob of another generation under a key is a miss, never deleted."""
    producer, consumer, keys = started(deployment)
    admin = deployment["admin"]
    scope = scope_of(producer)
    reports = inbox(producer)
    gen = keys[0].split(":")[2]
    next_gen = make_key("tiny-space", generation_of("the-next-bundle"), "ab" * 16)
    other_space = make_key("other-space", gen, "ab" * 16)
    for key in (next_gen, other_space):
        admin.set(key, b"someone else's blob", px=5_000)
    foreign = encode_blob(BlobMeta("scd-reuse", "the-next-bundle", 8), b"kv" * 100, key=keys[0],
                          signer=producer.store.keyring.signer("tiny-space"))  # genuine, another generation's
    admin.set(keys[0], foreign, px=5_000)
    junk = [next_gen, other_space, "junk", f"scd:tiny-space:{gen}:xyz", "x" * 500]
    try:
        publish(deployment, scope, "suspects", [*junk, keys[0]])
        publish(deployment, scope, "hits", junk)
        reader = as_user(deployment, "consumer")
        for bad in (b"\xff\xfe", b"{}", b'{"kind": "hits", "keys": [1]}', b"x" * (128 << 10)):  # malformed
            reader.publish(channel_of(scope), bad)
        reader.close()
        assert wait_for(lambda: len(reports.take("suspects", scope, 100)) == 6 and
                        len(reports.take("hits", scope, 100)) == 5)
        assert wait_for(lambda: producer.store.stats.value("refused_reports", tier="redis") == 4)
        assert producer.store.repair_now() == (0, 0)
        assert admin.get(next_gen) == admin.get(other_space) == b"someone else's blob"
        assert admin.pttl(next_gen) <= 5_000 and admin.pttl(other_space) <= 5_000  # no TTL refreshed either
        assert admin.get(keys[0]) == foreign  # verified as foreign: a miss, not damage
        assert producer.store.stats.value("refused_reports", tier="redis", space="tiny-space") == 4 + 5 + 5
        assert not reports.take("suspects", scope, 100) and not reports.take("hits", scope, 100)
        assert len(consumer.get("consumer-a", HASHES)) == 0 and consumer.store.stats.value("foreign_blobs") == 1
        # a round takes a bounded number of reports, and the inbox keeps a bounded number, however many come
        publish(deployment, scope, "suspects", [f"junk-{i}" for i in range(10_000)])
        assert wait_for(lambda: len(reports.take("suspects", scope, 10**6)) == 8192)
        assert wait_for(lambda: producer.store.stats.value("dropped_reports") == 10_000 - 8192)
        assert producer.store.repair_now() == (0, 0) and len(reports.take("suspects", scope, 10**6)) == 8192 - 256
    finally:
        producer.close(), consumer.close()


def volatile_blobs(admin, n: int = 24, size: int = 1 << 20) -> list[str]:
    """``n`` volatile values of ``size`` bytes (stand-ins for a producer's large blobs: they can be evicted)."""
    keys = [f"scd:tiny-space:big:{i}" for i in range(n)]
    for key in keys:
        admin.set(key, b"b" * size, px=600_000)
    return keys


def test_a_consumer_cannot_flood_the_blobs_instance_into_evicting_blobs(deployment):  # noqa: F811
    """The measured attacks: twenty-nine 1 MiB hashes a consumer wrote under volatile-lru left 0 of 40 blobs; and,
    without writing a key, a consumer's client buffers (a bulk argument declared 400 MB of which 40 KB are sent;
    pipelined GETs of large blobs whose replies it never reads) count toward maxmemory and evicted every blob. With
    the recipe's server settings and maxmemory sized for the blobs plus maxmemory-clients, none is evicted."""
    import socket

    from scd_store.store.redis_acl import SERVER_SETTINGS

    producer, consumer, keys = started(deployment)
    admin = deployment["admin"]
    scope = scope_of(producer)
    inbox(producer)
    more = [bytes([0x40 + i]) * 16 for i in range(37)]
    assert producer.put("producer-a", more, chunks(37)) == 37
    producer.drain(10)
    blobs = keys + producer._access.producer(producer.binding("producer-a")).keys(more) + volatile_blobs(admin)
    for name, value in SERVER_SETTINGS:
        admin.config_set(name, value)
    used = int(admin.info("memory")["used_memory"])
    admin.config_set("maxmemory", str(used + (40 << 20)))  # room for the clients' cap (32 MiB), not for a flood
    rogue = as_user(deployment, "consumer")
    port = deployment["server"].port
    try:
        for i in range(29):
            with pytest.raises(NoPermissionError):
                rogue.hset(f"scd:__stats__:flood:{i}", mapping={f"f{j}": b"x" * 1024 for j in range(1024)})
            rogue.publish(channel_of(scope), b"x" * (1 << 20))  # a 1 MiB report: delivered, refused, not stored
        for i in range(200):
            publish(deployment, scope, "suspects", [blobs[i % len(blobs)]])
        socks = []
        for _ in range(4):  # declared 400 MB bulks, 40 KB sent, connections held open
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"*3\r\n$4\r\nAUTH\r\n$12\r\nscd-consumer\r\n$7\r\ncons-pw\r\n")
            channel = channel_of(scope).encode()
            sock.sendall(b"*3\r\n$7\r\nPUBLISH\r\n$%d\r\n%s\r\n$400000000\r\n" % (len(channel), channel)
                         + b"x" * 40_000)
            socks.append(sock)
        reader = socket.create_connection(("127.0.0.1", port))  # GETs of 1 MiB values, replies never read
        reader.sendall(b"*3\r\n$4\r\nAUTH\r\n$12\r\nscd-consumer\r\n$7\r\ncons-pw\r\n")
        big = blobs[-1].encode()
        reader.sendall(b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(big), big) for _ in range(200)))
        time.sleep(2.0)
        assert all(admin.exists(k) for k in blobs) and int(admin.info("stats")["evicted_keys"]) == 0
        for sock in (*socks, reader):
            sock.close()
        assert producer.store.repair_now()[0] == 0 and all(admin.exists(k) for k in blobs)  # false reports: kept
        assert len(consumer.get("consumer-a", HASHES)) == 3
    finally:
        rogue.close()
        admin.config_set("maxmemory", "0")
        admin.config_set("maxmemory-clients", "0")
        producer.close(), consumer.close()


def test_a_refused_subscription_is_counted_and_the_rest_still_heard(deployment):  # noqa: F811
    """A producer user without the evictions channel (one made before the recipe had it): its reports are still
    heard; the refusal is logged and counted (subscription_errors), never silent."""
    server = deployment["server"]
    assert server.cli("ACL", "SETUSER", "scd-producer-tiny-space", "resetchannels",
                      "&scd:__reports__:tiny-space:*").strip() == "OK"
    producer, consumer, keys = started(deployment)
    scope = scope_of(producer)
    try:
        reports = inbox(producer)
        assert wait_for(lambda: producer.store.stats.value("subscription_errors") >= 1)
        publish(deployment, scope, "suspects", [keys[0]])
        assert wait_for(lambda: reports.take("suspects", scope, 10) == [keys[0]])
    finally:
        producer.close(), consumer.close()


def test_what_redis_evicts_or_refuses_of_the_producers_writes_is_counted(deployment):  # noqa: F811
    producer, consumer, keys = started(deployment)
    admin = deployment["admin"]
    inbox(producer)
    try:
        used = int(admin.info("memory")["used_memory"])
        admin.config_set("maxmemory", str(used + (1 << 20)))
        admin.config_set("maxmemory-policy", "volatile-lru")
        for i in range(8):  # an administrator's own volatile keys push the producer's blobs out
            admin.set(f"filler:{i}", b"x" * (256 << 10), px=60_000)
        assert wait_for(lambda: producer.store.stats.value("evicted_blobs", tier="redis", space="tiny-space") ==
                        sum(not admin.exists(k) for k in keys) > 0)
        admin.delete(*(f"filler:{i}" for i in range(8)))
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", str(int(admin.info("memory")["used_memory"]) // 2))  # full: writes refused
        before = producer.store.stats.value("lost_writes", tier="redis") + producer.store.stats.value(
            "dropped_writes", tier="redis")
        more = [bytes([0x70 + i]) * 16 for i in range(3)]
        producer.put("producer-a", more, chunks(3))
        producer.drain(10)
        after = producer.store.stats.value("lost_writes", tier="redis") + producer.store.stats.value(
            "dropped_writes", tier="redis")
        assert after - before >= 3 and producer.store.stats.value("tier_errors", tier="redis") >= 1
    finally:
        admin.config_set("maxmemory", "0")
        admin.config_set("maxmemory-policy", "noeviction")
        producer.close(), consumer.close()


def test_a_lost_subscription_is_made_again(deployment):  # noqa: F811
    producer, consumer, keys = started(deployment)
    admin = deployment["admin"]
    scope = scope_of(producer)
    reports = inbox(producer)
    try:
        admin.client_kill_filter(_type="pubsub")
        assert wait_for(lambda: not reports.subscribed(scope), 2.0) or True
        assert wait_for(lambda: reports.subscribed(scope), 10.0)
        publish(deployment, scope, "suspects", [keys[0]])
        assert wait_for(lambda: reports.take("suspects", scope, 10) == [keys[0]])
    finally:
        producer.close(), consumer.close()


def test_a_tier_failure_midway_leaves_the_reports_for_the_next_round(deployment):  # noqa: F811
    """Reports used to be removed before they were verified: a failing delete or rewrite lost them."""
    producer, consumer, keys = started(deployment)
    admin, server = deployment["admin"], deployment["server"]
    scope = scope_of(producer)
    reports = inbox(producer)
    user = "scd-producer-tiny-space"
    good = {k: admin.get(k) for k in keys}
    try:
        admin.set(keys[1], forged_for(producer, keys[1]))
        assert len(consumer.get("consumer-a", HASHES)) == 1
        assert wait_for(lambda: reports.take("suspects", scope, 10) == [keys[1]])
        assert server.cli("ACL", "SETUSER", user, "-del").strip() == "OK"  # the delete fails
        assert producer.store.repair_now() == (0, 0)
        assert reports.take("suspects", scope, 10) == [keys[1]] and admin.get(keys[1]) != good[keys[1]]
        assert server.cli("ACL", "SETUSER", user, "+del", "-set").strip() == "OK"  # the rewrite fails
        assert wait_for(lambda: producer.store.repair_now() == (1, 0))  # once the tier's backoff has passed
        assert reports.take("suspects", scope, 10) == [keys[1]] and not admin.exists(keys[1])
        assert server.cli("ACL", "SETUSER", user, "+set").strip() == "OK"
        assert wait_for(lambda: producer.store.repair_now() == (0, 1))  # the key it deleted, rewritten from its copy
        assert admin.get(keys[1]) == good[keys[1]] and not reports.take("suspects", scope, 10)
        assert producer.store.stats.value("tier_errors", tier="redis") >= 2
        assert len(consumer.get("consumer-a", HASHES)) == 3
    finally:
        producer.close(), consumer.close()
