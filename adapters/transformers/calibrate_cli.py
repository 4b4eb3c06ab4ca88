"""``scd-store calibrate``: a bundle with one code space and a decoder per consumer."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from scd_store.adapters.transformers.calibrate import CalibrationConfig, distil_decoder, fit_space
from scd_store.adapters.transformers.loading import load_model
from scd_store.codecs.scd.bundle import load_space, save_pair, save_space
from scd_store.models import catalog


def calibrate(producer_name: str, consumers: list[str], out: Path, budget: float = 0.25, steps: int | None = None,
              windows: int | None = None, reuse_space: bool = False) -> dict:
    """Fit (or reuse) the space of ``producer_name`` over the consumers' corpora and distil each decoder."""
    config = CalibrationConfig(budget=budget)
    if steps is not None:
        config = replace(config, distill_steps=steps)
    if windows is not None:
        config = replace(config, distill_windows=windows)
    specs = [catalog.consumer(name) for name in consumers]
    producer = load_model(producer_name)
    report: dict = {"bundle": str(out), "consumers": {}}
    start = time.perf_counter()
    if reuse_space:
        space = load_space(out, producer_fingerprint=producer.fingerprint)
    else:
        corpora = sorted({spec.corpus for spec in specs})
        space_id = f"{producer.name}-{int(round(budget * 1000)):03d}"
        space = fit_space(producer, corpora, config, space_id)
        save_space(out, space, extra={"producer": producer.name, "corpora": corpora,
                                      "calibration": {"budget": budget, "key_weight": config.key_weight}})
    report["space"] = {"space_id": space.space_id, "fingerprint": space.fingerprint,
                       "payload_ratio": round(space.payload_ratio(), 4),
                       "seconds": round(time.perf_counter() - start, 1)}
    for spec in specs:
        consumer = load_model(spec.name)
        decoder, stats = distil_decoder(producer, consumer, space, spec.corpus, config)
        save_pair(out, decoder, extra={"calibration": stats})
        report["consumers"][spec.name] = stats
    report["seconds"] = round(time.perf_counter() - start, 1)
    return report
