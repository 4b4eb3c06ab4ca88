import os

import pytest

from scd_store.store.transfer import BlobRef, SourceInfo, TransferError, make_reader, make_source
from scd_store.store.transfer.arena import Arena
from scd_store.store.transfer.base import refs_from_json, refs_to_json


def test_arena_wraps_and_drops_overwritten_blobs():
    arena = Arena(100)
    first = arena.put({"a": b"x" * 40, "b": b"y" * 40})
    assert [(r.offset, r.length) for r in first] == [(0, 40), (40, 40)]
    (c,) = arena.put({"c": b"z" * 30})  # does not fit after b: wraps to 0 and overwrites a
    assert c.offset == 0 and set(arena.live()) == {"b", "c"}
    with pytest.raises(TransferError, match="larger than the arena"):
        arena.put({"huge": b"0" * 101})


def test_source_info_and_refs_round_trip_without_pickle():
    info = SourceInfo("src", "nixl", "DRAM", 1234, 4096, 0, b"\x00agent-md\xff")
    data = info.to_bytes()
    assert b"pickle" not in data and SourceInfo.from_bytes(data) == info
    refs = [BlobRef("k1", 0, 10), BlobRef("k2", 10, 0)]
    assert refs_from_json(refs_to_json(refs)) == refs
    for bad in (b"", b"\x05\x00\x00\x00{bad", info.to_bytes().replace(b"scd-xfer", b"other-xx")):
        with pytest.raises(TransferError):
            SourceInfo.from_bytes(bad)
    with pytest.raises(TransferError):
        refs_from_json(b'[["k", -1, 3]]')


def test_copy_transfer_reads_published_blobs_and_misses_cleanly():
    blobs = {f"k{i}": os.urandom(100 + i) for i in range(20)}
    with make_source(1 << 16, kind="copy") as source, make_reader(kind="copy") as reader:
        refs = source.publish(blobs)
        name = reader.connect(source.info().to_bytes())
        assert reader.read(name, refs) == [blobs[r.key] for r in refs]
        assert reader.read("unknown", refs) == [None] * len(refs)
        assert reader.read(name, [BlobRef("k", 1 << 16, 1)]) == [None]
    assert reader.read(name, refs) == [None] * len(refs)  # the source is gone: a miss


def test_a_reader_refuses_another_kind_of_source():
    with make_source(1024, kind="copy") as source, pytest.raises(TransferError, match="cannot reach"):
        from scd_store.store.transfer.nixl_transfer import NixlBlobReader

        NixlBlobReader().connect(source.info())
