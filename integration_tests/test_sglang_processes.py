"""SGLang HiCache backends, built by SGLang's own factory, in separate OS processes sharing one
embedded scd-store: pages a producer process writes back in two batches (positions from
``prefix_keys``) are prefetched by two consumer processes as their own decodes at their true
positions, and pages in one tenant's namespace are not another's."""

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


def test_consumer_processes_prefetch_their_decodes_of_a_producer_process_pages(tmp_path):
    bundle = tmp_path / "bundle"
    write_tiny_bundle(bundle, consumers=("consumer-a", "consumer-b"))
    store_yaml = write_store_yaml(tmp_path / "store.yaml", tmp_path / "disk")
    env = {"SCD_STORE_HOME": str(tmp_path / "home")}
    from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed

    keys = page_keys(PAGES)
    tokens = list(range(PAGES * PAGE))  # one tenant's namespace, another's: SGLang's own page chains
    acme = get_hash_str(tokens, storage_namespace_seed("acme", None), page_size=PAGE)
    globex = get_hash_str(tokens, storage_namespace_seed("globex", None), page_size=PAGE)
    engines = [backend(name, bundle, store_yaml, env) for name in (PRODUCER, "consumer-a", "consumer-b")]
    producer, *consumers = engines
    try:
        assert producer.ask({"write": {"keys": keys[:1], "prefix": [], "seed": 7}})["drained"]
        assert producer.ask({"write": {"keys": keys[1:], "prefix": keys[:1], "seed": 7}}) == {
            "queued": True, "drained": True}
        for name, consumer in zip(("consumer-a", "consumer-b"), consumers, strict=True):
            out = str(tmp_path / f"{name}.safetensors")
            assert consumer.ask({"prefetch": {"keys": keys, "out": out}}) == {"hit": PAGES, "got": PAGES}
        assert producer.ask({"write": {"keys": acme, "prefix": [], "seed": 8}})["drained"]
        none = str(tmp_path / "none.safetensors")
        assert consumers[0].ask({"prefetch": {"keys": globex, "out": none}})["hit"] == 0  # another tenant
        assert consumers[0].ask({"prefetch": {"keys": acme, "out": none}})["hit"] == PAGES
    finally:
        for engine in engines:
            engine.close()
    space = load_space(bundle)
    kv = producer_kv(seed=7)
    for name in ("consumer-a", "consumer-b"):
        codec = ScdCodec(space, load_pair(bundle, name, space))
        want = []
        for p in range(PAGES):
            part = kv[:, :, :, p * PAGE:(p + 1) * PAGE].float()
            state = codec.decode(codec.encode(KVState(part[0].contiguous(), part[1].contiguous(), start=p * PAGE)))
            want.append(torch.stack([state.keys, state.values]).half())
        assert torch.equal(load_file(str(tmp_path / f"{name}.safetensors"))["pages"], torch.cat(want, dim=3))


def test_a_consumer_process_with_another_page_size_fails_loudly(tmp_path):
    bundle = tmp_path / "bundle"
    write_tiny_bundle(bundle, consumers=("consumer-a",))
    store_yaml = write_store_yaml(tmp_path / "store.yaml", tmp_path / "disk")
    env = {"SCD_STORE_HOME": str(tmp_path / "home")}
    producer = backend(PRODUCER, bundle, store_yaml, env)  # records its page hashing
    try:
        other = JsonLineProcess("integration_tests.sglang_process",
                                ["--model", "consumer-a", "--bundle", str(bundle), "--store-yaml", str(store_yaml),
                                 "--page-size", str(PAGE // 2)], env)
        assert f"chunk size: producer {PAGE}, here {PAGE // 2}" in other.ready["error"]
        other.close()
    finally:
        producer.close()
