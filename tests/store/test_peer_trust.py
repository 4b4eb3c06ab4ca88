"""The peer tier against a hostile directory: whoever can write it (Redis, or the files) must not make a
reader connect elsewhere, read where it says or allocate what it says. The copy transfer stands in
for NIXL here (integration_tests/test_nixl_transfer.py plays the agent swap over NIXL)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from scd_store.store.keyring import Keyring
from scd_store.store.keys import chunk_hashes, generation_of, hash_keys
from scd_store.store.signing import ALL_SPACES, SigningKey, write_key_file
from scd_store.store.tiers import peer as peer_module
from scd_store.store.tiers.peer import PeerTier
from scd_store.store.transfer.base import SourceInfo
from scd_store.store.transfer.directory import FilePeerDirectory, PeerDirectory
from tests.conftest import skip_without_cryptography

KEYS = hash_keys("sp", generation_of("fp"), chunk_hashes(list(range(40)), 4))
OTHER_SPACE_KEY = hash_keys("other", generation_of("fp"), chunk_hashes(list(range(4)), 4))[0]


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def keyrings(tmp_path):
    """``(private, public)`` keyrings of one key for every space."""
    skip_without_cryptography()
    key = SigningKey.generate("k1", spaces=(ALL_SPACES,))
    assert key.public is not None
    write_key_file(tmp_path / "private.keys", [key.line()], private=True)
    write_key_file(tmp_path / "public.keys", [key.public.line()], private=False)
    return Keyring(tmp_path / "private.keys"), Keyring(tmp_path / "public.keys")


class Peers:
    """A producer's and a reader's peer tier over one file directory, their counters, and a spy on connect."""

    def __init__(self, tmp_path, producer_keys, reader_keys, **kw) -> None:
        self.root = tmp_path / "peers"
        self.counts: Counter = Counter()
        self.source = PeerTier(FilePeerDirectory(self.root), publish_bytes=1 << 16, transfer="copy", **kw)
        self.reader = PeerTier(FilePeerDirectory(self.root), transfer="copy", **kw)
        self.source.attach(keyring=producer_keys, count=lambda n, a: self.counts.update({"source:" + n: a}))
        self.reader.attach(keyring=reader_keys, count=lambda n, a: self.counts.update({n: a}))
        run(self.source.start())
        run(self.reader.start())
        self.connects: list = []
        self.reads: list = []
        inner = self.reader.reader
        connect, read = inner.connect, inner.read
        inner.connect = lambda info: (self.connects.append(info), connect(info))[1]
        inner.read = lambda src, refs, timeout_s=2.0: (self.reads.append(refs), read(src, refs, timeout_s))[1]

    @property
    def name(self) -> str:
        assert self.source.source is not None
        return self.source.source.info().name

    def log_lines(self) -> list[list]:
        return [json.loads(line) for line in (self.root / f"{self.name}.jsonl").read_text().splitlines()]

    def append(self, *lines: list | str) -> None:
        with open(self.root / f"{self.name}.jsonl", "a") as log:
            for line in lines:
                log.write((line if isinstance(line, str) else json.dumps(line)) + "\n")

    def get(self, keys):
        return run(self.reader.get_many(keys))


def test_signed_entries_are_read_by_a_reader_holding_only_public_keys(tmp_path, keyrings):
    peers = Peers(tmp_path, *keyrings)
    run(peers.source.put_many([(KEYS[0], b"alpha"), (KEYS[1], b"beta")]))
    (line, _) = peers.log_lines()
    assert line[0] == KEYS[0] and line[1] == peers.name and line[5] == "k1" and len(line[6]) == 128
    assert run(peers.reader.contains_many(KEYS[:3])) == [True, True, False]
    assert peers.get(KEYS[:3]) == [b"alpha", b"beta", None]
    assert not peers.counts and len(peers.connects) == 1


def test_a_swapped_source_info_is_refused_before_connecting(tmp_path, keyrings):
    peers = Peers(tmp_path, *keyrings)
    run(peers.source.put_many([(KEYS[0], b"alpha")]))
    genuine = peers.root / f"{peers.name}.info"
    other_agent = SourceInfo(peers.name, "copy", "DRAM", 0, 1 << 16, 0, b"metadata of the attacker's agent")
    genuine.write_bytes(other_agent.to_bytes())
    assert peers.get(KEYS[:1]) == [None] and run(peers.reader.contains_many(KEYS[:1])) == [False]
    assert peers.connects == [] and peers.reads == []  # never connected to the agent the directory named
    assert peers.counts["refused_locations"] == 2  # the get and the contains
    genuine.write_bytes(b"\x05\x00\x00\x00garbage agent metadata")
    assert peers.get(KEYS[:1]) == [None] and peers.connects == []
    assert peers.counts["refused_locations"] == 3


def test_forged_unsigned_and_moved_entries_are_misses(tmp_path, keyrings):
    peers = Peers(tmp_path, *keyrings)
    run(peers.source.put_many([(KEYS[0], b"alpha"), (KEYS[1], b"beta")]))
    first, second = peers.log_lines()
    peers.append([KEYS[0], first[1], second[2], *first[3:]])  # KEYS[0]'s signature, beta's offset: forged
    peers.append([KEYS[1], *first[1:5], "", ""])  # no signature
    peers.append([KEYS[2], *first[1:]])  # KEYS[0]'s genuine entry moved to another key
    peers.append([OTHER_SPACE_KEY, *first[1:]])  # ... or to another space's
    assert peers.get([KEYS[0], KEYS[1], KEYS[2], OTHER_SPACE_KEY]) == [None] * 4
    assert peers.counts["refused_locations"] == 4 and peers.reads == []


def test_a_reader_without_keys_takes_unsigned_entries_and_one_with_keys_refuses_them(tmp_path, keyrings):
    unsigned = Peers(tmp_path, None, None)  # the operator chose allow_unsigned
    run(unsigned.source.put_many([(KEYS[0], b"alpha")]))
    assert unsigned.log_lines()[0][5:] == ["", ""]
    assert unsigned.get(KEYS[:1]) == [b"alpha"]
    strict = PeerTier(FilePeerDirectory(unsigned.root), transfer="copy")
    counts: Counter = Counter()
    strict.attach(keyring=keyrings[1], count=lambda n, a: counts.update({n: a}))
    run(strict.start())
    assert run(strict.get_many(KEYS[:1])) == [None] and counts["refused_locations"] == 1


def test_a_reader_holding_public_keys_only_cannot_publish(tmp_path, keyrings):
    peers = Peers(tmp_path, keyrings[1], keyrings[1])
    run(peers.source.put_many([(KEYS[0], b"alpha"), (KEYS[1], b"beta")]))
    assert peers.counts["source:unsigned_puts"] == 2
    assert peers.source.source.arena.live() == {} and not (peers.root / f"{peers.name}.jsonl").exists()
    assert peers.get(KEYS[:2]) == [None, None]


@pytest.mark.parametrize("length", [2 ** 62, "Infinity", "NaN", "1e400", "1.0", "true", '"5"', "-1", "9" * 5000])
def test_entries_claiming_huge_or_non_integer_lengths_allocate_nothing(tmp_path, keyrings, length):
    for reader_keys in (None, keyrings[1]):  # the bound holds with or without signatures
        peers = Peers(tmp_path / str(reader_keys is None), keyrings[0], reader_keys)
        run(peers.source.put_many([(KEYS[0], b"alpha")]))
        (line,) = peers.log_lines()
        compact = json.dumps([KEYS[1], *line[1:]], separators=(",", ":"))
        raw = compact.replace(f",{line[2]},{line[3]},", f",{line[2]},{length},")
        assert raw != compact
        peers.append(raw)
        assert peers.get(KEYS[:2]) == [b"alpha", None]
        assert [len(refs) for refs in peers.reads] == [1] and peers.counts["refused_locations"] == 1


def test_an_entry_outside_its_source_region_is_a_miss(tmp_path):
    peers = Peers(tmp_path, None, None)
    run(peers.source.put_many([(KEYS[0], b"alpha")]))
    peers.append([KEYS[1], peers.name, (1 << 16) - 2, 5, *peers.log_lines()[0][4:]])
    assert peers.get(KEYS[:2]) == [b"alpha", None] and peers.counts["refused_locations"] == 1


def test_a_batch_larger_than_max_batch_bytes_takes_several_transfers(tmp_path, keyrings):
    peers = Peers(tmp_path, *keyrings, max_value_bytes=100, max_batch_bytes=250)
    blobs = [bytes([i]) * 100 for i in range(7)]
    run(peers.source.put_many(list(zip(KEYS, blobs, strict=False))))
    assert peers.get(KEYS[:7]) == blobs
    assert peers.reader.reader.transfers == 4  # 2 + 2 + 2 + 1 blobs of 100 bytes
    with pytest.raises(ValueError, match="max_batch_bytes"):
        PeerTier(FilePeerDirectory(tmp_path / "x"), max_value_bytes=100, max_batch_bytes=99)


def test_a_verified_entry_is_verified_again_once_the_key_may_have_gone(tmp_path, keyrings, monkeypatch):
    peers = Peers(tmp_path, *keyrings)
    run(peers.source.put_many([(KEYS[0], b"alpha")]))
    assert peers.get(KEYS[:1]) == [b"alpha"]
    other = SigningKey.generate("k2", spaces=(ALL_SPACES,))
    write_key_file(tmp_path / "other.keys", [other.line()], private=True)
    peers.reader.keyring = Keyring(tmp_path / "other.keys")  # k1 is no longer held
    assert peers.get(KEYS[:1]) == [b"alpha"]  # trusted a moment ago
    monkeypatch.setattr(peer_module, "TRUST_S", 0.0)
    assert peers.get(KEYS[:1]) == [None] and peers.counts["refused_locations"] == 1


class FakeRedis:
    """The few hash commands the Redis directory uses, over dicts (byte values, like redis-py)."""

    def __init__(self) -> None:
        self.hashes: dict[str, dict[str, bytes]] = {}

    def hset(self, name, key=None, value=None, mapping=None):
        h = self.hashes.setdefault(name, {})
        for k, v in ({key: value} if key is not None else mapping).items():
            h[k] = v if isinstance(v, bytes) else str(v).encode()

    def hget(self, name, key):
        return self.hashes.get(name, {}).get(key)

    def hmget(self, name, keys):
        return [self.hget(name, k) for k in keys]

    def hstrlen(self, name, key):
        return len(self.hget(name, key) or b"")

    def close(self):
        return None


def test_the_redis_directory_refuses_malformed_entries_and_infos(keyrings):
    from scd_store.store.transfer.directory import LOCATIONS, SOURCES, RedisPeerDirectory

    client = FakeRedis()
    peers_dir = RedisPeerDirectory("redis://unused", client=client)
    source = PeerTier(peers_dir, publish_bytes=1 << 16, transfer="copy")
    reader = PeerTier(RedisPeerDirectory("redis://unused", client=client), transfer="copy")
    counts: Counter = Counter()
    source.attach(keyring=keyrings[0], count=None)
    reader.attach(keyring=keyrings[1], count=lambda n, a: counts.update({n: a}))
    run(source.start())
    run(reader.start())
    run(source.put_many([(KEYS[0], b"alpha")]))
    assert run(reader.get_many(KEYS[:1])) == [b"alpha"]
    good = json.loads(client.hashes[LOCATIONS][KEYS[0]])
    for bad in ('["src",0,Infinity,"","",""]', '["src",0.0,5,"","",""]', '["src",false,5,"","",""]',
                "[" * 100_000, json.dumps([*good[:2], 2 ** 64, *good[3:]]), "x" * 5000):
        client.hashes[LOCATIONS][KEYS[1]] = bad.encode()
        assert run(reader.get_many(KEYS[1:2])) == [None]
    assert counts["refused_locations"] == 6
    client.hashes[SOURCES]["big"] = b"A" * (2 << 20)  # never decoded
    assert reader.directory.source_bytes("big") is None and reader.directory.source("../x") is None
    client.hashes[SOURCES]["bad"] = b"not base64!"
    assert reader.directory.source("bad") is None


def test_the_file_directory_opens_no_fifo_symlink_or_foreign_name(tmp_path):
    import os

    root = tmp_path / "peers"
    directory = FilePeerDirectory(root)
    os.mkfifo(root / "fifo.jsonl")
    os.mkfifo(root / "fifo.info")
    (tmp_path / "secret").write_bytes(b"x" * 100)
    os.symlink(tmp_path / "secret", root / "link.info")
    assert directory.entries(KEYS[:1]) == [None]  # the FIFO log is skipped, not waited on
    assert directory.source("fifo") is None and directory.source("link") is None
    assert directory.source("../secret") is None
    assert isinstance(directory, PeerDirectory)


def test_the_file_directory_is_its_owners_and_never_writes_through_a_planted_link(tmp_path):
    """Another local user who could write the directory could point a source's log at any file the producer may
    write (its registry, say) and have the producer append to it."""
    from scd_store.store.fs_safety import UnsafePath
    from scd_store.store.transfer.directory import FilePeerDirectory
    from scd_store.store.transfer.entry import LocationEntry

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(UnsafePath):
        FilePeerDirectory(shared)
    directory = FilePeerDirectory(tmp_path / "peers")
    victim = tmp_path / "registry.json"
    victim.write_text("{}")
    (tmp_path / "peers" / "src-1.jsonl").symlink_to(victim)
    entry = LocationEntry(KEYS[0], "src-1", 0, 4, "", "", "")
    with pytest.raises(OSError):
        directory.record_entries([entry])
    assert victim.read_text() == "{}"


def test_a_process_that_only_asks_what_peers_hold_opens_no_transfer(tmp_path, keyrings, monkeypatch):
    peers = Peers(tmp_path, *keyrings)
    run(peers.source.put_many([(KEYS[0], b"alpha")]))
    made: list = []
    real = peer_module.make_reader
    monkeypatch.setattr(peer_module, "make_reader", lambda **kw: (made.append(kw), real(**kw))[1])
    looker = PeerTier(FilePeerDirectory(peers.root), transfer="copy")
    looker.attach(keyring=keyrings[1], count=lambda n, a: None)
    run(looker.start())
    assert run(looker.contains_many(KEYS[:2])) == [True, False] and made == []  # presence: the directory only
    assert run(looker.get_many(KEYS[:1])) == [b"alpha"] and len(made) == 1  # the first read makes the reader
    assert run(looker.get_many(KEYS[:1])) == [b"alpha"] and len(made) == 1
    run(looker.close())
