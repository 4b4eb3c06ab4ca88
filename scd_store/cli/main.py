"""``scd-store``: one command line with subcommands."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _models_prepare(args: argparse.Namespace) -> int:
    from scd_store.models import catalog
    from scd_store.models.prepare import prepare_consumer, prepare_producer

    names = args.only or list(catalog.ALL_MODELS)
    for name in names:
        path = prepare_producer(force=args.force) if name == catalog.PRODUCER else prepare_consumer(name, args.force)
        print(f"{name}: {path}")
    return 0


def _models_train(args: argparse.Namespace) -> int:
    import json

    from scd_store.models.train import train_consumer

    print(json.dumps(train_consumer(args.consumer)))
    print("adapter written; run `scd-store models prepare --force` to rebuild the checkpoint")
    return 0


def _models_list(_: argparse.Namespace) -> int:
    from scd_store.models import catalog
    from scd_store.models.prepare import ModelNotPrepared, model_dir

    for name in catalog.ALL_MODELS:
        try:
            print(f"{name}\t{model_dir(name)}")
        except ModelNotPrepared:
            print(f"{name}\t(not prepared)")
    return 0


def _bench_quality(args: argparse.Namespace) -> int:
    from scd_store.bench.quality import QualityConfig, run_quality, write_report
    from scd_store.cli.tables import print_quality

    methods = {} if args.methods is None else {"methods": tuple(["oracle", *(m for m in args.methods.split(",")
                                                                              if m and m != "oracle")])}
    config = QualityConfig(args.consumer, producer=args.producer, text=tuple(args.text),
                           calib_text=tuple(args.calib_text), windows=args.windows, seed=args.seed, device=args.device,
                           prefix_tokens=args.prefix_tokens, continuation_tokens=args.continuation_tokens,
                           bundles=tuple(str(b) for b in args.bundle), no_map=args.no_map,
                           anchor_map=str(args.anchor_map or ""), droidspeak_layers=args.droidspeak_layers, **methods)
    if args.quick:
        config = config.quick()
    report = run_quality(config)
    print_quality(report)
    write_report(report, args.json)
    return 0


def _bench_pareto(args: argparse.Namespace) -> int:
    from scd_store.bench.pareto import plot_reports

    print(plot_reports(args.reports, args.png))
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    import json
    from dataclasses import replace

    from scd_store.adapters.transformers.calibration import CalibrationConfig, calibrate
    from scd_store.models.user_text import UserText

    base = CalibrationConfig()
    if args.prefix_tokens:
        base = replace(base, prefix_tokens=args.prefix_tokens)
    if args.continuation_tokens:
        base = replace(base, continuation_tokens=args.continuation_tokens)
    base = replace(base, decoder=args.decoder, head_groups=args.head_groups, quantiser=args.quantiser,
                   packing=args.packing)
    print(json.dumps(calibrate(args.producer, args.consumer, args.out, budget=args.budget or [base.budget],
                               steps=args.steps, windows=args.windows, reuse_space=args.reuse_space,
                               patch_layers=args.patch_layers or [0], patch_source=args.patch_source,
                               base_config=base, patch_at=tuple(args.patch_at),
                               text=UserText(tuple(args.text)) if args.text else None,
                               device=resolve_device(args.device)), indent=2))
    return 0


def resolve_device(device: str) -> str:
    """``auto``: CUDA when present, else the CPU."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _demo(args: argparse.Namespace) -> int:
    from scd_store.cli.demo.run import DemoConfig, main

    return main(DemoConfig(redis_url=args.redis, bundle=args.bundle, new_tokens=args.new_tokens, device=args.device,
                           engine=args.engine, agreement_requests=args.agreement_requests))


