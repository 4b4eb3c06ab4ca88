import torch

from scd_store.adapters.transformers.calibrate import layout_of
from scd_store.adapters.transformers.sensitivity import feature_fisher
from tests.conftest import tiny_llama


def test_feature_fisher_is_a_deterministic_psd_matrix_per_group_and_leaves_the_model_alone():
    model = tiny_llama(layers=2)
    layout = layout_of(model)
    windows = [torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    fisher = feature_fisher(model, layout, windows, prefix_tokens=30, sink_tokens=2, progress=False)
    assert fisher.shape == (layout.groups, layout.width, layout.width) and fisher.dtype == torch.float64
    torch.testing.assert_close(fisher, fisher.transpose(1, 2))
    assert torch.linalg.eigvalsh(fisher).min() > -1e-9
    assert (torch.diagonal(fisher, dim1=1, dim2=2).sum(1) > 0).all()  # every K and V group matters somewhat
    again = feature_fisher(model, layout, windows, prefix_tokens=30, sink_tokens=2, progress=False)
    torch.testing.assert_close(fisher, again)
    assert all(p.requires_grad and p.grad is None for p in model.parameters())


def test_fisher_allocation_needs_fisher_statistics():
    import pytest

    from scd_store.adapters.transformers.calibrate import CalibrationConfig, SpaceStatistics
    from tests.bundles import LAYOUT

    g, c = LAYOUT.groups, LAYOUT.width
    stats = SpaceStatistics(LAYOUT, torch.zeros(g, c, dtype=torch.float64),
                            torch.eye(c, dtype=torch.float64).repeat(g, 1, 1), {}, "fp")
    assert stats.space("v", CalibrationConfig(allocation="variance")).bits.sum() > 0
    with pytest.raises(ValueError, match="no sensitivity"):
        stats.space("f", CalibrationConfig(allocation="fisher"))
