"""Calibration bundles on disk: safetensors tensors + a JSON manifest per space and per pair.

Layout of a bundle directory::

    space.json, space.safetensors                 the code space (producer side)
    pairs/<consumer>.json, pairs/<consumer>.safetensors   one decoder per registered consumer

Manifests carry the format version, the model fingerprints the bundle was calibrated against,
and a content fingerprint of the tensors; loading checks all three.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from scd_store.codecs.scd.decoder import PairDecoder
from scd_store.codecs.scd.ecsq import EcsqQuantiser
from scd_store.codecs.scd.hidden import HiddenCode
from scd_store.codecs.scd.layout import KVLayout
from scd_store.codecs.scd.patch import PatchAligner
from scd_store.codecs.scd.range_coding import CodeTables
from scd_store.codecs.scd.space import CodeSpace
from scd_store.codecs.tensor_pack import json_int, strict_json
from scd_store.errors import ScdStoreError

FORMAT = "scd-bundle"
FORMAT_VERSION = 1


class BundleError(ScdStoreError, ValueError):
    """A bundle is missing, of another format version, corrupt, or for other models."""


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n")
    os.replace(tmp, path)


def parse_manifest(text: str | bytes, kind: str, where: str = "manifest") -> dict:
    """A manifest's JSON, checked: an object of this format, ``kind`` and version. Raises :class:`BundleError`
    (also on ``NaN`` / ``Infinity`` / overflowing numbers: :func:`~scd_store.codecs.tensor_pack.strict_json`)."""
    try:
        manifest = strict_json(text)
    except (ValueError, UnicodeDecodeError, RecursionError, OverflowError) as exc:
        raise BundleError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("kind") != kind:
        raise BundleError(f"{where}: not an scd {kind} manifest")
    version = manifest.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise BundleError(f"{where}: format_version must be an integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise BundleError(f"{where}: bundle format {version} is newer than this scd-store understands "
                          f"({FORMAT_VERSION}); upgrade scd-store")
    if version != FORMAT_VERSION:
        raise BundleError(f"{where}: unsupported bundle format version {version}")
    return manifest


def _text(manifest: dict, key: str, where: str) -> str:
    value = manifest.get(key)
    if not isinstance(value, str):
        raise BundleError(f"{where}: {key} must be a string, got {value!r:.40}")
    return value


def _layers(values: object, where: str) -> list[int]:
    """A manifest's list of layer indices (integers, no coercion)."""
    if not isinstance(values, list):
        raise BundleError(f"{where}: patch layers must be a list, got {values!r:.40}")
    return [json_int(v, f"{where}: a patch layer", BundleError) for v in values]


def _read_manifest(path: Path, kind: str) -> dict:
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise BundleError(f"no {kind} manifest at {path}") from None
    except OSError as exc:
        raise BundleError(f"cannot read the {kind} manifest at {path}: {exc}") from None
    return parse_manifest(text, kind, str(path))


def read_space_manifest(bundle: Path) -> dict:
    """The space manifest of ``bundle`` (format and version checked)."""
    return _read_manifest(bundle / "space.json", "space")


def save_space(bundle: Path, space: CodeSpace, extra: dict | None = None) -> None:
    bundle.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in space.tensors().items()}, str(bundle / "space.safetensors"))
    _write_json(bundle / "space.json", {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": "space",
        "space_id": space.space_id, "layout": space.layout.to_dict(), "sink_tokens": space.sink_tokens,
        "patch_layers": list(space.patch_layers), "quantiser": "ecsq" if space.ecsq is not None else "fixed",
        "packing": space.packing, "producer_fingerprint": space.producer_fingerprint,
        "content_fingerprint": space.fingerprint,
        "bits_per_token": space.bits_per_token, "payload_ratio": round(space.payload_ratio(), 5),
        **(extra or {}),
    })


