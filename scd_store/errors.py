"""The root of every error scd-store raises on purpose: ``except ScdStoreError`` catches them all.

Each class keeps the builtin it always subclassed (``ValueError`` for bad input, ``RuntimeError`` for
a state), so callers that catch those still do.
"""

from __future__ import annotations


class ScdStoreError(Exception):
    """Any error scd-store raises on purpose (a bad config, blob, key, registry record, model...)."""
