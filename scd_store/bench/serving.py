"""A deployment of real vLLM servers for the demo and ``bench serve``: one base-model server (the
producer) and one server per fine-tune, each with scd-store's connector and the raw-KV reuse
baseline side by side (vLLM's MultiConnector), over one store.

Every consumer request picks its route with ``kv_transfer_params`` (:data:`ROUTES`): scd-store's
codes, the producer's raw KV, or the consumer's own prefill. Consumer servers run without vLLM's
own prefix cache, so every request loads (or computes) its prefix afresh.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from scd_store.bench.vllm_server import (
    ServerSpec,
    VllmServer,
    multi_config,
    raw_reuse_config,
    scd_connector_config,
)
from scd_store.codecs.kv_state import KVState
from scd_store.models.prepare import model_dir
from scd_store.service import KVService
from scd_store.store.build import open_store
from scd_store.store.config import load_config
from scd_store.store.host_keys import deployment_keys
from scd_store.store.keys import chunk_hashes

CHUNK = 256
ROUTES: dict[str, dict | None] = {
    "own": {"scd_skip_load": True, "raw_skip_load": True},  # the consumer's own prefill
    "scd": None,  # scd-store's codes, decoded by the consumer's decoder
    "raw": {"scd_skip_load": True},  # the producer's raw KV, as a plain KV store would serve it
}


@dataclass
class Deployment:
    """The servers and their shared store, under ``root`` (made afresh)."""

    root: Path
    bundle: Path
    producer: str
    consumers: Sequence[str]
    redis_url: str | None = None
    max_model_len: int = 4096
    servers: dict[str, VllmServer] = field(default_factory=dict)
    _reader: KVService | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for sub in ("disk", "raw", "stats", "logs"):
            shutil.rmtree(self.root / sub, ignore_errors=True)
        self.root.mkdir(parents=True, exist_ok=True)
        tiers: list[dict] = [{"kind": "cpu", "max_bytes": "256MiB"}]
        config: dict = {"chunk_size": CHUNK, "stats_path": str(self.root / "stats")}
        if self.redis_url:
            tiers.append({"kind": "redis", "url": self.redis_url})
        else:
            tiers.append({"kind": "disk", "path": str(self.root / "disk"), "max_bytes": "2GiB"})
            config["registry_path"] = str(self.root / "registry.json")
        # the producer signs with the private key; consumers (and this process, a reader) hold the public one
        private, public = deployment_keys(self.root / "keys")
        self.store_yaml = self.root / "store.yaml"
        self.store_yaml.write_text(yaml.safe_dump({"tiers": tiers, **config, "signing_keys": str(public)}))
        self.producer_yaml = self.root / "producer-store.yaml"
        self.producer_yaml.write_text(yaml.safe_dump({"tiers": tiers, **config, "signing_keys": str(private)}))
        self.raw_dir = self.root / "raw"

    def start(self, timeout: float = 600.0) -> Deployment:
        """Start every server (their start-ups overlap) and wait until all serve."""
        def kv_config(store_yaml: Path) -> dict:
            return multi_config(scd_connector_config([self.bundle], store_yaml),
                                raw_reuse_config(self.raw_dir, self.producer, CHUNK))

        kv = kv_config(self.store_yaml)
        specs = [ServerSpec(model_dir(self.producer), self.producer, kv_config(self.producer_yaml),
                            max_model_len=self.max_model_len)]
        specs += [ServerSpec(model_dir(name), name, kv, max_model_len=self.max_model_len, prefix_caching=False)
                  for name in self.consumers]
        try:
            for spec in specs:
                self.servers[spec.served_name] = VllmServer(spec, self.root / "logs" / f"{spec.served_name}.log")
            for server in self.servers.values():
                server.wait_ready(timeout)
                server.stream(server.spec.served_name, list(range(1000, 1016)), 2, kv_params=ROUTES["own"])  # warm up
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def store_service(self) -> KVService:
        """This process's service over the deployment's store, for reading what the servers stored (opened
        once, closed with the deployment; its counters stay out of the deployment's)."""
        if self._reader is None:
            self._reader = KVService(open_store(load_config(str(self.store_yaml)), share_stats=False), [self.bundle])
        return self._reader

    def wait_stored(self, prompt: list[int], timeout: float = 60.0) -> int:
        """Wait until the producer's whole chunks of ``prompt`` are in the store and the raw directory;
        the tokens they cover."""
        hashes = chunk_hashes(prompt, CHUNK)
        service = self.store_service()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            raw = all((self.raw_dir / f"{h.hex()}.kv").is_file() for h in hashes)
            if raw and service.contains(self.producer, hashes) == len(hashes):
                return len(hashes) * CHUNK
            time.sleep(0.25)
        raise TimeoutError(f"the producer's {len(hashes)} chunks were not stored within {timeout:.0f} s")

    def stored_codes(self, consumer: str, tokens: list[int]) -> KVState:
        """``consumer``'s decode of the stored codes of ``tokens`` (whole chunks, from position 0), as the servers
        load them; raises when the store does not give them all (a score over other positions would be wrong)."""
        states = self.store_service().get(consumer, chunk_hashes(tokens, CHUNK))
        got = sum(s.num_tokens for s in states)
        if not states or got != len(tokens):
            raise RuntimeError(f"the store gave {got} of the {len(tokens)} stored tokens' codes for {consumer}; "
                               "scores are made only where every chunk decodes")
        return KVState.cat(states)

    def hit_bytes(self, prompt: list[int]) -> dict[str, int]:
        """Bytes a hit on ``prompt``'s stored chunks moves: codes and raw KV (fp16), from the stored blobs."""
        hashes = chunk_hashes(prompt[:-1], CHUNK)
        service = self.store_service()
        consumer = next(name for name in self.consumers if service.binding(name))
        codes = service.stored_bytes(consumer, hashes)
        raw = sum((self.raw_dir / f"{h.hex()}.kv").stat().st_size for h in hashes
                  if (self.raw_dir / f"{h.hex()}.kv").is_file())
        return {"scd": codes, "raw": raw}
