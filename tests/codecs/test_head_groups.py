"""Code spaces fitted per head group (tensor-parallel ranks): each component lives on one rank's heads."""

import pytest
import torch

from scd_store.adapters.transformers.calibration.config import CalibrationConfig
from scd_store.codecs.scd.layout import KVLayout, to_features
from scd_store.codecs.scd.space import CodeSpace, head_group_basis
from tests.bundles import correlated_state

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=8, rope_theta=1e4)


def _moments() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.cat([to_features(correlated_state(64, seed=s), LAYOUT) for s in range(4)]).transpose(0, 1).double()
    mean = x.mean(1)
    return mean, torch.einsum("gtc,gtd->gcd", x - mean[:, None], x - mean[:, None]) / x.shape[1]


def test_every_component_of_a_head_group_basis_lives_on_one_group_of_heads():
    _, cov = _moments()
    cov = cov + 0.3  # cross-head correlation a full basis would use
    vals, vecs = head_group_basis(cov, LAYOUT, 2)
    width = LAYOUT.head_dim
    support = vecs.abs() > 0
    on_first, on_second = support[:, :width].any(1), support[:, width:].any(1)  # [G, components]
    assert not (on_first & on_second).any()
    assert on_first.sum(1).eq(width).all() and on_second.sum(1).eq(width).all()
    eye = torch.eye(LAYOUT.width, dtype=torch.float64).expand_as(vecs)
    assert torch.allclose(vecs.transpose(1, 2) @ vecs, eye, atol=1e-10)
    assert (vals[:, :-1] >= vals[:, 1:]).all()  # components by decreasing variance across both groups


def test_one_head_group_is_the_full_basis_and_a_full_basis_keeps_more_variance():
    _, cov = _moments()
    cov = cov + 0.3
    full_vals, full_vecs = head_group_basis(cov, LAYOUT, 1)
    eigvals, eigvecs = torch.linalg.eigh(cov)
    assert torch.allclose(full_vals, eigvals.flip(-1).clamp_min(0))
    split_vals, _ = head_group_basis(cov, LAYOUT, 2)
    # the leading components of the joint basis hold more of the variance than any split basis can
    assert (full_vals[:, :4].sum(1) > split_vals[:, :4].sum(1)).all()


def test_a_head_group_space_codes_and_a_rank_decodes_its_heads_from_its_components_alone():
    mean, cov = _moments()
    space = CodeSpace.from_statistics("split", LAYOUT, mean, cov, 0.5, sink_tokens=0, head_groups=2)
    state = correlated_state(16, seed=7)
    z = space.project(to_features(state, LAYOUT))  # [T, G, C]
    first = space.basis[:, :LAYOUT.head_dim].abs().sum(1) > 0  # [G, C]: components on head 0
    rebuilt = torch.einsum("tgc,gdc->tgd", z * first, space.basis) + space.mean
    assert torch.allclose(rebuilt[..., :LAYOUT.head_dim], to_features(state, LAYOUT)[..., :LAYOUT.head_dim],
                          atol=1e-4)


def test_head_groups_must_divide_the_heads_and_refuse_a_dense_map():
    _, cov = _moments()
    with pytest.raises(ValueError, match="divide"):
        head_group_basis(cov, LAYOUT, 3)
    with pytest.raises(ValueError, match="head_groups"):
        CalibrationConfig(head_groups=0)
    with pytest.raises(ValueError, match="dense"):
        CalibrationConfig(head_groups=2, decoder="dense")
    assert CalibrationConfig(head_groups=2).map_request == "per-head"
    assert CalibrationConfig().map_request == "auto"
