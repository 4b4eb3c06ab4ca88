import pytest

from scd_store.adapters.transformers.calibrate import CalibrationConfig


def test_calibration_config_checks_its_knobs():
    assert CalibrationConfig().allocation == "variance"
    with pytest.raises(ValueError, match="allocation"):
        CalibrationConfig(allocation="mse")
    with pytest.raises(ValueError, match="sensitivity_windows"):
        CalibrationConfig(sensitivity_windows=0)
    with pytest.raises(ValueError, match="greedy_weight"):
        CalibrationConfig(greedy_weight=-1.0)
    with pytest.raises(ValueError, match="key_weight"):
        CalibrationConfig(key_weight=0.0)
    with pytest.raises(ValueError, match="eval"):
        CalibrationConfig(splits=("calib", "eval"))
    with pytest.raises(ValueError, match="shortest_prefix"):
        CalibrationConfig(shortest_prefix=0.0)


def test_distillation_cuts_start_past_the_sinks_and_end_at_the_whole_prefix():
    assert CalibrationConfig().first_cut == 224  # half of the 448-token default
    assert CalibrationConfig(shortest_prefix=1.0).first_cut == 448  # always the whole prefix
    assert CalibrationConfig(prefix_tokens=8, sink_tokens=4, shortest_prefix=0.1).first_cut == 5


def test_greedy_margin_loss_is_zero_for_a_faithful_student_and_grows_when_the_greedy_token_flips():
    import torch

    from scd_store.adapters.transformers.calibrate import greedy_margin_loss

    teacher = torch.log_softmax(torch.tensor([[[2.0, 1.5, 0.0], [0.0, 3.0, 0.1]]]), -1)
    assert float(greedy_margin_loss(teacher.clone(), teacher)) == 0.0
    assert float(greedy_margin_loss(teacher + 0.3, teacher)) == 0.0  # a shift of all logits changes nothing
    flipped = torch.log_softmax(torch.tensor([[[1.5, 2.0, 0.0], [0.0, 3.0, 0.1]]]), -1)
    loss = greedy_margin_loss(flipped, teacher)
    assert abs(float(loss) - (0.5 + 0.5) / 2) < 1e-5  # first token: needs +0.5 margin, has -0.5
    student = flipped.clone().requires_grad_(True)
    greedy_margin_loss(student, teacher).backward()
    assert student.grad[0, 0, 0] < 0 < student.grad[0, 0, 1]  # raises the teacher's choice, lowers the rival
    assert torch.all(student.grad[0, 1] == 0)


def test_time_budgeted_step_counts_round_down_within_their_bounds():
    from scd_store.adapters.transformers.calibrate import planned_steps

    config = CalibrationConfig()
    assert config.distill_steps is None and (config.min_steps, config.max_steps) == (100, 1000)
    assert planned_steps(config, 20, 0.4, 400.0) == 1000  # 20 + 1,000 fit: capped
    assert planned_steps(config, 20, 0.5, 300.0) == 600  # 620 fit
    assert planned_steps(config, 20, 1.2, 300.0) == 200  # 270 fit
    assert planned_steps(config, 20, 1.5, 100.0) == 100  # 86 fit: never fewer than min_steps
    assert planned_steps(config, 20, 1.0, -5.0) == 100  # already past the budget
    with pytest.raises(ValueError, match="distill_steps"):
        CalibrationConfig(distill_steps=-1)
    with pytest.raises(ValueError, match="min_steps"):
        CalibrationConfig(min_steps=500, max_steps=400)
    with pytest.raises(ValueError, match="time_budget_s"):
        CalibrationConfig(time_budget_s=0)