def load_space(bundle: Path, producer_fingerprint: str | None = None) -> CodeSpace:
    """Load a code space; ``producer_fingerprint``, when given, must match the calibrated producer's."""
    where = str(bundle / "space.json")
    manifest = _read_manifest(bundle / "space.json", "space")
    space_id, producer, content = (_text(manifest, key, where)
                                   for key in ("space_id", "producer_fingerprint", "content_fingerprint"))
    if producer_fingerprint is not None and producer != producer_fingerprint:
        raise BundleError(f"code space {space_id} was calibrated for producer {producer}, not {producer_fingerprint}")
    sink_tokens = json_int(manifest.get("sink_tokens"), f"{where}: sink_tokens", BundleError)
    patch_layers = _layers(manifest.get("patch_layers", []), where)
    layout = manifest.get("layout")
    if not isinstance(layout, dict):
        raise BundleError(f"{where}: layout must be an object")
    packing = manifest.get("packing", "planes-2")  # what encode writes; manifests before ECSQ had no choice
    if not isinstance(packing, str):
        raise BundleError(f"{where}: packing must be a string, got {packing!r:.40}")
    try:
        tensors = load_file(str(bundle / "space.safetensors"))
        hidden = None
        if patch_layers:
            hidden = HiddenCode(tuple(patch_layers), tensors["hidden_mean"], tensors["hidden_basis"],
                                tensors["hidden_sigma"], tensors["hidden_bits"])
        ecsq = None
        if any(name.startswith("ecsq_") for name in tensors):
            ecsq = EcsqQuantiser(tensors["ecsq_steps"], tensors["ecsq_widths"], tensors["ecsq_probabilities"])
        tables = CodeTables(tensors["bits"].flatten(), tensors["code_tables"]) if "code_tables" in tensors else None
        space = CodeSpace(space_id, KVLayout.from_dict(layout), tensors["mean"], tensors["basis"], tensors["sigma"],
                          tensors["bits"], sink_tokens, producer, hidden, ecsq, packing, tables)
    except (KeyError, OSError, TypeError, ValueError, OverflowError, SafetensorError) as exc:
        raise BundleError(f"{bundle}: cannot load the code space: {exc}") from None
    if space.fingerprint != content:
        raise BundleError(f"{bundle}: code space tensors do not match their manifest's content fingerprint")
    return space


def save_pair(bundle: Path, decoder: PairDecoder, extra: dict | None = None) -> None:
    pairs = bundle / "pairs"
    pairs.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in decoder.tensors().items()},
              str(pairs / f"{decoder.consumer}.safetensors"))
    _write_json(pairs / f"{decoder.consumer}.json", {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": "pair", "consumer": decoder.consumer,
        "patches": [{"layer": p.layer, "source": p.source} for p in decoder.patches],
        "consumer_fingerprint": decoder.consumer_fingerprint, "space_fingerprint": decoder.space_fingerprint,
        "content_fingerprint": decoder.fingerprint, **(extra or {}),
    })


def pair_names(bundle: Path) -> list[str]:
    return sorted(p.stem for p in (bundle / "pairs").glob("*.json"))


def load_pair(bundle: Path, consumer: str, space: CodeSpace, consumer_fingerprint: str | None = None) -> PairDecoder:
    """Load one consumer's decoder; it must belong to ``space`` (and the given consumer weights)."""
    path = bundle / "pairs" / f"{consumer}.json"
    manifest = _read_manifest(path, "pair")
    found_space, found_consumer, content = (_text(manifest, key, str(path))
                                            for key in ("space_fingerprint", "consumer_fingerprint",
                                                        "content_fingerprint"))
    if found_space != space.fingerprint:
        raise BundleError(f"decoder of {consumer} was calibrated for another code space")
    if consumer_fingerprint is not None and found_consumer != consumer_fingerprint:
        raise BundleError(f"decoder of {consumer} was calibrated for consumer weights "
                          f"{found_consumer}, not {consumer_fingerprint}")
    patches = manifest.get("patches", [])
    if not isinstance(patches, list) or not all(isinstance(p, dict) for p in patches):
        raise BundleError(f"{path}: patches must be a list of objects")
    layers = _layers([p.get("layer") for p in patches], str(path))
    try:
        tensors = load_file(str(bundle / "pairs" / f"{consumer}.safetensors"))
        aligners = [PatchAligner(layer, p.get("source"), **{
            name: tensors[f"patch.{layer}.{name}"]
            for name in ("w_in", "b_in", "w_out", "k_proj", "v_proj", "k_bias", "v_bias")})
            for layer, p in zip(layers, patches, strict=True)]
        decoder = PairDecoder(consumer, found_space, tensors["weight"], tensors["bias"], found_consumer, aligners)
    except (KeyError, OSError, TypeError, ValueError, OverflowError, SafetensorError) as exc:
        raise BundleError(f"{bundle}: cannot load the decoder of {consumer}: {exc}") from None
    if decoder.fingerprint != content:
        raise BundleError(f"{bundle}: decoder of {consumer} does not match its manifest's content fingerprint")
    return decoder
