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

from safetensors.torch import load_file, save_file

from scd_store.codecs.scd.decoder import PairDecoder
from scd_store.codecs.scd.hidden import HiddenCode
from scd_store.codecs.scd.layout import KVLayout
from scd_store.codecs.scd.patch import PatchAligner
from scd_store.codecs.scd.space import CodeSpace

FORMAT = "scd-bundle"
FORMAT_VERSION = 1


class BundleError(ValueError):
    """A bundle is missing, of another format version, corrupt, or for other models."""


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def parse_manifest(text: str | bytes, kind: str, where: str = "manifest") -> dict:
    """A manifest's JSON, checked: an object of this format, ``kind`` and version. Raises :class:`BundleError`."""
    try:
        manifest = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
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


def _read_manifest(path: Path, kind: str) -> dict:
    if not path.exists():
        raise BundleError(f"no {kind} manifest at {path}")
    return parse_manifest(path.read_bytes(), kind, str(path))


def read_space_manifest(bundle: Path) -> dict:
    """The space manifest of ``bundle`` (format and version checked)."""
    return _read_manifest(bundle / "space.json", "space")


def save_space(bundle: Path, space: CodeSpace, extra: dict | None = None) -> None:
    bundle.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in space.tensors().items()}, str(bundle / "space.safetensors"))
    _write_json(bundle / "space.json", {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": "space",
        "space_id": space.space_id, "layout": space.layout.to_dict(), "sink_tokens": space.sink_tokens,
        "patch_layers": list(space.patch_layers),
        "producer_fingerprint": space.producer_fingerprint, "content_fingerprint": space.fingerprint,
        "bits_per_token": space.bits_per_token, "payload_ratio": round(space.payload_ratio(), 5),
        **(extra or {}),
    })


def load_space(bundle: Path, producer_fingerprint: str | None = None) -> CodeSpace:
    """Load a code space; ``producer_fingerprint``, when given, must match the calibrated producer's."""
    manifest = _read_manifest(bundle / "space.json", "space")
    if producer_fingerprint is not None and manifest["producer_fingerprint"] != producer_fingerprint:
        raise BundleError(f"code space {manifest['space_id']} was calibrated for producer "
                          f"{manifest['producer_fingerprint']}, not {producer_fingerprint}")
    try:
        tensors = load_file(str(bundle / "space.safetensors"))
        hidden = None
        if manifest.get("patch_layers"):
            hidden = HiddenCode(tuple(manifest["patch_layers"]), tensors["hidden_mean"], tensors["hidden_basis"],
                                tensors["hidden_sigma"], tensors["hidden_bits"])
        space = CodeSpace(manifest["space_id"], KVLayout.from_dict(manifest["layout"]), tensors["mean"],
                          tensors["basis"], tensors["sigma"], tensors["bits"], int(manifest["sink_tokens"]),
                          manifest["producer_fingerprint"], hidden)
    except (KeyError, OSError, TypeError, ValueError) as exc:
        raise BundleError(f"{bundle}: cannot load the code space: {exc}") from None
    if space.fingerprint != manifest["content_fingerprint"]:
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
    manifest = _read_manifest(bundle / "pairs" / f"{consumer}.json", "pair")
    if manifest["space_fingerprint"] != space.fingerprint:
        raise BundleError(f"decoder of {consumer} was calibrated for another code space")
    if consumer_fingerprint is not None and manifest["consumer_fingerprint"] != consumer_fingerprint:
        raise BundleError(f"decoder of {consumer} was calibrated for consumer weights "
                          f"{manifest['consumer_fingerprint']}, not {consumer_fingerprint}")
    try:
        tensors = load_file(str(bundle / "pairs" / f"{consumer}.safetensors"))
        patches = [PatchAligner(int(p["layer"]), p["source"], **{
            name: tensors[f"patch.{p['layer']}.{name}"]
            for name in ("w_in", "b_in", "w_out", "k_proj", "v_proj", "k_bias", "v_bias")})
            for p in manifest.get("patches", [])]
        decoder = PairDecoder(consumer, manifest["space_fingerprint"], tensors["weight"], tensors["bias"],
                              manifest["consumer_fingerprint"], patches)
    except (KeyError, OSError, TypeError, ValueError) as exc:
        raise BundleError(f"{bundle}: cannot load the decoder of {consumer}: {exc}") from None
    if decoder.fingerprint != manifest["content_fingerprint"]:
        raise BundleError(f"{bundle}: decoder of {consumer} does not match its manifest's content fingerprint")
    return decoder
