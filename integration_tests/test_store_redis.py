"""The Redis tier, the store, the registry and the stats mirror against real redis-server processes
(standalone and a 3-master cluster) that these tests start on free loopback ports."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import redis

from integration_tests.redis_servers import RedisCluster, RedisServer
from integration_tests.store_ops import get_tokens, hit_tokens, keys_of, put_tokens
from scd_store.store.keys import chunk_hashes
from scd_store.store.registry import FileRegistry, NotRegistered, Pair, RedisRegistry, Space
from scd_store.store.stats import REDIS_STATS_KEY, StoreStats
from scd_store.store.stats_sinks import PROCESS_TTL_S, RedisStatsMirror, read_redis_stats
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier
from scd_store.store.tiers.redis_tier import RedisTier

SPACE = Space("sp", "producer-m", "prod-fp", "space-fp", chunk_size=4, raw_kv_bytes_per_token=500)
PAIR = Pair("pair", "sp", "consumer-m", "cons-fp", "pair-fp", "space-fp")
TOKENS = list(range(4 * 8))
PAYLOADS = [bytes([i]) * (1000 + i) for i in range(8)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis")) as srv:
        yield srv


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with RedisCluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.fixture
def raw(server):
    client = redis.Redis(host="127.0.0.1", port=server.port)
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def registry(tmp_path):
    reg = FileRegistry(tmp_path / "registry.json")
    reg.register_space(SPACE)
    reg.register_pair(PAIR)
    return reg


def run(coro):
    return asyncio.run(coro)


async def _tier_round_trip(tier: RedisTier, keys: list[str]) -> None:
    await tier.start()
    try:
        await tier.put_many([(k, k.encode() * 3) for k in keys[:-1]])
        assert await tier.get_many(keys) == [k.encode() * 3 for k in keys[:-1]] + [None]
        assert await tier.contains_many(keys) == [True] * (len(keys) - 1) + [False]
        await tier.put(keys[-1], b"\x00" * (3 << 20))  # one 3 MiB SET: whole or nothing
        assert await tier.get(keys[-1]) == b"\x00" * (3 << 20)
        assert await tier.delete(keys[0]) and not await tier.contains(keys[0])
        assert await tier.delete_many(keys[1:4]) == 3 and await tier.get_many(keys[1:4]) == [None] * 3
        await tier.put_many([(k, b"back") for k in keys[1:4]])
    finally:
        await tier.close()


def test_standalone_round_trip(server, raw) -> None:
    run(_tier_round_trip(RedisTier(server.url), keys_of("sp", "space-fp", list(range(40)), 4)))
    assert raw.dbsize() == 9


def test_cluster_round_trip_across_slots(cluster) -> None:
    keys = keys_of("sp", "space-fp", list(range(200)), 4)  # 50 keys spread over the 3 masters
    run(_tier_round_trip(RedisTier(cluster.url), keys))
    sizes = [int(n.cli("DBSIZE").strip()) for n in cluster.nodes]
    assert sum(sizes) == len(keys) - 1 and all(s > 0 for s in sizes)  # one key was deleted


def test_ttl(server, raw) -> None:
    key = keys_of("sp", "space-fp", [1, 2, 3, 4], 4)[0]

    async def go() -> bytes | None:
        tier = RedisTier(server.url, ttl_s=0.3)
        try:
            await tier.put(key, b"short-lived")
            assert 0 < raw.pttl(key) <= 300
            assert await tier.get(key) == b"short-lived"
            await asyncio.sleep(0.6)
            return await tier.get(key)
        finally:
            await tier.close()

    assert run(go()) is None


def test_max_value_bytes_and_server_maxmemory(tmp_path) -> None:
    keys = keys_of("sp", "space-fp", list(range(4 * 40)), 4)
    with RedisServer(tmp_path / "small") as srv:
        async def go() -> RedisTier:
            tier = RedisTier(srv.url, max_value_bytes=1 << 20, server_maxmemory=4 << 20, ttl_s=3600)
            await tier.start()
            try:
                await tier.put(keys[0], b"x" * ((1 << 20) + 1))
                for key in keys:
                    await tier.put(key, b"y" * (256 << 10))
            finally:
                await tier.close()
            return tier

        client = redis.Redis(host="127.0.0.1", port=srv.port)
        registry = RedisRegistry(srv.url)
        registry.register_space(SPACE)  # no TTL: under volatile-lru the registry is never evicted
        tier = run(go())
        assert tier.rejected == 1
        assert client.config_get("maxmemory")["maxmemory"] == str(4 << 20)
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "volatile-lru"
        assert registry.space("sp", "space-fp") == SPACE
        registry.close()
        assert client.dbsize() < len(keys)  # the server evicted to stay within its budget
        assert not client.exists(keys[0]) and client.exists(keys[-1])
        client.close()


def test_a_value_another_writer_made_huge_is_read_cut_at_the_bound(server, raw) -> None:
    """Whoever can write a blob key could store 512 MB under a hot key and have every reader allocate it: reads
    take at most max_value_bytes + 1 bytes, so such a value fails verification instead."""
    key = keys_of("sp", "space-fp", list(range(4)), 4)[0]
    raw.set(key, b"z" * (8 << 20))

    async def go() -> list[bytes | None]:
        tier = RedisTier(server.url, max_value_bytes=1 << 20)
        await tier.start()
        try:
            return [*await tier.get_many([key]), await tier.get("scd:sp:absent")]
        finally:
            await tier.close()

    cut, absent = run(go())
    assert cut is not None and len(cut) == (1 << 20) + 1 and absent is None


def test_store_over_redis_round_trip_and_corruption(server, raw, registry) -> None:
    store = TieredStore([CpuTier(1 << 20), RedisTier(server.url)], registry, chunk_size=4)
    try:
        keys = put_tokens(store, "sp", "producer-m", TOKENS, PAYLOADS)
        store.flush()
        assert raw.exists(*keys) == 8
        for key in keys:
            store.tiers[0].delete_now(key)
        raw.set(keys[5], b"SCDB but not really")
        chunks = get_tokens(store, "pair", "consumer-m", TOKENS)
        assert [bytes(c.payload) for c in chunks] == PAYLOADS[:5] and {c.tier for c in chunks} == {"redis"}
        assert store.stats.value("corrupt_blobs", tier="redis") == 1
        assert raw.exists(keys[5])  # a reader never deletes from a shared tier: it reports the key
        assert store.repair_now() == (1, 0)  # the producer verifies it, deletes it (it holds no good copy)...
        assert not raw.exists(keys[5])
        assert store.producer("sp", "producer-m", "space-fp").contains(chunk_hashes(TOKENS, 4)) == 5  # ...re-store
        assert hit_tokens(store, "pair", "consumer-m", TOKENS) == 20
        assert store.stats.value("bytes_saved", pair="pair") == 5 * 4 * 500 - sum(len(raw.get(k)) for k in keys[:5])
    finally:
        store.close()


def test_store_over_cluster(cluster, registry) -> None:
    store = TieredStore([CpuTier(1 << 20), RedisTier(cluster.url)], registry, chunk_size=4)
    try:
        keys = put_tokens(store, "sp", "producer-m", TOKENS, PAYLOADS)
        store.flush()
        for key in keys:
            store.tiers[0].delete_now(key)
        assert store.consumer("pair", "consumer-m", "space-fp").lookup(chunk_hashes(TOKENS, 4)).tiers == ("redis",) * 8
        assert [bytes(c.payload) for c in get_tokens(store, "pair", "consumer-m", TOKENS)] == PAYLOADS
    finally:
        store.close()


def test_server_killed_then_restarted(tmp_path, registry, caplog) -> None:
    srv = RedisServer(tmp_path / "outage").start()
    op_timeout = 1.0
    store = TieredStore([CpuTier(1 << 20), RedisTier(srv.url, socket_timeout=op_timeout, connect_timeout=0.5)],
                        registry, chunk_size=4, op_timeout_s=op_timeout, put_timeout_s=3.0, backoff_min_s=0.05,
                        backoff_max_s=0.2)
    try:
        keys = put_tokens(store, "sp", "producer-m", TOKENS, PAYLOADS)
        store.flush()
        for key in keys:
            store.tiers[0].delete_now(key)
        srv.kill()
        with caplog.at_level("WARNING", logger="scd_store.store"):
            for _ in range(6):
                t0 = time.monotonic()
                assert get_tokens(store, "pair", "consumer-m", TOKENS) == []
                assert hit_tokens(store, "pair", "consumer-m", TOKENS) == 0
                assert time.monotonic() - t0 < 2 * op_timeout + 5.0  # bounded by the op timeout, not hung
                time.sleep(0.05)
            put_tokens(store, "sp", "producer-m", TOKENS, PAYLOADS[:2])  # top tier still works
            assert hit_tokens(store, "pair", "consumer-m", TOKENS) == 8
            assert store.stats.value("tier_errors", tier="redis") >= 1
            assert store.health["redis"].down
            srv.start()
            redis.Redis(host="127.0.0.1", port=srv.port).set("warm", "1")
            deadline = time.monotonic() + 15
            while store.health["redis"].down and time.monotonic() < deadline:
                hit_tokens(store, "pair", "consumer-m", TOKENS)
                time.sleep(0.05)
        assert not store.health["redis"].down and store.health["redis"].incidents == 1
        assert sum("failed" in r.message for r in caplog.records) == 1
        assert sum("recovered" in r.message for r in caplog.records) == 1
        put_tokens(store, "sp", "producer-m", TOKENS, PAYLOADS)
        store.flush()
        assert redis.Redis(host="127.0.0.1", port=srv.port).exists(*keys) == 8
    finally:
        store.close()
        srv.stop()


def test_registry_in_redis(server, raw) -> None:
    reg = RedisRegistry(server.url)
    reg.register_space(SPACE)
    reg.register_pair(PAIR)
    other = RedisRegistry(server.url)  # another process
    assert other.resolve("pair", "consumer-m", "space-fp") == (PAIR, SPACE)
    with pytest.raises(NotRegistered, match="'stranger' is not registered"):
        other.resolve("pair", "stranger", "space-fp")
    with pytest.raises(NotRegistered):
        other.pair("missing", "space-fp")
    assert json.loads(raw.hget("scd:__registry__:spaces", SPACE.ident))["producer_model_id"] == "producer-m"
    reg.close()
    other.close()


def test_registry_in_cluster(cluster) -> None:
    reg = RedisRegistry(cluster.url)
    reg.register_space(SPACE, replace=True)
    assert reg.space("sp", "space-fp") == SPACE
    reg.close()


def test_stats_mirrored_in_redis(server, raw, registry) -> None:
    stores = [TieredStore([CpuTier(1 << 20), RedisTier(server.url)], registry, chunk_size=4,
                          stats=StoreStats(), stats_sink=RedisStatsMirror(server.url), stats_flush_s=60)
              for _ in range(2)]
    try:
        put_tokens(stores[0], "sp", "producer-m", TOKENS, PAYLOADS)
        stores[0].flush()
        for st in stores:
            assert len(get_tokens(st, "pair", "consumer-m", TOKENS)) == 8
            st.flush_stats()
    finally:
        for st in stores:
            st.close()
    assert raw.hget(REDIS_STATS_KEY, "c|hit_chunks|cpu|sp|pair") == b"8"
    assert raw.hget(REDIS_STATS_KEY, "c|hit_chunks|redis|sp|pair") == b"8"  # the second process read Redis
    snapshot = read_redis_stats(server.url)
    lookups = [c for c in snapshot["counters"] if c["name"] == "lookups" and c["pair"] == "pair"]
    assert lookups[0]["value"] == 2 and any(h["op"] == "get" for h in snapshot["latency"])
    # every stats key has a TTL (refreshed by each flush): under volatile-lru none of them fills Redis for good
    procs = [k.decode() for k in raw.hkeys(f"{REDIS_STATS_KEY}:procs")]  # one: both stores are this process
    assert len(procs) == len(snapshot["processes"]) == 1
    for key in (REDIS_STATS_KEY, f"{REDIS_STATS_KEY}:procs", *(f"{REDIS_STATS_KEY}:proc:{p}" for p in procs)):
        assert 0 < raw.ttl(key) <= PROCESS_TTL_S, key
    raw.expire(REDIS_STATS_KEY, 5)
    mirror = RedisStatsMirror(server.url)
    stats = StoreStats()
    stats.inc("puts", space="sp")
    mirror.flush(stats)
    mirror.close()
    assert raw.ttl(REDIS_STATS_KEY) > PROCESS_TTL_S - 60  # refreshed


def test_stats_cli_survives_any_field(server, raw, capsys) -> None:
    """Every process (consumers too) may write the stats hashes: junk there is skipped, never fatal, and
    counters stay forgeable only within the schema (they are informational)."""
    from scd_store.cli.main import main

    good = {"c|hit_tokens|redis|sp|pair": 4096, "c|lookups|[/x]|sp|[bold]": 7, "h|get|redis||3": 2}
    junk = {"c|hit_tokens|redis|sp|pair2": "not a number", "c|lookups|||": "1.5", "c|puts|||": "9" * 30,
            "c|puts|x||": str(2 ** 63), "c|puts|y||": "-3", "c|nope|||": 1, "garbage": "x", "c|hit_tokens|a|b": 1,
            "h|get|||99": 1, "h|get|||x": 1, "h|get|||3": "1e3", b"\xff\xfe": 1, "c|lookups|" + "t" * 300 + "||": 1,
            "c|lookups|\x1b[31m||": 1, "c|puts|||" + "z" * 100_000: 1}
    pipe = raw.pipeline(transaction=False)
    pipe.hset(REDIS_STATS_KEY, mapping={**good, **junk})
    for i in range(100_000):
        pipe.hset(REDIS_STATS_KEY, f"c|junk-{i}|||", i)
    record = {"host": "host", "pid": 1, "name": "[/red]", "id": "host-1", "started": 1.0, "updated": "yesterday"}
    pipe.hset(f"{REDIS_STATS_KEY}:procs", mapping={
        "host-1": json.dumps(record), "host-2": "{not json", "host-3": "[" * 3000, "host-4": "[1, 2]",
        "host-5": json.dumps({**record, "name": "x" * 300}), "host-7": json.dumps({**record, "name": "x" * 10_000}),
        "bad|pid": json.dumps(record),
        "host-6": json.dumps({**record, "pid": "abc", "updated": float("nan")})})
    for pid in ("host-1", "host-5", "host-6", "host-7", "bad|pid"):
        pipe.hset(f"{REDIS_STATS_KEY}:proc:{pid}", mapping={**good, **junk})
    pipe.execute()
    t0 = time.monotonic()
    assert main(["stats", "--redis", server.url, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert time.monotonic() - t0 < 60
    counters = {(c["name"], c["tier"], c["space"], c["pair"]): c["value"] for c in out["counters"]}
    assert counters == {("hit_tokens", "redis", "sp", "pair"): 4096, ("lookups", "[/x]", "sp", "[bold]"): 7}
    assert [h["buckets"][3] for h in out["latency"]] == [2]
    assert [p["process"]["id"] for p in out["processes"]] == ["host-1", "host-5", "host-6"]
    first, second, third = (p["process"] for p in out["processes"])
    assert first == {"host": "host", "pid": 1, "name": "[/red]", "id": "host-1", "started": 1.0}
    assert "name" not in second and "pid" not in third and "updated" not in third
    assert {row["pair"]: row["hit_tokens"] for row in out["summary"]["pairs"]} == {"pair": 4096, "[bold]": 0}
    for extra in ([], ["--counters"]):
        assert main(["stats", "--redis", server.url, *extra]) == 0
        text = capsys.readouterr().out
        assert "4,096" in text and "[/red]" in text  # labels printed as text, never as markup
    assert "[/x]" in text and "junk-" not in text


def test_a_spoiled_counter_field_costs_its_own_increment_only(server, raw) -> None:
    """A consumer may write counters: one field set to a non-integer makes its HINCRBY fail. The other deltas of
    the flush are applied once, never re-added to the fields that took them."""
    from scd_store.store.stats import StoreStats
    from scd_store.store.stats_sinks import RedisStatsMirror

    raw.hset(REDIS_STATS_KEY, "c|puts|||", "not a number")
    stats = StoreStats()
    mirror = RedisStatsMirror(server.url)
    try:
        stats.inc("puts", 2)
        stats.inc("lookups", 3)
        mirror.flush(stats)
        mirror.flush(stats)
        assert int(raw.hget(REDIS_STATS_KEY, "c|lookups|||")) == 3
        assert raw.hget(REDIS_STATS_KEY, "c|puts|||") == b"not a number"
    finally:
        mirror.close()


def test_stats_cli_reads_redis(server, raw, capsys) -> None:
    from scd_store.cli.main import main

    raw.hincrby(REDIS_STATS_KEY, "c|hit_tokens|redis|sp|pair", 4096)
    assert main(["stats", "--redis", server.url, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"name": "hit_tokens", "tier": "redis", "space": "sp", "pair": "pair", "value": 4096} in out["counters"]
    assert out["summary"]["pairs"][0]["hit_tokens"] == 4096
    assert main(["stats", "--redis", server.url]) == 0
    summary = capsys.readouterr().out
    assert "hits per pair" in summary and "4,096" in summary
    assert main(["stats", "--redis", server.url, "--counters"]) == 0
    assert "hit_tokens" in capsys.readouterr().out


def test_the_peer_directory_in_redis(server, raw) -> None:
    from scd_store.store.transfer.base import BlobRef, SourceInfo
    from scd_store.store.transfer.directory import RedisPeerDirectory

    writer, reader = RedisPeerDirectory(server.url), RedisPeerDirectory(server.url)  # two processes
    try:
        info = SourceInfo("src-1", "nixl", "DRAM", 4096, 1 << 20, 0, b"agent-metadata")
        writer.add_source(info)
        writer.record("src-1", [BlobRef("scd:sp:" + "0" * 32, 0, 10), BlobRef("scd:sp:" + "1" * 32, 10, 5)])
        assert reader.source("src-1") == info and reader.source("nope") is None
        keys = ["scd:sp:" + "0" * 32, "scd:sp:" + "1" * 32, "scd:sp:" + "2" * 32]
        assert reader.locate(keys) == [("src-1", BlobRef(keys[0], 0, 10)), ("src-1", BlobRef(keys[1], 10, 5)), None]
        reader.forget(keys[:1])  # this process's view only
        assert reader.locate(keys[:1]) == [None] and writer.locate(keys[:1]) != [None]
        writer.record("src-1", [BlobRef(keys[0], 20, 10)])  # published anew
        assert reader.locate(keys[:1]) == [("src-1", BlobRef(keys[0], 20, 10))]
    finally:
        writer.close(), reader.close()
