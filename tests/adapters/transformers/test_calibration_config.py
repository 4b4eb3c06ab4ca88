import pytest

from scd_store.adapters.transformers.calibration import CalibrationConfig, Recipe


def test_calibration_config_checks_its_knobs():
    with pytest.raises(ValueError, match="budget"):
        CalibrationConfig(budget=0.0)
    with pytest.raises(ValueError, match="patch_source"):
        CalibrationConfig(patch_source="logits")
    with pytest.raises(ValueError, match="continuation"):
        CalibrationConfig(continuation_tokens=0)


def test_the_recipe_checks_its_constants():
    assert Recipe().key_weight == 4.0 and CalibrationConfig().recipe == Recipe()
    with pytest.raises(ValueError, match="key_weight"):
        Recipe(key_weight=0.0)
    with pytest.raises(ValueError, match="eval"):
        Recipe(splits=("calib", "eval"))
    with pytest.raises(ValueError, match="shortest_prefix"):
        Recipe(shortest_prefix=0.0)


def test_distillation_cuts_start_past_the_sinks_and_end_at_the_whole_prefix():
    assert CalibrationConfig().first_cut == 224  # half of the 448-token default
    assert CalibrationConfig(recipe=Recipe(shortest_prefix=1.0)).first_cut == 448  # always the whole prefix
    assert CalibrationConfig(prefix_tokens=8, recipe=Recipe(sink_tokens=4, shortest_prefix=0.1)).first_cut == 5


def test_the_step_count_is_fixed_whatever_the_machine():
    config = CalibrationConfig()
    assert config.distill_steps == 900 and not hasattr(config, "time_budget_s")
    with pytest.raises(ValueError, match="distill_steps"):
        CalibrationConfig(distill_steps=-1)
    with pytest.raises(ValueError, match="distill_steps"):
        CalibrationConfig(distill_steps=None)


def test_calibration_windows_never_read_the_eval_split():
    from scd_store.adapters.transformers.calibration.text import calibration_windows

    with pytest.raises(ValueError, match="eval"):
        calibration_windows(None, "shakespeare", 1, 8, 0, ("calib", "eval"))
