"""The reports readers leave in Redis and the producer takes, against a real redis-server with the documented ACL
users: verified hits (the producer refreshes their TTL: readers cannot), bad keys (the producer verifies them, deletes
and rewrites what is bad), both bounded, both refused outside the producer's space generation, and a report removed
only once it was processed."""

from __future__ import annotations

import time

from integration_tests.test_redis_roles import HASHES, TTL_S, as_user, deployment, started  # noqa: F401 - fixture
from scd_store.store.blob import BlobMeta, encode_blob
from scd_store.store.keys import generation_of, make_key
from scd_store.store.signing import SigningKey
from scd_store.store.tiers.redis_tier import REPORT_TTL_S


def wait_for(check, timeout: float = 5.0) -> bool:
    """Whether ``check()`` came true within ``timeout`` (it is called until it does, never after)."""
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def reports(keys: list[str]) -> tuple[str, str]:
    gen = keys[0].split(":")[2]
    return f"scd:__stats__:suspects:tiny-space:{gen}", f"scd:__stats__:hits:tiny-space:{gen}"


def forged_for(producer, key: str) -> bytes:
    """Well formed, signed with the real key id and another private key: a bad signature."""
    fingerprint = producer.binding("producer-a").space.fingerprint
    return encode_blob(BlobMeta("scd-reuse", fingerprint, 8), b"kv" * 100, key=key,
                       signer=SigningKey("k1", b"\x01" * 32))


def test_readers_never_delete_and_the_producer_quarantines(deployment):  # noqa: F811
    producer, consumer, keys = started(deployment)
    admin = deployment["admin"]
    suspects, _ = reports(keys)
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
        # the reader reported both keys, in a hash with a TTL; the producer verifies them, deletes and rewrites them
        assert wait_for(lambda: admin.hlen(suspects) == 2)
        assert sorted(admin.hscan(suspects)[1]) == sorted(k.encode() for k in keys[1:])
        assert 0 < admin.ttl(suspects) <= REPORT_TTL_S
        assert producer.store.repair_now() == (2, 2)
        assert admin.get(keys[1]) == good and admin.get(keys[2]) != good and admin.hlen(suspects) == 0
        assert producer.store.stats.value("repaired_blobs") == 2
        assert len(consumer.get("consumer-a", HASHES)) == 3
        # a blob the producer no longer holds: it deletes the bad copy, so its engine stores the chunk again
        admin.set(keys[2], forged)
        producer.store.tiers[0].delete_now(keys[2])
        assert len(consumer.get("consumer-a", HASHES)) == 2
        assert wait_for(lambda: admin.hlen(suspects) == 1)
        assert producer.store.repair_now() == (1, 0) and admin.get(keys[2]) is None
        assert producer.contains("producer-a", HASHES) == 2
    finally:
        producer.close(), consumer.close()


def test_verified_hits_refresh_the_ttl_through_the_producer_only(deployment):  # noqa: F811
    producer, consumer, keys = started(deployment)
    admin = deployment["admin"]
    _, hits = reports(keys)
    try:
        admin.delete(hits)
        for key in (keys[0], keys[2]):
            admin.pexpire(key, 5_000)
        producer.store.tiers[0].delete_now(keys[1])  # no good copy: the bad blob is deleted, never kept alive
        admin.set(keys[1], forged_for(producer, keys[1]), px=5_000)
        assert len(consumer.get("consumer-a", HASHES)) == 1
        # the consumer reported the blobs it verified (chunk 2 too: good, though past the served run)...
        assert wait_for(lambda: admin.hlen(hits) == 2)
        assert sorted(admin.hscan(hits)[1]) == [keys[0].encode(), keys[2].encode()]
        assert 0 < admin.ttl(hits) <= REPORT_TTL_S
        time.sleep(0.2)
        assert admin.pttl(keys[0]) <= 5_000 and admin.pttl(keys[2]) <= 5_000  # ...and refreshed nothing (it cannot)
        assert producer.store.repair_now() == (1, 0)
        assert min(admin.pttl(keys[0]), admin.pttl(keys[2])) > TTL_S * 1000 - 10_000 and not admin.exists(keys[1])
        assert producer.store.stats.value("ttl_refreshes", tier="redis", space="tiny-space") == 2
        assert admin.hlen(hits) == 0  # processed: removed
        # a reported hit of a key that is gone brings nothing back
        reader = as_user(deployment, "consumer")
        reader.hset(hits, keys[1], "1")
        reader.close()
        assert producer.store.repair_now() == (0, 0) and not admin.exists(keys[1]) and admin.hlen(hits) == 0
        assert producer.store.stats.value("ttl_refreshes") == 2
    finally:
        producer.close(), consumer.close()


