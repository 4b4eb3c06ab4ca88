"""``scd-store bench serve --link``: time to first token when the producer and the consumer are two hosts.

A :class:`~scd_store.bench.link_deployment.LinkDeployment` over a
:class:`~scd_store.bench.netns.HostPair`: the producer's host holds Redis, the base model's server and its
peer tier's arena; the consumer's host holds one fine-tune server per transport and this client. For each
prefix length the producer prefills ``requests`` distinct prefixes once; then, for each link shape (set
with ``tc`` on the live link), concurrency and route, every prefix is asked for once (prefix + a distinct
suffix, streamed). Routes: the consumer's own prefill, scd-store's codes and the producer's raw fp16 KV
(the same connector path, raw payload), each over Redis and over the NIXL peer tier. Per cell: TTFT at
the client and the bytes that crossed the link, read from the veth's counters.
"""

from __future__ import annotations

import platform
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from scd_store.bench.link_deployment import LinkDeployment
from scd_store.bench.link_report import crossovers, model_gap
from scd_store.bench.netns import HostPair, LinkSpec, entered
from scd_store.bench.serve import percentile
from scd_store.models import catalog

ROUTES = {  # route -> (consumer server by transport, kv_transfer_params)
    "own": ("redis", {"scd_skip_load": True, "raw_skip_load": True}),
    "scd-redis": ("redis", None), "scd-peer": ("peer", None),
    "raw-redis": ("redis", {"scd_skip_load": True}), "raw-peer": ("peer", {"scd_skip_load": True}),
}
DEFAULT_LINKS = ("100mbit", "1gbit", "10gbit", "unshaped")


@dataclass(frozen=True, slots=True)
class LinkServeConfig:
    bundle: str
    consumer: str = "smollm2-135m-shakespeare"
    links: tuple[str, ...] = DEFAULT_LINKS
    prefix_tokens: tuple[int, ...] = (512, 2048)
    concurrency: tuple[int, ...] = (1, 16)
    requests: int = 16  # per cell: distinct stored prefixes, asked for in waves of `concurrency`
    suffix_tokens: int = 32
    new_tokens: int = 4
    root: str | None = None
    routes: tuple[str, ...] = field(default=tuple(ROUTES))
    model: bool = True  # bench ttft's modelled TTFT at the same shaped rates, beside the measured one
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not (Path(self.bundle) / "pairs" / f"{self.consumer}.json").is_file():
            raise ValueError(f"--bundle {self.bundle} has no pair for {self.consumer!r}")
        for text in self.links:
            LinkSpec.parse(text)
        if min(self.prefix_tokens) < 256 or min(self.concurrency) < 1 or self.new_tokens < 1:
            raise ValueError("prefixes need at least one 256-token chunk; concurrency and new tokens >= 1")
        if any(self.requests % c for c in self.concurrency):
            raise ValueError(f"requests ({self.requests}) must be a multiple of every concurrency "
                             f"({list(self.concurrency)})")
        unknown = set(self.routes) - set(ROUTES)
        if unknown:
            raise ValueError(f"unknown routes {sorted(unknown)}; known: {list(ROUTES)}")


def _prompts(consumer: str, length: int, count: int, suffix: int, seed: int) -> tuple[list, list]:
    """``count`` distinct prefixes of ``length`` tokens and a distinct suffix for each (held-out text)."""
    from transformers import AutoTokenizer

    from scd_store.models.prepare import model_dir
    from scd_store.models.windows import eval_windows

    tokenizer = AutoTokenizer.from_pretrained(model_dir(consumer))
    windows = eval_windows(tokenizer, catalog.consumer(consumer).corpus, 2 * count, length, seed=seed)
    prefixes = [[int(t) for t in w[:length]] for w in windows[:count]]
    return prefixes, [[int(t) for t in w[:suffix]] for w in windows[count:]]


