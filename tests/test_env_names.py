"""Every environment variable scd-store reads is named literally in its source and listed, by that name, in the
generated configuration reference (docs/configuration.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scd_store.store.config_doc import OTHER_ENV, reference

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("scd_store", "codecs", "adapters", "benchmarks", "tools")
NAME = re.compile(r"SCD_STORE_[A-Z0-9_]+")
BUILT = [  # ways of building a variable's name instead of writing it
    re.compile(r"""["']SCD_STORE_?["']"""),  # the bare prefix as a string, to be joined or added to
    re.compile(r"""["']SCD_STORE_[A-Z0-9_]*["']\s*\+"""),  # "SCD_STORE_" + key
    re.compile(r"SCD_STORE_[A-Z0-9_]*(\{|%[sd(])"),  # f"SCD_STORE_{kind}", "SCD_STORE_%s", "SCD_STORE_{}".format
]


def _sources() -> list[Path]:
    return sorted(p for folder in SOURCES for p in (ROOT / folder).rglob("*.py"))


def _names() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in _sources():
        for name in NAME.findall(path.read_text(encoding="utf-8")):
            found.setdefault(name.rstrip("_"), path)
    return found


def test_the_sources_name_variables():
    assert len(_sources()) > 50 and {"SCD_STORE_HOME", "SCD_STORE_CONFIG", "SCD_STORE_CPU_MAX_BYTES"} <= set(_names())


@pytest.mark.parametrize("name", sorted(_names()))
def test_every_variable_is_in_the_reference(name):
    assert f"| `{name}` |" in reference(), (f"{name} ({_names()[name].relative_to(ROOT)}) is not listed in "
                                            "docs/configuration.md: add it to scd_store/store/config_doc.py")


def test_no_source_builds_a_variable_name():
    built = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in _sources()
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if any(pattern.search(line) for pattern in BUILT)]
    assert not built, "write environment variable names out in full:\n" + "\n".join(built)


def test_the_patterns_catch_built_names():
    for line in ('"SCD_STORE_" + key', "f\"SCD_STORE_{t.kind.upper()}_\"", "'SCD_STORE_%s' % key",
                 '"_".join(["SCD_STORE", kind])', '"SCD_STORE_{}".format(key)'):
        assert any(pattern.search(line) for pattern in BUILT), line
    for line in ('os.environ.get("SCD_STORE_HOME")', 'f"{name}: {exc}"', 'env["SCD_STORE_TIERS"].split(",")'):
        assert not any(pattern.search(line) for pattern in BUILT), line


def test_the_others_are_read_somewhere():
    readers = {name: [p for p in _sources() if p.name != "config_doc.py" and name in p.read_text(encoding="utf-8")]
               for name, _, _ in OTHER_ENV}
    assert all(readers.values()), [name for name, paths in readers.items() if not paths]
