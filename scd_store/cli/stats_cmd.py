"""``scd-store stats``: hit statistics of a deployment, summary first.

Opens with one row per consumer pair (requested tokens, hit tokens, hit rate, bytes fetched against
their raw-KV equivalent, decode p50 / p99, misses by reason), then one row per engine process, then
the misses that belong to no pair; ``--counters`` adds every counter and latency histogram,
``--watch N`` redraws every N seconds. Reads Redis when the deployment has one, else this host's
per-process snapshot files. What it reads was written by every process of the deployment, consumers
included: fields and records outside the schema are skipped (:mod:`scd_store.store.stats_sinks`), and
every label is printed as plain text (never as Rich markup).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def load_view(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """The deployment view and where it came from."""
    from scd_store.store.build import stats_dir
    from scd_store.store.config import load_config
    from scd_store.store.stats_sinks import clean_snapshot, read_redis_stats, read_snapshot_files

    url = args.redis
    if not url and not args.file:
        config = load_config(args.config)
        url = config.stats_redis_url or config.redis_url
    if url:
        return read_redis_stats(url), f"Redis {url.split('@')[-1]}"
    path = Path(args.file) if args.file else stats_dir()
    if path.is_file():
        try:
            data = clean_snapshot(json.loads(path.read_text()))
        except (ValueError, RecursionError):
            data = None
        if data is None:
            raise SystemExit(f"scd-store stats: {path} is no stats snapshot")
        return {**data, "processes": [data] if "process" in data else []}, str(path)
    view = read_snapshot_files(path)
    return view, f"{path} ({len(view['processes'])} processes)"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def fmt_s(value: float | None) -> str:
    if value is None:
        return "-"
    if value == float("inf"):
        return "inf"
    return f"{value * 1e6:.0f} us" if value < 1e-3 else f"{value * 1e3:.1f} ms"


def _age(record: dict[str, Any]) -> str:
    updated = record.get("updated")
    return "-" if updated is None else f"{max(0.0, time.time() - updated):.0f} s ago"


def print_view(view: dict[str, Any], source: str, *, counters: bool = False, console: Console | None = None) -> None:
    """The summary tables of a deployment view (and every counter with ``counters``)."""
    from scd_store.store.stats_summary import summary

    console = console or Console(width=max(Console().width, 140))
    report = summary(view)
    pairs = Table(title=f"scd-store hits per pair ({escape(source)})")
    for column in ("space", "pair", "requested", "hit", "hit rate", "fetched", "raw KV", "decode p50/p99 <=",
                   "misses by reason (chunks)"):
        pairs.add_column(column, justify="left" if column in ("space", "pair", "misses by reason (chunks)")
                         else "right")
    for row in report["pairs"]:
        misses = ", ".join(f"{k} {v:,}" for k, v in row["misses"].items() if v) or "-"
        pairs.add_row(escape(row["space"]), escape(row["pair"].split("/", 1)[-1]), f"{row['requested_tokens']:,}",
                      f"{row['hit_tokens']:,}", _pct(row["hit_rate"]), _bytes(row["bytes_fetched"]),
                      _bytes(row["raw_kv_bytes"]), f"{fmt_s(row['decode_p50_le_s'])} / {fmt_s(row['decode_p99_le_s'])}",
                      misses)
    console.print(pairs)
    if report["processes"]:
        procs = Table(title="per engine process")
        for column in ("process", "serves", "updated", "requested", "hit", "hit rate", "puts", "dropped",
                       "unpositioned", "hash mismatch", "tier errors"):
            procs.add_column(column, justify="left" if column in ("process", "serves", "updated") else "right")
        for row in report["processes"]:
            record = row["process"]
            procs.add_row(escape(str(record.get("id", "?"))), escape(serving(record)), _age(record),
                          f"{row['requested_tokens']:,}",
                          f"{row['hit_tokens']:,}", _pct(row["hit_rate"]), f"{row['puts']:,}",
                          f"{row['dropped_puts']:,}", f"{row['unpositioned_chunks']:,}", f"{row['hash_mismatch']:,}",
                          f"{row['tier_errors']:,}")
        console.print(procs)
    other = ", ".join(f"{k} {v:,}" for k, v in report["misses"].items() if v)
    console.print(f"not per pair: {other or 'none'} (unregistered = requests from models in no bundle; "
                  "dropped = producer chunks the put queue had no room for)")
    if counters:
        print_counters(view, console)


def serving(record: dict[str, Any]) -> str:
    """What a process serves, by role ("producer X; consumer Y, Z"); its program name when it names no model."""
    serves = record.get("serves") or {}
    parts = [f"{role} {', '.join(sorted(m for m, r in serves.items() if r == role))}"
             for role in ("producer", "consumer") if role in serves.values()]
    return "; ".join(parts) or str(record.get("name", "?"))


def print_counters(view: dict[str, Any], console: Console) -> None:
    """Every counter and latency histogram of a view."""
    table = Table(title="all counters")
    for column in ("counter", "tier", "space", "pair", "value"):
        table.add_column(column, justify="right" if column == "value" else "left")
    for c in view["counters"]:
        table.add_row(*(escape(c[k] or "-") for k in ("name", "tier", "space", "pair")), f"{c['value']:,}")
    console.print(table)
    if view["latency"]:
        lat = Table(title="latency (histogram bucket upper bounds)")
        for column in ("op", "tier", "pair", "count", "p50 <=", "p99 <="):
            lat.add_column(column, justify="left" if column in ("op", "tier", "pair") else "right")
        for h in view["latency"]:
            lat.add_row(escape(h["op"]), escape(h["tier"] or "-"), escape(h.get("pair") or "-"), str(h["count"]),
                        fmt_s(h["p50_le_s"]),
                        fmt_s(h["p99_le_s"]))
        console.print(lat)


def stats_command(args: argparse.Namespace) -> int:
    from scd_store.store.stats_summary import summary

    while True:
        view, source = load_view(args)
        if args.json:
            print(json.dumps({"summary": summary(view), **view}, indent=1))
        else:
            if args.watch:
                Console().clear()
            print_view(view, source, counters=args.counters)
        if not args.watch:
            return 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0


def add_stats_parser(sub: Any) -> None:
    stats = sub.add_parser("stats", help="hit statistics per pair and per process (Redis, else this host's)")
    stats.add_argument("--redis", metavar="URL", help="read the shared counters from this Redis")
    stats.add_argument("--store-config", "--config", dest="config", metavar="YAML",
                       help="the deployment's scd-store YAML (its Redis URL is used when set)")
    stats.add_argument("--file", metavar="PATH", help="one process's snapshot JSON, or a directory of them")
    stats.add_argument("--counters", action="store_true", help="also every counter and latency histogram")
    stats.add_argument("--watch", type=float, metavar="SECONDS", help="redraw every SECONDS")
    stats.add_argument("--json", action="store_true", help="print JSON (the summary and the view) instead")
    stats.set_defaults(func=stats_command)
