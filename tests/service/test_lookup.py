"""A lookup says how many of a hit's chunks only a remote tier holds (what an engine loads off its step)."""

from __future__ import annotations

from scd_store.service import KVService, Lookup
from scd_store.store.registry import FileRegistry
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier
from tests.bundles import PRODUCER, write_tiny_bundle
from tests.service.test_kv_service import HASHES, chunks
from tests.store.conftest import FailingTier


def test_chunks_only_a_remote_tier_holds_are_counted_as_remote(tmp_path):
    write_tiny_bundle(tmp_path / "bundle", consumers=("consumer-a",))
    cpu, remote = CpuTier(1 << 20), FailingTier()
    store = TieredStore([cpu, remote], FileRegistry(tmp_path / "reg.json"), chunk_size=8)
    service = KVService(store, [tmp_path / "bundle"])
    try:
        _, parts = chunks()
        assert service.put(PRODUCER, HASHES, parts) == 3
        store.flush(timeout=10)
        assert service.lookup("consumer-a", HASHES) == Lookup(3, 0, ("cpu",) * 3)  # all in this host's CPU tier
        third = [k for k in remote.data if HASHES[2].hex() in k]
        assert len(third) == 1 and cpu.delete_now(third[0])  # the CPU tier lost the third chunk; Redis has it
        assert service.lookup("consumer-a", HASHES) == Lookup(3, 1, ("cpu", "cpu", "flaky"))
        assert service.contains("consumer-a", HASHES) == 3
        assert service.lookup("stranger", HASHES) == Lookup(0, 0)
        remote.broken = True  # a remote tier that cannot answer holds nothing a lookup can count on
        assert service.lookup("consumer-a", HASHES).chunks == 2
    finally:
        service.close()
        store.close()
