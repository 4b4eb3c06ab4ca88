"""``scd-store bench store``: tier throughput and latency beside the physical references of this machine.

Per tier and blob size (64 KiB, 1 MiB, 4 MiB), puts and gets are timed one at a time, interleaved op
by op with the reference (so background load hits both alike):

- CPU tier: ``memcpy`` of the same bytes (slice assignment into a preallocated buffer). The tier keeps
  immutable ``bytes`` and hands them back without a copy, so its raw get is reported, and so is the
  consumer's real path, a consumer view's ``get`` of one chunk hash, which verifies the blob's xxh3-128
  checksum.
- Disk tier: a plain sequential write / read of a file of the same size in the same directory.
- Redis tier: the raw redis-py asyncio client's ``SET`` / ``GET`` of the same value, against a
  ``redis-server`` this benchmark starts on a free loopback port.

Plus the latency of a 32-chunk lookup on a CPU-only store, through a consumer view as the engines
look up: of 32 chunk hashes (what LMCache and SGLang hand over), and of 8,192 tokens hashed by
``chunk_hashes`` first (a list and a numpy array). Ratios are tier / reference throughput (ops/s at
the same size), so 1.0 means as fast as the reference.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from scd_store.store.keys import chunk_hashes, generation_of, hash_keys
from scd_store.store.registry import FileRegistry, Pair, Space
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier
from scd_store.store.tiers.disk import DiskTier
from scd_store.store.tiers.redis_tier import RedisTier

SIZES = (64 << 10, 1 << 20, 4 << 20)
TARGETS = {"cpu_get_vs_memcpy_min": 0.5, "redis_vs_raw_min": 0.8, "lookup32_p99_us_max": 1000.0}


def _keys(n: int) -> list[str]:
    """Store keys of ``n`` distinct chunks (256 tokens each) in the bench space."""
    return hash_keys("bench", generation_of("s-fp"), chunk_hashes(list(range(256 * n)), 256))


def _ops_for(size: int, quick: bool) -> int:
    budget = (16 << 20) if quick else (96 << 20)
    return max(8, min(300, budget // size))


def _summary(times: list[float], size: int) -> dict[str, float]:
    arr = np.asarray(times)
    mean = float(arr.mean())
    return {"p50_us": float(np.percentile(arr, 50) * 1e6), "p99_us": float(np.percentile(arr, 99) * 1e6),
            "mean_us": mean * 1e6, "ops_s": 1.0 / mean, "MiB_s": size / mean / (1 << 20)}


def _time(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _ratio(a: dict[str, float], b: dict[str, float]) -> float:
    return a["ops_s"] / b["ops_s"]


def bench_cpu(sizes: tuple[int, ...], quick: bool, work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    registry = FileRegistry(work / "registry.json")
    registry.register_space(Space("bench", "producer", "p-fp", "s-fp", chunk_size=256))
    registry.register_pair(Pair("bench-pair", "bench", "consumer", "c-fp", "pair-fp", "s-fp"))
    for size in sizes:
        out[str(size)] = _cpu_size(size, _ops_for(size, quick), registry)
    return out


def _cpu_size(size: int, n: int, registry: FileRegistry) -> dict[str, Any]:
    tier = CpuTier(max(64 << 20, 2 * n * size))
    store = TieredStore([CpuTier(256 << 20)], registry, chunk_size=256)
    consumer = store.consumer("bench-pair", "consumer", "s-fp")
    values = [os.urandom(size) for _ in range(4)]
    dst = bytearray(size)
    keys = _keys(n)
    one_chunk = chunk_hashes(list(range(256)), 256)
    store.producer("bench", "producer", "s-fp").put(one_chunk, values[:1], [256], codec_id="bench")
    assert bytes(consumer.get(one_chunk)[0].host_payload()) == values[0]
    put_t, get_t, ref_t, store_t = [], [], [], []
    for i, key in enumerate(keys):
        value = values[i % len(values)]
        ref_t.append(_time(lambda v=value: dst.__setitem__(slice(None), v)))
        put_t.append(_time(lambda k=key, v=value: tier.put_now(k, v)))
    for i, key in enumerate(keys):
        value = values[i % len(values)]
        ref_t.append(_time(lambda v=value: dst.__setitem__(slice(None), v)))
        get_t.append(_time(lambda k=key: tier.get_now(k)))
        store_t.append(_time(lambda: consumer.get(one_chunk)))
    store.close()
    memcpy, get, sget = _summary(ref_t, size), _summary(get_t, size), _summary(store_t, size)
    return {"ops": n, "memcpy": memcpy, "put": _summary(put_t, size), "get": get,
            "store_get_verified": sget, "get_ratio": _ratio(get, memcpy),
            "store_get_verified_ratio": _ratio(sget, memcpy)}


def bench_disk(sizes: tuple[int, ...], quick: bool, work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    loop = asyncio.new_event_loop()
    try:
        for size in sizes:
            out[str(size)] = _disk_size(size, _ops_for(size, quick), work, loop)
    finally:
        loop.close()
    return out


def _disk_size(size: int, n: int, work: Path, loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
    root = work / f"disk-{size}"
    tier = DiskTier(root, max(256 << 20, 2 * n * size))
    loop.run_until_complete(tier.start())
    value = os.urandom(size)
    keys = _keys(n)
    ref_dir = work / f"ref-{size}"
    ref_dir.mkdir()
    put_t, get_t, wref_t, rref_t = [], [], [], []

    def write_ref(i: int) -> None:
        with open(ref_dir / f"{i}.bin", "wb") as f:
            f.write(value)

    def read_ref(i: int) -> None:
        with open(ref_dir / f"{i}.bin", "rb") as f:
            f.read()

    for i, key in enumerate(keys):
        wref_t.append(_time(lambda i=i: write_ref(i)))
        put_t.append(_time(lambda k=key: loop.run_until_complete(tier.put(k, value))))
    for i, key in enumerate(keys):
        rref_t.append(_time(lambda i=i: read_ref(i)))
        get_t.append(_time(lambda k=key: loop.run_until_complete(tier.get(k))))
    put, get = _summary(put_t, size), _summary(get_t, size)
    wref, rref = _summary(wref_t, size), _summary(rref_t, size)
    result = {"ops": n, "file_write": wref, "file_read": rref, "put": put, "get": get,
              "put_ratio": _ratio(put, wref), "get_ratio": _ratio(get, rref)}
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(ref_dir, ignore_errors=True)
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_redis(work: Path, port: int | None = None, extra: tuple[str, ...] = ()
                 ) -> tuple[subprocess.Popen[bytes], int]:
    """A redis-server on a free loopback port (or ``port``), data in ``work``; ``extra`` server arguments."""
    server = shutil.which("redis-server")
    if server is None:
        raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
    port = port or _free_port()
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(work), "--save", "",
                             "--appendonly", "no", "--protected-mode", "yes", "--loglevel", "warning", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the benchmark's redis-server did not start")


def bench_redis(sizes: tuple[int, ...], quick: bool, work: Path) -> dict[str, Any]:
    from redis.asyncio import Redis

    proc, port = _start_redis(work)
    url = f"redis://127.0.0.1:{port}/0"
    out: dict[str, Any] = {"server": f"redis-server on 127.0.0.1:{port}"}
    loop = asyncio.new_event_loop()
    try:
        tier = RedisTier(url)
        raw = Redis(host="127.0.0.1", port=port)
        loop.run_until_complete(tier.start())
        for size in sizes:
            out[str(size)] = _redis_size(size, _ops_for(size, quick), tier, raw, loop)
        loop.run_until_complete(tier.close())
        loop.run_until_complete(raw.aclose())
    finally:
        loop.close()
        proc.terminate()
        proc.wait(timeout=10)
    return out


def _redis_size(size: int, n: int, tier: RedisTier, raw: Any, loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
    value = os.urandom(size)
    keys = _keys(n)
    raw_keys = [f"raw:{i}" for i in range(n)]
    put_t, get_t, rset_t, rget_t = [], [], [], []
    for key, rkey in zip(keys, raw_keys, strict=True):
        rset_t.append(_time(lambda k=rkey: loop.run_until_complete(raw.set(k, value))))
        put_t.append(_time(lambda k=key: loop.run_until_complete(tier.put(k, value))))
    for key, rkey in zip(keys, raw_keys, strict=True):
        rget_t.append(_time(lambda k=rkey: loop.run_until_complete(raw.get(k))))
        get_t.append(_time(lambda k=key: loop.run_until_complete(tier.get(k))))
    put, get = _summary(put_t, size), _summary(get_t, size)
    rset, rget = _summary(rset_t, size), _summary(rget_t, size)
    result = {"ops": n, "raw_set": rset, "raw_get": rget, "put": put, "get": get,
                      "put_ratio": _ratio(put, rset), "get_ratio": _ratio(get, rget)}
    loop.run_until_complete(raw.flushall())
    return result


def bench_lookup(work: Path, quick: bool, chunks: int = 32) -> dict[str, Any]:
    registry = FileRegistry(work / "lookup-registry.json")
    registry.register_space(Space("look", "producer", "p-fp", "s-fp", chunk_size=256))
    registry.register_pair(Pair("look-pair", "look", "consumer", "c-fp", "pair-fp", "s-fp"))
    store = TieredStore([CpuTier(64 << 20)], registry, chunk_size=256)
    try:
        tokens = np.random.default_rng(0).integers(0, 50000, 256 * chunks).tolist()
        hashes = chunk_hashes(tokens, 256)
        store.producer("look", "producer", "s-fp").put(hashes, [b"x" * 1024] * chunks, [256] * chunks, codec_id="bench")
        consumer = store.consumer("look-pair", "consumer", "s-fp")
        array = np.asarray(tokens, dtype=np.int64)
        result: dict[str, Any] = {"chunks": chunks}
        cases: dict[str, Callable[[], int]] = {
            "hashes": lambda: consumer.contains(hashes),
            "tokens_list": lambda: consumer.contains(chunk_hashes(tokens, 256)),
            "tokens_numpy": lambda: consumer.contains(chunk_hashes(array, 256)),
        }
        for label, lookup in cases.items():
            assert lookup() == chunks
            times = [_time(lookup) for _ in range(300 if quick else 2000)]
            arr = np.asarray(times) * 1e6
            result[label] = {"p50_us": float(np.percentile(arr, 50)), "p99_us": float(np.percentile(arr, 99))}
        return result
    finally:
        store.close()


def run_store_bench(*, quick: bool = False, tiers: tuple[str, ...] = ("cpu", "disk", "redis"),
                    sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    """Run the whole benchmark; returns a JSON-ready report."""
    work = Path(tempfile.mkdtemp(prefix="scd-bench-store-"))
    report: dict[str, Any] = {"sizes": list(sizes), "cpus": os.cpu_count(), "quick": quick, "targets": TARGETS}
    try:
        if "cpu" in tiers:
            report["cpu"] = bench_cpu(sizes, quick, work)
            report["lookup_cpu"] = bench_lookup(work, quick)
        if "disk" in tiers:
            report["disk"] = bench_disk(sizes, quick, work)
        if "redis" in tiers:
            report["redis"] = bench_redis(sizes, quick, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["summary"] = summarize(report)
    return report


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """The ratios and latencies the issue's targets are about, with pass/fail per target."""
    s: dict[str, Any] = {}
    big = [str(x) for x in report["sizes"] if x >= (1 << 20)]
    if "cpu" in report:
        s["cpu_get_ratio"] = {k: round(v["get_ratio"], 3) for k, v in report["cpu"].items()}
        s["cpu_store_get_verified_ratio"] = {k: round(v["store_get_verified_ratio"], 3)
                                             for k, v in report["cpu"].items()}
        s["cpu_target_met"] = all(report["cpu"][k]["store_get_verified_ratio"] >= TARGETS["cpu_get_vs_memcpy_min"]
                                  for k in big)
    if "lookup_cpu" in report:
        tokens = report["lookup_cpu"]["tokens_list"]  # the whole path: hash 8,192 tokens, then look up
        s["lookup32_p50_us"] = round(tokens["p50_us"], 1)
        s["lookup32_p99_us"] = round(tokens["p99_us"], 1)
        s["lookup32_hashes_p99_us"] = round(report["lookup_cpu"]["hashes"]["p99_us"], 1)
        s["lookup32_target_met"] = tokens["p99_us"] < TARGETS["lookup32_p99_us_max"]
    if "disk" in report:
        s["disk_put_ratio"] = {k: round(v["put_ratio"], 3) for k, v in report["disk"].items()}
        s["disk_get_ratio"] = {k: round(v["get_ratio"], 3) for k, v in report["disk"].items()}
    if "redis" in report:
        sized = {k: v for k, v in report["redis"].items() if k != "server"}
        s["redis_put_ratio"] = {k: round(v["put_ratio"], 3) for k, v in sized.items()}
        s["redis_get_ratio"] = {k: round(v["get_ratio"], 3) for k, v in sized.items()}
        s["redis_target_met"] = all(min(v["put_ratio"], v["get_ratio"]) >= TARGETS["redis_vs_raw_min"]
                                    for v in sized.values())
    return s


def write_report(report: dict[str, Any], path: str | os.PathLike[str] | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=1))
