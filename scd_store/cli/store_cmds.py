"""Handlers for ``scd-store bench store`` and ``scd-store bench soak`` (imported lazily by ``main``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def bench_store_command(args: argparse.Namespace) -> int:
    from scd_store.bench.store import run_store_bench, write_report

    report = run_store_bench(quick=args.quick, tiers=tuple(args.tiers))
    write_report(report, args.json)
    print(json.dumps(report["summary"], indent=1))
    return 0


def bench_soak_command(args: argparse.Namespace) -> int:
    if not args.no_faults:
        return _fault_soak(args)
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


def _fault_soak(args: argparse.Namespace) -> int:
    from scd_store.bench.fault_soak import FaultSoakConfig, run_fault_soak

    report = run_fault_soak(FaultSoakConfig(processes=args.processes, duration_s=args.duration, seed=args.seed))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if report["ok"] else 1


def add_bench_store_parser(bench: Any) -> None:
    store = bench.add_parser("store", help="tier throughput / latency against memcpy, file I/O and raw Redis")
    store.add_argument("--json", type=Path, help="write the full report here")
    store.add_argument("--quick", action="store_true", help="fewer operations per size")
    store.add_argument("--tiers", nargs="+", default=["cpu", "disk", "redis"], choices=["cpu", "disk", "redis"])
    store.set_defaults(func=bench_store_command)
    soak = bench.add_parser("soak", help="a producer and --processes consumer processes on one Redis while it is "
                            "killed, the disk fills, blobs are corrupted and forged and the pair is revoked "
                            "(--no-faults: concurrent clients, torn reads and lost writes)")
    soak.add_argument("--processes", type=int, default=3, help="consumer processes (fault soak) or worker "
                      "processes (--no-faults)")
    soak.add_argument("--duration", type=float, default=60.0, help="fault soak: seconds")
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--no-faults", action="store_true", help="the concurrency soak instead")
    soak.add_argument("--redis", help="--no-faults: a Redis URL (default: start a redis-server on a free port)")
    soak.add_argument("--threads", type=int, default=16)
    soak.add_argument("--threads-per-process", type=int, default=8)
    soak.add_argument("--ops", type=int, default=100_000)
    soak.add_argument("--fuzz-inputs", type=int, default=100_000, help="fuzzed inputs per parser (0: skip)")
    soak.add_argument("--json", type=Path)
    soak.set_defaults(func=bench_soak_command)
