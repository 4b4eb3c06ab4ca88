"""Fixtures for the store unit tests: a file registry with one space and one pair, in-process tiers."""

from __future__ import annotations

import pytest

from scd_store.store.registry import FileRegistry, Pair, Space
from scd_store.store.store import TieredStore
from scd_store.store.tiers.cpu import CpuTier
from scd_store.store.tiers.disk import DiskTier

SPACE = Space("space-a", "producer-m", "prod-fp", "space-fp", codec_id="raw", chunk_size=4,
              raw_kv_bytes_per_token=1000)
PAIR = Pair("pair-a", "space-a", "consumer-m", "cons-fp", "pair-fp")


@pytest.fixture
def registry(tmp_path) -> FileRegistry:
    reg = FileRegistry(tmp_path / "registry.json")
    reg.register_space(SPACE)
    reg.register_pair(PAIR)
    return reg


@pytest.fixture
def store(tmp_path, registry):
    tiers = [CpuTier(1 << 20), DiskTier(tmp_path / "disk", 4 << 20)]
    st = TieredStore(tiers, registry, chunk_size=4, op_timeout_s=2.0, put_timeout_s=5.0, queue_size=8)
    yield st
    st.close()
