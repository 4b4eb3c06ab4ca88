"""docs/engines.md's table of engine settings names every field of EngineSettings, and each default it
quotes is the field's own (the defaults live in code once; the table must not drift from them)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from scd_store.service.settings import EngineSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "engines.md"
ROW = re.compile(r"^\| `(\w+)` \| (.*) \|$")


def _table() -> dict[str, str]:
    return {m.group(1): m.group(2) for line in DOC.read_text().splitlines() if (m := ROW.match(line))}


def test_every_setting_has_a_row():
    rows = _table()
    assert {f.name for f in dataclasses.fields(EngineSettings)} <= set(rows)


def test_each_quoted_default_is_the_fields_default():
    rows, checked = _table(), 0
    for f in dataclasses.fields(EngineSettings):
        quoted = re.search(r"\(default:? `?([\w.]+)`?[;)]", rows[f.name])
        if quoted is None or not isinstance(f.default, (bool, int, float, str)):
            continue
        text, checked = quoted.group(1), checked + 1
        expected = str(f.default).lower() if isinstance(f.default, bool) else f.default
        if isinstance(f.default, bool):
            assert text == expected, (f.name, text, expected)
        elif isinstance(f.default, (int, float)):
            assert float(text) == float(expected), (f.name, text, expected)
        else:
            assert text == expected, (f.name, text, expected)
    assert checked >= 7  # discovery_interval_s, register_bundles, max_positions, put_queue_chunks, ...
