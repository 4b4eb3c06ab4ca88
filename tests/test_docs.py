"""The user docs hold together: every relative link lands on a file (and a heading, where it names one),
and docs/commands.md lists exactly the commands the command line has."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from scd_store.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors (lower case, punctuation but '-' and '_' dropped, spaces to '-') and explicit
    ``<a id="...">`` ones."""
    text = page.read_text()
    out = set(re.findall(r'<a id="([^"]+)"', text))
    fenced = False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        if line.startswith("#") and not fenced:
            text = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return out


def test_relative_links_resolve() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def _commands(parser: argparse.ArgumentParser, prefix: str = "") -> set[str]:
    found = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                inner = _commands(sub, f"{prefix}{name} ")
                found |= inner or {f"{prefix}{name}"}
    return found


def _listed(page: str) -> set[str]:
    """The command of each ``scd-store ...`` line: its words up to the first option or placeholder."""
    out = set()
    for line in page.splitlines():
        if line.startswith("scd-store "):
            words = []
            for word in line.split()[1:]:
                if not re.fullmatch(r"[a-z][a-z0-9-]*", word):
                    break
                words.append(word)
            out.add(" ".join(words))
    return out


def test_commands_page_lists_every_command() -> None:
    listed = _listed((ROOT / "docs" / "commands.md").read_text())
    commands = _commands(build_parser())
    assert not commands - listed, f"docs/commands.md does not list: {sorted(commands - listed)}"
    assert not listed - commands, f"docs/commands.md lists what the CLI lacks: {sorted(listed - commands)}"
