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
    ttl_ms = 60_000
    max_lifetime_ms = 480_000

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

    async def touch_many(self, keys, ttls_ms=None):
        self.touched += keys
        self.ttls = list(ttls_ms or [])
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
        later(producer, 20)  # the TTLs written with the blobs are a quarter old: refreshed on the reported hits
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


def later(store: TieredStore, seconds: float) -> None:
    """The producer's clock of what it wrote, ``seconds`` on."""
    at = time.time() + seconds
    store.births.clock = lambda: at


def stores(registry, data, reports, **kw):
    producer = TieredStore([CpuTier(1 << 20), SharedTier(data, reports)], registry, chunk_size=4, repair_s=0, **kw)
    return producer, producer.tiers[1]


def test_hits_refresh_only_blobs_the_producer_wrote_within_their_lifetime(registry) -> None:
    """The attack: a reader reports every blob as a hit for ever, so no unused blob expires. The producer refreshes
    only what it wrote itself, at most once a quarter TTL, and never past the blob's maximum lifetime."""
    data: dict[str, bytes] = {}
    reports: dict[tuple[str, str], set[str]] = {}
    producer, shared = stores(registry, data, reports)
    with producer:
        keys = put_all(producer, 3)
        producer.flush()
        planted = make_key("space-a", SPACE.generation, "ab" * 16)  # in the tier, never written by this producer
        data[planted] = data[keys[0]]
        scope = SPACE.scope
        reports[("hits", scope)] = {keys[0], keys[1], planted}
        producer.repair_now()
        assert shared.touched == []  # a TTL less than a quarter old is fresh: nothing to do
        later(producer, 20)
        reports[("hits", scope)] = {keys[0], keys[1], planted}
        producer.repair_now()
        assert sorted(shared.touched) == sorted(keys[:2]) and shared.ttls == [60_000, 60_000]
        assert producer.stats.value("refused_refreshes") == 2 and reports[("hits", scope)] == set()
        reports[("hits", scope)] = {keys[0]}  # again at once: its TTL is fresh, nothing to do
        shared.touched.clear()
        producer.repair_now()
        assert shared.touched == [] and producer.stats.value("ttl_refreshes") == 2
        births = producer.births
        now = time.time()
        births.clock = lambda: now + 470  # 10 s of its 480 s lifetime left: refreshed to 10 s, not 60
        reports[("hits", scope)] = {keys[0]}
        producer.repair_now()
        assert shared.touched == [keys[0]] and 9_000 <= shared.ttls[0] <= 10_000
        births.clock = lambda: now + 500  # past its lifetime: never refreshed again, however often reported
        reports[("hits", scope)] = {keys[0], keys[2]}
        shared.touched.clear()
        producer.repair_now()
        assert shared.touched == [] and producer.stats.value("refused_refreshes") == 2 + 2


def test_reported_keys_that_are_gone_are_not_rewritten(registry) -> None:
    """The write amplifier: a reader reporting evicted keys as bad made the producer write them back, 256 a round.
    A key that is not there is no damage: its report is refused; only a blob the producer deleted is rewritten."""
    data: dict[str, bytes] = {}
    reports: dict[tuple[str, str], set[str]] = {}
    producer, shared = stores(registry, data, reports)
    with producer:
        keys = put_all(producer, 3)
        producer.flush()
        evicted = {k: data.pop(k) for k in keys}
        reports[("suspects", SPACE.scope)] = set(keys)
        assert producer.repair_now() == (0, 0) and not any(k in data for k in keys)
        assert producer.stats.value("refused_reports") == 3 and reports[("suspects", SPACE.scope)] == set()
        data[keys[0]] = evicted[keys[0]][:-1] + b"x"  # there and bad: deleted and rewritten
        reports[("suspects", SPACE.scope)] = {keys[0]}
        assert producer.repair_now() == (1, 1) and data[keys[0]] == evicted[keys[0]]


def test_rewrites_spend_a_rate_and_a_key_is_rewritten_once_a_cooldown(registry) -> None:
    data: dict[str, bytes] = {}
    reports: dict[tuple[str, str], set[str]] = {}
    producer, shared = stores(registry, data, reports, repair_rate=2.0)
    with producer:
        keys = put_all(producer, 6)
        producer.flush()
        good = dict(data)
        for key in keys:
            data[key] = good[key][:-1] + b"x"
        reports[("suspects", SPACE.scope)] = set(keys)
        assert producer.repair_now() == (6, 2)  # all six deleted; two rewritten, the rest deferred
        assert producer.stats.value("deferred_repairs") == 4 and len(reports[("suspects", SPACE.scope)]) == 4
        time.sleep(1.05)  # two more tokens
        assert producer.repair_now() == (0, 2) and producer.stats.value("repaired_blobs") == 4
        rewritten = [k for k in keys if data.get(k) == good[k]]
        data[rewritten[0]] = good[rewritten[0]][:-1] + b"x"  # damaged again at once: deleted, rewrite waits
        reports[("suspects", SPACE.scope)].add(rewritten[0])
        time.sleep(1.05)
        quarantined, repaired = producer.repair_now()
        assert quarantined == 1 and rewritten[0] not in data and repaired == 2  # the others, not the cooled-down one


def test_false_reports_are_read_once_a_minute_and_reads_spend_a_byte_budget(registry, monkeypatch) -> None:
    """The amplifier: a reader reporting intact blobs as bad every round made the producer read and verify them
    all every round. A key found intact is not read again for a minute; a round reads at most VERIFY_BYTES."""
    from scd_store.store import repair as repair_module

    data: dict[str, bytes] = {}
    reports: dict[tuple[str, str], set[str]] = {}
    producer, shared = stores(registry, data, reports)
    with producer:
        keys = put_all(producer, 6)
        producer.flush()
        reports[("suspects", SPACE.scope)] = set(keys)
        before = shared.calls
        assert producer.repair_now() == (0, 0) and producer.stats.value("false_reports") == 6
        read = shared.calls - before
        for _ in range(5):  # reported again and again: cleared, never read again
            reports[("suspects", SPACE.scope)] = set(keys)
            assert producer.repair_now() == (0, 0)
        assert shared.calls - before == read and producer.stats.value("false_reports") == 6 * 6
        assert reports[("suspects", SPACE.scope)] == set()
    monkeypatch.setattr(repair_module, "VERIFY_BATCH", 1)
    monkeypatch.setattr(repair_module, "VERIFY_BYTES", 100)  # about two of these blobs a round
    data2: dict[str, bytes] = {}
    reports2: dict[tuple[str, str], set[str]] = {}
    producer, shared = stores(registry, data2, reports2)
    with producer:
        keys = put_all(producer, 6)
        producer.flush()
        reports2[("suspects", SPACE.scope)] = set(keys)
        producer.repair_now()
        left = reports2[("suspects", SPACE.scope)]
        assert 0 < len(left) < 6 and producer.stats.value("false_reports") == 6 - len(left)  # the rest waits
        while reports2[("suspects", SPACE.scope)]:
            producer.repair_now()
        assert producer.stats.value("false_reports") == 6
