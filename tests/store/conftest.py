"""Fixtures for the store unit tests: a file registry with one space and one pair, in-process tiers."""

from __future__ import annotations

import asyncio

import pytest

from scd_store.store.keys import chunk_hashes
from scd_store.store.registry import FileRegistry, Pair, Space
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.base import Tier, TierUsage
from scd_store.store.tiers.cpu import CpuTier
from scd_store.store.tiers.disk import DiskTier

SPACE = Space("space-a", "producer-m", "prod-fp", "space-fp", codec_id="raw", chunk_size=4,
              raw_kv_bytes_per_token=1000)
PAIR = Pair("pair-a", "space-a", "consumer-m", "cons-fp", "pair-fp", "space-fp")
TOKENS = list(range(4 * 6 + 2))  # 6 whole chunks of 4, plus 2 unhashed tokens
HASHES = chunk_hashes(TOKENS, 4)
PAYLOADS = [bytes([i]) * (50 + i) for i in range(6)]


def put_all(store: TieredStore, n: int = 6) -> list[str]:
    """The producer's put of the first ``n`` chunks of ``TOKENS``."""
    return store.producer("space-a", "producer-m", "space-fp").put(HASHES[:n], PAYLOADS[:n], [4] * n, codec_id="raw")


class FailingTier(Tier):
    """A remote-like tier that fails while ``broken`` is set (no mocks of Redis: a real in-process tier)."""

    kind = "flaky"

    def __init__(self) -> None:
        super().__init__()
        self.broken = False
        self.data: dict[str, bytes] = {}
        self.calls = 0

    def _check(self) -> None:
        self.calls += 1
        if self.broken:
            raise ConnectionError("tier unreachable")

    async def get(self, key):
        self._check()
        return self.data.get(key)

    async def put(self, key, value):
        self._check()
        self.data[key] = value

    async def contains(self, key):
        self._check()
        return key in self.data

    async def delete(self, key):
        self._check()
        return self.data.pop(key, None) is not None

    def usage(self) -> TierUsage:
        return TierUsage(len(self.data), sum(map(len, self.data.values())), None)


class SlowTier(FailingTier):
    """A tier whose every put takes half a second."""

    kind = "slow"

    async def put(self, key, value):
        await asyncio.sleep(0.5)
        self.data[key] = value


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


@pytest.fixture
def consumer(store):
    return store.consumer("pair-a", "consumer-m", "space-fp")
