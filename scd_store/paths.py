"""Where scd-store keeps downloaded and prepared material."""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    """The data directory: ``$SCD_STORE_HOME`` or ``~/.cache/scd-store``."""
    root = os.environ.get("SCD_STORE_HOME")
    path = Path(root).expanduser() if root else Path.home() / ".cache" / "scd-store"
    path.mkdir(parents=True, exist_ok=True)
    return path


def models_dir() -> Path:
    path = data_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def downloads_dir() -> Path:
    path = data_dir() / "downloads"
    path.mkdir(parents=True, exist_ok=True)
    return path
