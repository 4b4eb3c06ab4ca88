"""Kill redis-server in the middle of a run of concurrent lookups, gets and puts: every request completes
(a miss where needed) within its timeout, errors are counted, and the tier comes back by itself."""

from __future__ import annotations

import random
import threading
import time

import redis

from integration_tests.redis_servers import RedisServer
from integration_tests.store_ops import keys_of
from scd_store.bench.soak import CHUNK, PAIR, PRODUCER, SPACE, SoakConfig, payload_for, prefix_tokens
from scd_store.store.keys import chunk_hashes
from scd_store.store.registry import FileRegistry, Pair, Space
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier
from scd_store.store.tiers.redis_tier import RedisTier

OP_TIMEOUT = 0.5


def test_outage_mid_run(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    config = SoakConfig(server.url, prefixes=50, max_bytes=8 << 10)
    registry = FileRegistry(tmp_path / "registry.json")
    registry.register_space(Space(SPACE, PRODUCER, "p-fp", "soak-fp", codec_id="raw", chunk_size=CHUNK))
    registry.register_pair(Pair(PAIR, SPACE, "soak-consumer", "c-fp", "pair-fp", "soak-fp"))
    store = TieredStore([CpuTier(256 << 10), RedisTier(server.url, socket_timeout=OP_TIMEOUT, connect_timeout=0.3)],
                        registry, chunk_size=CHUNK, op_timeout_s=OP_TIMEOUT, put_timeout_s=2.0,
                        backoff_min_s=0.05, backoff_max_s=0.3)
    outage = {"down": False}
    done = {"total": 0, "during_outage": 0, "errors": 0, "torn": 0, "max_latency": 0.0}
    lock = threading.Lock()
    stop = time.monotonic() + 5.0
    producer, consumer = store.producer(SPACE, PRODUCER, "soak-fp"), store.consumer(PAIR, "soak-consumer", "soak-fp")

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop:
            tokens = prefix_tokens(rng.randrange(config.prefixes), 2)
            hashes = chunk_hashes(tokens, CHUNK)
            t0 = time.monotonic()
            try:
                if rng.random() < 0.4:
                    payloads = [payload_for(k, config) for k in keys_of(SPACE, "soak-fp", tokens, CHUNK)]
                    producer.put(hashes, payloads, [CHUNK] * len(hashes), codec_id="raw")
                elif rng.random() < 0.7:
                    chunks = consumer.get(hashes)
                    torn = sum(bytes(c.payload) != payload_for(c.key, config) for c in chunks)
                    with lock:
                        done["torn"] += torn
                else:
                    consumer.contains(hashes)
            except Exception:
                with lock:
                    done["errors"] += 1
            latency = time.monotonic() - t0
            with lock:
                done["total"] += 1
                done["during_outage"] += outage["down"]
                done["max_latency"] = max(done["max_latency"], latency)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        time.sleep(1.0)
        server.kill()
        outage["down"] = True
        time.sleep(2.0)
        server.start()
        outage["down"] = False
        for t in threads:
            t.join()
        assert done["errors"] == 0 and done["torn"] == 0
        assert done["during_outage"] > 0  # requests kept completing (as misses) while Redis was down
        assert done["max_latency"] < 2 * OP_TIMEOUT + 2.0  # bounded by the op timeout, nothing hung
        assert store.stats.value("tier_errors", tier="redis") >= 1
        deadline = time.monotonic() + 10
        while store.health["redis"].down and time.monotonic() < deadline:
            consumer.contains(chunk_hashes(prefix_tokens(0, 2), CHUNK))
            time.sleep(0.05)
        assert not store.health["redis"].down  # recovered by itself
        tokens = prefix_tokens(999, 2)
        payloads = [payload_for(k, config) for k in keys_of(SPACE, "soak-fp", tokens, CHUNK)]
        keys = producer.put(chunk_hashes(tokens, CHUNK), payloads, [CHUNK, CHUNK], codec_id="raw")
        store.flush()
        assert redis.Redis(host="127.0.0.1", port=server.port).exists(*keys) == len(keys)
        print(f"outage figures: {done}")
    finally:
        store.close()
        server.stop()
