"""The producer's side of calibration: moments of its KV features, and code spaces built from them.

Per group (layer x K/V) the pre-RoPE features of the producer's KV on calibration windows (sink
tokens excluded) give a mean and a covariance; a code space for any budget is a PCA basis of those
with greedy bit allocation (:meth:`CodeSpace.from_statistics`). PATCH from ``H_in`` adds the same
moments of the producer's normalised pre-attention input at the patch layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from scd_store.adapters.transformers.calibration.config import CalibrationConfig
from scd_store.adapters.transformers.calibration.text import calibration_windows
from scd_store.adapters.transformers.capture import prefill_capture
from scd_store.adapters.transformers.layout import layout_of
from scd_store.adapters.transformers.loading import LoadedModel
from scd_store.codecs.scd.ecsq import EcsqQuantiser, fit, step_tables
from scd_store.codecs.scd.layout import KVLayout, to_features
from scd_store.codecs.scd.space import CodeSpace, key_weights
from scd_store.models.windows import Corpus


@dataclass(slots=True)
class SpaceStatistics:
    """First and second moments of the producer's features (and ``H_in`` at some layers) on
    calibration windows: every code space of a sweep (budgets, patch layers) is built from them."""

    layout: KVLayout
    mean: torch.Tensor  # [G, C] float64
    cov: torch.Tensor  # [G, C, C]
    hidden: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (mean [D], cov [D, D])
    producer_fingerprint: str
    samples: torch.Tensor | None = None  # [N, G, C] fp16 features (kept for entropy-coded quantisers)
    # ECSQ step tables per head_groups (the basis): every budget of a sweep shares them
    step_tables: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def space(self, space_id: str, config: CalibrationConfig, patch_layers: tuple[int, ...] = ()) -> CodeSpace:
        """The code space for ``config.budget`` (PATCH ``H_in`` codes at ``patch_layers``, which must be
        among the layers the statistics hold)."""
        hidden_stats = None
        if patch_layers:
            missing = [layer for layer in patch_layers if layer not in self.hidden]
            if missing:
                raise ValueError(f"no H_in statistics for patch layers {missing}")
            hidden_stats = (tuple(patch_layers), torch.stack([self.hidden[i][0] for i in patch_layers]),
                            torch.stack([self.hidden[i][1] for i in patch_layers]))
        space = CodeSpace.from_statistics(space_id, self.layout, self.mean, self.cov, config.budget,
                                          config.recipe.key_weight, config.recipe.sink_tokens,
                                          self.producer_fingerprint, hidden_stats, head_groups=config.head_groups)
        if config.quantiser == "ecsq":
            space = space.with_ecsq(self.entropy_coded(space, config), config.payload_packing)
        elif config.payload_packing == "ans-1":
            space = space.with_tables(self.coordinates(space))
        return space

    def coordinates(self, space: CodeSpace) -> torch.Tensor:
        """The kept calibration features in ``space``'s basis ``[N, G * C]``."""
        if self.samples is None:
            raise ValueError("fitting quantisers or code tables needs the calibration features: "
                             "space_statistics(keep_samples=True)")
        return torch.cat([space.project(chunk.float()).flatten(1) for chunk in self.samples.split(2048)])

    def entropy_coded(self, space: CodeSpace, config: CalibrationConfig) -> EcsqQuantiser:
        """Entropy-coded scalar quantisers over ``space``'s basis at ``config.budget`` (the tables' entropy,
        against 16 bits), fitted on the kept calibration features."""
        z = self.coordinates(space)
        sigma = space.sigma.flatten()
        if config.head_groups not in self.step_tables:
            self.step_tables[config.head_groups] = step_tables(z, sigma)
        weights = key_weights(self.layout.groups, self.layout.width, config.recipe.key_weight).flatten()
        return fit(z, sigma, weights, config.budget * 16, self.step_tables[config.head_groups])


@torch.no_grad()
def space_statistics(producer: LoadedModel, corpora: list[Corpus], config: CalibrationConfig,
                     hidden_layers: tuple[int, ...] = (), progress: bool = True,
                     keep_samples: bool = False) -> SpaceStatistics:
    """Moments of the producer's pre-RoPE K / V features (sink tokens excluded) and of ``H_in`` at
    ``hidden_layers`` over calibration windows of ``corpora``; ``keep_samples`` also keeps the features
    (fp16) that entropy-coded quantisers are fitted on."""
    layout = layout_of(producer.model)
    sinks = config.recipe.sink_tokens
    g, c = layout.groups, layout.width
    total = torch.zeros(g, c, dtype=torch.float64)
    outer = torch.zeros(g, c, c, dtype=torch.float64)
    width = producer.model.config.hidden_size
    h_total = torch.zeros(len(hidden_layers), width, dtype=torch.float64)
    h_outer = torch.zeros(len(hidden_layers), width, width, dtype=torch.float64)
    count = 0
    kept = []
    windows = [w for corpus in corpora for w in calibration_windows(
        producer.tokenizer, corpus, config.basis_windows, config.prefix_tokens, config.seed, config.recipe.splits)]
    for window in tqdm(windows, desc="code space: producer KV", unit="window", disable=not progress):
        state, _ = prefill_capture(producer.model, window, hidden_layers=hidden_layers, last_logits_only=True)
        x = to_features(state, layout)[sinks:].double().cpu().transpose(0, 1)  # [G, T, C]
        if keep_samples:
            kept.append(x.transpose(0, 1).half())
        total += x.sum(1)
        outer += x.transpose(1, 2) @ x
        count += x.shape[1]
        if hidden_layers:
            h = torch.stack([state.hidden[layer][sinks:] for layer in hidden_layers]).double().cpu()
            h_total += h.sum(1)
            h_outer += h.transpose(1, 2) @ h
    mean = total / count
    cov = outer / count - mean.unsqueeze(2) * mean.unsqueeze(1)
    h_mean = h_total / count
    h_cov = h_outer / count - h_mean.unsqueeze(2) * h_mean.unsqueeze(1)
    hidden = {layer: (h_mean[i], h_cov[i]) for i, layer in enumerate(hidden_layers)}
    return SpaceStatistics(layout, mean, cov, hidden, producer.fingerprint, torch.cat(kept) if kept else None)


def fit_space(producer: LoadedModel, corpora: list[Corpus], config: CalibrationConfig, space_id: str,
              progress: bool = True, patch_layers: tuple[int, ...] = ()) -> CodeSpace:
    """PCA basis and bit allocation from the producer's KV on calibration windows of ``corpora``; with
    ``patch_layers`` (and ``patch_source="hidden"``) also the basis of ``H_in`` at those layers."""
    coded_hidden = tuple(patch_layers) if config.patch_source == "hidden" else ()
    stats = space_statistics(producer, corpora, config, coded_hidden, progress, config.keeps_samples)
    return stats.space(space_id, config, coded_hidden)
