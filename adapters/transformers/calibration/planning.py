"""How many distillation steps a time-budgeted calibration runs."""

from __future__ import annotations

from scd_store.adapters.transformers.calibration.config import CalibrationConfig

# steps timed before an automatic step count is fixed (their learning rate is the schedule's first, ~1.0x)
PROBE_STEPS = 20


def planned_steps(config: CalibrationConfig, done: int, step_seconds: float, seconds_left: float) -> int:
    """The step count of a time-budgeted distillation: ``done`` steps plus as many more as fit
    ``seconds_left`` at ``step_seconds`` each, rounded down to a multiple of 100, within the recipe's
    ``min_steps..max_steps``."""
    fit = done + max(0.0, seconds_left) / max(step_seconds, 1e-9)
    return int(min(config.recipe.max_steps, max(config.recipe.min_steps, fit // 100 * 100)))
