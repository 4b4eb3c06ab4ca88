"""Calibration bundles into a running service: register their space and pairs, bind their models.

Registration is idempotent; a registry record that differs from the bundle's is an error unless
the caller owns the registry (``replace=True``, e.g. the demo's). Each record's bundle directory is
recorded too, so engines started earlier find pairs registered later (:mod:`scd_store.service.discovery`).
"""

from __future__ import annotations

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
from scd_store.service.bindings import Binding, ServiceError, pair_id_for
from scd_store.store.registry import Pair, Registry, Space


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


def register_bundle(bundle: Path, registry: Registry, *, chunk_size: int, replace: bool = False,
                    load: Collection[str] | None = None
                    ) -> tuple[Space, CodeSpace, list[tuple[Pair, Binding | None]]]:
    """Register ``bundle``'s space and every pair and record where the bundle lies. Returns the space and
    its pairs, each with its consumer binding: decoders are loaded (their tensors checked against their
    manifests) for every pair, or only for the consumers in ``load`` (the others: None, manifest only)."""
    if not (bundle / "space.json").is_file():
        raise ServiceError(f"{bundle} is not a calibration bundle (no space.json)")
    bundle = bundle.resolve()
    space = load_space(bundle)
    record = registry.register_space(space_record(bundle, space, chunk_size), replace=replace)
    registry.record_location(space.space_id, str(bundle))
    pairs = []
    for consumer in pair_names(bundle):
        pair_id = pair_id_for(space.space_id, consumer)
        binding = None
        if load is None or consumer in load:
            decoder = load_pair(bundle, consumer, space)
            fingerprints = decoder.consumer_fingerprint, decoder.fingerprint
            binding = Binding(consumer, "consumer", space, ScdCodec(space, decoder), pair_id)
        else:
            manifest = _pair_manifest(bundle, consumer, space)
            fingerprints = manifest.get("consumer_fingerprint"), manifest.get("content_fingerprint") or ""
        pair = registry.register_pair(Pair(pair_id, space.space_id, consumer, fingerprints[0] or "unknown",
                                           fingerprints[1]), replace=replace)
        registry.record_location(pair_id, str(bundle))
        pairs.append((pair, binding))
    return record, space, pairs


def bind_bundle(bundle: Path, registry: Registry, *, chunk_size: int, replace: bool = False,
                models: Collection[str] | None = None) -> list[Binding]:
    """Register ``bundle``'s space and pairs in ``registry``; the producer's binding, then each consumer's
    (only those named in ``models`` when it is given: a process keeps the decoders of what it serves)."""
    record, space, pairs = register_bundle(bundle, registry, chunk_size=chunk_size, replace=replace, load=models)
    return [Binding(record.producer_model_id, "producer", space, ScdCodec(space)), *(b for _, b in pairs if b)]
