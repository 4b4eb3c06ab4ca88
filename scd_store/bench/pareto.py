"""The quality Pareto plot: payload ratio against continuation-perplexity increase, per method."""

from __future__ import annotations

import json
from pathlib import Path

SKIPPED = ("oracle", "none")  # the reference, and the no-prefix point far above every method


def pareto_points(report: dict) -> list[tuple[str, float, float]]:
    """``(method, payload_ratio, ppl_rel)`` of every method in a quality report but the references."""
    return [(m["name"], m["payload_ratio"], m["ppl_rel"]) for m in report["methods"] if m["name"] not in SKIPPED]


def plot_pareto(reports: list[dict], path: Path) -> Path:
    """One panel per report (consumer): each method and budget a labelled point, the lower-left frontier
    drawn. Writes a PNG and returns its path."""
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError("the Pareto plot needs matplotlib: pip install 'scd-store[plots]'",
                                  name="matplotlib") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    fig, axes = plt.subplots(1, len(reports), figsize=(6 * len(reports), 4.5), squeeze=False)
    for ax, report in zip(axes[0], reports, strict=True):
        points = sorted(pareto_points(report), key=lambda p: p[1])
        for name, ratio, rel in points:
            ax.scatter(ratio, 100 * rel, s=30, color="tab:red" if name.startswith("scd") else "tab:blue")
            ax.annotate(name, (ratio, 100 * rel), textcoords="offset points", xytext=(4, 4), fontsize=8)
        frontier, best = [], float("inf")
        for _, ratio, rel in points:
            if rel < best:
                best = rel
                frontier.append((ratio, 100 * rel))
        if frontier:
            ax.step(*zip(*frontier, strict=True), where="post", color="grey", linewidth=0.8, linestyle="--")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
        ax.xaxis.set_minor_formatter(PercentFormatter(1.0, decimals=0))
        ax.set_xlabel("payload / raw fp16 KV")
        ax.set_ylabel("continuation PPL vs consumer's own prefill (%)")
        ax.set_title(f"{report['consumer']} ({report['windows']} windows, {report['prefix_tokens']} cached tokens)",
                     fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_reports(paths: list[Path], out: Path) -> Path:
    """:func:`plot_pareto` of quality report JSON files."""
    return plot_pareto([json.loads(p.read_text()) for p in paths], out)
