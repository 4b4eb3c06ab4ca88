"""The real pair through LMCache: the consumer fed by the plugin scores exactly as scd-store's own decode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from integration_tests.lmcache_engines import make_engine, plugin_config, scd_backend, write_store_yaml
from scd_store.adapters.transformers import continue_with_prefix, prefill_capture
from scd_store.adapters.transformers.calibration import CalibrationConfig, distil_decoder, fit_space
from scd_store.bench.quality import load_scd_codec
from scd_store.codecs.scd.bundle import save_pair, save_space
from scd_store.models import catalog
from scd_store.models.windows import eval_windows

from lmcache.v1.cache_engine import LMCacheEngineBuilder  # isort: skip

pytestmark = pytest.mark.slow
PREFIX, CONTINUATION, CHUNK = 128, 32, 64


def nll(model, state, continuation: torch.Tensor) -> float:
    logits = continue_with_prefix(model, state, continuation)
    return float(F.cross_entropy(logits[:-1].float(), continuation[1:]))


def test_consumer_through_lmcache_matches_scd_quality(producer, shakespeare, tmp_path):
    config = CalibrationConfig(budget=0.25, basis_windows=3, prefix_tokens=64, continuation_tokens=8,
                               distill_windows=4, distill_steps=4)
    bundle = tmp_path / "bundle"
    space = fit_space(producer, ["shakespeare"], config, "lmcache-real", progress=False)
    decoder, _ = distil_decoder(producer, shakespeare, space, "shakespeare", config, progress=False)
    save_space(bundle, space, extra={"producer": catalog.PRODUCER})
    save_pair(bundle, decoder)
    codec = load_scd_codec(bundle, producer, shakespeare)
    lm_config = plugin_config([bundle], write_store_yaml(tmp_path / "store.yaml", tmp_path / "disk"), CHUNK)
    layers, heads, dim = 30, 3, 64
    instances = []
    try:
        for window in eval_windows(shakespeare.tokenizer, "shakespeare", 2, PREFIX + CONTINUATION, seed=21):
            prefix, continuation = window[:PREFIX], window[PREFIX:]
            produced, _ = prefill_capture(producer.model, prefix)
            kv = torch.stack([produced.keys, produced.values]).permute(0, 1, 3, 2, 4).reshape(
                2, layers, PREFIX, heads * dim).contiguous()
            name, prod_engine = make_engine(catalog.PRODUCER, lm_config, kv, heads)
            instances.append(name)
            prod_engine.store(prefix)
            assert scd_backend(prod_engine).drain(timeout=60)
            out = torch.zeros_like(kv)
            name, cons_engine = make_engine(shakespeare.name, lm_config, out, heads)
            instances.append(name)
            assert cons_engine.lookup(prefix) == PREFIX
            cons_engine.retrieve(prefix)
            fed = out.view(2, layers, PREFIX, heads, dim).permute(0, 1, 3, 2, 4)
            via_lmcache = type(produced)(fed[0].contiguous(), fed[1].contiguous())
            direct = codec.decode(codec.encode(produced))
            assert torch.allclose(via_lmcache.keys, direct.keys, atol=1e-5)
            assert torch.allclose(via_lmcache.values, direct.values, atol=1e-5)
            a, b = nll(shakespeare.model, via_lmcache, continuation), nll(shakespeare.model, direct, continuation)
            assert abs(a - b) < 1e-4
            raw = nll(shakespeare.model, produced, continuation)
            assert abs(a - raw) < 1.0  # a sane continuation, not garbage KV
    finally:
        for name in instances:
            LMCacheEngineBuilder.destroy(name)
