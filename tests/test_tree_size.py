"""The tree stays small enough to travel: everything git would carry (tracked files, and untracked ones it does not
ignore) goes with each call to the lent GPU machine, which takes 64 MiB in all, wheels and builds included
(issue 47). The model material is most of it, kept packed (scd_store/models/packed.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
# 64 MiB travel per call, less the wheels the device check carries (cryptography 4.7, cffi 0.2, constriction 0.4
# MiB) and some room. Issue 47 asks for 40 MiB: the adapters and the kept bundle cannot get there losslessly
# (their int8 deltas and float mantissas are close to incompressible: ~49 MiB is the floor while the consumers stay
# bit-identical); getting there means lossier consumers, a new kept bundle and new quality figures.
LIMIT = 58 * MiB


def _carried() -> dict[str, int]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode().split("\0")
    sizes = {}
    for name in filter(None, listed):
        path = ROOT / name
        if path.is_file() and not path.is_symlink():  # a tracked file deleted in the work tree is not carried
            sizes[name] = path.stat().st_size
    return sizes


def test_what_travels_with_the_tree_stays_under_the_limit():
    sizes = _carried()
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda item: -item[1])[:8]
    assert total < LIMIT, (f"the tree carries {total / MiB:.1f} MiB (limit {LIMIT / MiB:.0f} MiB); largest: "
                           + ", ".join(f"{name} {size / MiB:.1f} MiB" for name, size in largest))
