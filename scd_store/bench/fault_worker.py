"""One process of the fault soak (:mod:`scd_store.bench.fault_soak`): the producer, a consumer or the rogue
consumer (:mod:`scd_store.bench.fault_rogue`).

Run as ``python -m scd_store.bench.fault_worker JSON``; it works until its stop file appears and writes
one JSON report (no pickle). Payloads are a pure function of their key
(:func:`~scd_store.bench.fault_space.payload_for`), so every chunk a consumer is served is checked byte for
byte. The producer signs with the private key; consumers and the rogue hold the public one.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from scd_store.bench.fault_space import (
    CHUNK,
    CONSUMER,
    FINGERPRINT,
    PAIR,
    PRODUCER,
    SPACE,
    payload_for,
    prefix_hashes,
    store_keys,
)


def _store(spec: dict[str, Any]):  # noqa: ANN202 - a TieredStore
    from scd_store.store.keyring import Keyring
    from scd_store.store.registry import RedisRegistry
    from scd_store.store.tiered import TieredStore
    from scd_store.store.tiers.cpu import CpuTier
    from scd_store.store.tiers.disk import DiskTier
    from scd_store.store.tiers.redis_tier import RedisTier

    tiers: list[Any] = [CpuTier(spec["cpu_bytes"])]
    if spec.get("disk"):
        tiers.append(DiskTier(spec["disk"], spec["disk_bytes"], rescan_s=None, max_value_bytes=1 << 20))
    tiers.append(RedisTier(spec["url"], ttl_s=spec["ttl_s"], socket_timeout=1.0, connect_timeout=0.5))
    return TieredStore(tiers, RedisRegistry(spec["url"]), chunk_size=CHUNK, op_timeout_s=1.0, put_timeout_s=2.0,
                       backoff_min_s=0.05, backoff_max_s=0.5, keyring=Keyring(spec["keyring"]),
                       registry_refresh_s=spec["registry_refresh_s"], repair_s=0.5)


def _counters(store: Any) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """Each counter's total, and per tier for the counters a tier labels."""
    totals: dict[str, int] = defaultdict(int)
    per_tier: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for entry in store.stats.snapshot()["counters"]:
        totals[entry["name"]] += int(entry["value"])
        if entry["tier"]:
            per_tier[entry["tier"]][entry["name"]] += int(entry["value"])
    return dict(totals), {tier: dict(c) for tier, c in per_tier.items()}


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    from scd_store.bench.fault_rogue import Rogue
    from scd_store.store.records import NotRegistered

    stop = Path(spec["stop"])
    rng = random.Random(spec["seed"])
    store = _store(spec)
    report: dict[str, Any] = {"role": spec["role"], "requests": 0, "errors": 0, "first_error": "", "served": 0,
                              "garbage": 0, "refusals": 0, "first_refusal_at": None, "puts": 0}
    acknowledged: set[str] = set()
    rogue = Rogue(spec, store, lambda i: store_keys(i, spec["chunks"]), rng) if spec["role"] == "rogue" else None
    latencies: list[float] = []
    started = time.monotonic()
    try:
        while not stop.exists():
            # the producer's prefixes grow over the run (new requests keep arriving); consumers ask for any
            grown = (time.monotonic() - started) / spec["duration_s"]
            reach = spec["prefixes"] if spec["role"] != "producer" else min(
                spec["prefixes"], 4 + int(grown * spec["prefixes"]))
            hashes = prefix_hashes(rng.randrange(reach), spec["chunks"])
            t0 = time.perf_counter()
            try:
                if rogue is not None:
                    rogue.round()
                elif spec["role"] == "producer":
                    view = store.producer(SPACE, PRODUCER, FINGERPRINT)
                    have = view.lookup(hashes).hit_chunks
                    if have < len(hashes):
                        keys = view.keys(hashes)
                        stored = view.put(hashes, [payload_for(k, spec["payload_bytes"]) for k in keys],
                                          [CHUNK] * len(keys), codec_id="raw")
                        report["puts"] += len(stored)
                        acknowledged.update(stored)
                else:
                    chunks = store.consumer(PAIR, CONSUMER, FINGERPRINT).get(hashes)
                    report["served"] += len(chunks)
                    report["garbage"] += sum(bytes(c.host_payload()) != payload_for(c.key, spec["payload_bytes"])
                                             for c in chunks)
                report["requests"] += 1
                latencies.append(time.perf_counter() - t0)
            except NotRegistered:
                report["refusals"] += 1
                report["first_refusal_at"] = report["first_refusal_at"] or time.time()
            except Exception as exc:  # noqa: BLE001 - counted: a request that did not complete
                report["errors"] += 1
                report["first_error"] = report["first_error"] or f"{type(exc).__name__}: {exc}"
            time.sleep(spec["pause_s"])
    finally:
        if rogue is not None:
            report["rogue"] = rogue.report()
            rogue.close()
        report["acknowledged"] = sorted(acknowledged)
        report["unwritten"] = store.close(timeout=5.0)
        report["counters"], report["tier_counters"] = _counters(store)
        report["incidents"] = {name: h.incidents for name, h in store.health.items()}
    latencies.sort()
    report["p50_ms"] = round(latencies[len(latencies) // 2] * 1e3, 2) if latencies else 0.0
    report["p99_ms"] = round(latencies[int(len(latencies) * 0.99)] * 1e3, 2) if latencies else 0.0
    return report


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    Path(job["out"]).write_text(json.dumps(run_worker(job)))