def _add_store_commands(sub: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    from scd_store.cli.bench_cmds import add_bench_parsers
    from scd_store.cli.keys_cmds import add_keys_parsers
    from scd_store.cli.registry_cmds import add_registry_parsers
    from scd_store.cli.stats_cmd import add_stats_parser
    from scd_store.cli.store_cmds import add_bench_store_parser

    add_stats_parser(sub)
    add_registry_parsers(sub)
    add_keys_parsers(sub)
    add_bench_parsers(bench)
    add_bench_store_parser(bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scd-store", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="prepare and list the model material").add_subparsers(
        dest="action", required=True)
    prepare = models.add_parser("prepare", help="build the producer and consumer checkpoints (cached)")
    prepare.add_argument("--only", nargs="+", metavar="NAME", help="prepare only these models")
    prepare.add_argument("--force", action="store_true", help="rebuild even if the cache is current")
    prepare.set_defaults(func=_models_prepare)
    train = models.add_parser("train", help="re-create a consumer's committed LoRA adapter from its recipe")
    train.add_argument("--consumer", required=True)
    train.set_defaults(func=_models_train)
    models.add_parser("list", help="show the catalog and where each model is prepared").set_defaults(
        func=_models_list)

    bench = sub.add_parser("bench", help="benchmarks (JSON output)").add_subparsers(dest="bench", required=True)
    quality = bench.add_parser("quality", help="consumer continuation quality per method, against the oracle")
    quality.add_argument("--consumer", required=True,
                         help="catalog name, checkpoint dir, PEFT adapter dir or NAME=PATH")
    quality.add_argument("--producer", default="smollm2-135m-instruct", help="catalog name or checkpoint dir")
    quality.add_argument("--text", action="append", default=[], metavar="PATH",
                         help="held-out evaluation text: .txt/.md/.jsonl files or folders (repeat; default: the "
                              "catalog consumer's eval split). Never text the bundle was calibrated on")
    quality.add_argument("--calib-text", action="append", default=[], metavar="PATH",
                         help="with --text: text the droidspeak baseline picks its layers on (else it is skipped)")
    quality.add_argument("--windows", type=int, default=20)
    quality.add_argument("--prefix-tokens", type=int, default=448)
    quality.add_argument("--continuation-tokens", type=int, default=64)
    quality.add_argument("--seed", type=int, default=0)
    quality.add_argument("--quick", action="store_true", help="6 windows, 32 scored tokens")
    quality.add_argument("--device", default="cpu")
    quality.add_argument("--json", type=Path, help="write the report here")
    quality.add_argument("--bundle", type=Path, action="append", default=[],
                         help="an SCD calibration bundle: adds an scd method (repeat for a budget sweep)")
    quality.add_argument("--methods", help="comma-separated subset (oracle is always measured); default: all baselines "
                                           "(rot1..rot4, the rotated scalar quantiser, only when named)")
    quality.add_argument("--no-map", action="store_true",
                         help="also each bundle's codes decoded without the consumer's map (no adaptation)")
    quality.add_argument("--anchor-map", type=Path, metavar="BUNDLE",
                         help="also each anchor (raw, int*, rot*, kvq2) followed by BUNDLE's distilled map for this "
                              "consumer (<anchor>+map): adaptation held equal, compression compared")
    quality.add_argument("--droidspeak-layers", type=int, default=6, help="layers the droidspeak baseline recomputes")
    quality.set_defaults(func=_bench_quality)
    _add_store_commands(sub, bench)

    pareto = bench.add_parser("pareto", help="plot quality reports (payload ratio against PPL rise, KL and top-1, "
                                                      "with intervals) into one PNG")
    pareto.add_argument("reports", type=Path, nargs="+", help="quality report JSON files, one panel each")
    pareto.add_argument("--png", type=Path, required=True)
    pareto.set_defaults(func=_bench_pareto)

    cal = sub.add_parser("calibrate", help="fit a code space and distil consumer decoders into a bundle")
    cal.add_argument("--producer", default="smollm2-135m-instruct", help="catalog name or checkpoint dir")
    cal.add_argument("--consumer", action="append", required=True,
                     help="catalog name, checkpoint dir, PEFT LoRA adapter dir (on the producer) or NAME=PATH; "
                          "repeat for a shared code space")
    cal.add_argument("--text", action="append", default=[], metavar="PATH",
                     help="calibration text: .txt/.md files, folders of them, JSONL with 'text' or chat 'messages' "
                          "(repeat; default: each catalog consumer's own corpus)")
    cal.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    cal.add_argument("--decoder", choices=["auto", "dense", "per-head"], default="auto",
                     help="the decoder map: dense over a layer's KV heads, or one per KV head (auto: dense where it "
                          "stays within 2%% of the consumer's bf16 weights)")
    cal.add_argument("--head-groups", type=int, default=1, metavar="N",
                     help="fit the space for N tensor-parallel ranks: a basis per group of KV heads, per-head maps")
    cal.add_argument("--quantiser", choices=("fixed", "ecsq"), default="fixed",
                     help="fixed: fixed-rate quantisers in bit planes; ecsq: entropy-coded scalar quantisers with "
                          "fractional rates and range-coded payloads (--budget is then the coded entropy)")
    cal.add_argument("--packing", choices=("planes-2", "ans-1"), default="",
                     help="the payload format producers write: bit planes (fastest to decode) or range-coded against "
                          "tables counted on the calibration text (fewest bytes); default: planes-2 for fixed, "
                          "ans-1 for ecsq")
    cal.add_argument("--out", type=Path, required=True, help="bundle directory")
    cal.add_argument("--budget", type=float, action="append",
                     help="coded bits per dimension against fp16 (default 0.24: payload <= 25%% of fp16 KV); "
                          "repeat for a sweep")
    cal.add_argument("--steps", type=int, default=None,
                     help="distillation steps per consumer (default 900, on every machine; the time it will take is "
                          "estimated and printed before it starts)")
    cal.add_argument("--windows", type=int, default=None, help="distillation windows per consumer")
    cal.add_argument("--prefix-tokens", type=int, default=None,
                     help="prefix length of calibration windows (default 448; --continuation-tokens follow)")
    cal.add_argument("--continuation-tokens", type=int, default=None,
                     help="scored tokens after each cut in distillation (default 64)")
    cal.add_argument("--patch-layers", type=int, action="append",
                     help="k: layers the consumers regenerate (PATCH), chosen on calibration text (default 0); "
                          "repeat for a sweep (bundles OUT/b<budget>-k<k>)")
    cal.add_argument("--patch-at", type=lambda text: [int(x) for x in text.split(",")], default=[],
                     help="comma-separated layers to patch, instead of measuring which (--patch-layers)")
    cal.add_argument("--patch-source", choices=["hidden", "kv"], default="hidden",
                     help="hidden: code H_in at patch layers; kv: aligners on the REUSE output (no extra payload)")
    cal.add_argument("--reuse-space", action="store_true",
                     help="keep the bundle's existing code space (stored codes stay valid); only add decoders")
    cal.set_defaults(func=_calibrate)

    demo = sub.add_parser("demo", help="the main job: one shared prefill, two fine-tunes served from its codes")
    demo.add_argument("--device", default="cpu")
    demo.add_argument("--redis", help="add a Redis tier (and keep the registry there), e.g. redis://127.0.0.1:6379")
    demo.add_argument("--bundle", help="serve this calibration bundle (default: the one kept with scd-store for the "
                                       "catalog fine-tunes, calibrated at the defaults)")
    demo.add_argument("--agreement-requests", type=int, default=6,
                      help="held-out requests per fine-tune whose answers are compared with its own, codes and raw "
                           "KV, with 95%% intervals (vLLM; 0: none)")
    demo.add_argument("--new-tokens", type=int, default=24, help="greedy tokens generated per request")
    demo.add_argument("--engine", choices=("auto", "vllm", "transformers"), default="auto",
                      help="vllm: real vLLM servers in their own processes; transformers: this process "
                           "(auto: vllm when installed)")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from scd_store.cli.allocator import keep_freed_blocks
    from scd_store.errors import ScdStoreError
    from scd_store.models.prepare import ModelNotPrepared

    args.allocator = keep_freed_blocks()

    try:
        return args.func(args)
    except ModelNotPrepared as exc:
        print(f"scd-store: {exc}", file=sys.stderr)
        return 3
    except (KeyError, ValueError, FileNotFoundError, ScdStoreError) as exc:
        print(f"scd-store: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # an optional package (an extra) this command needs
        print(f"scd-store: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