def test_reports_outside_the_producers_space_generation_are_refused(deployment):  # noqa: F811
    """The rollout DoS: a reader listed another generation's keys in a generation's suspects hash and that
    generation's producer deleted them. Now only keys of the repairing space generation are processed; the rest
    is counted, dropped and left alone, and a blob of another generation under a key is a miss, never deleted."""
    producer, consumer, keys = started(deployment)
    admin, reader = deployment["admin"], as_user(deployment, "consumer")
    suspects, hits = reports(keys)
    gen = keys[0].split(":")[2]
    next_gen = make_key("tiny-space", generation_of("the-next-bundle"), "ab" * 16)
    other_space = make_key("other-space", gen, "ab" * 16)
    for key in (next_gen, other_space):
        admin.set(key, b"someone else's blob", px=5_000)
    fingerprint = producer.binding("producer-a").space.fingerprint
    foreign = encode_blob(BlobMeta("scd-reuse", "the-next-bundle", 8), b"kv" * 100, key=keys[0],
                          signer=producer.store.keyring.signer("tiny-space"))  # genuine, another generation's
    assert fingerprint != "the-next-bundle"
    admin.set(keys[0], foreign, px=5_000)
    junk = [next_gen, other_space, "junk", f"scd:tiny-space:{gen}:xyz", "x" * 10_000]
    try:
        reader.hset(suspects, mapping=dict.fromkeys([*junk, keys[0]], "1"))
        reader.hset(suspects, b"\xff\xfe", "1")
        reader.hset(hits, mapping=dict.fromkeys(junk, "1"))
        assert producer.store.repair_now() == (0, 0)
        assert admin.get(next_gen) == admin.get(other_space) == b"someone else's blob"
        assert admin.pttl(next_gen) <= 5_000 and admin.pttl(other_space) <= 5_000  # no TTL refreshed either
        assert admin.get(keys[0]) == foreign  # verified as foreign: a miss, not damage
        assert producer.store.stats.value("refused_reports", tier="redis", space="tiny-space") == 6 + 5
        assert admin.hlen(suspects) == 0 and admin.hlen(hits) == 0  # processed or refused: dropped
        assert len(consumer.get("consumer-a", HASHES)) == 0 and consumer.store.stats.value("foreign_blobs") == 1
        # a round takes a bounded number of reports, however many a reader writes
        pipe = admin.pipeline(transaction=False)
        for i in range(5_000):
            pipe.hset(suspects, f"junk-{i}", "1")
        pipe.execute()
        assert producer.store.repair_now() == (0, 0) and admin.hlen(suspects) == 5_000 - 256
    finally:
        reader.close()
        producer.close(), consumer.close()


def test_a_tier_failure_midway_leaves_the_reports_for_the_next_round(deployment):  # noqa: F811
    """Reports used to be removed before they were verified: a failing delete or rewrite lost them."""
    producer, consumer, keys = started(deployment)
    admin, server = deployment["admin"], deployment["server"]
    suspects, _ = reports(keys)
    user = "scd-producer-tiny-space"
    good = {k: admin.get(k) for k in keys}
    try:
        admin.set(keys[1], forged_for(producer, keys[1]))
        assert len(consumer.get("consumer-a", HASHES)) == 1 and wait_for(lambda: admin.hlen(suspects) == 1)
        assert server.cli("ACL", "SETUSER", user, "-del").strip() == "OK"  # the delete fails
        assert producer.store.repair_now() == (0, 0)
        assert admin.hexists(suspects, keys[1]) and admin.get(keys[1]) != good[keys[1]]
        assert server.cli("ACL", "SETUSER", user, "+del", "-set").strip() == "OK"  # the rewrite fails
        assert wait_for(lambda: producer.store.repair_now() == (1, 0))  # once the tier's backoff has passed
        assert admin.hexists(suspects, keys[1]) and not admin.exists(keys[1])
        assert server.cli("ACL", "SETUSER", user, "+set").strip() == "OK"
        assert wait_for(lambda: producer.store.repair_now() == (0, 1))  # the absent key, rewritten from its copy
        assert admin.get(keys[1]) == good[keys[1]] and admin.hlen(suspects) == 0
        assert producer.store.stats.value("tier_errors", tier="redis") >= 2
        assert len(consumer.get("consumer-a", HASHES)) == 3
    finally:
        producer.close(), consumer.close()
