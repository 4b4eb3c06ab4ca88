"""``scd-store bench entropy``: an entropy audit of a code space's indices on real KV.

The producer prefills calibration windows (the tables' text: the space's own basis windows) and
held-out windows of the space's corpora; their features go through the space's basis. Reported, in
bits per coded element, all held-out cross-entropies (:mod:`scd_store.bench.entropy_audit`):

- ``fixed``: today's fixed-rate indices (integer widths): allocated bits, order-0 coded, coded given
  the same component's previous token, coded given the previous layer's same component;
- ``curves``: weighted distortion (the allocator's: key components weighted ``key_weight``) against
  rate for fixed-rate allocations at several budgets and for entropy-coded scalar quantisers
  (fractional rates, a step per component), both measured on the held-out tokens;
- ``joint_layers``: the Gaussian rate-distortion model's saving from one basis over two adjacent
  layers (K with K, V with V) at the distortion today's allocation reaches (modelled, not coded).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from scd_store.bench.entropy_audit import (
    CONTEXT_BITS,
    coarsen,
    coded_bits,
    ecsq_allocate,
    ecsq_at_rate,
    ecsq_tables,
    entropy_bits,
    gaussian_rate,
)
from scd_store.codecs.scd.quantizer import allocate_bits, dequantize, quantize
from scd_store.codecs.scd.space import CodeSpace, key_weights


@dataclass(frozen=True, slots=True)
class EntropyConfig:
    """What ``bench entropy`` reads: a bundle, window counts per corpus, the budgets of the fixed-rate curve."""

    bundle: str
    table_windows: int = 24  # per corpus, calibration split (the space's basis windows)
    test_windows: int = 24  # per corpus, evaluation split
    seed: int = 0
    key_weight: float = 4.0  # the allocator's weight of key components (the recipe's)
    budgets: tuple[float, ...] = (0.09, 0.12, 0.15, 0.18, 0.24, 0.3, 0.5)
    ecsq_rates: tuple[float, ...] = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.84)

    def __post_init__(self) -> None:
        if min(self.table_windows, self.test_windows) <= 0:
            raise ValueError("window counts must be positive")
        if not self.budgets or min(self.budgets) <= 0 or max(self.budgets) > 1:
            raise ValueError("budgets must be in (0, 1]")


def coordinates(space: CodeSpace, producer, windows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per window, the producer's basis coordinates ``[T - sinks, groups * C]`` (float32, centred)."""
    from scd_store.adapters.transformers.capture import prefill_capture
    from scd_store.codecs.scd.layout import to_features

    out = []
    for window in tqdm(windows, desc="entropy: producer KV", unit="window"):
        state, _ = prefill_capture(producer.model, window, last_logits_only=True)
        features = to_features(state, space.layout)[space.sink_tokens:]
        out.append(space.project(features).reshape(features.shape[0], -1).float())
    return out


def weights_of(space: CodeSpace, key_weight: float) -> torch.Tensor:
    """The allocator's distortion weight per component ``[groups * C]``: ``key_weight`` on keys, 1 on values."""
    return key_weights(space.layout.groups, space.layout.width, key_weight).flatten()


def fixed_rate_point(space: CodeSpace, bits: torch.Tensor, test: torch.Tensor, weights: torch.Tensor
                     ) -> tuple[float, float]:
    """(allocated bits per element, held-out weighted distortion) of a fixed-rate allocation."""
    sigma = space.sigma.flatten()
    zhat = dequantize(quantize(test, sigma, bits), sigma, bits)
    return float(bits.double().mean()), float((weights * (test - zhat).pow(2).mean(0)).sum())


def first_rows(lengths: list[int]) -> torch.Tensor:
    """``[T]`` bool: whether each row is its window's first token (no previous-token context)."""
    first = torch.zeros(sum(lengths), dtype=torch.bool)
    first[torch.tensor([0, *lengths[:-1]]).cumsum(0)] = True
    return first


