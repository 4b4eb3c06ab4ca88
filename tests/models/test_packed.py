"""The packed safetensors files the adapters and the kept bundle are stored as: lossless, byte for byte."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import save

from scd_store.models import catalog, lora
from scd_store.models import packed as packing
from scd_store.models.catalog_bundle import KEPT_BUNDLE, bundle_misfit, catalog_bundle
from scd_store.models.fingerprint import file_fingerprint
from tests.conftest import tiny_llama

# SHA-256 of the safetensors files as they were committed before packing (adapters made by `scd-store models
# train`, the bundle by `scd-store calibrate`): the packed files must give back exactly these bytes.
COMMITTED = {
    "adapters/smollm2-135m-python.safetensors":
        "0873c22372b5780b0fc14e72bd25dca143278224d4f594aab70f75f46f2330a9",
    "adapters/smollm2-135m-shakespeare.safetensors":
        "6c7cdc3ea19861ee520680be16cf9a516ba4d37574bc95b1242246fd6d597f02",
    "bundles/catalog/space.safetensors":
        "b25c3d5087e2ab853807f600bd29c2ce998d23173837b898bdd243cd891f55b3",
    "bundles/catalog/pairs/smollm2-135m-python.safetensors":
        "77ef9d15726e1a133099e6b491a90b83408e3aa6c8884c5e982218130b6cb7f5",
    "bundles/catalog/pairs/smollm2-135m-shakespeare.safetensors":
        "cc4aecabb263230cf5d7d0c94f9f104ac9f05ce4b2df6315abc2cfcf51d8b9cc",
}
# the weights the kept bundle was calibrated on (the prepared models' `weights_fingerprint`)
PRODUCER_FP = "cd83125d46cdb764e6440451a70fffb1"
CONSUMER_FPS = {"smollm2-135m-python": "9b8c73416fb941e35304ed8ed93c1a3a",
                "smollm2-135m-shakespeare": "42d820d5e55e6c6074d04f3879b78b9d"}
MODELS = catalog.ADAPTERS_DIR.parent


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    floats = torch.randn(7, 13, generator=gen)
    return {
        "f32": floats, "f64": floats.double(), "bf16": floats.bfloat16(), "f16": floats.half(),
        "i8": torch.randint(-127, 128, (5, 9), generator=gen, dtype=torch.int8),
        "u8": torch.randint(0, 256, (11,), generator=gen, dtype=torch.uint8),
        "i64": torch.randint(0, 9, (3, 4), generator=gen), "i32": torch.arange(6, dtype=torch.int32),
        "bool": torch.rand(10, generator=gen) > 0.5, "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4),
    }


def test_pack_round_trips_every_dtype_byte_for_byte():
    data = save(_tensors(), metadata={"note": "test"})
    blob = packing.pack(data)
    assert blob.startswith(packing.MAGIC) and packing.unpack(blob) == data


def test_packed_and_plain_files_load_the_same_tensors(tmp_path):
    tensors = _tensors()
    packing.save_tensors(tensors, tmp_path / "a.safetensors", {"k": "v"})
    packing.save_tensors(tensors, tmp_path / "a.safetensors.packed", {"k": "v"})
    plain, packed = tmp_path / "a.safetensors", tmp_path / "a.safetensors.packed"
    assert packing.read_bytes(packed) == plain.read_bytes()
    assert packing.content_fingerprint(packed) == packing.content_fingerprint(plain) == file_fingerprint(plain)
    digest = hashlib.sha256(plain.read_bytes()).hexdigest()
    assert packing.original_sha256(packed) == packing.original_sha256(plain) == digest
    loaded = packing.load_tensors(packed)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)


@pytest.mark.parametrize("damage", [
    lambda blob: blob[:-5],                                    # truncated
    lambda blob: blob[:60] + bytes([blob[60] ^ 1]) + blob[61:],  # a flipped bit in the stream
    lambda blob: blob[:12] + bytes([blob[12] ^ 1]) + blob[13:],  # a wrong recorded digest
    lambda blob: b"NOTPACKD" + blob[8:],                       # not ours
    lambda blob: b"",
])
def test_a_damaged_packed_file_is_refused(damage):
    blob = packing.pack(save(_tensors()))
    with pytest.raises(packing.PackError):
        packing.unpack(damage(blob))


def test_only_safetensors_files_are_packed():
    with pytest.raises(packing.PackError):
        packing.pack(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")


def test_a_packed_adapter_merges_exactly_as_the_plain_one(tmp_path):
    model = tiny_llama(seed=0)
    lora.attach(model, rank=0, alpha=1.0, seed=0)
    full = lora.unfreeze_full(model, ("k_proj", "up_proj", "norm"))
    with torch.no_grad():
        for param, initial in full.values():
            param.copy_(initial + torch.randn_like(param) * 0.05)
    for name in ("a.safetensors", "a.safetensors.packed"):
        lora.save_adapter(tmp_path / name, {}, {"note": "t"}, full, delta_format="int8")
    plain, packed = tiny_llama(seed=0), tiny_llama(seed=0)
    assert lora.merge_adapter(plain, tmp_path / "a.safetensors", 1.0) == \
        lora.merge_adapter(packed, tmp_path / "a.safetensors.packed", 1.0) == len(full)
    for (name, a), (_, b) in zip(plain.state_dict().items(), packed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("relative", sorted(COMMITTED))
def test_the_committed_material_unpacks_to_the_files_it_was(relative):
    packed = MODELS / f"{relative}.packed"
    assert packing.original_sha256(packed) == COMMITTED[relative]
    assert hashlib.sha256(packing.read_bytes(packed)).hexdigest() == COMMITTED[relative]


def test_the_catalog_adapters_are_the_packed_files():
    assert {spec.adapter_path.relative_to(MODELS).as_posix() for spec in catalog.CONSUMERS.values()} == \
        {f"{name}.packed" for name in COMMITTED if name.startswith("adapters/")}


def test_the_kept_bundle_unpacks_once_into_a_bundle_that_fits_the_catalog_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("SCD_STORE_HOME", str(tmp_path))
    bundle = catalog_bundle()
    assert bundle.parent == tmp_path / "bundles"
    for relative, digest in COMMITTED.items():
        if relative.startswith("bundles/catalog/"):
            assert hashlib.sha256((bundle / relative.removeprefix("bundles/catalog/")).read_bytes()).hexdigest() \
                == digest
    for manifest in KEPT_BUNDLE.rglob("*.json"):
        assert (bundle / manifest.relative_to(KEPT_BUNDLE)).read_bytes() == manifest.read_bytes()
    assert bundle_misfit(bundle, PRODUCER_FP, CONSUMER_FPS) is None
    assert "calibrated for consumer weights" in bundle_misfit(bundle, PRODUCER_FP, {"smollm2-135m-python": "x"})

    space = bundle / "space.safetensors"
    stamp = space.stat().st_mtime_ns
    assert catalog_bundle() == bundle and space.stat().st_mtime_ns == stamp  # reused, not unpacked again
    space.write_bytes(b"damaged")
    assert catalog_bundle() == bundle and bundle_misfit(bundle, PRODUCER_FP, CONSUMER_FPS) is None  # repaired
