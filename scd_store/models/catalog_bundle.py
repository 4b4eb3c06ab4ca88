"""The code space and decoders kept with scd-store for the catalog pairs (:func:`catalog_bundle`).

One shared code space of the catalog producer and a decoder for each catalog consumer, calibrated at the
defaults (budget 0.24, 900 distillation steps per consumer), so the demo and the benches serve codes at
the product's quality without a long first run. It was made by::

    scd-store calibrate --consumer smollm2-135m-shakespeare --consumer smollm2-135m-python \\
        --out scd_store/models/bundles/catalog
    python -m scd_store.models.packed scd_store/models/bundles/catalog   # *.safetensors -> *.safetensors.packed

and kept, packed, in :data:`KEPT_BUNDLE` (the manifests as they are, each tensor file packed by
:mod:`scd_store.models.packed`). :func:`catalog_bundle` unpacks it once into ``<data dir>/bundles/catalog-<digest>``,
a plain bundle directory, byte for byte the calibrated one (``python -m scd_store.models.catalog_bundle`` prints
its path, for ``--bundle``).

It fits only the exact weights it was calibrated on: :func:`bundle_misfit` checks the space's producer
fingerprint and each pair's consumer fingerprint (and every content fingerprint, as loading does), and a
bundle that does not fit is not served (the demo calibrates one instead).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from scd_store.codecs.scd.bundle import BundleError, load_pair, load_space
from scd_store.models.packed import SUFFIX, original_sha256, read_bytes
from scd_store.paths import data_dir

KEPT_BUNDLE = Path(__file__).resolve().parent / "bundles" / "catalog"


def _members(kept: Path) -> dict[str, tuple[Path, str]]:
    """``{path in the plain bundle: (kept file, SHA-256 of the plain file)}``."""
    members = {}
    for path in sorted(kept.rglob("*")):
        if not path.is_file():
            continue
        relative = path.relative_to(kept).as_posix()
        if relative.endswith(SUFFIX):
            members[relative.removesuffix(SUFFIX)] = (path, original_sha256(path))
        elif relative.endswith(".json"):
            members[relative] = (path, hashlib.sha256(path.read_bytes()).hexdigest())
    if "space.json" not in members:
        raise BundleError(f"{kept}: no kept bundle here (no space.json)")
    return members


def _intact(directory: Path, members: dict[str, tuple[Path, str]]) -> bool:
    for relative, (_, digest) in members.items():
        path = directory / relative
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            return False
    return True


def catalog_bundle(kept: Path = KEPT_BUNDLE) -> Path:
    """The kept bundle as a plain bundle directory, unpacked (once; reused while intact) into
    ``<data dir>/bundles/catalog-<digest of its files>``."""
    members = _members(kept)
    key = hashlib.sha256("\n".join(f"{name} {digest}" for name, (_, digest) in members.items()).encode())
    out = data_dir() / "bundles" / f"catalog-{key.hexdigest()[:16]}"
    if _intact(out, members):
        return out
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    for relative, (source, _) in members.items():
        target = tmp / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(read_bytes(source))
    if not _intact(tmp, members):
        shutil.rmtree(tmp, ignore_errors=True)
        raise BundleError(f"{kept}: the kept bundle does not unpack to the files it records")
    shutil.rmtree(out, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:  # another process unpacked it first
        shutil.rmtree(tmp, ignore_errors=True)
        if not _intact(out, members):
            raise
    return out


def __getattr__(name: str) -> Path:
    # CATALOG_BUNDLE: the unpacked kept bundle, resolved (and unpacked) on first use, not on import
    if name == "CATALOG_BUNDLE":
        return catalog_bundle()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


__all__ = ["KEPT_BUNDLE", "bundle_misfit", "catalog_bundle"]

if __name__ == "__main__":
    print(catalog_bundle())
