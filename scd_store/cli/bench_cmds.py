"""Handlers and parsers of the serving benchmarks: ``scd-store bench decode | transfer | ttft | serve |
engine-put | decoder-sizes`` (imported lazily by ``main``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def bench_decode(args: argparse.Namespace) -> int:
    import json

    import torch

    from scd_store.bench.decode import DecodeBenchConfig, run_decode_bench

    config = DecodeBenchConfig(prefix_tokens=tuple(args.prefix_tokens), budget=args.budget, repeats=args.repeats,
                               decodes_per_round=args.decodes_per_round, device=args.device, dtype=args.dtype,
                               geometry=args.geometry, quantiser=args.quantiser)
    codec = consumer = None
    if args.bundle:
        from scd_store.adapters.transformers import load_model
        from scd_store.bench.quality import load_scd_codec
        from scd_store.models import catalog

        producer = load_model(catalog.PRODUCER, device=args.device)
        loaded = load_model(args.consumer, device=args.device)
        codec, consumer = load_scd_codec(args.bundle, producer, loaded), loaded.model.to(getattr(torch, args.dtype))
    allocator = getattr(args, "allocator", "not set")
    report = json.dumps({**run_decode_bench(config, codec, consumer), "allocator": allocator}, indent=2)
    print(report)
    if args.json:
        args.json.write_text(report + "\n")
    return 0


def bench_transfer(args: argparse.Namespace) -> int:
    import json

    from scd_store.bench.transfer import run_transfer_bench
    from scd_store.store.transfer import nixl_available

    kind = args.kind if args.kind != "auto" else ("nixl" if nixl_available() else "copy")
    report = json.dumps(run_transfer_bench(kind, args.device, args.reps), indent=2)
    print(report)
    if args.json:
        args.json.write_text(report + "\n")
    return 0


def catalog_consumers() -> tuple[str, ...]:
    from scd_store.models import catalog

    return tuple(catalog.CONSUMERS)


DEMO_BUNDLE_HELP = "calibration bundle (default: the demo's, kept with scd-store for the catalog fine-tunes)"


def _demo_bundle(given: str | None) -> str:
    """``given``, or the demo's bundle (the one kept with scd-store for the catalog pairs when it fits)."""
    if given:
        return given
    from rich.console import Console

    from scd_store.adapters.transformers import load_model
    from scd_store.cli.demo.run import DemoConfig, demo_bundle
    from scd_store.models import catalog

    producer = load_model(catalog.PRODUCER)
    consumers = [load_model(name) for name in catalog.CONSUMERS]
    return str(demo_bundle(DemoConfig(), producer, consumers, Console(stderr=True)))


def bench_async_load(args: argparse.Namespace) -> int:
    import json

    from scd_store.bench.async_load import AsyncLoadConfig, run_async_load

    try:
        config = AsyncLoadConfig(_demo_bundle(args.bundle), args.consumer, args.prefix_tokens, args.probes,
                                 args.background, args.background_tokens, args.link_latency_ms, args.link_mbps)
    except ValueError as exc:
        print(f"bench async-load: {exc}", file=sys.stderr)
        return 2
    report = json.dumps(run_async_load(config, args.root), indent=1)
    if args.json:
        args.json.write_text(report + "\n")
    print(report)
    return 0


def bench_serve(args: argparse.Namespace) -> int:
    import json

    from scd_store.bench.serve import ServeConfig, run_serve

    if args.link:
        return bench_serve_link(args)
    bundle = _demo_bundle(args.bundle)
    try:
        config = ServeConfig(bundle, args.consumer, tuple(args.prefix_tokens or (512, 1024, 2048)),
                             tuple(args.concurrency or (1, 4, 16)), args.waves, args.suffix_tokens,
                             args.new_tokens or 16, args.root, agreement_windows=args.agreement_windows,
                             agreement_consumers=tuple(args.agreement_consumers))
    except ValueError as exc:
        print(f"bench serve: {exc}", file=sys.stderr)
        return 2
    report = json.dumps(run_serve(config), indent=1)
    if args.json:
        args.json.write_text(report + "\n")
    print(report)
    return 0


