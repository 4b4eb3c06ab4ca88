"""The code space and decoders kept with scd-store for the catalog pairs (:data:`CATALOG_BUNDLE`).

One shared code space of the catalog producer and a decoder for each catalog consumer, calibrated at the
defaults (budget 0.24, 900 distillation steps per consumer), so the demo and the benches serve codes at
the product's quality without a long first run. It was made by::

    scd-store calibrate --consumer smollm2-135m-shakespeare --consumer smollm2-135m-python \\
        --out scd_store/models/bundles/catalog

It fits only the exact weights it was calibrated on: :func:`bundle_misfit` checks the space's producer
fingerprint and each pair's consumer fingerprint (and every content fingerprint, as loading does), and a
bundle that does not fit is not served (the demo calibrates one instead).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from scd_store.codecs.scd.bundle import BundleError, load_pair, load_space

CATALOG_BUNDLE = Path(__file__).resolve().parent / "bundles" / "catalog"


def bundle_misfit(bundle: Path, producer_fingerprint: str, consumers: Mapping[str, str]) -> str | None:
    """Why ``bundle`` cannot serve this producer and these consumers (``{name: weights fingerprint}``), or None
    when it holds a space calibrated for the producer and an intact decoder for each consumer."""
    try:
        space = load_space(bundle, producer_fingerprint)
        for name, fingerprint in consumers.items():
            load_pair(bundle, name, space, fingerprint)
    except BundleError as exc:
        return str(exc)
    return None


__all__ = ["CATALOG_BUNDLE", "bundle_misfit"]
