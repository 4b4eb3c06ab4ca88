"""Calibration bundles into a running service: register their space and pairs, bind their models.

Registration is idempotent; a registry record that differs from the bundle's is an error unless
the caller owns the registry (``replace=True``, e.g. the demo's).
"""

from __future__ import annotations

from pathlib import Path

from scd_store.codecs.scd.bundle import load_pair, load_space, pair_names, read_space_manifest
from scd_store.codecs.scd.codec import ScdCodec
from scd_store.service.bindings import Binding, ServiceError, pair_id_for
from scd_store.store.registry import Pair, Registry, Space


def bind_bundle(bundle: Path, registry: Registry, *, chunk_size: int, replace: bool = False) -> list[Binding]:
    """Register ``bundle``'s space and pairs in ``registry``; the producer's binding, then each consumer's."""
    if not (bundle / "space.json").is_file():
        raise ServiceError(f"{bundle} is not a calibration bundle (no space.json)")
    manifest = read_space_manifest(bundle)
    space = load_space(bundle)
    producer = manifest.get("producer") or ""
    if not producer:
        raise ServiceError(f"{bundle}: the space manifest names no producer model")
    record = Space(space.space_id, producer, space.producer_fingerprint or "unknown", space.fingerprint,
                   codec_id=ScdCodec.codec_id, chunk_size=chunk_size,
                   raw_kv_bytes_per_token=space.layout.fp16_bytes_per_token)
    registry.register_space(record, replace=replace)
    bindings = [Binding(producer, "producer", space, ScdCodec(space))]
    for consumer in pair_names(bundle):
        decoder = load_pair(bundle, consumer, space)
        pair_id = pair_id_for(space.space_id, consumer)
        registry.register_pair(Pair(pair_id, space.space_id, consumer, decoder.consumer_fingerprint or "unknown",
                                    decoder.fingerprint), replace=replace)
        bindings.append(Binding(consumer, "consumer", space, ScdCodec(space, decoder), pair_id))
    return bindings
