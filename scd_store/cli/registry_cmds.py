"""``scd-store register BUNDLE``, ``scd-store pairs`` and ``scd-store revoke``: a deployment's registry from
the command line (the operator's role: engines need not write the registry).

Registering writes the bundle's space and pairs (and where the bundle lies) into the registry the
store config names; engines already running bind a newly registered pair the first time they are
asked for its model, within their ``discovery_interval_s`` (no restart).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _registry(args: argparse.Namespace):  # noqa: ANN202 - a Registry
    from scd_store.store.build import open_registry_for
    from scd_store.store.config import load_config

    config = load_config(args.store_config)
    return open_registry_for(config), config


def register_command(args: argparse.Namespace) -> int:
    from scd_store.service.bundles import register_bundle

    registry, config = _registry(args)
    record, space, pairs = register_bundle(args.bundle, registry, chunk_size=config.chunk_size, replace=args.replace)
    print(f"space {record.space_id} (producer {record.producer_model_id}, payload {space.payload_ratio():.1%} of "
          f"fp16): {args.bundle.resolve()}")
    for pair, _ in pairs:
        print(f"  pair {pair.pair_id}: consumer {pair.consumer_model_id}")
    return 0


def pairs_command(args: argparse.Namespace) -> int:
    registry, _ = _registry(args)
    locations = registry.locations()
    spaces = [{"space_id": s.space_id, "producer": s.producer_model_id, "producer_fingerprint": s.producer_fingerprint,
               "fingerprint": s.fingerprint, "generation": s.generation, "chunk_size": s.chunk_size,
               "bundle": locations.get(s.ident, ""), "pairs": []} for s in registry.spaces()]
    by_id = {f"{s['space_id']}@{s['generation']}": s for s in spaces}
    for pair in registry.pairs():
        entry = {"pair_id": pair.pair_id, "consumer": pair.consumer_model_id,
                 "consumer_fingerprint": pair.consumer_fingerprint, "fingerprint": pair.bundle_fingerprint,
                 "bundle": locations.get(pair.ident, "")}
        orphan = {"space_id": pair.space_id, "generation": pair.generation, "pairs": []}
        by_id.setdefault(f"{pair.space_id}@{pair.generation}", orphan)["pairs"].append(entry)
    if args.json:
        print(json.dumps({"spaces": list(by_id.values())}, indent=1))
        return 0
    if not by_id:
        print("no spaces registered")
    for space in by_id.values():
        print(f"space {space['space_id']}  generation {space['generation']}  producer {space.get('producer', '?')}  "
              f"fingerprint {space.get('fingerprint', '?')}  {space.get('bundle') or '(no bundle recorded)'}")
        for pair in space["pairs"]:
            print(f"  {pair['consumer']:<32} fingerprint {pair['fingerprint']}  consumer weights "
                  f"{pair['consumer_fingerprint']}")
    return 0


def revoke_command(args: argparse.Namespace) -> int:
    registry, _ = _registry(args)
    removed = registry.revoke(args.ident, args.fingerprint)
    if not removed:
        print(f"nothing registered under {args.ident!r}" + (f" with fingerprint {args.fingerprint}"
                                                             if args.fingerprint else ""))
        return 1
    for name in removed:
        print(f"revoked {name}")
    print("engines stop serving them within their registry_refresh_s")
    return 0


def add_registry_parsers(sub: Any) -> None:
    register = sub.add_parser("register", help="add a bundle's space and pairs to a deployment's registry "
                              "(running engines pick them up)")
    register.add_argument("bundle", type=Path)
    register.add_argument("--store-config", help="the deployment's scd-store YAML (default: $SCD_STORE_CONFIG or "
                          "the embedded default)")
    register.add_argument("--replace", action="store_true", help="overwrite records that differ (you own the registry)")
    register.set_defaults(func=register_command)
    pairs = sub.add_parser("pairs", help="list the registry's spaces, pairs and their fingerprints")
    pairs.add_argument("--store-config")
    pairs.add_argument("--json", action="store_true")
    pairs.set_defaults(func=pairs_command)
    revoke = sub.add_parser("revoke", help="remove a space (with its pairs) or a pair from the registry; running "
                            "engines stop serving it within their registry_refresh_s")
    revoke.add_argument("ident", help="a space id or a pair id (as `scd-store pairs` lists them)")
    revoke.add_argument("--fingerprint", help="only the generation whose space fingerprint this is")
    revoke.add_argument("--store-config")
    revoke.set_defaults(func=revoke_command)
