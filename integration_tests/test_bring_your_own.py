"""A fine-tune from outside the catalog, from the command line alone: calibrated on the user's text,
benchmarked on held-out text, registered into running vLLM servers and served through the store.

The consumer is a short LoRA fine-tune of the producer, brought twice: as a merged checkpoint (its
own server) and as a PEFT adapter (served by name on the base model's server). The servers start
with no bundle at all; ``scd-store register`` adds the pairs while they run.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from integration_tests.byo_harness import make_finetune, write_texts
from integration_tests.redis_servers import RedisServer
from integration_tests.vllm_harness import hit_tokens, reference, wait_until
from scd_store.adapters.transformers import load_model
from scd_store.codecs.kv_state import KVState
from scd_store.models import catalog
from scd_store.models.prepare import model_dir
from scd_store.models.windows import eval_windows

pytestmark = pytest.mark.slow
CKPT, LORA = "byo-ckpt", "byo-lora"
PREFIX, CONTINUATION, STEPS = 256, 16, 8


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scd_store.cli.main", *args], capture_output=True, text=True,
                          timeout=1200)


@pytest.fixture(scope="module")
def material(tmp_path_factory, producer):
    root = tmp_path_factory.mktemp("byo")
    return {"root": root, **write_texts(root), **make_finetune(producer, root)}


@pytest.fixture(scope="module")
def bundle(material):
    out = material["root"] / "bundle"
    done = cli("calibrate", "--consumer", f"{LORA}={material['adapter']}", "--consumer",
               f"{CKPT}={material['checkpoint']}", "--text", str(material["calib"]), "--steps", str(STEPS),
               "--windows", "4", "--prefix-tokens", str(PREFIX), "--continuation-tokens", str(CONTINUATION),
               "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "estimated" in done.stderr  # the time it will take, said before it starts
    return out


def test_calibrate_records_what_it_did(bundle, material):
    for name in (CKPT, LORA):
        manifest = json.loads((bundle / "pairs" / f"{name}.json").read_text())
        stats = manifest["calibration"]
        assert (stats["steps"], stats["device"], stats["windows"]) == (STEPS, "cpu", 4)
        assert stats["text"] == f"text:{material['calib']}" and stats["train_seconds"] > 0
    assert json.loads((bundle / "pairs" / f"{LORA}.json").read_text())["calibration"]["adapter"] == str(
        material["adapter"])


def test_bad_input_is_refused_before_any_work(material, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Too little text to calibrate on.")
    done = cli("calibrate", "--consumer", str(material["checkpoint"]), "--text", str(short),
               "--out", str(tmp_path / "o"))
    assert done.returncode == 2 and "too little calibration text" in done.stderr
    from transformers import LlamaConfig, LlamaForCausalLM

    other = tmp_path / "other"
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=49152)).save_pretrained(str(other))
    done = cli("calibrate", "--consumer", str(other), "--text", str(material["calib"]), "--out", str(tmp_path / "o"))
    assert done.returncode == 2 and "does not fit producer" in done.stderr
    done = cli("calibrate", "--consumer", str(material["checkpoint"]), "--out", str(tmp_path / "o"))
    assert done.returncode == 2 and "--text" in done.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("consumer", [CKPT, LORA])
def test_bench_quality_on_the_users_held_out_text(bundle, material, tmp_path, consumer):
    path = material["checkpoint"] if consumer == CKPT else material["adapter"]
    report = tmp_path / "q.json"
    done = cli("bench", "quality", "--consumer", f"{consumer}={path}", "--text", str(material["eval"]), "--bundle",
               str(bundle), "--quick", "--prefix-tokens", str(PREFIX), "--methods", "raw,int4", "--json", str(report))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(report.read_text())
    methods = {m["name"]: m for m in result["methods"]}
    assert result["consumer"] == consumer and result["text"] == f"text:{material['eval']}"
    assert set(methods) == {"oracle", "raw", "int4", "scd"} and methods["scd"]["payload_ratio"] < 0.3
    assert all(torch.isfinite(torch.tensor(m["kl"])) for m in methods.values()) and methods["raw"]["kl"] > 0


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, material):
    pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")
    from scd_store.bench.vllm_server import ServerSpec, VllmServer, scd_connector_config

    root = tmp_path_factory.mktemp("byo-serve")
    with RedisServer(root / "redis") as redis:
        store_yaml = root / "store.yaml"
        store_yaml.write_text(json.dumps({"tiers": [{"kind": "cpu", "max_bytes": "64MiB"},
                                                    {"kind": "redis", "url": redis.url}]}))
        kv = scd_connector_config([], store_yaml, discovery_interval_s=0.5)  # no bundle: all from the registry
        # without vLLM's own prefix cache, a prompt sent again (after the model was bound) is computed or
        # loaded again instead of served from the engine's blocks: the retries below need that
        base = ServerSpec(model_dir(catalog.PRODUCER), catalog.PRODUCER, kv, max_model_len=1024,
                          lora_modules={LORA: str(material["adapter"])}, prefix_caching=False)
        fine = ServerSpec(str(material["checkpoint"]), CKPT, kv, max_model_len=1024, prefix_caching=False)
        servers = [VllmServer(base, root / "producer.log"), VllmServer(fine, root / "consumer.log")]
        try:
            for server in servers:
                server.wait_ready()
            yield {"producer": servers[0], "consumer": servers[1], "store_yaml": store_yaml, "redis": redis}
        finally:
            for server in servers:
                server.stop()


def test_pairs_registered_into_running_servers_are_served(deployment, bundle, material, producer):
    from scd_store.bench.vllm_server import choice_tokens
    from scd_store.service import KVService
    from scd_store.store.build import open_store
    from scd_store.store.config import load_config
    from scd_store.store.keys import chunk_hashes

    store_yaml = str(deployment["store_yaml"])
    done = cli("register", str(bundle), "--store-config", store_yaml)
    assert done.returncode == 0 and f"consumer {CKPT}" in done.stdout, done.stderr
    listed = json.loads(cli("pairs", "--store-config", store_yaml, "--json").stdout)
    assert sorted(p["consumer"] for p in listed["spaces"][0]["pairs"]) == [CKPT, LORA]
    (window,) = eval_windows(producer.tokenizer, "shakespeare", 1, 2 * 256 + 24, seed=41)
    prompt = [int(t) for t in window]
    hashes = chunk_hashes(prompt, 256)
    reader = KVService(open_store(load_config(store_yaml), share_stats=False), [bundle])
    merged = load_model(str(material["checkpoint"]))  # both consumers' weights (the adapter, merged)
    try:
        # the producer server binds its space on its first request after registration, then stores
        assert wait_until(lambda: deployment["producer"].complete(catalog.PRODUCER, prompt, 2) and
                          reader.contains(catalog.PRODUCER, hashes) == 2, timeout=60)
        for server, name in ((deployment["consumer"], CKPT), (deployment["producer"], LORA)):
            before = hit_tokens(deployment["redis"].url)
            # the first request names the model to the server's discovery; within its interval it is bound
            assert wait_until(lambda server=server, name=name, before=before: server.complete(name, prompt, 2) and
                              hit_tokens(deployment["redis"].url) > before, timeout=60), name
            tokens, logprobs = choice_tokens(server.complete(name, prompt, 6))
            want, want_logprobs = reference(merged.model, KVState.cat(reader.get(name, hashes)), prompt[512:], 6)
            assert tokens == want
            assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 2e-3
    finally:
        reader.close()

