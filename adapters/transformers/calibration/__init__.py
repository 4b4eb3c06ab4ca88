"""SCD calibration with real transformers models, in the order it runs.

1. ``statistics``: the producer's KV on calibration windows (``text``) -> per group PCA of pre-RoPE
   features (sinks excluded) -> a code space per budget (greedy bit allocation).
2. ``teacher``: both models over the distillation windows once; ``through_space`` quantises the
   producer's states through a space.
3. ``distillation``: each consumer's decoder trained end to end on its own next-token distribution,
   for a step count that ``planning`` fits to a time budget unless one is given.
4. ``run``: ``scd-store calibrate`` over all of it (sweeps of budgets and PATCH layers, bundles).

Knobs: :class:`CalibrationConfig`; the method's fixed constants: :class:`Recipe`.
"""

from scd_store.adapters.transformers.calibration.config import DEFAULT_BUDGET, CalibrationConfig, Recipe
from scd_store.adapters.transformers.calibration.distillation import distil_decoder
from scd_store.adapters.transformers.calibration.run import calibrate
from scd_store.adapters.transformers.calibration.statistics import fit_space, space_statistics
from scd_store.adapters.transformers.calibration.teacher import collect_teacher

__all__ = [
    "DEFAULT_BUDGET",
    "CalibrationConfig",
    "Recipe",
    "calibrate",
    "collect_teacher",
    "distil_decoder",
    "fit_space",
    "space_statistics",
]
