"""Where scd-store keeps downloaded and prepared material: the data directory, ``$SCD_STORE_HOME``."""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "SCD_STORE_HOME"  # the data directory; default ~/.cache/scd-store


def data_dir() -> Path:
    """The data directory: ``$SCD_STORE_HOME`` or ``~/.cache/scd-store`` (created)."""
    root = os.environ.get(HOME_ENV)
    path = Path(root).expanduser() if root else Path.home() / ".cache" / "scd-store"
    path.mkdir(parents=True, exist_ok=True)
    return path


def models_dir() -> Path:
    """``<data dir>/models`` (created)."""
    path = data_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def downloads_dir() -> Path:
    """``<data dir>/downloads`` (created)."""
    path = data_dir() / "downloads"
    path.mkdir(parents=True, exist_ok=True)
    return path
