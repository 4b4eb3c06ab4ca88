"""``scd-store bench async-load``: what a consumer's load over a slow link costs the other requests in the batch.

One real vLLM-CPU server of a fine-tune with scd-store's connector, its store a small CPU tier and
Redis behind a shaped loopback link (:class:`~scd_store.bench.slow_link.SlowLink`: a round-trip
latency and a bandwidth cap on what Redis sends). The base model's codes of a few distinct prefixes
are stored in Redis first (from its transformers prefill, through the direct link). Then, while
``background`` streamed requests that touch no stored prefix decode, ``probes`` consumer requests
whose prefix only Redis holds arrive one by one. The run is made twice on a fresh server, with
``async_loads`` on (the load runs on the connector's fetch thread between steps) and off (before
the step's forward, on the engine's thread). Measured at the client: the background requests'
inter-token latency (p50, p99, max) and each probe's time to first token; the link's shape is set,
not measured.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from scd_store.bench.serve import percentile
from scd_store.bench.slow_link import SlowLink
from scd_store.bench.store import _start_redis
from scd_store.bench.vllm_server import ServerSpec, VllmServer, scd_connector_config
from scd_store.models import catalog
from scd_store.models.prepare import model_dir
from scd_store.store.host_keys import deployment_keys

CHUNK = 256


@dataclass(frozen=True, slots=True)
class AsyncLoadConfig:
    bundle: str
    consumer: str = "smollm2-135m-shakespeare"
    prefix_tokens: int = 2048
    probes: int = 3
    background: int = 3
    background_tokens: int = 160
    link_latency_ms: float = 2.0
    link_mbps: float = 4.0  # megabytes per second from Redis to the consumer

    def __post_init__(self) -> None:
        if self.prefix_tokens < CHUNK or self.probes < 1 or self.background < 1 or self.link_mbps <= 0:
            raise ValueError("prefix_tokens >= 256, probes >= 1, background >= 1 and link_mbps > 0 are needed")


def _store_yaml(path: Path, url: str, keys: Path, registry: str) -> Path:
    # a get over the slow link takes seconds: the tiers' deadline must allow it (op_timeout_s)
    path.write_text(yaml.safe_dump({"chunk_size": CHUNK, "signing_keys": str(keys), "registry_url": registry,
                                    "op_timeout_s": 30.0,
                                    "tiers": [{"kind": "cpu", "max_bytes": "64MiB"}, {"kind": "redis", "url": url}]}))
    return path


def _store_prefixes(config: AsyncLoadConfig, store_yaml: Path, prompts: list[list[int]]) -> None:
    """The base model's codes of each prompt's whole chunks, put in the store by this process."""
    import torch

    from scd_store.adapters.transformers import load_model, prefill_capture
    from scd_store.codecs.kv_state import KVState
    from scd_store.service import KVService
    from scd_store.store.build import open_store
    from scd_store.store.config import load_config
    from scd_store.store.keys import chunk_hashes

    producer = load_model(catalog.PRODUCER)
    service = KVService(open_store(load_config(str(store_yaml))), [config.bundle])
    try:
        for prompt in prompts:
            whole = config.prefix_tokens // CHUNK * CHUNK
            state, _ = prefill_capture(producer.model, torch.tensor(prompt[:whole]))
            parts = [KVState(state.keys[:, :, i:i + CHUNK].contiguous(), state.values[:, :, i:i + CHUNK].contiguous(),
                             start=i) for i in range(0, whole, CHUNK)]
            service.put(catalog.PRODUCER, chunk_hashes(prompt[:whole], CHUNK), parts)
        service.store.flush(timeout=60)
    finally:
        service.close()
        service.store.close()


def _hit_tokens(url: str) -> int:
    out = subprocess.run([sys.executable, "-m", "scd_store.cli.main", "stats", "--redis", url, "--json"],
                         capture_output=True, text=True, check=True)
    return sum(row["hit_tokens"] for row in json.loads(out.stdout)["summary"]["pairs"])


def _run_mode(config: AsyncLoadConfig, root: Path, store_yaml: Path, prompts: list[list[int]],
              background: list[list[int]], asynchronous: bool, direct_url: str) -> dict[str, Any]:
    name = "async" if asynchronous else "sync"
    kv = scd_connector_config([config.bundle], store_yaml, async_loads=asynchronous)
    spec = ServerSpec(model_dir(config.consumer), config.consumer, kv, max_model_len=config.prefix_tokens + 256)
    with VllmServer(spec, root / f"consumer-{name}.log") as server:
        server.wait_ready()
        server.stream(config.consumer, background[0], 4)  # warm-up
        before = _hit_tokens(direct_url)
        streams: list[Any] = [None] * len(background)

        def run(i: int) -> None:
            streams[i] = server.stream(config.consumer, background[i], config.background_tokens)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(background))]
        for thread in threads:
            thread.start()
        time.sleep(1.5)  # the background batch is decoding
        probes = [server.stream(config.consumer, prompt, 4) for prompt in prompts]
        for thread in threads:
            thread.join()
        time.sleep(2.5)  # the counters' flush
        hits = _hit_tokens(direct_url) - before
    gaps = [b - a for s in streams for a, b in zip(s.arrivals, s.arrivals[1:], strict=False)]
    return {"async_loads": asynchronous, "background_requests": len(streams), "itl_samples": len(gaps),
            "itl_p50_ms": round(percentile(gaps, 0.5) * 1e3, 1), "itl_p99_ms": round(percentile(gaps, 0.99) * 1e3, 1),
            "itl_max_ms": round(max(gaps) * 1e3, 1),
            "probe_ttft_ms": [round(p.ttft_s * 1e3, 1) for p in probes], "probe_hit_tokens": hits,
            "probe_tokens": [p.token_ids for p in probes]}


def run_async_load(config: AsyncLoadConfig, root: str | None = None, progress: bool = True) -> dict[str, Any]:
    """Both modes side by side on the same stored prefixes and link; the report."""
    from scd_store.adapters.transformers import load_model
    from scd_store.bench.serve import _texts

    work = Path(root) if root else Path(tempfile.mkdtemp(prefix="scd-bench-async-"))
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = load_model(config.consumer).tokenizer
    prompts = [_texts(tokenizer, config.prefix_tokens + 24, 1, seed=300 + i)[0] for i in range(config.probes)]
    background = _texts(tokenizer, 64, config.background, seed=400)[1]
    started = time.time()
    proc, port = _start_redis(work)
    direct = f"redis://127.0.0.1:{port}/0"
    private, public = deployment_keys(work / "keys")
    try:
        _store_prefixes(config, _store_yaml(work / "producer.yaml", direct, private, direct), prompts)
        modes = []
        with SlowLink("127.0.0.1", port, latency_s=config.link_latency_ms / 1e3,
                      bytes_per_s=config.link_mbps * 1e6) as link:
            shaped = f"redis://127.0.0.1:{link.port}/0"
            store_yaml = _store_yaml(work / "consumer.yaml", shaped, public, direct)
            for asynchronous in (True, False):
                modes.append(_run_mode(config, work, store_yaml, prompts, background, asynchronous, direct))
                if progress:
                    m = modes[-1]
                    print(f"async_loads={m['async_loads']}: background ITL p50 {m['itl_p50_ms']} ms p99 "
                          f"{m['itl_p99_ms']} ms max {m['itl_max_ms']} ms; probe TTFT {m['probe_ttft_ms']} ms; "
                          f"hit tokens {m['probe_hit_tokens']}", flush=True)
    finally:
        proc.kill()
    return {"kind": "measured", "what": __doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
            "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine()},
            "date": time.strftime("%Y-%m-%d", time.gmtime(started)), "config": asdict(config),
            "link": {"latency_ms": config.link_latency_ms, "megabytes_per_s": config.link_mbps, "kind": "modelled"},
            "modes": modes}
