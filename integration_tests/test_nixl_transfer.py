"""NIXL between two processes: a consumer reads code blobs out of a producer process's registered DRAM."""

from __future__ import annotations

import os
import time
from pathlib import Path

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


def test_a_batch_past_max_batch_bytes_takes_several_transfers_and_the_buffer_shrinks_back():
    with SourceProcess("nixl") as source:
        reader = make_reader(kind="nixl", max_batch_bytes=8 << 20, initial_bytes=1 << 20)
        name = reader.connect(source.info)
        count, size = BATCHES["1MiB"]
        refs = source.refs[count:count + 20]  # twenty 1 MiB blobs of the 64 MiB batch
        want = seeded_blobs(*BATCHES["64MiB"], 1)
        assert reader.read(name, refs) == [want[r.key] for r in refs]
        assert reader.transfers == 3 and reader.buffer_bytes == 1 << 20  # 8 + 8 + 4 MiB, then back to 1 MiB
        assert reader.read_views(name, refs) == [None] * 20  # views of one transfer only: over the bound, a miss
        assert reader.buffer_bytes == 1 << 20
        reader.close()


def test_timed_out_transfers_hold_a_bounded_number_of_buffers(monkeypatch):
    from scd_store.store.transfer.nixl_transfer import NixlBlobReader, NixlBlobSource

    hung, healthy = NixlBlobSource(1 << 20), NixlBlobSource(1 << 20)
    refs = hung.publish({"a": b"x" * 1000})
    assert healthy.publish({"a": b"y" * 1000}) == refs
    reader = NixlBlobReader()
    hung_name, healthy_name = reader.connect(hung.info()), reader.connect(healthy.info())
    agent = reader.agent
    real_transfer, real_state, real_init = agent.transfer, agent.check_xfer_state, agent.initialize_xfer
    stuck: list = []
    started: list = []

    def init(*args):
        started.append(args[-1])
        return real_init(*args)

    def transfer(handle):
        if started[-1] == hung_name:  # a peer that never answers
            stuck.append(handle)
            return "PROC"
        return real_transfer(handle)

    monkeypatch.setattr(agent, "initialize_xfer", init)
    monkeypatch.setattr(agent, "transfer", transfer)
    monkeypatch.setattr(agent, "check_xfer_state", lambda h: "PROC" if h in stuck else real_state(h))
    per_source = NixlBlobReader.MAX_ABANDONED_PER_SOURCE
    for _ in range(per_source + 2):
        assert reader.read(hung_name, refs, timeout_s=0.05) == [None]
    assert started.count(hung_name) == per_source and len(reader._abandoned) == per_source  # no more buffers
    assert reader.read(healthy_name, refs) == [b"y" * 1000]  # the other peers are still read
    monkeypatch.setattr(agent, "check_xfer_state", lambda h: "ERR" if h in stuck else real_state(h))  # they ended
    stuck_before = len(stuck)
    monkeypatch.setattr(agent, "transfer", real_transfer)
    assert reader.read(hung_name, refs) == [b"x" * 1000] and reader._abandoned == [] and len(stuck) == stuck_before
    reader.close(), hung.close(), healthy.close()


def test_metadata_of_another_agent_than_the_source_named_is_refused():
    from scd_store.store.transfer import SourceInfo, TransferError
    from scd_store.store.transfer.nixl_transfer import NixlBlobReader, NixlBlobSource

    victim, attacker = NixlBlobSource(1 << 16), NixlBlobSource(1 << 16)
    info, evil = victim.info(), attacker.info()
    reader = NixlBlobReader()
    with pytest.raises(TransferError, match="names agent"):
        reader.connect(SourceInfo(info.name, "nixl", "DRAM", evil.base, evil.size, 0, evil.agent_metadata))
    assert reader.read(info.name, [BlobRef("k", 0, 1)]) == [None]
    reader.close(), victim.close(), attacker.close()


def test_a_peer_tier_refuses_a_swapped_agent_before_connecting(tmp_path, signing_keys):
    import asyncio
    from collections import Counter

    from scd_store.store.keyring import Keyring
    from scd_store.store.keys import chunk_hashes, generation_of, hash_keys
    from scd_store.store.tiers.peer import PeerTier
    from scd_store.store.transfer import SourceInfo
    from scd_store.store.transfer.directory import FilePeerDirectory
    from scd_store.store.transfer.nixl_transfer import NixlBlobSource

    keys = hash_keys("sp", generation_of("fp"), chunk_hashes(list(range(8)), 4))
    producer = PeerTier(FilePeerDirectory(tmp_path), publish_bytes=1 << 16, transfer="nixl")
    reader = PeerTier(FilePeerDirectory(tmp_path), transfer="nixl")
    counts: Counter = Counter()
    producer.attach(keyring=Keyring(signing_keys["private"]), count=None)
    reader.attach(keyring=Keyring(signing_keys["public"]), count=lambda n, a: counts.update({n: a}))
    asyncio.run(producer.start())
    asyncio.run(reader.start())
    asyncio.run(producer.put_many([(keys[0], b"genuine")]))
    name = producer.source.info().name
    attacker = NixlBlobSource(1 << 16)
    attacker.publish({"planted": b"planted"})
    evil = attacker.info()
    genuine = (tmp_path / f"{name}.info").read_bytes()
    (tmp_path / f"{name}.info").write_bytes(
        SourceInfo(name, "nixl", "DRAM", evil.base, evil.size, 0, evil.agent_metadata).to_bytes())
    added: list = []
    agent = reader.reader.agent
    real_add = agent.add_remote_agent
    agent.add_remote_agent = lambda md: (added.append(md), real_add(md))[1]
    assert asyncio.run(reader.get_many(keys[:1])) == [None]
    assert added == [] and counts["refused_locations"] == 1  # refused before NIXL ever saw the attacker's agent
    (tmp_path / f"{name}.info").write_bytes(genuine)
    assert asyncio.run(reader.get_many(keys[:1])) == [b"genuine"] and len(added) == 1
    asyncio.run(reader.close()), asyncio.run(producer.close()), attacker.close()


def test_an_idle_source_and_reader_leave_the_cpu_alone():
    # NIXL's own progress thread spins a core per agent when its wait is 0 (its Python API's setting)
    with SourceProcess("nixl") as source:
        reader = make_reader(kind="nixl")
        name = reader.connect(source.info)
        assert all(b is not None for b in reader.read(name, source.refs[:4]))
        before, own = _cpu_seconds(source.proc.pid), time.process_time()
        time.sleep(2.0)
        assert _cpu_seconds(source.proc.pid) - before < 0.4  # a spinning thread would take ~2 s of the 2
        assert time.process_time() - own < 0.4
        assert all(b is not None for b in reader.read(name, source.refs[:4]))  # still served after the wait
        reader.close()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
