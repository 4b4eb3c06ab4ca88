import pytest
import torch

from scd_store.adapters.sglang.pages import AXES, _from_lhtd, _to_lhtd, flat_page, state_from_flat
from scd_store.codecs.kv_state import KVState

L, H, T, D = 3, 2, 4, 5
# get_data_page(flat=False) shapes of SGLang's MHA host pool, per layout, for one of K / V
EXPECTED = {"layer_first": (L, T, H, D), "page_first": (T, L, H, D), "page_first_direct": (1, L, T, H, D),
            "page_head": (1, H, T, L, D)}


@pytest.mark.parametrize("layout", sorted(AXES))
def test_page_layouts_round_trip_with_sglang_shapes(layout):
    keys, values = torch.randn(L, H, T, D), torch.randn(L, H, T, D)
    page = _from_lhtd(keys, layout)
    assert tuple(page.shape) == EXPECTED[layout]
    assert torch.equal(_to_lhtd(page, layout), keys)
    back = state_from_flat(flat_page(KVState(keys, values), layout, torch.float16), layout, L, H, D, start=7)
    assert back.start == 7
    assert torch.equal(back.keys, keys.half().float()) and torch.equal(back.values, values.half().float())
