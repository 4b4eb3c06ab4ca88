"""The quality Pareto plot: payload ratio against each quality measure (perplexity rise, KL, top-1), per method."""

from __future__ import annotations

import json
from pathlib import Path

X_TICKS = (0.0625, 0.125, 0.25, 0.5, 1.0)  # payload / fp16: a sixteenth to all of it
SKIPPED = ("oracle", "none")  # the reference, and the no-prefix point far above every method
# (report field, axis label, scale, lower is better)
MEASURES = (("ppl_rel", "continuation PPL vs own prefill (%)", 100.0, True),
            ("kl", "KL(own prefill || method), nats / token", 1.0, True),
            ("top1", "top-1 agreement with own prefill (%)", 100.0, False))


def pareto_points(report: dict, measure: str = "ppl_rel") -> list[tuple[str, float, float]]:
    """``(method, payload_ratio, value of measure)`` of every method in a quality report but the references."""
    return [(m["name"], m["payload_ratio"], m[measure]) for m in report["methods"] if m["name"] not in SKIPPED]


def _colour(name: str) -> str:
    """scd-store's codes red, anchors followed by the distilled map green, anchors alone blue."""
    if name.startswith("scd"):
        return "tab:red"
    return "tab:green" if name.endswith("+map") else "tab:blue"


def _interval(report: dict, name: str, measure: str) -> tuple[float, float] | None:
    """A method's ``(low, high)`` for ``measure`` when the report carries intervals."""
    for m in report["methods"]:
        if m["name"] == name:
            ci = (m.get("intervals") or {}).get(measure)
            return (ci["low"], ci["high"]) if ci else None
    return None


def frontier(points: list[tuple[str, float, float]], lower_is_better: bool) -> list[tuple[float, float]]:
    """The points no cheaper point beats, in payload order: ``(payload_ratio, value)``."""
    out, best = [], float("inf")
    for _, ratio, value in sorted(points, key=lambda p: p[1]):
        score = value if lower_is_better else -value
        if score < best:
            best = score
            out.append((ratio, value))
    return out


def plot_pareto(reports: list[dict], path: Path) -> Path:
    """One column per report (consumer), one row per measure: each method a labelled point with its
    interval where the report has one, the frontier dashed. Writes a PNG and returns its path."""
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError("the Pareto plot needs matplotlib: pip install 'scd-store[plots]'",
                                  name="matplotlib") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, PercentFormatter

    measures = [m for m in MEASURES if all(all(m[0] in x for x in r["methods"]) for r in reports)]
    fig, axes = plt.subplots(len(measures), len(reports), figsize=(6 * len(reports), 3.6 * len(measures)),
                             squeeze=False)
    for col, report in enumerate(reports):
        for row, (measure, label, scale, lower) in enumerate(measures):
            ax = axes[row][col]
            points = pareto_points(report, measure)
            for name, ratio, value in points:
                color = _colour(name)
                ax.scatter(ratio, scale * value, s=24, color=color, zorder=3)
                ci = _interval(report, name, measure)
                if ci is not None:
                    ax.vlines(ratio, scale * ci[0], scale * ci[1], color=color, linewidth=1, alpha=0.6)
                ax.annotate(name, (ratio, scale * value), textcoords="offset points", xytext=(4, 3), fontsize=7)
            line = frontier(points, lower)
            if line:
                ax.step([r for r, _ in line], [scale * v for _, v in line], where="post", color="grey",
                        linewidth=0.8, linestyle="--")
            ax.set_xscale("log")
            ax.set_xticks(X_TICKS)
            ax.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=1))
            ax.xaxis.set_minor_formatter(NullFormatter())
            if lower:  # orders of magnitude apart (a 1-bit quantiser next to near-lossless codes): log-like
                ax.set_yscale("symlog", linthresh=1.0 if measure == "ppl_rel" else 0.01)
                lows = [scale * v for _, _, v in points] + [scale * ci[0] for name, _, _ in points
                                                            if (ci := _interval(report, name, measure))]
                ax.set_ylim(bottom=min([0.0, *lows]))
            ax.set_xlabel("payload / raw fp16 KV")
            ax.set_ylabel(label, fontsize=8)
            if row == 0:
                ax.set_title(f"{report['consumer']} ({report['windows']} windows, seed {report.get('seed', 0)}, "
                             f"{report['prefix_tokens']} cached tokens)", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_reports(paths: list[Path], out: Path) -> Path:
    """:func:`plot_pareto` of quality report JSON files."""
    return plot_pareto([json.loads(p.read_text()) for p in paths], out)
