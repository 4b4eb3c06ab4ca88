"""What ``bench serve --link`` concludes from its rows, on rows made up to have known answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from scd_store.bench.link_report import crossovers, markdown_table, model_gap, plot_link

RATES = {"0.1gbit": 0.1, "1gbit": 1.0, "10gbit": 10.0, "unshaped": None}
TTFT = {  # route -> TTFT p50 per link: raw wins only on fast links, the codes everywhere but unshaped
    "own": {"0.1gbit": 100.0, "1gbit": 100.0, "10gbit": 100.0, "unshaped": 100.0},
    "scd-redis": {"0.1gbit": 60.0, "1gbit": 40.0, "10gbit": 35.0, "unshaped": 35.0},
    "raw-redis": {"0.1gbit": 400.0, "1gbit": 130.0, "10gbit": 50.0, "unshaped": 45.0},
}


def _rows(loaded: bool = True) -> list[dict]:
    return [{"link": link, "link_gbit": gbit, "prefix_tokens": 512, "concurrency": 1, "route": route,
             "ttft_p50_ms": TTFT[route][link], "ttft_p99_ms": TTFT[route][link] * 1.5,
             "loaded": loaded or route == "own",
             "link_bytes_to_consumer": 0 if route == "own" else 10_000_000}
            for link, gbit in RATES.items() for route in TTFT]


def _pair(out: list[dict], a: str, b: str) -> dict:
    return next(c for c in out if (c["a"], c["b"]) == (a, b))


def test_crossover_is_where_the_winner_changes() -> None:
    out = crossovers(_rows())
    raw = _pair(out, "raw-redis", "own")
    assert raw["a_faster_at_gbit"] == [10.0]
    assert 1.0 < raw["crossover_gbit"] < 10.0  # -30 ms at 1 gbit, +50 ms at 10: log-interpolated between
    scd = _pair(out, "scd-redis", "own")
    assert scd["a_faster_at_gbit"] == [0.1, 1.0, 10.0] and scd["crossover_gbit"] is None
    assert _pair(out, "scd-redis", "raw-redis")["a_faster_at_gbit"] == [0.1, 1.0, 10.0]


def test_a_miss_is_no_data_not_a_win() -> None:
    out = crossovers(_rows(loaded=False))
    assert not any(c["a"] != "own" and c["b"] == "own" for c in out)


def test_model_gap_pairs_measured_with_modelled_at_the_same_rate() -> None:
    modelled = {"prefixes": [{"prefix_tokens": 512, "own_prefill_ms": 50.0, "methods": {
        "scd": {"links": {"1": {"ttft_ms": 20.0}, "10": {"ttft_ms": 35.0}}},
        "raw": {"links": {"1": {"ttft_ms": 65.0}}}}}]}
    gap = {(g["route"], g["link"]): g["measured_over_modelled"] for g in model_gap(_rows(), modelled)}
    assert gap[("own", "1gbit")] == 2.0
    assert gap[("scd-redis", "1gbit")] == 2.0 and gap[("scd-redis", "10gbit")] == 1.0
    assert gap[("raw-redis", "1gbit")] == 2.0 and ("raw-redis", "10gbit") not in gap
    assert not any(link == "unshaped" for _, link in gap)


def test_markdown_table_says_a_miss() -> None:
    table = markdown_table({"rows": _rows(loaded=False)})
    assert table.count("\n") == 2 + len(_rows())
    assert "no (miss)" in table and "| 0.1gbit | 512 | 1 | own | 100.0 |" in table


def test_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "link.png"
    plot_link({"rows": _rows(), "config": {"consumer": "c"}, "date": "2026-12-05"}, png)
    assert png.stat().st_size > 5000 and png.read_bytes()[:4] == b"\x89PNG"
