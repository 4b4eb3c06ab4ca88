"""``scd-store calibrate``: bundles with one code space and a decoder per consumer.

Several budgets and patch-layer counts make a sweep: the models run over the calibration windows
once (basis statistics, teacher logits, patch-layer gains) and every combination gets its own
bundle under ``OUT/b<budget>-k<k>``. Models are catalog names, local checkpoints or PEFT adapters
(:mod:`scd_store.models.sources`); text is a built-in corpus or the user's own files. Everything that
can be checked without the weights (specs, architectures, tokenizers, enough text) is checked first.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from scd_store.adapters.transformers.calibration.config import DEFAULT_BUDGET, CalibrationConfig
from scd_store.adapters.transformers.calibration.distillation import distil_decoder
from scd_store.adapters.transformers.calibration.estimate import estimate
from scd_store.adapters.transformers.calibration.patch_select import layer_gains, rank_layers
from scd_store.adapters.transformers.calibration.statistics import space_statistics
from scd_store.adapters.transformers.calibration.teacher import collect_teacher
from scd_store.adapters.transformers.calibration.text import calibration_windows
from scd_store.adapters.transformers.loading import LoadedModel, load_model
from scd_store.codecs.scd.bundle import load_space, save_pair, save_space
from scd_store.models import catalog
from scd_store.models.sources import ModelSource, check_pair, resolve, tokenizer_of
from scd_store.models.windows import Corpus, corpus_name, count_windows


@dataclass(frozen=True, slots=True)
class PairPlan:
    """One consumer of a calibration and the text its decoder is distilled on."""

    source: ModelSource
    corpus: Corpus


def plan_pairs(producer: ModelSource, consumers: list[str | ModelSource], text: Corpus | None) -> list[PairPlan]:
    """Each consumer with its text: ``text`` when given, else its catalog corpus (a consumer from
    outside the catalog needs ``text``). Architectures and tokenizers are checked against the producer."""
    plans = []
    for spec in consumers:
        source = spec if isinstance(spec, ModelSource) else resolve(spec, base=producer)
        if text is None and not source.in_catalog:
            raise ValueError(f"consumer {source.name} is not in the catalog: give its calibration text (--text PATH)")
        check_pair(producer, source)
        plans.append(PairPlan(source, text if text is not None else catalog.consumer(source.name).corpus))
    names = [p.source.name for p in plans]
    if len(set(names)) != len(names) or producer.name in names:
        raise ValueError(f"consumer names must be distinct and differ from the producer's: {names}")
    return plans


def check_text(producer: ModelSource, plans: list[PairPlan], config: CalibrationConfig, space: bool,
               ranking: bool) -> None:
    """Raise ``ValueError`` unless every text holds the windows the plan draws (before any model loads)."""
    window = config.prefix_tokens + config.continuation_tokens
    wanted = [(config.distill_windows, window, "distillation windows (--windows)")]
    if ranking:
        wanted.append((config.recipe.selection_windows, window, "PATCH layer-selection windows"))
    if space:
        wanted.append((config.basis_windows, config.prefix_tokens, "code-space windows"))
    corpora = {corpus_name(plan.corpus): plan.corpus for plan in plans}  # consumers sharing a text: checked once
    for name, corpus in corpora.items():
        have = count_windows(tokenizer_of(producer.path), corpus, tuple({n for _, n, _ in wanted}), split="calib")
        for count, length, what in wanted:
            if have[length] < count:
                raise ValueError(f"too little calibration text in {name}: {count} {what} of {length} tokens are "
                                 f"drawn, it holds {have[length]} ({have[length] * length:,} tokens of the "
                                 f"~{count * length:,} needed); add text or lower --windows / --prefix-tokens")


def layer_ranking(producer: LoadedModel, consumers: list[LoadedModel], plans: list[PairPlan],
                  config: CalibrationConfig, k: int) -> tuple[tuple[int, ...], list[list[float]]]:
    """The ``k`` layers with the largest exact-KV gains summed over ``consumers``, best first, and the gains."""
    gains = []
    for consumer, plan in zip(consumers, plans, strict=True):
        windows = calibration_windows(consumer.tokenizer, plan.corpus, config.recipe.selection_windows,
                                      config.prefix_tokens + config.continuation_tokens, config.seed + 2,
                                      config.recipe.splits)
        gains.append(layer_gains(producer.model, consumer.model, windows, config.prefix_tokens, progress=True))
    return rank_layers(gains, k), gains


def bundle_dir(out: Path, budget: float, k: int, source: str, sweep: bool) -> Path:
    if not sweep:
        return out
    return out / (f"b{budget:g}-k{k}" + ("-kv" if k and source == "kv" else ""))


def calibrate(producer_name: str | ModelSource, consumers: list[str | ModelSource], out: Path,
              budget: float | list[float] = DEFAULT_BUDGET, steps: int | None = None, windows: int | None = None,
              reuse_space: bool = False, patch_layers: int | list[int] = 0, patch_source: str = "hidden",
              base_config: CalibrationConfig | None = None, patch_at: tuple[int, ...] = (),
              text: Corpus | None = None, device: str = "cpu", progress: bool = True) -> dict:
    """Fit (or reuse) the producer's space over the consumers' text and distil each decoder.

    Models are catalog names, checkpoint directories, PEFT adapter directories (merged onto the
    producer) or :class:`ModelSource`; ``text`` (a built-in corpus name or :class:`UserText`) is every
    consumer's calibration text, default each catalog consumer's own corpus. With ``patch_layers`` = k
    > 0, the k layers where the consumers' exact KV helps most (measured on calibration text) are
    patched: H_in is coded there (``patch_source="hidden"``) or aligners correct the REUSE output
    there (``"kv"``, no extra payload). Lists of budgets or k sweep. ``patch_at`` names the patch
    layers instead of measuring them (k = their count)."""
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
    producer_source = producer_name if isinstance(producer_name, ModelSource) else resolve(producer_name)
    plans = plan_pairs(producer_source, consumers, text)
    ranked = max(ks) > 0 and not patch_at
    check_text(producer_source, plans, config, space=not reuse_space, ranking=ranked)
    start = time.perf_counter()
    producer = load_model(producer_source, device=device)
    loaded = [load_model(plan.source, device=device) for plan in plans]
    guess = estimate(producer, loaded[0], config, len(loaded) * len(combos), 0 if reuse_space else config.basis_windows,
                     config.recipe.selection_windows if ranked else 0)
    if progress:
        print(guess.line(len(loaded) * len(combos), config.distill_steps), file=sys.stderr, flush=True)
    report: dict = {"out": str(out), "estimate": guess.to_dict(), "bundles": {}}
    ranking: tuple[int, ...] = ()
    if patch_at:
        if max(patch_at) >= producer.model.config.num_hidden_layers or min(patch_at) < 0:
            raise ValueError(f"patch layers {list(patch_at)} outside the model's layers")
        ranking = tuple(patch_at)
    elif ranked:
        ranking, gains = layer_ranking(producer, loaded, plans, config, max(ks))
        report["patch_ranking"] = {"layers": list(ranking), "gains": [[round(x, 5) for x in g] for g in gains]}
    hidden_layers = tuple(sorted(ranking)) if patch_source == "hidden" else ()
    corpora = {corpus_name(plan.corpus): plan.corpus for plan in plans}
    stats = None if reuse_space else space_statistics(producer, [corpora[n] for n in sorted(corpora)], config,
                                                      hidden_layers, progress, config.keeps_samples)
    teachers = {plan.source.name: collect_teacher(producer, consumer, plan.corpus, config, hidden_layers, progress)
                for plan, consumer in zip(plans, loaded, strict=True)}
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
            save_space(path, space, extra={"producer": producer.name, "corpora": sorted(corpora),
                                           "calibration": {"budget": b, "allocation": "variance",
                                                           "key_weight": config.recipe.key_weight,
                                                           "patch_layers": list(chosen), "patch_source": patch_source,
                                                           "head_groups": config.head_groups,
                                                           "quantiser": config.quantiser,
                                                           "packing": config.payload_packing,
                                                           "device": str(producer.device)}})
        entry: dict = {"space_id": space.space_id, "payload_ratio": round(space.payload_ratio(), 4),
                       "patch_layers": list(chosen), "consumers": {}}
        for plan, consumer in zip(plans, loaded, strict=True):
            kv_layers = chosen if patch_source == "kv" else ()
            decoder, pair_stats = distil_decoder(producer, consumer, space, plan.corpus, combo_config,
                                                 progress=progress, patch_layers=kv_layers,
                                                 teacher=teachers[plan.source.name])
            pair_stats = {**pair_stats, "text": corpus_name(plan.corpus),
                          "adapter": str(plan.source.adapter) if plan.source.adapter else None}
            save_pair(path, decoder, extra={"calibration": pair_stats})
            entry["consumers"][plan.source.name] = pair_stats
        report["bundles"][str(path)] = entry
    report["seconds"] = round(time.perf_counter() - start, 1)
    return report
