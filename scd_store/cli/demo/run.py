"""The demo: the base model prefills a shared prefix once; two fine-tunes answer requests from its codes.

With vLLM installed (``make demo`` installs it) the models run as real vLLM servers in their own
processes (:mod:`scd_store.cli.demo.servers`). ``--engine transformers`` runs them in this process
instead: for each request, side by side with the consumer's own prefill, time to first token, the
generated text and its agreement with the oracle's greedy text, and bytes fetched against raw KV
bytes. The store's hit statistics close the run. Everything runs on the embedded store (CPU + disk
under the data dir) unless ``--redis URL`` adds a Redis tier (and keeps the registry there).
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from scd_store.adapters.transformers import LoadedModel, load_model
from scd_store.adapters.transformers.calibration import CalibrationConfig
from scd_store.adapters.transformers.capture import prefill_capture
from scd_store.adapters.transformers.inject import PrefixBuffer, generate_greedy
from scd_store.bench.metrics import common_prefix
from scd_store.bench.ttft import first_token
from scd_store.cli.demo.prompts import REQUESTS, SYSTEM_PROMPT
from scd_store.cli.tables import one_line
from scd_store.codecs.kv_state import KVState
from scd_store.errors import ScdStoreError
from scd_store.models import catalog
from scd_store.models.catalog_bundle import bundle_misfit, catalog_bundle
from scd_store.models.prepare import ModelNotPrepared
from scd_store.paths import data_dir
from scd_store.service import KVService
from scd_store.store.build import open_store
from scd_store.store.config import StoreConfig, TierConfig
from scd_store.store.keys import chunk_hashes

DEMO_CHUNK = 256
# the bundle kept with scd-store: None = the catalog's, unpacked on first use (catalog_bundle()); tests set a path
CATALOG_BUNDLE: Path | None = None
ENGINES = ("auto", "vllm", "transformers")


class DemoError(ScdStoreError, RuntimeError):
    """Something the demo needs is missing; the message says how to get it."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class DemoConfig:
    redis_url: str | None = None
    bundle: str | None = None
    new_tokens: int = 24
    device: str = "cpu"
    store_dir: str | None = None  # the embedded store's directory (default: <data dir>/demo-store)
    engine: str = "auto"  # "vllm" (real servers), "transformers" (this process), "auto": vllm when installed
    agreement_requests: int = 6  # vLLM: held-out requests per fine-tune whose answers are compared (0: none)

    def __post_init__(self) -> None:
        if self.new_tokens <= 0:
            raise ValueError("new_tokens must be positive")
        if self.agreement_requests < 0:
            raise ValueError("agreement_requests must be >= 0")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")

    def resolved_engine(self) -> str:
        if self.engine != "auto":
            return self.engine
        import importlib.util

        return "vllm" if importlib.util.find_spec("vllm") is not None else "transformers"


def _load(name: str, device: str) -> LoadedModel:
    try:
        return load_model(name, device=device)
    except (ModelNotPrepared, FileNotFoundError, OSError) as exc:
        raise DemoError(f"model {name!r} is not prepared ({exc}); run `scd-store models prepare` "
                        "(or `make demo`, which does)") from None


def demo_bundle(config: DemoConfig, producer: LoadedModel, consumers: list[LoadedModel], console: Console) -> Path:
    """The bundle to serve: ``--bundle``; else the one kept with scd-store for the catalog pairs when it fits
    these models' weights; else one calibrated here at the defaults (once, cached by the models' fingerprints)."""
    if config.bundle:
        path = Path(config.bundle)
        if not (path / "space.json").is_file():
            raise DemoError(f"--bundle {path} is not a calibration bundle (no space.json)")
        return path
    fingerprints = {c.name: c.fingerprint for c in consumers}
    kept = CATALOG_BUNDLE or catalog_bundle()
    misfit = bundle_misfit(kept, producer.fingerprint, fingerprints)
    if misfit is None:
        console.print(f"code space and decoders: {kept} (kept with scd-store; calibrated at the defaults)")
        return kept
    key = hashlib.sha256("|".join([producer.fingerprint, *fingerprints.values(),
                                   repr(CalibrationConfig())]).encode()).hexdigest()[:16]
    path = data_dir() / "bundles" / f"demo-{key}"
    if bundle_misfit(path, producer.fingerprint, fingerprints) is None:
        console.print(f"code space and decoders: {path} (calibrated here at the defaults)")
        return path
    console.print(f"[bold]The bundle kept with scd-store does not fit these models ({misfit}): calibrating a "
                  f"shared code space for {len(consumers)} consumers at the defaults into {path}[/bold] (once)")
    from scd_store.adapters.transformers.calibration import calibrate

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    calibrate(producer.name, [c.name for c in consumers], tmp)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


def demo_store_config(config: DemoConfig) -> StoreConfig:
    root = Path(config.store_dir) if config.store_dir else data_dir() / "demo-store"
    if config.redis_url:  # a shared tier: the demo (producer and consumers in one process) signs its codes
        from scd_store.store.host_keys import deployment_keys

        tiers = (TierConfig("cpu", max_bytes="256MiB"), TierConfig("redis", url=config.redis_url))
        return StoreConfig(tiers=tiers, chunk_size=DEMO_CHUNK, signing_keys=str(deployment_keys(root / "keys")[0]))
    tiers = (TierConfig("cpu", max_bytes="256MiB"), TierConfig("disk", path=str(root / "disk"), max_bytes="2GiB"))
    return StoreConfig(tiers=tiers, chunk_size=DEMO_CHUNK, registry_path=str(root / "registry.json"))


