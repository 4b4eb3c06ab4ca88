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
        table.add_row(name, f"{m['ppl']:.3f}", f"{m['ppl_rel']:+.2%}", f"{m['kl']:.4f}", f"{m['top1']:.3f}",
                      f"{m['bytes_per_token']:.0f}", f"{m['payload_ratio']:.1%}")
    console.print(table)
    for method, why in report.skipped.items():
        console.print(f"{method}: not measured ({why})")
