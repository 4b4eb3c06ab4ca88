"""``scd-store bench transfer``: blob reads from another process's registered memory (NIXL, or copy).

A child process (``python -m scd_store.bench.transfer --serve``) publishes seeded random blobs in
a registered arena and writes its :class:`SourceInfo` and the refs to stdout (length-prefixed
bytes, JSON inside: no pickle). This process connects a reader and reads batches of 1 MiB
(16 x 64 KiB blobs) and 64 MiB (64 x 1 MiB blobs), checking every byte against the same seeded
blobs. Reported per batch size: first read (connection set-up included), then the median and p99
of steady reads into the reader's registered buffer (views, no copy) and the throughput at the
median, the median of reads copied out into ``bytes``, and an in-process ``memcpy`` of the same
bytes measured in the same run (``vs_memcpy`` = memcpy time / read time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import subprocess
import sys
import time
from typing import Any

import numpy as np

from scd_store.store.transfer import BlobRef, SourceInfo, make_reader, make_source
from scd_store.store.transfer.base import refs_from_json, refs_to_json

BATCHES = {"1MiB": (16, 64 << 10), "64MiB": (64, 1 << 20)}
_LEN = struct.Struct("<Q")


def seeded_blobs(count: int, size: int, seed: int) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    return {f"blob-{seed}-{i}": rng.integers(0, 256, size, dtype=np.uint8).tobytes() for i in range(count)}


def _write_frame(stream, data: bytes) -> None:
    stream.write(_LEN.pack(len(data)) + data)
    stream.flush()


def _read_frame(stream) -> bytes:
    head = stream.read(_LEN.size)
    if len(head) != _LEN.size:
        raise RuntimeError("blob source process ended early")
    (n,) = _LEN.unpack(head)
    return stream.read(n)


def serve(kind: str, device: str) -> None:
    """Child side: publish every batch's blobs, print info + refs, wait for stdin to close."""
    out = os.fdopen(os.dup(1), "wb")  # frames go to the real stdout; library logging to stdout goes to stderr
    os.dup2(2, 1)
    total = sum(count * size for count, size in BATCHES.values())
    source = make_source(total + (1 << 20), device, kind)
    refs: list[BlobRef] = []
    for seed, (count, size) in enumerate(BATCHES.values()):
        refs += source.publish(seeded_blobs(count, size, seed))
    _write_frame(out, source.info().to_bytes())
    _write_frame(out, refs_to_json(refs))
    sys.stdin.buffer.read()  # parent closes stdin when done
    source.close()


class SourceProcess:
    """A blob source in a child process; use as a context manager."""

    def __init__(self, kind: str = "nixl", device: str = "cpu") -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "scd_store.bench.transfer", "--serve", "--kind", kind,
                                      "--device", device], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.info = SourceInfo.from_bytes(_read_frame(self.proc.stdout))
        self.refs = refs_from_json(_read_frame(self.proc.stdout))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __enter__(self) -> SourceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _memcpy_median_s(nbytes: int, reps: int) -> float:
    """This machine's reference: one in-process copy of the same bytes."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    dst[:] = src
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst[:] = src
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_transfer_bench(kind: str = "nixl", device: str = "cpu", reps: int = 20) -> dict[str, Any]:
    report: dict[str, Any] = {"kind": kind, "device": device, "reps": reps, "batches": {}}
    with SourceProcess(kind, device) as source:
        reader = make_reader(device, kind)
        name = reader.connect(source.info)
        start = 0
        for seed, (label, (count, size)) in enumerate(BATCHES.items()):
            refs = source.refs[start:start + count]
            start += count
            want = seeded_blobs(count, size, seed)
            t0 = time.perf_counter()
            got = reader.read(name, refs, timeout_s=30.0)
            first = time.perf_counter() - t0
            identical = all(g == want[r.key] for g, r in zip(got, refs, strict=True))
            times, copied = [], []
            views = getattr(reader, "read_views", reader.read)
            for _ in range(reps):
                t0 = time.perf_counter()
                got = views(name, refs, timeout_s=30.0)
                times.append(time.perf_counter() - t0)
                identical = identical and all(g is not None for g in got)
                t0 = time.perf_counter()
                reader.read(name, refs, timeout_s=30.0)
                copied.append(time.perf_counter() - t0)
            median = statistics.median(times)
            memcpy = _memcpy_median_s(count * size, reps)
            nbytes = count * size
            report["batches"][label] = {
                "blobs": count, "blob_bytes": size, "bytes": nbytes, "bytes_identical": identical,
                "first_ms": round(first * 1e3, 3), "median_ms": round(median * 1e3, 3),
                "p99_ms": round(sorted(times)[min(len(times) - 1, int(0.99 * len(times)))] * 1e3, 3),
                "gib_per_s": round(nbytes / median / 2**30, 3),
                "median_ms_copied_out": round(statistics.median(copied) * 1e3, 3),
                "memcpy_ms": round(memcpy * 1e3, 3), "vs_memcpy": round(memcpy / median, 3)}
        reader.close()
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--serve", action="store_true")
    parser.add_argument("--kind", default="nixl", choices=("nixl", "copy"))
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.kind, args.device)


if __name__ == "__main__":
    main()