def _agreement(a: list[int], b: list[int]) -> tuple[int, float]:
    """Tokens ``a`` shares with ``b`` before they first differ, and the position-wise match rate."""
    n = max(len(a), len(b))
    return common_prefix(a, b), (sum(x == y for x, y in zip(a, b, strict=False)) / n if n else 1.0)


def serve_consumer(service: KVService, consumer: LoadedModel, prefix_ids: torch.Tensor, hashes: list[bytes],
                   config: DemoConfig, console: Console) -> list[dict]:
    rows = []
    for request in REQUESTS[consumer.name]:
        req_ids = torch.tensor(consumer.tokenizer(request, add_special_tokens=False)["input_ids"])
        full = torch.cat([prefix_ids, req_ids])
        t0 = time.perf_counter()
        first_token(consumer.model, None, full)
        own_ttft = time.perf_counter() - t0
        oracle = generate_greedy(consumer.model, None, full, config.new_tokens)

        read_before = service.stat("bytes_read")
        t0 = time.perf_counter()
        buffer = PrefixBuffer(consumer.model, len(prefix_ids))  # the chunks decode straight into it
        service.contains(consumer.name, hashes, tokens=len(hashes) * DEMO_CHUNK)  # the engine's lookup
        states = service.get(consumer.name, hashes, into=buffer)
        covered = sum(s.num_tokens for s in states)
        state = buffer.state(covered)
        first_token(consumer.model, state, full[covered:])
        scd_ttft = time.perf_counter() - t0
        fetched = service.stat("bytes_read") - read_before
        text_ids = generate_greedy(consumer.model, state, full[covered:], config.new_tokens)
        raw_bytes = covered * service.binding(consumer.name).space.layout.fp16_bytes_per_token
        rows.append({"request": request, "own_ttft_ms": own_ttft * 1e3, "scd_ttft_ms": scd_ttft * 1e3,
                     "covered": covered, "fetched": fetched, "raw_bytes": raw_bytes,
                     "agreement": _agreement(text_ids, oracle), "new_tokens": len(oracle),
                     "text": consumer.tokenizer.decode(text_ids), "oracle": consumer.tokenizer.decode(oracle)})
    table = Table(title=f"{consumer.name}: {len(prefix_ids)}-token shared prefix "
                        f"({rows[0]['covered']} tokens from codes, the rest prefilled with the request)")
    for column in ("request", "TTFT own", "TTFT scd", "speed-up", "fetched / raw KV", "same first tokens"):
        table.add_column(column)
    for r in rows:
        ratio = f"{r['fetched'] / 2**20:.2f} / {r['raw_bytes'] / 2**20:.2f} MiB" if r["raw_bytes"] else "miss"
        common, _ = r["agreement"]
        table.add_row(one_line(r["request"], 40), f"{r['own_ttft_ms']:.0f} ms", f"{r['scd_ttft_ms']:.0f} ms",
                      f"{r['own_ttft_ms'] / r['scd_ttft_ms']:.1f}x", ratio, f"{common} of {r['new_tokens']}")
    console.print(table)
    for r in rows:
        console.print(f"[bold]{one_line(r['request'], 40)}[/bold]  (position-wise agreement {r['agreement'][1]:.0%})")
        console.print(f"  own prefill: {one_line(r['oracle'], 150)}")
        console.print(f"  from codes:  {one_line(r['text'], 150)}")
    return rows


def run_demo(config: DemoConfig) -> int:
    console = Console(width=max(Console().width, 140))
    producer = _load(catalog.PRODUCER, config.device)
    consumers = [_load(name, config.device) for name in catalog.CONSUMERS]
    bundle = demo_bundle(config, producer, consumers, console)
    if config.resolved_engine() == "vllm":
        from scd_store.cli.demo.servers import run_server_demo

        return run_server_demo(producer, consumers, bundle, config.new_tokens, config.redis_url, console,
                               Path(config.store_dir) if config.store_dir else None, config.agreement_requests)
    console.print("[bold]Engine: transformers in this process[/bold] (--engine vllm runs real vLLM servers)")
    try:
        store = open_store(demo_store_config(config))
    except Exception as exc:
        raise DemoError(f"cannot open the store: {exc}", code=3) from None
    try:
        try:
            service = KVService(store, [bundle], replace_registrations=True)
        except Exception as exc:
            raise DemoError(f"cannot register the bundle {bundle}: {exc}", code=3) from None
        prefix_ids = torch.tensor(producer.tokenizer(SYSTEM_PROMPT)["input_ids"])
        hashes = chunk_hashes(prefix_ids.tolist(), DEMO_CHUNK)
        t0 = time.perf_counter()
        produced, _ = prefill_capture(producer.model, prefix_ids[:len(hashes) * DEMO_CHUNK])
        prefill_s = time.perf_counter() - t0
        chunks = [KVState(produced.keys[:, :, i:i + DEMO_CHUNK].contiguous(),
                          produced.values[:, :, i:i + DEMO_CHUNK].contiguous(), start=i)
                  for i in range(0, produced.num_tokens, DEMO_CHUNK)]
        service.put(producer.name, hashes, chunks)
        store.flush()
        console.print(f"[bold]{producer.name}[/bold] prefilled the shared prefix once: {len(prefix_ids)} tokens "
                      f"in {prefill_s * 1e3:.0f} ms; {len(chunks)} chunks of {DEMO_CHUNK} stored as codes "
                      f"({bundle.name}).")
        for consumer in consumers:
            serve_consumer(service, consumer, prefix_ids, hashes, config, console)
        from scd_store.cli.stats_cmd import print_view

        print_view(store.stats.snapshot(), "this demo run")
    finally:
        store.close()
    return 0


def main(config: DemoConfig) -> int:
    try:
        return run_demo(config)
    except DemoError as exc:
        print(f"scd-store demo: {exc}", file=sys.stderr)
        return exc.code
