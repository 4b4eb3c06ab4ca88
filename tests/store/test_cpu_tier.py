from __future__ import annotations

import asyncio

from scd_store.store.tiers.cpu import CpuTier
from scd_store.store.tiers.lru import ByteLRU


def test_lru_bound_and_order() -> None:
    evicted: list[str] = []
    lru: ByteLRU[bytes] = ByteLRU(100, len, lambda k, n: evicted.append(k))
    for i in range(5):
        assert lru.put(f"k{i}", b"x" * 30)
        assert lru.bytes_used <= 100
    assert evicted == ["k0", "k1"]
    lru.get("k2")  # k2 becomes most recent: k3 goes next
    lru.put("k5", b"y" * 30)
    assert evicted == ["k0", "k1", "k3"]
    assert lru.contains_many(["k2", "k3", "k4", "k5"]) == [True, False, True, True]
    assert not lru.put("huge", b"z" * 101) and "huge" not in lru and len(lru) == 3


def test_lru_overwrite_accounts_bytes() -> None:
    lru: ByteLRU[bytes] = ByteLRU(100, len)
    lru.put("a", b"x" * 60)
    lru.put("a", b"x" * 10)
    assert lru.bytes_used == 10 and len(lru) == 1
    assert lru.pop("a") == b"x" * 10 and lru.bytes_used == 0


def test_cpu_tier_sync_and_async_faces() -> None:
    evictions: list[tuple[str, str, int]] = []
    tier = CpuTier(64)
    tier.set_evict_listener(lambda t, k, n: evictions.append((t, k, n)))
    tier.put_many_now([("a", b"1" * 32), ("b", b"2" * 32)])
    assert tier.get_many_now(["a", "b", "c"]) == [b"1" * 32, b"2" * 32, None]
    asyncio.run(tier.put("c", b"3" * 32))
    assert evictions == [("cpu", "a", 32)]
    assert asyncio.run(tier.contains_many(["a", "b", "c"])) == [False, True, True]
    assert tier.usage().bytes_used == 64 and tier.usage().capacity_bytes == 64
    assert asyncio.run(tier.delete("b")) and not tier.contains_now("b")
    tier.put_now("big", b"x" * 65)
    assert tier.rejected_too_large == 1 and tier.get_now("big") is None


def test_cpu_tier_copies_mutable_input() -> None:
    tier = CpuTier(64)
    value = bytearray(b"abc")
    tier.put_now("k", value)
    value[0] = ord("z")
    assert tier.get_now("k") == b"abc"
