"""Incidents: every occurrence counted, the first one logged."""

from __future__ import annotations

import logging

from scd_store.store.log_once import Incidents
from scd_store.store.stats import StoreStats


def test_counts_every_time_and_logs_once_per_key(caplog):
    stats = StoreStats()
    incidents = Incidents(stats, logging.getLogger("scd_store.test"))
    with caplog.at_level(logging.WARNING, logger="scd_store.test"):
        for _ in range(3):
            incidents.count("refused_chunks", "refused %s (counted as refused_chunks)", "x", n=2, space="s",
                            once="refused:a")
        incidents.count("refused_chunks", "refused %s", "y", once="refused:b")
    assert stats.value("refused_chunks", space="s") == 6
    assert stats.value("refused_chunks") == 7
    assert [r.getMessage() for r in caplog.records] == ["refused x (counted as refused_chunks)", "refused y"]


def test_a_bound_on_the_kinds_remembered_stops_logging_new_ones(caplog):
    stats = StoreStats()
    incidents = Incidents(stats, logging.getLogger("scd_store.test"), limit=2)
    with caplog.at_level(logging.WARNING, logger="scd_store.test"):
        for what in ("a", "b", "c", "a"):
            incidents.count("refused_chunks", "refused %s", what, once=what)
    assert stats.value("refused_chunks") == 4  # every one counted
    assert [r.getMessage() for r in caplog.records] == ["refused a", "refused b"]