def _cell(deployment: LinkDeployment, pair: HostPair, route: str, prompts: list[list[int]], concurrency: int,
          config: LinkServeConfig) -> dict[str, Any]:
    transport, params = ROUTES[route]
    server = deployment.servers[transport]
    before = pair.counters()
    ttft, started = [], time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        for wave in range(0, len(prompts), concurrency):
            batch = prompts[wave:wave + concurrency]
            answers = list(pool.map(lambda p: server.stream(config.consumer, p, config.new_tokens, kv_params=params,
                                                            timeout=config.request_timeout_s), batch))
            ttft += [a.ttft_s for a in answers]
    finally:  # on SIGTERM or an error, leave the requests in flight: stopping the servers ends them
        pool.shutdown(wait=False, cancel_futures=True)
    wall = time.perf_counter() - started
    after = pair.counters()
    return {"route": route, "requests": len(ttft), "ttft_p50_ms": round(percentile(ttft, 0.5) * 1e3, 1),
            "ttft_p99_ms": round(percentile(ttft, 0.99) * 1e3, 1), "wall_s": round(wall, 2),
            "link_bytes_to_consumer": after["producer_to_consumer"] - before["producer_to_consumer"],
            "link_bytes_to_producer": after["consumer_to_producer"] - before["consumer_to_producer"]}


def _measure_length(deployment: LinkDeployment, pair: HostPair, config: LinkServeConfig, links: list[LinkSpec],
                    length: int, seed: int, rows: list[dict[str, Any]], progress: bool) -> dict[str, int]:
    """Store ``config.requests`` prefixes of ``length`` tokens, then one row per link, concurrency and route
    (appended to ``rows``); the bytes one request's hit reads, codes and raw."""
    prefixes, suffixes = _prompts(config.consumer, length, config.requests, config.suffix_tokens, seed=seed)
    pair.shape(LinkSpec())
    for prefix in prefixes:
        deployment.servers["producer"].stream(catalog.PRODUCER, prefix, 1)
    covered = min(deployment.wait_stored(prefix) for prefix in prefixes)
    payload = deployment.hit_bytes(prefixes[0] + suffixes[0])
    prompts = [p + s for p, s in zip(prefixes, suffixes, strict=True)]
    for link in links:
        pair.shape(link)
        for concurrency in config.concurrency:
            for route in config.routes:
                row = {"link": link.label, "link_gbit": None if link.rate_bps is None else link.rate_bps / 1e9,
                       "prefix_tokens": length, "stored_tokens": covered, "concurrency": concurrency,
                       **_cell(deployment, pair, route, prompts, concurrency, config)}
                kind = route.split("-")[0]
                row["payload_bytes"] = payload.get(kind, 0) * row["requests"]
                row["loaded"] = kind == "own" or row["link_bytes_to_consumer"] >= 0.95 * row["payload_bytes"]
                rows.append(row)
                if progress:
                    print(f"{link.label:>9} prefix {length:5d} x{concurrency:<3d} {route:9s} TTFT p50 "
                          f"{row['ttft_p50_ms']:9.1f} ms p99 {row['ttft_p99_ms']:9.1f} ms  "
                          f"{row['link_bytes_to_consumer'] / 1e6:8.1f} MB over the link"
                          f"{'' if row['loaded'] else '  (NOT LOADED: a miss)'}", flush=True)
    return payload


def run_serve_link(config: LinkServeConfig, progress: bool = True) -> dict[str, Any]:
    """The report: one row per link, prefix length, concurrency and route; crossovers; the model's gap."""
    import tempfile

    root = Path(config.root) if config.root else Path(tempfile.mkdtemp(prefix="scd-bench-link-"))
    links = [LinkSpec.parse(text) for text in config.links]
    rows: list[dict[str, Any]] = []
    payloads: dict[int, dict[str, int]] = {}
    started = time.time()
    with HostPair() as pair, entered(pair, "consumer"), LinkDeployment(
            pair, root, Path(config.bundle), catalog.PRODUCER, config.consumer,
            max_model_len=max(config.prefix_tokens) + 128) as deployment:
        for n, length in enumerate(config.prefix_tokens):
            payloads[length] = _measure_length(deployment, pair, config, links, length, 211 + n, rows, progress)
        pair.shape(LinkSpec())
    report: dict[str, Any] = {
        "kind": "measured", "what": __doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine()},
        "date": time.strftime("%Y-%m-%d", time.gmtime(started)), "config": asdict(config),
        "payload_bytes_per_request": {str(k): v for k, v in payloads.items()}, "rows": rows,
        "crossovers": crossovers(rows)}
    if config.model:
        from scd_store.bench.ttft import TtftConfig, run_ttft

        rates = tuple(link.rate_bps / 1e9 for link in links if link.rate_bps is not None)
        if rates:
            modelled = run_ttft(TtftConfig(config.consumer, config.prefix_tokens, config.suffix_tokens, rates,
                                           config.bundle, methods=("raw", "scd")), progress=progress)
            report["modelled"] = modelled
            report["model_gap"] = model_gap(rows, modelled)
    return report
