"""``scd-store bench serve``: time to first token and throughput at the client, against real vLLM servers.

One deployment (:class:`~scd_store.bench.serving.Deployment`: a base-model server and a fine-tune
server over one store). For each shared-prefix length the producer stores the prefix once; then,
for each concurrency, ``waves`` waves of that many concurrent streamed requests (the prefix plus a
distinct suffix each) go to the fine-tune's server by each route: scd-store's codes, its own
prefill, and the producer's raw KV. Everything in the JSON is measured here, in one run, at the
client: TTFT is the time to the first streamed token.
"""

from __future__ import annotations

import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from scd_store.bench.serving import ROUTES, Deployment
from scd_store.bench.vllm_server import Streamed
from scd_store.models import catalog


@dataclass(frozen=True, slots=True)
class ServeConfig:
    bundle: str
    consumer: str = "smollm2-135m-shakespeare"
    prefix_tokens: tuple[int, ...] = (512, 1024, 2048)
    concurrency: tuple[int, ...] = (1, 4, 16)
    waves: int = 2
    suffix_tokens: int = 32
    new_tokens: int = 16
    root: str | None = None  # the deployment's directory (default: a temporary one)
    routes: tuple[str, ...] = field(default=tuple(ROUTES))
    agreement_windows: int = 10  # held-out windows per consumer for the answer agreement (0: none)
    agreement_consumers: tuple[str, ...] = tuple(catalog.CONSUMERS)

    def __post_init__(self) -> None:
        if not (Path(self.bundle) / "space.json").is_file():
            raise ValueError(f"--bundle {self.bundle} is not a calibration bundle (no space.json)")
        if min(self.prefix_tokens) < 256 or min(self.concurrency) < 1 or self.waves < 1 or self.new_tokens < 1:
            raise ValueError("prefixes need at least one 256-token chunk; concurrency, waves and new tokens >= 1")
        if self.agreement_windows < 0:
            raise ValueError("agreement_windows must be >= 0")
        for name in (self.consumer, *(self.agreement_consumers if self.agreement_windows else ())):
            if not (Path(self.bundle) / "pairs" / f"{name}.json").is_file():
                raise ValueError(f"bundle {self.bundle} has no pair for {name!r} (see --agreement-consumers)")
        unknown = set(self.routes) - set(ROUTES)
        if unknown:
            raise ValueError(f"unknown routes {sorted(unknown)}; known: {list(ROUTES)}")


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _texts(tokenizer: Any, length: int, count: int, seed: int) -> tuple[list[int], list[list[int]]]:
    """A shared prefix of ``length`` tokens and ``count`` distinct suffixes, from held-out corpus windows."""
    from scd_store.models.windows import eval_windows

    windows = eval_windows(tokenizer, "shakespeare", count + 1, max(length, 64), seed=seed)
    return [int(t) for t in windows[0][:length]], [[int(t) for t in w[:64]] for w in windows[1:]]


def run_wave(server: Any, model: str, prompts: list[list[int]], new_tokens: int, route: str
             ) -> tuple[list[Streamed], float]:
    """All ``prompts`` at once by ``route``; their answers and the wave's wall time."""
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        answers = list(pool.map(lambda p: server.stream(model, p, new_tokens, kv_params=ROUTES[route]), prompts))
    return answers, time.perf_counter() - started


def run_serve(config: ServeConfig, progress: bool = True) -> dict[str, Any]:
    """The report: one row per prefix length, concurrency and route, plus speed-ups over own prefill."""
    import tempfile

    from scd_store.adapters.transformers import load_model

    served = load_model(config.consumer)
    tokenizer = served.tokenizer
    root = Path(config.root) if config.root else Path(tempfile.mkdtemp(prefix="scd-bench-serve-"))
    rows: list[dict[str, Any]] = []
    agreement: list[dict[str, Any]] = []
    started = time.time()
    agreeing = config.agreement_consumers if config.agreement_windows else ()
    consumers = list(dict.fromkeys([config.consumer, *agreeing]))
    with Deployment(root, Path(config.bundle), catalog.PRODUCER, consumers,
                    max_model_len=max(config.prefix_tokens) + 128) as deployment:
        base, fine = deployment.servers[catalog.PRODUCER], deployment.servers[config.consumer]
        for n, length in enumerate(config.prefix_tokens):
            prefix, suffixes = _texts(tokenizer, length, max(config.concurrency) * config.waves, seed=101 + n)
            base.stream(catalog.PRODUCER, prefix, 1)
            covered = deployment.wait_stored(prefix)
            for concurrency in config.concurrency:
                for route in config.routes:
                    answers, walls = [], []
                    for wave in range(config.waves):
                        batch = suffixes[wave * concurrency:(wave + 1) * concurrency]
                        got, wall = run_wave(fine, config.consumer, [prefix + s[:config.suffix_tokens] for s in batch],
                                             config.new_tokens, route)
                        answers += got
                        walls.append(wall)
                    ttft = [a.ttft_s for a in answers]
                    row = {"prefix_tokens": length, "stored_tokens": covered, "concurrency": concurrency,
                           "route": route, "requests": len(answers),
                           "ttft_p50_ms": round(percentile(ttft, 0.5) * 1e3, 1),
                           "ttft_p99_ms": round(percentile(ttft, 0.99) * 1e3, 1),
                           "e2e_p50_ms": round(statistics.median(a.total_s for a in answers) * 1e3, 1),
                           "requests_per_s": round(len(answers) / sum(walls), 3),
                           "output_tokens_per_s": round(sum(len(a.token_ids) for a in answers) / sum(walls), 1)}
                    rows.append(row)
                    if progress:
                        print(f"prefix {length:5d}  x{concurrency:<3d} {route:4s}  TTFT p50 {row['ttft_p50_ms']:8.1f} "
                              f"ms  p99 {row['ttft_p99_ms']:8.1f} ms  {row['requests_per_s']:.2f} req/s", flush=True)
        if config.agreement_windows:
            from scd_store.bench.serve_agreement import consumer_agreement

            for name in config.agreement_consumers:
                agreement.append(consumer_agreement(deployment, served if name == served.name else load_model(name),
                                                    config.agreement_windows, 512, 32,
                                                    config.new_tokens))
                if progress:
                    print(f"agreement {name}: {agreement[-1]['against_own_answer']}; "
                          f"fidelity {agreement[-1]['engine_fidelity']}", flush=True)
    return {"kind": "measured", "what": __doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
            "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine()},
            "date": time.strftime("%Y-%m-%d", time.gmtime(started)), "config": asdict(config), "rows": rows,
            "speedups": speedups(rows), "agreement": agreement}


def speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Own-prefill p50 TTFT over each cache route's, per prefix length and concurrency (same run)."""
    out = []
    index = {(r["prefix_tokens"], r["concurrency"], r["route"]): r for r in rows}
    for (length, concurrency, route), row in index.items():
        own = index.get((length, concurrency, "own"))
        if route != "own" and own is not None and row["ttft_p50_ms"] > 0:
            out.append({"prefix_tokens": length, "concurrency": concurrency, "route": route,
                        "ttft_p50_speedup": round(own["ttft_p50_ms"] / row["ttft_p50_ms"], 2),
                        "throughput_ratio": round(row["requests_per_s"] / own["requests_per_s"], 2)})
    return out
