"""``scd-store bench soak``: concurrent clients on the CPU + Redis tiers under eviction pressure.

Clients are threads in this process plus worker processes (``python -m scd_store.bench.soak
--worker JSON``; results come back as one JSON line: no pickle). Each client runs a seeded mix of
puts (40%), gets (40%) and lookups (20%) on prefixes of a shared key space. Every payload is a
pure function of its chunk key, so every read can be checked byte for byte:

- **torn reads**: a get that returns bytes other than the key's payload (must be 0);
- **lost acknowledged writes**: after all clients finish and the write queues drain, every chunk
  a put acknowledged must be in Redis (the lowest tier; the small CPU tier evicts on purpose);
- throughput, p50 / p99 per operation, peak RSS of each process;
- then every parser of stored or transferred bytes is fuzzed (``fuzz_inputs`` per parser, see
  :mod:`scd_store.bench.fuzz`): any exception other than the parser's documented error fails the run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from scd_store.bench.fuzz import fuzz_all
from scd_store.store.keys import chunk_hashes
from scd_store.store.registry import Pair, RedisRegistry, Space
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier
from scd_store.store.tiers.redis_tier import RedisTier

SPACE, PAIR, PRODUCER, CONSUMER = "soak", "soak-pair", "soak-producer", "soak-consumer"
CHUNK = 4


@dataclass(frozen=True, slots=True)
class SoakConfig:
    redis_url: str
    threads: int = 16
    processes: int = 2
    threads_per_process: int = 8
    ops: int = 10_000  # in total, over all clients
    prefixes: int = 200  # distinct prefixes in the key space
    chunks_per_prefix: int = 4
    min_bytes: int = 1 << 10
    max_bytes: int = 64 << 10
    cpu_tier_bytes: int = 4 << 20  # small: eviction pressure
    seed: int = 0
    fuzz_inputs: int = 0  # per parser; the soak CLI runs 100,000

    def __post_init__(self) -> None:
        if self.threads < 0 or self.processes < 0 or self.threads + self.processes * self.threads_per_process <= 0:
            raise ValueError("need at least one client")
        if self.ops <= 0 or self.prefixes <= 0 or not 0 < self.min_bytes <= self.max_bytes:
            raise ValueError("ops, prefixes and payload sizes must be positive")

    @property
    def clients(self) -> int:
        return self.threads + self.processes * self.threads_per_process


def prefix_tokens(index: int, chunks: int) -> list[int]:
    return [index * 1000 + t for t in range(chunks * CHUNK)]


def payload_for(key: str, config: SoakConfig) -> bytes:
    """The one payload a chunk key ever holds (so any other bytes are a torn or foreign read)."""
    digest = hashlib.sha256(key.encode()).digest()
    size = config.min_bytes + int.from_bytes(digest[:4], "little") % (config.max_bytes - config.min_bytes + 1)
    return (digest * (size // len(digest) + 1))[:size]


def open_soak_store(config: SoakConfig) -> TieredStore:
    registry = RedisRegistry(config.redis_url)
    registry.register_space(Space(SPACE, PRODUCER, "p-fp", "soak-fp", codec_id="raw", chunk_size=CHUNK))
    registry.register_pair(Pair(PAIR, SPACE, CONSUMER, "c-fp", "pair-fp", "soak-fp"))
    return TieredStore([CpuTier(config.cpu_tier_bytes), RedisTier(config.redis_url)], registry, chunk_size=CHUNK,
                       op_timeout_s=5.0, put_timeout_s=30.0, queue_size=512)


def client(store: TieredStore, config: SoakConfig, client_id: int, ops: int) -> dict[str, Any]:
    rng = random.Random(config.seed * 1_000_003 + client_id)
    latency: dict[str, list[float]] = {"put": [], "get": [], "lookup": []}
    acked: list[str] = []
    torn = 0
    producer, consumer = store.producer(SPACE, PRODUCER, "soak-fp"), store.consumer(PAIR, CONSUMER, "soak-fp")
    for _ in range(ops):
        index = rng.randrange(config.prefixes)
        hashes = chunk_hashes(prefix_tokens(index, config.chunks_per_prefix), CHUNK)
        roll = rng.random()
        t0 = time.perf_counter()
        if roll < 0.4:
            payloads = [payload_for(k, config) for k in producer.keys(hashes)]
            done = producer.put(hashes, payloads, [CHUNK] * len(hashes), codec_id="raw")
            latency["put"].append(time.perf_counter() - t0)
            acked.extend(done)
        elif roll < 0.8:
            chunks = consumer.get(hashes)
            latency["get"].append(time.perf_counter() - t0)
            torn += sum(bytes(c.host_payload()) != payload_for(c.key, config) for c in chunks)
        else:
            consumer.contains(hashes)
            latency["lookup"].append(time.perf_counter() - t0)
    return {"latency": latency, "acked": acked, "torn": torn}


def run_clients(config: SoakConfig, threads: int, ops_each: int, first_id: int) -> dict[str, Any]:
    """``threads`` clients on one store in this process; the store is drained before returning."""
    store = open_soak_store(config)
    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def work(cid: int) -> None:
        result = client(store, config, cid, ops_each)
        with lock:
            results.append(result)

    workers = [threading.Thread(target=work, args=(first_id + i,)) for i in range(threads)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - start
    store.flush()
    stats = {name: store.stats.value(name)
             for name in ("tier_errors", "corrupt_blobs", "rejected_blobs", "dropped_writes", "evictions")}
    store.close()
    merged: dict[str, Any] = {"latency": {k: [] for k in ("put", "get", "lookup")}, "acked": [], "torn": 0,
                              "elapsed_s": elapsed, "stats": stats,
                              "peak_rss_mib": peak_rss_mib()}
    for r in results:
        for k, v in r["latency"].items():
            merged["latency"][k].extend(v)
        merged["acked"].extend(r["acked"])
        merged["torn"] += r["torn"]
    return merged


def peak_rss_mib() -> float:
    """This process's peak resident set (VmHWM: per address space, so an exec'd worker does not inherit
    its parent's peak as ``ru_maxrss`` does)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_soak(config: SoakConfig) -> dict[str, Any]:
    ops_each = max(1, config.ops // config.clients)
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        for p in range(config.processes):
            out = Path(tmp) / f"worker{p}.json"
            spec = json.dumps({"config": asdict(config), "threads": config.threads_per_process,
                               "ops_each": ops_each, "first_id": 10_000 * (p + 1), "out": str(out)})
            procs.append((subprocess.Popen([sys.executable, "-m", "scd_store.bench.soak", "--worker", spec]), out))
        t0 = time.perf_counter()
        local = run_clients(config, config.threads, ops_each, 0) if config.threads else None
        parts = [local] if local else []
        for proc, out in procs:
            if proc.wait(timeout=600) != 0:
                raise RuntimeError(f"soak worker exited with {proc.returncode}")
            parts.append(json.loads(out.read_text()))
        wall = time.perf_counter() - t0
    import redis as redis_py

    from scd_store.store.redis_url import make_sync_client

    raw: redis_py.Redis = make_sync_client(config.redis_url)
    acked = sorted({k for part in parts for k in part["acked"]})
    lost = sum(not raw.exists(k) for k in acked)
    raw.close()
    latency = {k: [x for part in parts for x in part["latency"][k]] for k in ("put", "get", "lookup")}
    total_ops = sum(len(v) for v in latency.values())
    return {
        "clients": config.clients, "threads": config.threads, "processes": config.processes,
        "ops": total_ops, "wall_s": round(wall, 3), "ops_per_s": round(total_ops / wall, 1),
        "per_op": {k: {"count": len(v), "p50_ms": round(_quantile(v, 0.5) * 1e3, 3),
                       "p99_ms": round(_quantile(v, 0.99) * 1e3, 3)} for k, v in latency.items()},
        "torn_reads": sum(p["torn"] for p in parts), "acknowledged_chunks": len(acked), "lost_writes": lost,
        # this process first (its peak includes whatever it held before the soak), then each worker process
        "peak_rss_mib": [round(p["peak_rss_mib"], 1) for p in parts],
        "store_counters": {k: sum(p["stats"][k] for p in parts) for k in parts[0]["stats"]},
        "fuzz": fuzz_all(config.fuzz_inputs) if config.fuzz_inputs else {},
        "config": asdict(config),
    }


def _worker(spec: str) -> None:
    job = json.loads(spec)
    config = SoakConfig(**job["config"])
    result = run_clients(config, job["threads"], job["ops_each"], job["first_id"])
    Path(job["out"]).write_text(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    _worker(parser.parse_args().worker)
    os._exit(0)
