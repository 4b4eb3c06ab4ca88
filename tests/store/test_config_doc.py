from dataclasses import fields
from pathlib import Path

from scd_store.store.config import StoreConfig, TierConfig
from scd_store.store.config_doc import STORE_DOCS, TIER_DOCS, reference


def test_every_config_field_is_documented():
    assert {f.name for f in fields(StoreConfig)} == set(STORE_DOCS)
    assert {f.name for f in fields(TierConfig)} == set(TIER_DOCS)


def test_the_committed_reference_is_current():
    page = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    assert page.read_text() == reference(), "regenerate: python -m scd_store.store.config_doc > docs/configuration.md"
