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
