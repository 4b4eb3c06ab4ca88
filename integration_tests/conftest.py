"""Fixtures over the real prepared models (``scd-store models prepare`` runs first in ``make test``)."""

from __future__ import annotations

import pytest

from scd_store.adapters.transformers import LoadedModel, load_model
from scd_store.models import catalog


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
