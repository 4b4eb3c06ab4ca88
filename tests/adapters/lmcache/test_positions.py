"""Chunk positions from LMCache's multiprocess server's token bindings."""

from __future__ import annotations

import threading
import time
import types

import pytest

from scd_store.adapters.lmcache.positions import PositionLedger


def test_positions_come_from_the_events_and_unknown_hashes_have_none():
    ledger = PositionLedger()
    ledger.record_event(types.SimpleNamespace(metadata={"chunk_hashes": [b"a", b"b"], "token_offsets": [0, 256]}))
    ledger.record_event(types.SimpleNamespace(metadata={"chunk_hashes": [b"c"], "token_offsets": []}))  # malformed
    assert ledger.positions([b"a", b"b"]) == [0, 256] and ledger.positions([b"c"]) == [None]


def test_a_lookup_waits_for_an_event_still_on_its_way():
    ledger = PositionLedger()
    threading.Timer(0.05, ledger.record, ([b"late"], [512])).start()
    t0 = time.monotonic()
    assert ledger.positions([b"late"], timeout=5) == [512] and time.monotonic() - t0 < 2
    assert ledger.positions([b"never"], timeout=0.05) == [None]


def test_the_ledger_is_bounded_least_recent_first():
    ledger = PositionLedger(max_entries=2)
    ledger.record([b"a", b"b"], [0, 1])
    ledger.record([b"a"], [0])  # a is recent again
    ledger.record([b"c"], [2])
    assert ledger.positions([b"a", b"b", b"c"]) == [0, None, 2]
    with pytest.raises(ValueError, match="max_entries"):
        PositionLedger(0)
