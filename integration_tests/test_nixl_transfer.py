"""NIXL between two processes: a consumer reads code blobs out of a producer process's registered DRAM."""

from __future__ import annotations

import time

import pytest

from scd_store.bench.transfer import BATCHES, SourceProcess, run_transfer_bench, seeded_blobs
from scd_store.store.transfer import BlobRef, make_reader, nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="nixl with UCX is not usable here")


def test_two_processes_move_blobs_byte_identical_in_one_batch():
    with SourceProcess("nixl") as source:
        reader = make_reader(kind="nixl")
        name = reader.connect(source.info)
        count, size = BATCHES["1MiB"]
        refs = source.refs[:count]
        got = reader.read(name, refs)
        want = seeded_blobs(count, size, 0)
        assert got == [want[r.key] for r in refs]
        # mixed order and a zero-length ref still map one to one
        picked = [refs[5], BlobRef("empty", 0, 0), refs[0]]
        assert reader.read(name, picked) == [want[refs[5].key], b"", want[refs[0].key]]
        reader.close()


def test_a_dead_source_is_a_miss_not_a_hang():
    source = SourceProcess("nixl")
    reader = make_reader(kind="nixl")
    name = reader.connect(source.info)
    refs = source.refs[:4]
    assert all(b is not None for b in reader.read(name, refs))
    source.proc.kill()
    source.proc.wait()
    t0 = time.monotonic()
    assert reader.read(name, refs, timeout_s=1.0) == [None] * 4
    assert time.monotonic() - t0 < 15
    assert reader.read("never-connected", refs) == [None] * 4
    assert reader.read(name, [BlobRef("outside", source.info.size, 1)]) == [None]
    reader.close()


def test_transfer_bench_reports_both_batch_sizes():
    report = run_transfer_bench("nixl", reps=3)
    for label in ("1MiB", "64MiB"):
        entry = report["batches"][label]
        assert entry["bytes_identical"] and entry["gib_per_s"] > 0
