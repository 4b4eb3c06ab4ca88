import json
import os
import struct

import pytest

from scd_store.store.transfer import BlobRef, SourceInfo, TransferError, make_reader, make_source
from scd_store.store.transfer.arena import Arena
from scd_store.store.transfer.base import refs_from_json, refs_to_json, split_batches


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


def _info_with(**changes) -> bytes:
    header = {"format": "scd-xfer", "version": 1, "name": "src", "kind": "nixl", "mem_type": "DRAM", "base": 4096,
              "size": 1 << 20, "device_id": 0}
    raw = json.dumps({**header, **changes}).replace('"@', "").replace('@"', "").encode()
    return struct.pack("<I", len(raw)) + raw + b"agent-md"


@pytest.mark.parametrize("changes", [
    {"size": "@Infinity@"}, {"size": "@NaN@"}, {"size": "@1e400@"}, {"size": 4096.0}, {"size": True}, {"size": "4096"},
    {"size": 0}, {"base": -1}, {"base": 2 ** 64}, {"base": 2 ** 64 - 10}, {"device_id": 1.5}, {"version": True},
    {"name": "../etc"}, {"name": "a\n"}, {"kind": "pickle"}, {"mem_type": "DISK"}, {"extra": 1},
    {"size": "@" + "9" * 5000 + "@"}])
def test_source_info_refuses_what_is_not_exactly_its_shape(changes):
    assert SourceInfo.from_bytes(_info_with()) == SourceInfo("src", "nixl", "DRAM", 4096, 1 << 20, 0, b"agent-md")
    with pytest.raises(TransferError):
        SourceInfo.from_bytes(_info_with(**changes))


def test_source_info_refuses_lengths_beyond_its_bytes():
    good = _info_with()
    for bad in (struct.pack("<I", 1 << 31) + good[4:], good[:20], b"\x00" * 3, b"x" * ((1 << 20) + 1)):
        with pytest.raises(TransferError):
            SourceInfo.from_bytes(bad)


@pytest.mark.parametrize("raw", [b'[["k", 0, Infinity]]', b'[["k", 0, NaN]]', b'[["k", 1.0, 3]]', b'[["k", true, 3]]',
                                 b'[["k", 0, "3"]]', b'[["k", 0, 1e400]]', b'[[5, 0, 3]]', b"[" * 100_000,
                                 b'[["k", 0, 18446744073709551616]]'])
def test_refs_from_json_refuses_non_integers(raw):
    with pytest.raises(TransferError):
        refs_from_json(raw)


def test_batches_are_split_at_max_batch_bytes():
    refs = [BlobRef(f"k{i}", 0, n) for i, n in enumerate([100, 100, 100, 0, 300, 50])]
    assert split_batches(refs, 250) == [[0, 1], [2, 3, 5]]  # the 300-byte ref fits no transfer: a miss
    blobs = {f"k{i}": os.urandom(100) for i in range(7)}
    with make_source(1 << 16, kind="copy") as source, make_reader(kind="copy", max_batch_bytes=250) as reader:
        refs = source.publish(blobs)
        name = reader.connect(source.info())
        assert reader.read(name, refs) == [blobs[r.key] for r in refs] and reader.transfers == 4
        assert reader.read(name, [BlobRef("big", 0, 251)]) == [None]
