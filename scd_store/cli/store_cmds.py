"""Handlers for ``scd-store stats`` and ``scd-store bench store`` (imported lazily by ``main``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _load_snapshot(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from scd_store.store.stats import read_redis_stats

    if args.redis:
        return read_redis_stats(args.redis), f"Redis {args.redis.split('@')[-1]}"
    from scd_store.store.config import load_config

    config = load_config(args.config)
    url = config.stats_redis_url or config.redis_url
    if url:
        return read_redis_stats(url), f"Redis {url.split('@')[-1]}"
    from scd_store.paths import data_dir

    path = Path(args.file) if args.file else data_dir() / "store" / "stats.json"
    if not path.exists():
        return {"counters": [], "latency": []}, f"{path} (none yet)"
    return json.loads(path.read_text()), str(path)


def stats_command(args: argparse.Namespace) -> int:
    snapshot, source = _load_snapshot(args)
    if args.json:
        print(json.dumps(snapshot, indent=1))
        return 0
    print_stats(snapshot, source)
    return 0


def print_stats(snapshot: dict[str, Any], source: str) -> None:
    """The counters and latency tables of a stats snapshot."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 140))
    table = Table(title=f"scd-store counters ({source})")
    for column in ("counter", "tier", "space", "pair", "value"):
        table.add_column(column, justify="right" if column == "value" else "left")
    for c in snapshot["counters"]:
        table.add_row(c["name"], c["tier"] or "-", c["space"] or "-", c["pair"] or "-", f"{c['value']:,}")
    console.print(table)
    if snapshot["latency"]:
        lat = Table(title="latency (histogram bucket upper bounds)")
        for column in ("op", "tier", "count", "p50 <=", "p99 <="):
            lat.add_column(column, justify="left" if column in ("op", "tier") else "right")
        for h in snapshot["latency"]:
            lat.add_row(h["op"], h["tier"] or "-", str(h["count"]), _fmt_s(h["p50_le_s"]), _fmt_s(h["p99_le_s"]))
        console.print(lat)


def _fmt_s(value: float | None) -> str:
    if value is None:
        return "-"
    if value == float("inf"):
        return "inf"
    return f"{value * 1e6:.0f} us" if value < 1e-3 else f"{value * 1e3:.1f} ms"


def bench_store_command(args: argparse.Namespace) -> int:
    from scd_store.bench.store import run_store_bench, write_report

    report = run_store_bench(quick=args.quick, tiers=tuple(args.tiers))
    write_report(report, args.json)
    print(json.dumps(report["summary"], indent=1))
    return 0


def add_stats_parser(sub: Any) -> None:
    stats = sub.add_parser("stats", help="store counters: deployment-wide from Redis, else this machine's")
    stats.add_argument("--redis", metavar="URL", help="read the shared counters from this Redis")
    stats.add_argument("--config", metavar="YAML", help="store config (its Redis URL is used when set)")
    stats.add_argument("--file", metavar="PATH", help="a stats snapshot JSON written by a store")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    stats.set_defaults(func=stats_command)


def bench_soak_command(args: argparse.Namespace) -> int:
    import tempfile

    from scd_store.bench.soak import SoakConfig, run_soak
    from scd_store.bench.store import _start_redis

    proc = None
    url = args.redis
    with tempfile.TemporaryDirectory() as work:
        if url is None:
            proc, port = _start_redis(Path(work))
            url = f"redis://127.0.0.1:{port}/0"
        try:
            report = run_soak(SoakConfig(url, threads=args.threads, processes=args.processes,
                                         threads_per_process=args.threads_per_process, ops=args.ops,
                                         fuzz_inputs=args.fuzz_inputs))
        finally:
            if proc is not None:
                proc.kill()
                proc.wait()
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if report["torn_reads"] == 0 and report["lost_writes"] == 0 else 1


def add_bench_store_parser(bench: Any) -> None:
    store = bench.add_parser("store", help="tier throughput / latency against memcpy, file I/O and raw Redis")
    store.add_argument("--json", type=Path, help="write the full report here")
    store.add_argument("--quick", action="store_true", help="fewer operations per size")
    store.add_argument("--tiers", nargs="+", default=["cpu", "disk", "redis"], choices=["cpu", "disk", "redis"])
    store.set_defaults(func=bench_store_command)
    soak = bench.add_parser("soak", help="concurrent clients (threads + processes) on CPU + Redis tiers")
    soak.add_argument("--redis", help="a Redis URL (default: start a redis-server on a free loopback port)")
    soak.add_argument("--threads", type=int, default=16)
    soak.add_argument("--processes", type=int, default=2)
    soak.add_argument("--threads-per-process", type=int, default=8)
    soak.add_argument("--ops", type=int, default=100_000)
    soak.add_argument("--fuzz-inputs", type=int, default=100_000, help="fuzzed inputs per parser (0: skip)")
    soak.add_argument("--json", type=Path)
    soak.set_defaults(func=bench_soak_command)