def bench_serve_link(args: argparse.Namespace) -> int:
    """``bench serve --link``: producer and consumer on two hosts joined by a shaped link (needs root)."""
    import json

    from scd_store.bench.link_report import markdown_table, plot_link
    from scd_store.bench.netns import LinkError, require_root_tools
    from scd_store.bench.serve_link import LinkServeConfig, run_serve_link

    try:
        require_root_tools()
        config = LinkServeConfig(_demo_bundle(args.bundle), args.consumer, tuple(args.link),
                                 tuple(args.prefix_tokens or (512, 2048)), tuple(args.concurrency or (1, 16)),
                                 args.requests, args.suffix_tokens, args.new_tokens or 4, args.root,
                                 model=not args.no_model)
        report = run_serve_link(config)
    except (ValueError, LinkError) as exc:
        print(f"bench serve --link: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
        args.json.with_suffix(".md").write_text(markdown_table(report))
        try:
            plot_link(report, args.json.with_suffix(".png"))
        except ModuleNotFoundError as exc:
            print(f"bench serve --link: no plot ({exc})", file=sys.stderr)
    print(text)
    return 0


def bench_ttft(args: argparse.Namespace) -> int:
    import json

    from scd_store.bench.ttft import TtftConfig, plot_ttft, run_ttft

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if "scd" in methods and not args.bundle:
        print("bench ttft: the scd method needs --bundle DIR (see `scd-store calibrate`); "
              "or pass --methods raw,int4,droidspeak", file=sys.stderr)
        return 2
    config = TtftConfig(args.consumer, tuple(args.prefix_tokens), args.suffix_tokens, bundle=args.bundle,
                        repeats=args.repeats, methods=methods,
                        droidspeak_group=tuple(int(x) for x in args.droidspeak_group.split("-")))
    report = run_ttft(config)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
        plot_ttft(report, args.json.with_suffix(".png"))
    return 0


def bench_decoder_sizes(args: argparse.Namespace) -> int:
    import json

    from scd_store.bench.decoder_sizes import decoder_sizes

    text = json.dumps({"kind": "computed from configs", "geometries": decoder_sizes()}, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


def bench_engine_put(args: argparse.Namespace) -> int:
    import json

    from scd_store.bench.engine_put import EnginePutConfig, run_engine_put_bench

    report = run_engine_put_bench(EnginePutConfig(prompts=args.prompts, prompt_tokens=args.prompt_tokens,
                                                  chunk_tokens=args.chunk_tokens))
    text = json.dumps(report, indent=1)
    if args.json:
        args.json.write_text(text)
    print(text)
    return 0


def bench_entropy(args: argparse.Namespace) -> int:
    import json

    from scd_store.bench.entropy import EntropyConfig, run_entropy

    config = EntropyConfig(_demo_bundle(args.bundle), table_windows=args.table_windows, test_windows=args.test_windows,
                           seed=args.seed)
    text = json.dumps(run_entropy(config), indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


def add_bench_parsers(bench: Any) -> None:
    decode = bench.add_parser("decode", help="SCD decode time against the consumer's own prefill")
    decode.add_argument("--prefix-tokens", type=int, nargs="+", default=[448, 2048])
    decode.add_argument("--budget", type=float, default=0.25)
    decode.add_argument("--repeats", type=int, default=5, help="rounds of one prefill and --decodes-per-round decodes")
    decode.add_argument("--decodes-per-round", type=int, default=5)
    decode.add_argument("--device", default="cpu")
    decode.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    decode.add_argument("--geometry", default="smollm2-135m", choices=["smollm2-135m", "llama3-8b"],
                        help="the random-init model's geometry (without --bundle; llama3-8b needs a GPU's memory)")
    decode.add_argument("--quantiser", default="fixed", choices=["fixed", "ecsq"],
                        help="the random-init space's quantiser (ecsq: range-coded payloads, timed beside the same "
                             "codes in bit planes)")
    decode.add_argument("--json", type=Path)
    decode.add_argument("--bundle", type=Path, help="time a real calibrated pair (default: random-init model)")
    decode.add_argument("--consumer", default="smollm2-135m-shakespeare", help="the consumer of --bundle")
    decode.set_defaults(func=bench_decode)

    transfer = bench.add_parser("transfer", help="blob reads from another process's registered memory (NIXL)")
    transfer.add_argument("--kind", default="auto", choices=["auto", "nixl", "copy"])
    transfer.add_argument("--device", default="cpu", help="cpu (DRAM) or cuda (VRAM)")
    transfer.add_argument("--reps", type=int, default=20)
    transfer.add_argument("--json", type=Path)
    transfer.set_defaults(func=bench_transfer)

    ttft = bench.add_parser("ttft", help="modelled what-if: disaggregated TTFT vs own prefill over modelled links "
                            "(measured against real servers: bench serve)")
    ttft.add_argument("--consumer", default="smollm2-135m-shakespeare")
    ttft.add_argument("--bundle", help="calibration bundle for the scd method")
    ttft.add_argument("--prefix-tokens", type=int, nargs="+", default=[512, 1024, 2048])
    ttft.add_argument("--suffix-tokens", type=int, default=32)
    ttft.add_argument("--repeats", type=int, default=3)
    ttft.add_argument("--methods", default="raw,int4,scd,droidspeak")
    ttft.add_argument("--droidspeak-group", default="18-24", help="layers [start-stop) droidspeak recomputes")
    ttft.add_argument("--json", type=Path, help="write the report here (and a PNG plot next to it)")
    ttft.set_defaults(func=bench_ttft)

    serve = bench.add_parser("serve", help="measured: client-side TTFT and throughput against real vLLM servers, "
                             "codes vs own prefill vs raw KV reuse")
    serve.add_argument("--bundle", help=DEMO_BUNDLE_HELP)
    serve.add_argument("--consumer", default="smollm2-135m-shakespeare")
    serve.add_argument("--prefix-tokens", type=int, nargs="+", help="default 512 1024 2048 (with --link: 512 2048)")
    serve.add_argument("--concurrency", type=int, nargs="+", help="default 1 4 16 (with --link: 1 16)")
    serve.add_argument("--link", nargs="+", metavar="RATE[:DELAY]",
                       help="producer and consumer on two hosts (network namespaces, a veth shaped with tc; needs "
                            "root), measured at each link shape in turn, e.g. 100mbit 1gbit 10gbit unshaped")
    serve.add_argument("--requests", type=int, default=16,
                       help="with --link: distinct stored prefixes asked for per cell (a multiple of --concurrency)")
    serve.add_argument("--no-model", action="store_true", help="with --link: skip bench ttft's modelled figures")
    serve.add_argument("--waves", type=int, default=2, help="waves of concurrent requests per route and setting")
    serve.add_argument("--suffix-tokens", type=int, default=32, help="distinct tokens after the shared prefix")
    serve.add_argument("--new-tokens", type=int, help="tokens generated per request (default 16; with --link 4)")
    serve.add_argument("--root", help="the servers' store, logs and stats (default: a temporary directory)")
    serve.add_argument("--agreement-windows", type=int, default=10,
                       help="held-out windows per consumer: greedy answers by each route against its own (0: skip)")
    serve.add_argument("--agreement-consumers", nargs="+", default=list(catalog_consumers()),
                       help="the fine-tunes whose answers are compared (their pairs must be in the bundle)")
    serve.add_argument("--json", type=Path)
    serve.set_defaults(func=bench_serve)

    slow = bench.add_parser("async-load", help="measured: the other requests' inter-token latency while a consumer's "
                            "codes come over a slow link to Redis, with async_loads on and off (real vLLM server)")
    slow.add_argument("--bundle", help=DEMO_BUNDLE_HELP)
    slow.add_argument("--consumer", default="smollm2-135m-shakespeare")
    slow.add_argument("--prefix-tokens", type=int, default=2048, help="the stored prefix of each probe request")
    slow.add_argument("--probes", type=int, default=3, help="consumer requests whose prefix only Redis holds")
    slow.add_argument("--background", type=int, default=3, help="requests decoding meanwhile (no stored prefix)")
    slow.add_argument("--background-tokens", type=int, default=160)
    slow.add_argument("--link-latency-ms", type=float, default=2.0, help="the shaped link's round trip (set)")
    slow.add_argument("--link-mbps", type=float, default=4.0, help="the shaped link's megabytes per second (set)")
    slow.add_argument("--root", help="Redis data, keys, stores and logs (default: a temporary directory)")
    slow.add_argument("--json", type=Path)
    slow.set_defaults(func=bench_async_load)

    sizes = bench.add_parser("decoder-sizes", help="a consumer's decoder bytes against its own weights (SmolLM2, "
                             "Llama-3-8B, a multi-head 7B; computed from configs)")
    sizes.add_argument("--json", type=Path)
    sizes.set_defaults(func=bench_decoder_sizes)

    entropy = bench.add_parser("entropy", help="measured: what a space's indices cost entropy-coded (order 0, "
                               "with token / layer contexts, fractional-rate scalar quantisers), before a coder")
    entropy.add_argument("--bundle", type=Path, default=None, help=DEMO_BUNDLE_HELP)
    entropy.add_argument("--table-windows", type=int, default=24, help="calibration windows per corpus (the tables)")
    entropy.add_argument("--test-windows", type=int, default=24, help="held-out windows per corpus (the rates)")
    entropy.add_argument("--seed", type=int, default=0)
    entropy.add_argument("--json", type=Path)
    entropy.set_defaults(func=bench_entropy)

    engine_put = bench.add_parser("engine-put", help="what a producer engine's thread waits for per stored prompt "
                                  "(a real LMCacheEngine with the plugin)")
    engine_put.add_argument("--prompts", type=int, default=30)
    engine_put.add_argument("--prompt-tokens", type=int, default=1024)
    engine_put.add_argument("--chunk-tokens", type=int, default=256)
    engine_put.add_argument("--json", type=Path)
    engine_put.set_defaults(func=bench_engine_put)
