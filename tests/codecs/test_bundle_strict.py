"""Hostile numbers and fields of the wrong type in bundle manifests are :class:`BundleError`, never an
OverflowError / KeyError / TypeError out of ``load_space`` / ``load_pair``, and never coerced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scd_store.codecs.scd.bundle import BundleError, load_pair, load_space, parse_manifest
from scd_store.codecs.scd.layout import KVLayout
from scd_store.codecs.scd.rope import RopeSpec
from tests.bundles import write_tiny_bundle
from tests.codecs.hostile import HOSTILE, hostile_variants, with_json_field

# where a float belongs, a finite number (an integer or a float) is fine: the rest is hostile
NOT_NUMBERS = tuple(t for t in HOSTILE if t not in ("2.5", "1" * 5000)) + ("1" + "0" * 400,)
ROPE = {"inv_freq": [[1.0, 0.1, 0.01, 0.001]], "scaling": [1.0], "layer_kinds": [0, 0], "max_position": 0}


@pytest.fixture
def bundle(tmp_path) -> Path:
    write_tiny_bundle(tmp_path / "b")
    return tmp_path / "b"


def _rewrite(path: Path, field: tuple, token: str, base: dict | None = None) -> None:
    text, _ = with_json_field(base if base is not None else json.loads(path.read_text()), field, token)
    path.write_text(text)


def _value(manifest: dict, field: tuple):
    for step in field:
        manifest = manifest[step]
    return manifest


SPACE_INTS = [("sink_tokens",), ("layout", "num_layers"), ("layout", "kv_heads"), ("layout", "head_dim"),
              ("format_version",)]


@pytest.mark.parametrize("field", SPACE_INTS, ids=lambda f: ".".join(f))
def test_integer_fields_of_a_space_manifest_refuse_hostile_numbers(bundle, field):
    path = bundle / "space.json"
    manifest = json.loads(path.read_text())
    value = _value(manifest, field)
    _rewrite(path, field, str(value), manifest)
    assert load_space(bundle).sink_tokens == 2  # the rewrite itself is sound
    for token in hostile_variants(value):
        _rewrite(path, field, token, manifest)
        with pytest.raises(BundleError, match="not valid JSON|must be"):
            load_space(bundle)


def test_the_rope_base_refuses_what_is_no_finite_number(bundle):
    path = bundle / "space.json"
    manifest = json.loads(path.read_text())
    for token in NOT_NUMBERS:
        _rewrite(path, ("layout", "rope_theta"), token, manifest)
        with pytest.raises(BundleError, match="not valid JSON|must be"):
            load_space(bundle)


def test_patch_layers_refuse_hostile_numbers(bundle):
    path = bundle / "space.json"
    manifest = {**json.loads(path.read_text()), "patch_layers": [0]}
    for token in hostile_variants(0):
        _rewrite(path, ("patch_layers", 0), token, manifest)
        with pytest.raises(BundleError, match="not valid JSON|must be"):
            load_space(bundle)
    for token in ('"0"', "{}", "7", "null"):
        _rewrite(path, ("patch_layers",), token, manifest)
        with pytest.raises(BundleError, match="must be a list"):
            load_space(bundle)


@pytest.mark.parametrize("field", [("inv_freq", 0, 0), ("scaling", 0), ("layer_kinds", 0), ("max_position",)],
                         ids=lambda f: ".".join(map(str, f)))
def test_a_rope_spec_in_the_layout_refuses_hostile_numbers(bundle, field):
    path = bundle / "space.json"
    manifest = json.loads(path.read_text())
    manifest["layout"]["rope"] = ROPE
    value = _value(ROPE, field)
    tokens = hostile_variants(value) if isinstance(value, int) else NOT_NUMBERS
    for token in tokens:
        _rewrite(path, ("layout", "rope", *field), token, manifest)
        with pytest.raises(BundleError, match="not valid JSON|must be"):
            load_space(bundle)


def test_rope_and_layout_dicts_round_trip_and_refuse_coercion():
    spec = RopeSpec(((1.0, 0.5),), (1.0,), (0, 0), 64)
    layout = KVLayout(2, 1, 4, 10000.0, spec)
    assert KVLayout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout
    assert repr(KVLayout.from_dict({"num_layers": 2, "kv_heads": 1, "head_dim": 4, "rope_theta": 10000})) == \
        repr(KVLayout(2, 1, 4, 10000.0))  # an integer base reads as the float it was written from: same fingerprint
    for bad in ({**spec.to_dict(), "layer_kinds": [0.0, 0]}, {**spec.to_dict(), "inv_freq": [1.0, 0.5]},
                {**spec.to_dict(), "scaling": "1"}, {**spec.to_dict(), "max_position": True}, [1]):
        with pytest.raises(ValueError):
            RopeSpec.from_dict(bad)
    with pytest.raises(ValueError, match="must be an integer"):
        KVLayout.from_dict({"num_layers": 2.0, "kv_heads": 1, "head_dim": 4, "rope_theta": 1e4})


@pytest.mark.parametrize("field", ["producer_fingerprint", "content_fingerprint", "space_id"])
def test_missing_or_mistyped_space_fields_are_bundle_errors(bundle, field):
    path = bundle / "space.json"
    manifest = json.loads(path.read_text())
    for token in ("7", "null", "[]"):
        _rewrite(path, (field,), token, manifest)
        with pytest.raises(BundleError, match="must be a string"):
            load_space(bundle, producer_fingerprint="producer-fp")
    path.write_text(json.dumps({k: v for k, v in manifest.items() if k != field}))
    with pytest.raises(BundleError, match="must be a string"):
        load_space(bundle)
    with pytest.raises(BundleError):
        load_space(bundle.parent / "nowhere")


def test_a_pair_manifest_refuses_hostile_patch_layers_and_mistyped_fields(bundle):
    space = load_space(bundle)
    path = bundle / "pairs" / "consumer-a.json"
    manifest = json.loads(path.read_text())
    assert load_pair(bundle, "consumer-a", space).consumer == "consumer-a"
    patched = {**manifest, "patches": [{"layer": 0, "source": "kv"}]}
    for token in hostile_variants(0):
        _rewrite(path, ("patches", 0, "layer"), token, patched)
        with pytest.raises(BundleError, match="not valid JSON|must be"):
            load_pair(bundle, "consumer-a", space)
    for token in ('"x"', "{}", "[1]", "[[0]]"):
        _rewrite(path, ("patches",), token, manifest)
        with pytest.raises(BundleError, match="list of objects"):
            load_pair(bundle, "consumer-a", space)
    for field in ("space_fingerprint", "consumer_fingerprint", "content_fingerprint"):
        path.write_text(json.dumps({k: v for k, v in manifest.items() if k != field}))
        with pytest.raises(BundleError, match="must be a string"):
            load_pair(bundle, "consumer-a", space)


@pytest.mark.parametrize("token", HOSTILE)
def test_parse_manifest_refuses_hostile_format_versions(token):
    text, _ = with_json_field({"format": "scd-bundle", "kind": "space", "format_version": 1}, ("format_version",),
                              token)
    with pytest.raises(BundleError):
        parse_manifest(text, "space")
    with pytest.raises(BundleError, match="not valid JSON"):
        parse_manifest('{"format": "scd-bundle", "kind": "space", "format_version": 1, "x": [1e400]}', "space")


@pytest.mark.parametrize("garbage", [b"", b"garbage", b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":1e400}     "])
def test_corrupt_tensor_files_and_unreadable_manifests_are_bundle_errors(bundle, garbage):
    space = load_space(bundle)
    (bundle / "pairs" / "consumer-a.safetensors").write_bytes(garbage)
    with pytest.raises(BundleError, match="cannot load the decoder"):
        load_pair(bundle, "consumer-a", space)
    (bundle / "space.safetensors").write_bytes(garbage)
    with pytest.raises(BundleError, match="cannot load the code space"):
        load_space(bundle)
    (bundle / "pairs" / "consumer-b.json").mkdir()  # a manifest path that is no file
    with pytest.raises(BundleError, match="cannot read the pair manifest"):
        load_pair(bundle, "consumer-b", space)