def previous_token(codes: torch.Tensor, bits: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """Each row's context: the previous row's coarsened codes (0 on a window's first row)."""
    ctx = coarsen(codes, bits)
    shifted = torch.zeros_like(ctx)
    shifted[1:] = ctx[:-1]
    shifted[first] = 0
    return shifted


def _group_codes(z: torch.Tensor, space: CodeSpace, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed-rate codes ``[T, C]`` (int64) of one group's columns and their bit widths ``[C]``."""
    c = space.layout.width
    cols = slice(group * c, (group + 1) * c)
    bits = space.bits[group]
    return quantize(z[:, cols], space.sigma[group], bits).to(torch.int64), bits


def fixed_rate_audit(space: CodeSpace, train: torch.Tensor, test: torch.Tensor, train_first: torch.Tensor,
                     test_first: torch.Tensor) -> dict:
    """Coded bits of today's indices: order 0, given the previous token, given the previous layer (a group
    at a time, so memory stays at one group's codes)."""
    contexts = 1 << CONTEXT_BITS
    totals = {"in_sample_entropy": 0.0, "order0": 0.0, "given_previous_token": 0.0, "given_previous_layer": 0.0}
    per_width: dict[int, list[float]] = {}
    coarse: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # the last groups' contexts, for the layer above
    for group in range(space.layout.groups):
        codes_train, bits = _group_codes(train, space, group)
        codes_test, _ = _group_codes(test, space, group)
        coarse[group] = (coarsen(codes_train, bits), coarsen(codes_test, bits))
        coarse.pop(group - 3, None)
        sent = bits > 0
        if not int(sent.sum()):
            continue
        a_train, a_test, b = codes_train[:, sent], codes_test[:, sent], bits[sent]
        alphabet = 1 << b
        order0 = coded_bits(a_train, a_test, alphabet)
        totals["in_sample_entropy"] += float(entropy_bits(a_test, alphabet).sum())
        totals["order0"] += float(order0.sum())
        for width, cost in zip(b.tolist(), order0.tolist(), strict=True):
            per_width.setdefault(width, []).append(cost)
        totals["given_previous_token"] += float(coded_bits(
            a_train, a_test, alphabet, previous_token(a_train, b, train_first),
            previous_token(a_test, b, test_first), contexts).sum())
        if group >= 2:
            ctx_train, ctx_test = (ctx[:, sent] for ctx in coarse[group - 2])
            totals["given_previous_layer"] += float(coded_bits(a_train, a_test, alphabet, ctx_train, ctx_test,
                                                               contexts).sum())
        else:
            totals["given_previous_layer"] += float(order0.sum())
    n_all = space.bits.numel()
    report = {"allocated": float(space.bits.double().mean()), **{k: v / n_all for k, v in totals.items()}}
    report["order0_by_width"] = {str(w): {"components": len(v), "order0_bits": round(sum(v) / len(v), 4)}
                                 for w, v in sorted(per_width.items())}
    return report


def joint_layers_audit(space: CodeSpace, train: torch.Tensor) -> dict:
    """Gaussian model: bits per element saved by one basis over layers ``l`` and ``l + 1`` (same K / V kind),
    at the distortion reverse water-filling reaches with today's bits spent on each layer's own basis."""
    g, c = space.layout.groups, space.layout.width

    def features(group: int) -> torch.Tensor:  # coordinates back to centred features: z @ basis^T
        return train[:, group * c:(group + 1) * c].double() @ space.basis[group].double().T

    sep_bits = joint_bits = 0.0
    for kind in (0, 1):
        for first in range(kind, g - 2, 4):  # disjoint pairs: layers (0, 1), (2, 3), ...
            pair = (first, first + 2)
            spent = float(space.bits[list(pair)].sum())
            x = [features(i) for i in pair]
            separate = torch.cat([torch.linalg.eigvalsh(torch.cov(xi.T)).clamp_min(0) for xi in x])
            distortion = _distortion_at(separate, spent)
            joint = torch.linalg.eigvalsh(torch.cov(torch.cat(x, 1).T)).clamp_min(0)
            sep_bits += gaussian_rate(separate, distortion)
            joint_bits += gaussian_rate(joint, distortion)
    elements = g * c
    return {"kind": "modelled (Gaussian reverse water-filling on calibration covariances)",
            "separate_bits_per_element": sep_bits / elements, "joint_bits_per_element": joint_bits / elements}


def _distortion_at(eigenvalues: torch.Tensor, bits: float) -> float:
    """The reverse water-filling distortion of ``bits`` (total) over ``eigenvalues``."""
    lo, hi = 0.0, float(eigenvalues.sum())
    for _ in range(100):
        mid = (lo + hi) / 2
        if gaussian_rate(eigenvalues, mid) > bits:
            lo = mid
        else:
            hi = mid
    return hi


def curves(space: CodeSpace, config: EntropyConfig, train: torch.Tensor, test: torch.Tensor) -> dict:
    """Weighted distortion against rate: fixed-rate allocations at ``config.budgets`` and entropy-coded
    scalar quantisers at ``config.ecsq_rates`` and at each fixed-rate point's distortion."""
    weights = weights_of(space, config.key_weight)
    variances = space.sigma.flatten().double() ** 2
    fixed = []
    for budget in config.budgets:
        bits = allocate_bits(variances, weights.double(), round(budget * 16 * weights.numel()))
        rate, distortion = fixed_rate_point(space, bits, test, weights)
        fixed.append({"budget": budget, "bits_per_element": rate, "distortion": distortion})
    start = time.perf_counter()
    tables = ecsq_tables(train, test, space.sigma.flatten())
    ecsq = []
    for rate in config.ecsq_rates:
        _, got, distortion = ecsq_at_rate(tables, weights, rate)
        ecsq.append({"bits_per_element": got, "distortion": distortion})
    same_distortion = []
    for point in fixed:
        _, got, distortion = ecsq_allocate(tables, weights, point["distortion"])
        same_distortion.append({"budget": point["budget"], "fixed_bits": point["bits_per_element"],
                                "ecsq_bits": got, "ecsq_distortion": distortion})
    return {"fixed_rate": fixed, "ecsq": ecsq, "ecsq_at_fixed_distortion": same_distortion,
            "ecsq_seconds": round(time.perf_counter() - start, 1),
            "nothing_sent": float((weights * test.pow(2).mean(0)).sum())}


def run_entropy(config: EntropyConfig) -> dict:
    """The audit of ``config.bundle``'s space on its producer and corpora (see the module docstring)."""
    from scd_store.adapters.transformers import load_model
    from scd_store.adapters.transformers.calibration.text import calibration_windows
    from scd_store.codecs.scd.bundle import load_space
    from scd_store.models import catalog
    from scd_store.models.windows import eval_windows

    bundle = Path(config.bundle)
    manifest = json.loads((bundle / "space.json").read_text())
    producer = load_model(catalog.PRODUCER)
    space = load_space(bundle, producer_fingerprint=producer.fingerprint)
    corpora = manifest.get("corpora") or []
    if not corpora:
        raise ValueError(f"{bundle}: the space names no corpora to read windows from")
    length = 448
    table_windows = [w for corpus in corpora for w in calibration_windows(
        producer.tokenizer, corpus, config.table_windows, length, config.seed, ("calib",))]
    test_windows = [w for corpus in corpora for w in eval_windows(
        producer.tokenizer, corpus, config.test_windows, length, config.seed)]
    started = time.perf_counter()
    train_parts = coordinates(space, producer, table_windows)
    test_parts = coordinates(space, producer, test_windows)
    train_first, test_first = (first_rows([p.shape[0] for p in parts]) for parts in (train_parts, test_parts))
    train, test = torch.cat(train_parts), torch.cat(test_parts)
    del train_parts, test_parts
    report = {
        "bundle": str(bundle), "space_id": space.space_id, "corpora": corpora, "prefix_tokens": length,
        "table_windows": len(table_windows), "test_windows": len(test_windows),
        "coded_elements_per_token": space.layout.groups * space.layout.width,
        "context_bits": CONTEXT_BITS, "key_weight": config.key_weight,
        "fixed": fixed_rate_audit(space, train, test, train_first, test_first),
        "joint_layers": joint_layers_audit(space, train),
    }
    report["curves"] = curves(space, config, train, test)
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report
