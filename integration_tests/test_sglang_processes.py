"""SGLang HiCache backends, built by SGLang's own factory, in separate OS processes sharing one
embedded scd-store: pages a producer process writes back in two batches (positions from
``prefix_keys``) are prefetched by a consumer process as its own decode at their true positions."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("sglang", reason="the SGLang stack is installed by `make test`")

from integration_tests.lmcache_engines import write_store_yaml  # noqa: E402
from integration_tests.processes import JsonLineProcess  # noqa: E402
from integration_tests.sglang_harness import PAGE, PAGES, page_keys, producer_kv  # noqa: E402
from scd_store.codecs.kv_state import KVState  # noqa: E402
from scd_store.codecs.scd.bundle import load_pair, load_space  # noqa: E402
from scd_store.codecs.scd.codec import ScdCodec  # noqa: E402
from tests.bundles import PRODUCER, write_tiny_bundle  # noqa: E402


def backend(model: str, bundle, store_yaml, env) -> JsonLineProcess:
    return JsonLineProcess("integration_tests.sglang_process",
                           ["--model", model, "--bundle", str(bundle), "--store-yaml", str(store_yaml)], env)


def test_a_consumer_process_prefetches_its_decode_of_a_producer_process_pages(tmp_path):
    bundle = tmp_path / "bundle"
    write_tiny_bundle(bundle, consumers=("consumer-a",))
    store_yaml = write_store_yaml(tmp_path / "store.yaml", tmp_path / "disk")
    env = {"SCD_STORE_HOME": str(tmp_path / "home")}
    keys = page_keys(PAGES)
    producer = backend(PRODUCER, bundle, store_yaml, env)
    consumer = backend("consumer-a", bundle, store_yaml, env)
    try:
        assert producer.ask({"write": {"keys": keys[:1], "prefix": [], "seed": 7}})["drained"]
        assert producer.ask({"write": {"keys": keys[1:], "prefix": keys[:1], "seed": 7}}) == {
            "queued": True, "drained": True}
        out = str(tmp_path / "pages.safetensors")
        assert consumer.ask({"prefetch": {"keys": keys, "out": out}}) == {"hit": PAGES, "got": PAGES}
    finally:
        producer.close(), consumer.close()
    space = load_space(bundle)
    codec = ScdCodec(space, load_pair(bundle, "consumer-a", space))
    kv = producer_kv(seed=7)
    want = []
    for p in range(PAGES):
        part = kv[:, :, :, p * PAGE:(p + 1) * PAGE].float()
        out_state = codec.decode(codec.encode(KVState(part[0].contiguous(), part[1].contiguous(), start=p * PAGE)))
        want.append(torch.stack([out_state.keys, out_state.values]).half())
    assert torch.equal(load_file(str(tmp_path / "pages.safetensors"))["pages"], torch.cat(want, dim=3))
