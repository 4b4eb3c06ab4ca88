"""One exception root: every exception class the package defines derives from ``ScdStoreError``."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

from scd_store.errors import ScdStoreError

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [p for d in ("scd_store", "codecs", "adapters") for p in (ROOT / d).rglob("*.py")]
BUILTIN_ERRORS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}


def _rootless(path: Path) -> list[str]:
    """Classes in ``path`` that subclass a builtin exception without also naming ``ScdStoreError``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
            if bases & BUILTIN_ERRORS and "ScdStoreError" not in bases:
                found.append(node.name)
    return found


def test_every_exception_class_has_the_root():
    rootless = {str(p.relative_to(ROOT)): names for p in SOURCES if p.name != "errors.py" and (names := _rootless(p))}
    assert rootless == {}


def test_the_check_sees_a_rootless_class(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("class Oops(ValueError):\n    pass\n")
    assert _rootless(bad) == ["Oops"]


@pytest.mark.parametrize("name", ["scd_store.store.config:ConfigError", "scd_store.store.blob:BlobError",
                                  "scd_store.codecs.tensor_pack:PayloadError", "scd_store.store.keys:KeyError_"])
def test_the_root_catches_them_and_the_builtin_still_does(name):
    module, cls = name.split(":")
    error = getattr(__import__(module, fromlist=[cls]), cls)
    assert issubclass(error, ScdStoreError) and issubclass(error, ValueError)
