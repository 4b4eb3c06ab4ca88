"""Fixtures over the real prepared models (``scd-store models prepare`` runs first in ``make test``)."""

from __future__ import annotations

import os

import pytest

from scd_store.adapters.transformers import LoadedModel, load_model
from scd_store.models import catalog


@pytest.fixture(scope="session", autouse=True)
def signing_keys(tmp_path_factory):
    """Every process these tests start signs and verifies with one private key file (``SCD_STORE_SIGNING_KEYS``,
    inherited by engine processes): a tier shared between processes requires signed blobs. Tests of the roles
    (a reader holding only the public key, the host keyring) set their own."""
    from scd_store.store.signing import ALL_SPACES, SigningKey, write_key_file

    root = tmp_path_factory.mktemp("signing-keys")
    key = SigningKey.generate("integration", spaces=(ALL_SPACES,))
    write_key_file(root / "private.keys", [key.line()], private=True)
    assert key.public is not None
    write_key_file(root / "public.keys", [key.public.line()], private=False)
    before = os.environ.get("SCD_STORE_SIGNING_KEYS")
    os.environ["SCD_STORE_SIGNING_KEYS"] = str(root / "private.keys")
    yield {"private": root / "private.keys", "public": root / "public.keys"}
    if before is None:
        os.environ.pop("SCD_STORE_SIGNING_KEYS", None)
    else:
        os.environ["SCD_STORE_SIGNING_KEYS"] = before


@pytest.fixture(scope="session")
def producer() -> LoadedModel:
    return load_model(catalog.PRODUCER)


@pytest.fixture(scope="session")
def shakespeare() -> LoadedModel:
    return load_model("smollm2-135m-shakespeare")


@pytest.fixture(scope="session")
def vllm_material(tmp_path_factory, producer, shakespeare) -> dict:
    """For the vLLM server tests: two PEFT LoRA adapters of the producer (one with a pair, one without) and a
    quick bundle with pairs for the Shakespeare fine-tune and the first adapter."""
    from integration_tests.vllm_harness import make_lora_adapter, quick_bundle

    root = tmp_path_factory.mktemp("vllm-material")
    lora = make_lora_adapter(producer, root / "lora-a", "smol-lora-a", seed=1)
    make_lora_adapter(producer, root / "lora-b", "smol-lora-unregistered", seed=2)
    bundle = quick_bundle(producer, [shakespeare, lora], root / "bundle", "vllm-test")
    return {"root": root, "bundle": bundle, "lora": lora, "lora_dirs": {"smol-lora-a": root / "lora-a",
                                                                          "smol-lora-unregistered": root / "lora-b"}}


@pytest.fixture(scope="session")
def tiny_bundle(producer, shakespeare, tmp_path_factory):
    """A tiny bundle (a few distillation steps) for both catalog consumers: structure, not quality."""
    from scd_store.adapters.transformers import load_model
    from scd_store.adapters.transformers.calibration import CalibrationConfig, distil_decoder, fit_space
    from scd_store.codecs.scd.bundle import save_pair, save_space

    python = load_model("smollm2-135m-python")
    config = CalibrationConfig(budget=0.25, basis_windows=2, prefix_tokens=64, continuation_tokens=8,
                               distill_windows=2, distill_steps=2)
    bundle = tmp_path_factory.mktemp("demo") / "bundle"
    space = fit_space(producer, ["shakespeare", "python"], config, "demo-test", progress=False)
    save_space(bundle, space, extra={"producer": catalog.PRODUCER})
    for consumer, corpus in ((shakespeare, "shakespeare"), (python, "python")):
        decoder, _ = distil_decoder(producer, consumer, space, corpus, config, progress=False)
        save_pair(bundle, decoder)
    return bundle
