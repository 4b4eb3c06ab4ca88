"""Payload of fixed-rate spaces range-coded against tables counted on their calibration windows, measured
on held-out windows beside the same codes in bit planes (what `calibrate --packing ans-1` would ship).

Usage: python benchmarks/range_coded_payloads.py BUNDLE [BUNDLE ...] [--json OUT]
The tables come from the space's own basis windows (24 per corpus, calibration split); the payloads are 24
held-out 448-token windows (12 per corpus) encoded both ways: real serialised bytes, sinks and header included.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from scd_store.adapters.transformers import load_model
from scd_store.adapters.transformers.calibration.text import calibration_windows
from scd_store.adapters.transformers.capture import prefill_capture
from scd_store.codecs.scd.bundle import load_space, read_space_manifest
from scd_store.codecs.scd.layout import to_features
from scd_store.models import catalog
from scd_store.models.windows import eval_windows

LENGTH, TABLE_WINDOWS, TEST_WINDOWS, SINKS = 448, 24, 12, 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundles", nargs="+", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    producer = load_model(catalog.PRODUCER)
    report = {}
    for bundle in args.bundles:
        space = load_space(bundle, producer_fingerprint=producer.fingerprint)
        corpora = read_space_manifest(bundle)["corpora"]
        train = [w for c in corpora for w in calibration_windows(producer.tokenizer, c, TABLE_WINDOWS, LENGTH, 0,
                                                                  ("calib",))]
        z = torch.cat([space.project(to_features(prefill_capture(producer.model, w, last_logits_only=True)[0],
                                                 space.layout)[SINKS:]).flatten(1) for w in train])
        ranged = space.with_tables(z)
        test = [w for c in corpora for w in eval_windows(producer.tokenizer, c, TEST_WINDOWS, LENGTH, 0)]
        states = [prefill_capture(producer.model, w, last_logits_only=True)[0] for w in test]
        fp16 = sum(s.fp16_bytes() for s in states)
        report[str(bundle)] = {
            "planes_ratio": round(sum(len(space.encode(s)) for s in states) / fp16, 4),
            "ans_ratio": round(sum(len(ranged.encode(s)) for s in states) / fp16, 4),
            "tables_entropy_ratio": round(ranged.payload_ratio(), 4), "windows": len(states)}
        print(bundle, report[str(bundle)], flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
