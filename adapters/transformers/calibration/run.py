"""``scd-store calibrate``: bundles with one code space and a decoder per consumer.

Several budgets and patch-layer counts make a sweep: the models run over the calibration windows
once (basis statistics, teacher logits, patch-layer gains) and every combination gets its own
bundle under ``OUT/b<budget>-k<k>``.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from scd_store.adapters.transformers.calibration.config import DEFAULT_BUDGET, CalibrationConfig
from scd_store.adapters.transformers.calibration.distillation import distil_decoder
from scd_store.adapters.transformers.calibration.patch_select import layer_gains, rank_layers
from scd_store.adapters.transformers.calibration.statistics import space_statistics
from scd_store.adapters.transformers.calibration.teacher import collect_teacher
from scd_store.adapters.transformers.calibration.text import calibration_windows
from scd_store.adapters.transformers.loading import LoadedModel, load_model
from scd_store.codecs.scd.bundle import load_space, save_pair, save_space
from scd_store.models import catalog


def layer_ranking(producer: LoadedModel, consumers: list[LoadedModel], config: CalibrationConfig, k: int
                  ) -> tuple[tuple[int, ...], list[list[float]]]:
    """The ``k`` layers with the largest exact-KV gains summed over ``consumers``, best first, and the gains."""
    gains = []
    for consumer in consumers:
        spec = catalog.consumer(consumer.name)
        windows = calibration_windows(consumer.tokenizer, spec.corpus, config.recipe.selection_windows,
                                      config.prefix_tokens + config.continuation_tokens, config.seed + 2,
                                      config.recipe.splits)
        gains.append(layer_gains(producer.model, consumer.model, windows, config.prefix_tokens, progress=True))
    return rank_layers(gains, k), gains


def bundle_dir(out: Path, budget: float, k: int, source: str, sweep: bool) -> Path:
    if not sweep:
        return out
    return out / (f"b{budget:g}-k{k}" + ("-kv" if k and source == "kv" else ""))


def calibrate(producer_name: str, consumers: list[str], out: Path, budget: float | list[float] = DEFAULT_BUDGET,
              steps: int | None = None, windows: int | None = None, reuse_space: bool = False,
              patch_layers: int | list[int] = 0, patch_source: str = "hidden",
              base_config: CalibrationConfig | None = None, patch_at: tuple[int, ...] = ()) -> dict:
    """Fit (or reuse) the space of ``producer_name`` over the consumers' corpora and distil each decoder.

    With ``patch_layers`` = k > 0, the k layers where the consumers' exact KV helps most (measured on
    calibration text) are patched: H_in is coded there (``patch_source="hidden"``) or aligners
    correct the REUSE output there (``"kv"``, no extra payload). Lists of budgets or k sweep.
    ``patch_at`` names the patch layers instead of measuring them (k = their count)."""
    budgets = budget if isinstance(budget, list) else [budget]
    ks = patch_layers if isinstance(patch_layers, list) else [patch_layers]
    if patch_at:
        if max(ks) > 0 or len(set(patch_at)) != len(patch_at):
            raise ValueError("give either patch_layers (k, measured) or patch_at (distinct layers), not both")
        ks = [len(patch_at)]
    combos = [(b, k) for b in budgets for k in ks]
    if reuse_space and len(combos) != 1:
        raise ValueError("--reuse-space adds decoders to one existing bundle: give one budget and one k")
    config = replace(base_config or CalibrationConfig(), budget=budgets[0], patch_layers=max(ks),
                     patch_source=patch_source)
    if steps is not None:
        config = replace(config, distill_steps=steps)
    if windows is not None:
        config = replace(config, distill_windows=windows)
    specs = [catalog.consumer(name) for name in consumers]
    start = time.perf_counter()
    producer = load_model(producer_name)
    loaded = [load_model(spec.name) for spec in specs]
    report: dict = {"out": str(out), "bundles": {}}
    ranking: tuple[int, ...] = ()
    if patch_at:
        if max(patch_at) >= producer.model.config.num_hidden_layers or min(patch_at) < 0:
            raise ValueError(f"patch layers {list(patch_at)} outside the model's layers")
        ranking = tuple(patch_at)
    elif max(ks) > 0:
        ranking, gains = layer_ranking(producer, loaded, config, max(ks))
        report["patch_ranking"] = {"layers": list(ranking), "gains": [[round(x, 5) for x in g] for g in gains]}
    hidden_layers = tuple(sorted(ranking)) if patch_source == "hidden" else ()
    corpora = sorted({spec.corpus for spec in specs})
    stats = None if reuse_space else space_statistics(producer, corpora, config, hidden_layers)
    teachers = {spec.name: collect_teacher(producer, consumer, spec.corpus, config, hidden_layers)
                for spec, consumer in zip(specs, loaded, strict=True)}
    # a pair's calibration fits the time budget: the shared phases so far (models, space, teachers) count
    # per consumer against it, the rest is each distillation's (config.distill_steps=None)
    time_limit = config.time_budget_s - (time.perf_counter() - start) / len(specs)
    for b, k in combos:
        combo_config = replace(config, budget=b, patch_layers=k)
        chosen = tuple(sorted(ranking[:k]))
        path = bundle_dir(out, b, k, patch_source, len(combos) > 1)
        coded = chosen if patch_source == "hidden" else ()
        if reuse_space:
            space = load_space(path, producer_fingerprint=producer.fingerprint)
            if space.patch_layers != coded:
                raise ValueError(f"the bundle's space codes H_in at {list(space.patch_layers)}, not {list(coded)}")
        else:
            space_id = f"{producer.name}-{int(round(b * 1000)):03d}" + (f"-p{k}" if coded else "")
            space = stats.space(space_id, combo_config, coded)
            save_space(path, space, extra={"producer": producer.name, "corpora": corpora,
                                           "calibration": {"budget": b, "allocation": "variance",
                                                           "key_weight": config.recipe.key_weight,
                                                           "patch_layers": list(chosen), "patch_source": patch_source}})
        entry: dict = {"space_id": space.space_id, "payload_ratio": round(space.payload_ratio(), 4),
                       "patch_layers": list(chosen), "consumers": {}}
        for spec, consumer in zip(specs, loaded, strict=True):
            kv_layers = chosen if patch_source == "kv" else ()
            decoder, pair_stats = distil_decoder(producer, consumer, space, spec.corpus, combo_config,
                                                 patch_layers=kv_layers, teacher=teachers[spec.name],
                                                 time_limit_s=time_limit)
            save_pair(path, decoder, extra={"calibration": pair_stats})
            entry["consumers"][spec.name] = pair_stats
        report["bundles"][str(path)] = entry
    report["seconds"] = round(time.perf_counter() - start, 1)
    return report
