"""Calibration bundles into a running service: :func:`bind_bundle` registers their space and pairs and binds
their models (:func:`register_bundle` only registers).

Registration is idempotent and reads before it writes (a record already there as it should be is
not written again); a registry record that differs from the bundle's is an error unless the caller
owns the registry (``replace=True``, e.g. the demo's). Each record's bundle directory is recorded
too, so engines started earlier find pairs registered later (:mod:`scd_store.service.discovery`).
Engines that may not write the registry (``register_bundles: false``, the least-privilege setting)
only check it: :func:`bind_registered` binds what an operator registered (``scd-store register``).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from pathlib import Path

from scd_store.codecs.scd.bundle import (
    BundleError,
    load_pair,
    load_space,
    pair_names,
    parse_manifest,
    read_space_manifest,
)
from scd_store.codecs.scd.codec import ScdCodec
from scd_store.codecs.scd.space import CodeSpace
from scd_store.service.bindings import Binding, Role, ServiceError, pair_id_for
from scd_store.store.records import NotRegistered, Pair, RegistryError, Space
from scd_store.store.registry import Registry

log = logging.getLogger("scd_store.service")


def space_record(bundle: Path, space: CodeSpace, chunk_size: int) -> Space:
    """The registry record of ``bundle``'s space (its manifest must name the producer)."""
    producer = read_space_manifest(bundle).get("producer") or ""
    if not producer:
        raise ServiceError(f"{bundle}: the space manifest names no producer model")
    return Space(space.space_id, producer, space.producer_fingerprint or "unknown", space.fingerprint,
                 codec_id=ScdCodec.codec_id, chunk_size=chunk_size,
                 raw_kv_bytes_per_token=space.layout.fp16_bytes_per_token)


def _pair_manifest(bundle: Path, consumer: str, space: CodeSpace) -> dict:
    path = bundle / "pairs" / f"{consumer}.json"
    manifest = parse_manifest(path.read_bytes(), "pair", str(path))
    if manifest.get("space_fingerprint") != space.fingerprint:
        raise BundleError(f"decoder of {consumer} was calibrated for another code space")
    return manifest


def _bundle_records(bundle: Path, load: Collection[str] | None, chunk_size: int
                    ) -> tuple[Path, CodeSpace, Space, list[tuple[Pair, Binding | None]]]:
    """The space record and every pair record of ``bundle``, with consumer bindings for ``load``."""
    if not (bundle / "space.json").is_file():
        raise ServiceError(f"{bundle} is not a calibration bundle (no space.json)")
    bundle = bundle.resolve()
    space = load_space(bundle)
    pairs = []
    for consumer in pair_names(bundle):
        pair_id = pair_id_for(space.space_id, consumer)
        binding = None
        if load is None or consumer in load:
            decoder = load_pair(bundle, consumer, space)
            fingerprints = decoder.consumer_fingerprint, decoder.fingerprint
            binding = Binding(consumer, Role.CONSUMER, space, ScdCodec(space, decoder), pair_id)
        else:
            manifest = _pair_manifest(bundle, consumer, space)
            fingerprints = manifest.get("consumer_fingerprint"), manifest.get("content_fingerprint") or ""
        pairs.append((Pair(pair_id, space.space_id, consumer, fingerprints[0] or "unknown", fingerprints[1],
                           space.fingerprint), binding))
    return bundle, space, space_record(bundle, space, chunk_size), pairs


def register_bundle(bundle: Path, registry: Registry, *, chunk_size: int, replace: bool = False,
                    load: Collection[str] | None = None
                    ) -> tuple[Space, CodeSpace, list[tuple[Pair, Binding | None]]]:
    """Register ``bundle``'s space and every pair and record where the bundle lies (writing only what is
    missing or, with ``replace``, different). Returns the space and its pairs, each with its consumer
    binding: decoders are loaded (their tensors checked against their manifests) for every pair, or only
    for the consumers in ``load`` (the others: None, manifest only)."""
    bundle, space, record, pairs = _bundle_records(bundle, load, chunk_size)
    locations = registry.locations()  # read once; each record's location is written after the record

    def locate(ident: str) -> None:
        if locations.get(ident) != str(bundle):
            registry.record_location(ident, str(bundle))

    if _registered(registry.space, record.space_id, record.fingerprint) != record:
        registry.register_space(record, replace=replace)
    locate(record.ident)
    for pair, _ in pairs:
        if _registered(registry.pair, pair.pair_id, pair.space_fingerprint) != pair:
            registry.register_pair(pair, replace=replace)
        locate(pair.ident)
    return record, space, pairs


def _registered(read, ident: str, fingerprint: str):  # noqa: ANN001, ANN202 - a record or None
    try:
        return read(ident, fingerprint)
    except NotRegistered:
        return None


def bind_registered(bundle: Path, registry: Registry, *, chunk_size: int,
                    models: Collection[str] | None = None) -> list[Binding]:
    """Bindings of ``bundle``'s producer and consumers whose records the registry holds exactly as the
    bundle has them (read-only: nothing is written). The others are left out with one warning each;
    discovery binds them once an operator registers them."""
    bundle, space, record, pairs = _bundle_records(bundle, models, chunk_size)
    bindings = []
    if _registered(registry.space, record.space_id, record.fingerprint) == record:
        bindings.append(Binding(record.producer_model_id, Role.PRODUCER, space, ScdCodec(space)))
    else:
        log.warning("scd-store: space %s of %s is not registered as this bundle has it; not producing into it "
                    "until `scd-store register %s`", record.ident, bundle, bundle)
    for pair, binding in pairs:
        if binding is None:
            continue
        if _registered(registry.pair, pair.pair_id, pair.space_fingerprint) == pair:
            bindings.append(binding)
        else:
            log.warning("scd-store: pair %s is not registered as %s has it; its model %r is bound once "
                        "`scd-store register` has run", pair.ident, bundle, pair.consumer_model_id)
    return bindings


def bind_bundle(bundle: Path, registry: Registry, *, chunk_size: int, replace: bool = False,
                models: Collection[str] | None = None, register: bool = True) -> list[Binding]:
    """The producer's binding, then each consumer's (only those named in ``models`` when it is given: a
    process keeps the decoders of what it serves), after registering ``bundle`` (``register``) or
    checking it is registered (:func:`bind_registered`)."""
    if not register:
        return bind_registered(bundle, registry, chunk_size=chunk_size, models=models)
    try:
        record, space, pairs = register_bundle(bundle, registry, chunk_size=chunk_size, replace=replace, load=models)
    except RegistryError:
        raise
    except Exception as exc:
        if "noperm" in str(exc).lower() or "no permissions" in str(exc).lower():
            raise ServiceError(f"this process may not write the registry ({exc}); register {bundle} with "
                               "`scd-store register` and start engines with register_bundles: false") from exc
        raise
    return [Binding(record.producer_model_id, Role.PRODUCER, space, ScdCodec(space)), *(b for _, b in pairs if b)]
