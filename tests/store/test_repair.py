"""The producer's repair: readers of a shared tier report what they found bad and what they hit; the space's
producer verifies the reports, deletes and rewrites what is bad, refreshes its hits and refuses the rest."""

from __future__ import annotations

import time

from scd_store.store.keys import generation_of, make_key
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier
from tests.store.conftest import HASHES, SPACE, FailingTier, put_all


class SharedTier(FailingTier):
    """A shared tier with a TTL, in process: two stores' tiers over one ``data`` and one set of reports."""

    kind = "shared"
    shared = True
    expires = True

    def __init__(self, data: dict[str, bytes], reports: dict[tuple[str, str], set[str]]) -> None:
        super().__init__()
        self.data = data
        self.reported = reports
        self.touched: list[str] = []

    async def report_suspects(self, scope, keys):
        self.reported.setdefault(("suspects", scope), set()).update(keys)

    async def report_hits(self, scope, keys):
        self.reported.setdefault(("hits", scope), set()).update(keys)

    async def reports(self, kind, scope, limit):
        return sorted(self.reported.get((kind, scope), ()))[:limit]

    async def clear_reports(self, kind, scope, keys):
        self.reported.get((kind, scope), set()).difference_update(keys)

    async def touch_many(self, keys):
        self.touched += keys
        return sum(k in self.data for k in keys)


def _wait(check, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_reported_blobs_are_verified_quarantined_rewritten_and_hits_refreshed(registry) -> None:
    data: dict[str, bytes] = {}
    reports: dict[tuple[str, str], set[str]] = {}
    with TieredStore([CpuTier(1 << 20), SharedTier(data, reports)], registry, chunk_size=4, repair_s=0) as producer, \
            TieredStore([SharedTier(data, reports)], registry, chunk_size=4, repair_s=0) as reader:
        keys = put_all(producer, 3)
        producer.flush()
        good = data[keys[1]]
        data[keys[1]] = good[:-1] + bytes([good[-1] ^ 0xFF])
        assert len(reader.consumer("pair-a", "consumer-m", "space-fp").get(HASHES[:3])) == 1
        assert data[keys[1]] != good  # the reader deleted nothing in the shared tier: it reported the key
        scope = SPACE.scope
        assert reports[("suspects", scope)] == {keys[1]}
        assert _wait(lambda: reports.get(("hits", scope)) == {keys[0], keys[2]})  # every verified hit
        foreign = make_key("other-space", generation_of("other-fp"), "0" * 32)
        reports[("suspects", scope)].add(foreign)  # anyone may write reports: outside the space, refused
        assert producer.repair_now() == (1, 1)
        assert data[keys[1]] == good and reports[("suspects", scope)] == set() and reports[("hits", scope)] == set()
        stats = producer.stats
        assert stats.value("quarantined_blobs", tier="shared") == 1 and stats.value("repaired_blobs") == 1
        assert stats.value("refused_reports", tier="shared") == 1 and stats.value("ttl_refreshes") == 2
        assert producer.repair_now() == (0, 0)  # every report was processed


def test_a_report_of_an_intact_blob_is_cleared_and_left_alone(registry) -> None:
    data: dict[str, bytes] = {}
    reports: dict[tuple[str, str], set[str]] = {}
    with TieredStore([CpuTier(1 << 20), SharedTier(data, reports)], registry, chunk_size=4, repair_s=0) as producer:
        keys = put_all(producer, 2)
        producer.flush()
        before = dict(data)
        reports[("suspects", SPACE.scope)] = {keys[0]}  # a false report
        assert producer.repair_now() == (0, 0)
        assert data == before and reports[("suspects", SPACE.scope)] == set()
