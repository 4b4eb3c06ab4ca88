"""What ``scd-store calibrate`` takes (:class:`CalibrationConfig`), and the method's fixed recipe.

:class:`Recipe` holds the constants the method was measured with (sink tokens, key weighting,
random cuts, optimiser): they are not deployment knobs. The experiments behind each value are in
docs/research/ (docs/calibration.md lists them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scd_store.codecs.scd.decoder import STRUCTURES
from scd_store.codecs.scd.patch import SOURCES

# coded bits against fp16 KV: with sinks and headers a 448-token payload is 24.7% of raw fp16 (<= 25%)
DEFAULT_BUDGET = 0.24
# distillation steps per consumer: the measured default bundle's (docs/calibration.md)
DEFAULT_STEPS = 900
QUANTISERS = ("fixed", "ecsq")


@dataclass(frozen=True, slots=True)
class Recipe:
    """The distillation recipe: fixed by measurement, the same for every pair."""

    sink_tokens: int = 4  # positions 0..3 are sent raw, never through the basis
    key_weight: float = 4.0  # bit allocation: key components weighted against values
    # each step cuts the coded prefix at a random length in [shortest_prefix * prefix_tokens, prefix_tokens]
    # and scores the continuation after the cut (1.0 = always the whole prefix)
    shortest_prefix: float = 0.5
    batch_size: int = 2
    lr_weight: float = 1e-4
    lr_bias: float = 1e-3
    lr_patch: float = 1e-3
    patch_units: int = 128  # PATCH aligner MLP width
    selection_windows: int = 4  # calibration windows that rank the layers for PATCH
    # corpus splits windows are drawn from: never "eval"; not "train" (the consumer was fine-tuned on it)
    splits: tuple[str, ...] = ("calib",)

    def __post_init__(self) -> None:
        if self.sink_tokens < 0 or self.batch_size <= 0:
            raise ValueError("sink_tokens must be >= 0 and batch_size positive")
        if self.key_weight <= 0:
            raise ValueError(f"key_weight must be positive, got {self.key_weight}")
        if not 0 < self.shortest_prefix <= 1:
            raise ValueError(f"shortest_prefix must be in (0, 1], got {self.shortest_prefix}")
        if min(self.lr_weight, self.lr_bias, self.lr_patch) <= 0:
            raise ValueError("learning rates must be positive")
        if self.patch_units <= 0 or self.selection_windows <= 0:
            raise ValueError("patch_units and selection_windows must be positive")
        if not self.splits or "eval" in self.splits:
            raise ValueError(f"calibration splits must be non-empty and exclude eval, got {self.splits}")


@dataclass(frozen=True, slots=True)
class CalibrationConfig:
    """One calibration: the payload budget, the text it sees, how long it distils, PATCH."""

    budget: float = DEFAULT_BUDGET  # coded bits against fp16 KV
    prefix_tokens: int = 448  # calibration prefixes: the serving length
    continuation_tokens: int = 64  # scored tokens after each cut (as many as `bench quality` scores)
    basis_windows: int = 24  # per corpus, for the code space's basis
    distill_windows: int = 48  # per consumer
    # fixed, so every machine gets the same bundle for the same text (a slow one just takes longer)
    distill_steps: int = DEFAULT_STEPS
    patch_layers: int = 0  # k: layers whose K / V the consumer regenerates (PATCH); 0 = REUSE only
    patch_source: str = "hidden"  # "hidden": code H_in at those layers; "kv": aligners on the REUSE output
    # the decoder map: "dense", "per-head", or "auto" (dense where it stays within 2% of the consumer's bf16 weights)
    decoder: str = "auto"
    # tensor-parallel ranks the space is fitted for: a basis per group of kv_heads / head_groups heads, and a
    # per-head map (so each rank encodes and decodes its own heads alone); 1 = one basis over every head
    head_groups: int = 1
    # "fixed": fixed-rate quantisers (integer widths, bit planes); "ecsq": entropy-coded scalar quantisers
    # (fractional rates, range-coded payloads; budget is then the tables' entropy against fp16)
    quantiser: str = "fixed"
    # the payload format the space's producers write: "planes-2" (bit planes) or "ans-1" (range-coded against
    # tables counted on the calibration text); "" = the quantiser's own (ecsq: ans-1, fixed: planes-2)
    packing: str = ""
    seed: int = 0
    recipe: Recipe = field(default_factory=Recipe)

    def __post_init__(self) -> None:
        if not 0 < self.budget <= 1:
            raise ValueError(f"budget must be in (0, 1], got {self.budget}")
        if self.prefix_tokens <= self.recipe.sink_tokens or self.continuation_tokens <= 0:
            raise ValueError("prefix must be longer than the sink tokens; continuation must be positive")
        if min(self.basis_windows, self.distill_windows) <= 0:
            raise ValueError("window counts must be positive")
        if isinstance(self.distill_steps, bool) or not isinstance(self.distill_steps, int) or self.distill_steps < 0:
            raise ValueError(f"distill_steps must be an int >= 0, got {self.distill_steps!r}")
        if self.patch_layers < 0:
            raise ValueError(f"patch_layers must be >= 0, got {self.patch_layers}")
        if self.decoder not in STRUCTURES:
            raise ValueError(f"decoder must be one of {STRUCTURES}, got {self.decoder!r}")
        if self.head_groups < 1:
            raise ValueError(f"head_groups must be >= 1, got {self.head_groups}")
        if self.head_groups > 1 and self.decoder == "dense":
            raise ValueError("a dense decoder map mixes every KV head: head_groups > 1 needs decoder per-head or auto")
        if self.quantiser not in QUANTISERS:
            raise ValueError(f"quantiser must be one of {QUANTISERS}, got {self.quantiser!r}")
        if self.quantiser == "ecsq" and (self.patch_layers and self.patch_source == "hidden"):
            raise ValueError("entropy-coded quantisers are for REUSE spaces: PATCH from H_in codes it at fixed rate")
        if self.packing not in ("", "planes-2", "ans-1"):
            raise ValueError(f"packing must be planes-2 or ans-1, got {self.packing!r}")
        if self.packing == "ans-1" and self.patch_layers and self.patch_source == "hidden":
            raise ValueError("range-coded payloads are for REUSE spaces: PATCH from H_in codes it in bit planes")
        if self.patch_source not in SOURCES:
            raise ValueError(f"patch_source must be one of {SOURCES}, got {self.patch_source!r}")

    @property
    def map_request(self) -> str:
        """The decoder structure asked of :func:`~scd_store.codecs.scd.decoder.choose_structure`: per-head
        for a space of several head groups (a dense map would mix the ranks' heads), else :attr:`decoder`."""
        return "per-head" if self.head_groups > 1 else self.decoder

    @property
    def payload_packing(self) -> str:
        """The format the space writes: :attr:`packing`, or the quantiser's own."""
        return self.packing or ("ans-1" if self.quantiser == "ecsq" else "planes-2")

    @property
    def keeps_samples(self) -> bool:
        """Whether the space needs the calibration features themselves (quantisers or tables fitted on them)."""
        return self.quantiser == "ecsq" or self.payload_packing == "ans-1"

    @property
    def first_cut(self) -> int:
        """The shortest coded prefix a distillation step trains on (always past the sinks)."""
        sinks = self.recipe.sink_tokens
        return min(self.prefix_tokens, max(sinks + 1, math.ceil(self.recipe.shortest_prefix * self.prefix_tokens)))
