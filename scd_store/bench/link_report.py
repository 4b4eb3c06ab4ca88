"""What ``bench serve --link`` concludes from its rows: where each route wins (crossover link rates), how far
``bench ttft``'s model is from the measurement, a Markdown table and a plot of TTFT against link rate."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

COMPARED = (("scd-redis", "own"), ("raw-redis", "own"), ("scd-redis", "raw-redis"),
            ("scd-peer", "own"), ("raw-peer", "own"), ("scd-peer", "raw-peer"))


def _index(rows: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    return {(r["prefix_tokens"], r["concurrency"], r["link"], r["route"]): r for r in rows}


def _shaped(rows: list[dict[str, Any]]) -> list[tuple[float, str]]:
    return sorted({(r["link_gbit"], r["link"]) for r in rows if r["link_gbit"] is not None})


def crossovers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per prefix length, concurrency and compared pair (a, b): the shaped rates at which a's TTFT p50 is lower,
    and the rate where they cross (interpolated linearly in log rate between the two measured rates whose
    winner differs; None when one wins at every rate). A cell that did not load (a miss) counts as no data."""
    index, shaped, out = _index(rows), _shaped(rows), []
    for length, concurrency in sorted({(r["prefix_tokens"], r["concurrency"]) for r in rows}):
        for a, b in COMPARED:
            points = []
            for gbit, label in shaped:
                ra, rb = index.get((length, concurrency, label, a)), index.get((length, concurrency, label, b))
                if ra and rb and ra["loaded"] and rb["loaded"]:
                    points.append((gbit, ra["ttft_p50_ms"] - rb["ttft_p50_ms"]))
            if not points:
                continue
            cross = None
            for (g1, d1), (g2, d2) in zip(points, points[1:], strict=False):
                if (d1 < 0) != (d2 < 0):
                    t = d1 / (d1 - d2)
                    cross = round(math.exp(math.log(g1) + t * (math.log(g2) - math.log(g1))), 3)
                    break
            out.append({"prefix_tokens": length, "concurrency": concurrency, "a": a, "b": b,
                        "a_faster_at_gbit": [g for g, d in points if d < 0], "crossover_gbit": cross})
    return out


def model_gap(rows: list[dict[str, Any]], modelled: dict[str, Any]) -> list[dict[str, Any]]:
    """Measured TTFT p50 at one request at a time against ``bench ttft``'s modelled TTFT at the same rate."""
    entries = {e["prefix_tokens"]: e for e in modelled["prefixes"]}
    out = []
    for r in rows:
        entry = entries.get(r["prefix_tokens"])
        if r["concurrency"] != 1 or r["link_gbit"] is None or entry is None or not r["loaded"]:
            continue
        kind = r["route"].split("-")[0]
        if kind == "own":
            model = entry["own_prefill_ms"]
        else:
            model = entry["methods"][kind]["links"].get(f"{r['link_gbit']:g}", {}).get("ttft_ms")
        if model:
            out.append({"prefix_tokens": r["prefix_tokens"], "link": r["link"], "route": r["route"],
                        "measured_ms": r["ttft_p50_ms"], "modelled_ms": model,
                        "measured_over_modelled": round(r["ttft_p50_ms"] / model, 2)})
    return out


def markdown_table(report: dict[str, Any]) -> str:
    """The rows as a Markdown table (TTFT p50 / p99, MB across the link per cell)."""
    lines = ["| link | prefix | concurrency | route | TTFT p50 (ms) | TTFT p99 (ms) | MB to consumer | loaded |",
             "|---|---:|---:|---|---:|---:|---:|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['link']} | {r['prefix_tokens']} | {r['concurrency']} | {r['route']} | "
                     f"{r['ttft_p50_ms']:,.1f} | {r['ttft_p99_ms']:,.1f} | {r['link_bytes_to_consumer'] / 1e6:,.1f} | "
                     f"{'yes' if r['loaded'] else 'no (miss)'} |")
    return "\n".join(lines) + "\n"


def plot_link(report: dict[str, Any], png: Path) -> None:
    """TTFT p50 against link rate, one panel per prefix length and concurrency, one line per route; the
    unshaped link is drawn right of the shaped rates."""
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError("the plot needs matplotlib: pip install 'scd-store[plots]'",
                                  name="matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    shaped = _shaped(rows)
    top = max((g for g, _ in shaped), default=1.0)
    x_of = {label: g for g, label in shaped} | {"unshaped": top * 4}
    panels = sorted({(r["prefix_tokens"], r["concurrency"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.0 * len(panels), 3.6), squeeze=False)
    for ax, (length, concurrency) in zip(axes[0], panels, strict=True):
        for route in dict.fromkeys(r["route"] for r in rows):
            cells = sorted((x_of[r["link"]], r["ttft_p50_ms"]) for r in rows if r["route"] == route
                           and r["prefix_tokens"] == length and r["concurrency"] == concurrency
                           and r["link"] in x_of and r["loaded"])
            if cells:
                ax.plot([c[0] for c in cells], [c[1] for c in cells], marker="o", label=route,
                        ls="--" if route == "own" else "-")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ticks = sorted(x_of.values())
        ax.set_xticks(ticks, [f"{t:g}" if t != top * 4 else "unshaped" for t in ticks], fontsize=7)
        ax.set_title(f"{length}-token prefix, {concurrency} at a time", fontsize=9)
        ax.set_xlabel("link (Gbit/s)")
        ax.set_ylabel("TTFT p50 (ms)")
        ax.legend(fontsize=7)
    fig.suptitle(f"{report['config']['consumer']}: TTFT at the client, producer and consumer on two hosts "
                 f"({report['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
