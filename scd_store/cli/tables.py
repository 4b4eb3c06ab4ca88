"""Rich tables for the CLI."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from scd_store.bench.quality import QualityReport

console = Console()


def one_line(text: str, width: int = 60) -> str:
    """One line of at most ``width`` characters, with rich markup escaped (code has brackets)."""
    text = " ".join(text.split())
    return escape(text if len(text) <= width else text[:width - 1] + "…")


def _bounds(interval: dict | None, fmt: str) -> str:
    """`` [low, high]`` of an interval dict, or nothing."""
    return f" [{fmt.format(interval['low'])}, {fmt.format(interval['high'])}]" if interval else ""


def print_quality(report: QualityReport) -> None:
    table = Table(title=f"{report.consumer} on {report.windows} held-out windows "
                        f"({report.prefix_tokens} prefix + {report.continuation_tokens} scored tokens"
                        + (f", {report.text}" if report.text else "") + ")")
    for column in ("method", "ppl", "ppl_rel", "kl (nats)", "top1", "bytes/token", "payload vs fp16"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for m in report.methods:
        name = m["name"]
        if "layers" in m:
            name += f" (layers {m['layers'][0]}-{m['layers'][1] - 1})"
        if m.get("patch_layers"):
            name += f" ({m['kind']} at {','.join(map(str, m['patch_layers']))})"
        ci = m.get("intervals") or {}
        table.add_row(name, f"{m['ppl']:.3f}", f"{m['ppl_rel']:+.2%}" + _bounds(ci.get("ppl_rel"), "{:+.1%}"),
                      f"{m['kl']:.4f}" + _bounds(ci.get("kl"), "{:.4f}"),
                      f"{m['top1']:.3f}" + _bounds(ci.get("top1"), "{:.3f}"),
                      f"{m['bytes_per_token']:.0f}", f"{m['payload_ratio']:.1%}")
    console.print(table)
    for pair in report.paired:
        console.print(f"{pair['a']} - {pair['b']} (paired, 95%): KL {pair['kl']['mean']:+.4f}"
                      f"{_bounds(pair['kl'], '{:+.4f}')}, top-1 {pair['top1']['mean']:+.3f}"
                      f"{_bounds(pair['top1'], '{:+.3f}')}, ppl x{1 + pair['ppl_ratio']['mean']:.4f}")
    for method, why in report.skipped.items():
        console.print(f"{method}: not measured ({why})")
