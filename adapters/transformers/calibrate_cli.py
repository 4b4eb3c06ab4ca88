"""``scd-store calibrate``: a bundle with one code space and a decoder per consumer."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from scd_store.adapters.transformers.calibrate import (
    CalibrationConfig,
    calibration_windows,
    distil_decoder,
    fit_space,
)
from scd_store.adapters.transformers.loading import load_model
from scd_store.adapters.transformers.patch_select import choose_patch_layers, layer_gains
from scd_store.codecs.scd.bundle import load_space, save_pair, save_space
from scd_store.models import catalog


def select_layers(producer, consumers: list, config: CalibrationConfig) -> tuple[tuple[int, ...], list[list[float]]]:
    """PATCH layers for the space: the ``config.patch_layers`` largest summed exact-KV gains."""
    gains = []
    for consumer in consumers:
        spec = catalog.consumer(consumer.name)
        windows = calibration_windows(consumer.tokenizer, spec.corpus, config.selection_windows,
                                      config.prefix_tokens + config.continuation_tokens, config.seed + 2, config.splits)
        gains.append(layer_gains(producer.model, consumer.model, windows, config.prefix_tokens, progress=True))
    return choose_patch_layers(gains, config.patch_layers), gains


def calibrate(producer_name: str, consumers: list[str], out: Path, budget: float = 0.25, steps: int | None = None,
              windows: int | None = None, reuse_space: bool = False, patch_layers: int = 0,
              patch_source: str = "hidden") -> dict:
    """Fit (or reuse) the space of ``producer_name`` over the consumers' corpora and distil each decoder.

    With ``patch_layers`` = k > 0, the k layers where the consumers' exact KV helps most (measured on
    calibration text) are patched: H_in is coded there (``patch_source="hidden"``) or aligners
    correct the REUSE output there (``"kv"``, no extra payload)."""
    config = CalibrationConfig(budget=budget, patch_layers=patch_layers, patch_source=patch_source)
    if steps is not None:
        config = replace(config, distill_steps=steps)
    if windows is not None:
        config = replace(config, distill_windows=windows)
    specs = [catalog.consumer(name) for name in consumers]
    producer = load_model(producer_name)
    report: dict = {"bundle": str(out), "consumers": {}}
    start = time.perf_counter()
    loaded = [load_model(spec.name) for spec in specs]
    chosen: tuple[int, ...] = ()
    if reuse_space:
        space = load_space(out, producer_fingerprint=producer.fingerprint)
        if config.patch_source == "hidden" and patch_layers and len(space.patch_layers) != patch_layers:
            raise ValueError(f"the bundle's space patches {len(space.patch_layers)} layers, not {patch_layers}")
        chosen = space.patch_layers
    else:
        corpora = sorted({spec.corpus for spec in specs})
        if patch_layers:
            chosen, gains = select_layers(producer, loaded, config)
            report["patch_selection"] = {"layers": list(chosen), "gains": [[round(x, 5) for x in g] for g in gains]}
        space_id = f"{producer.name}-{int(round(budget * 1000)):03d}"
        if chosen and patch_source == "hidden":
            space_id += f"-p{len(chosen)}"
        space = fit_space(producer, corpora, config, space_id, patch_layers=chosen)
        save_space(out, space, extra={"producer": producer.name, "corpora": corpora,
                                      "calibration": {"budget": budget, "key_weight": config.key_weight,
                                                      "patch_layers": list(chosen), "patch_source": patch_source}})
    report["space"] = {"space_id": space.space_id, "fingerprint": space.fingerprint,
                       "payload_ratio": round(space.payload_ratio(), 4),
                       "seconds": round(time.perf_counter() - start, 1)}
    for spec, consumer in zip(specs, loaded, strict=True):
        kv_layers = chosen if config.patch_source == "kv" else ()
        decoder, stats = distil_decoder(producer, consumer, space, spec.corpus, config, patch_layers=kv_layers)
        save_pair(out, decoder, extra={"calibration": stats})
        report["consumers"][spec.name] = stats
    report["seconds"] = round(time.perf_counter() - start, 1)
    return report
