"""The bundle kept with scd-store fits the catalog models as `scd-store models prepare` makes them on this
machine (their weights' fingerprints), so `make demo` serves codes at the defaults without calibrating; and
its codes bring each fine-tune closer to its own next-token distribution than the base model's raw KV."""

from __future__ import annotations

import statistics

import pytest
import torch

from scd_store.adapters.transformers import load_model
from scd_store.adapters.transformers.capture import prefill_capture
from scd_store.adapters.transformers.inject import continue_with_prefix, mean_kl
from scd_store.bench.quality import load_scd_codec
from scd_store.models import catalog
from scd_store.models.catalog_bundle import CATALOG_BUNDLE, bundle_misfit
from scd_store.models.windows import eval_windows

pytestmark = pytest.mark.slow
PREFIX, SCORED, WINDOWS = 448, 32, 3


def test_the_kept_bundle_fits_the_prepared_models_and_its_codes_beat_raw_kv(producer):
    consumers = [load_model(name) for name in catalog.CONSUMERS]
    assert bundle_misfit(CATALOG_BUNDLE, producer.fingerprint, {c.name: c.fingerprint for c in consumers}) is None
    for consumer in consumers:
        codec = load_scd_codec(CATALOG_BUNDLE, producer, consumer)
        kl = {"scd": [], "raw": []}
        for window in eval_windows(consumer.tokenizer, catalog.consumer(consumer.name).corpus, WINDOWS,
                                   PREFIX + SCORED, seed=5):
            ids = torch.tensor([int(t) for t in window])
            prefix, scored = ids[:PREFIX], ids[PREFIX:]
            produced, _ = prefill_capture(producer.model, prefix)
            own, _ = prefill_capture(consumer.model, prefix)
            oracle = continue_with_prefix(consumer.model, own, scored)
            decoded = codec.decode(codec.encode(produced), dtype=torch.float32, expect_tokens=PREFIX)
            kl["scd"].append(mean_kl(continue_with_prefix(consumer.model, decoded, scored), oracle))
            kl["raw"].append(mean_kl(continue_with_prefix(consumer.model, produced, scored), oracle))
        assert statistics.mean(kl["scd"]) < statistics.mean(kl["raw"]), (consumer.name, kl)
