import pytest
import torch

from scd_store.adapters.transformers import build_cache, continue_with_prefix, generate_greedy, prefill_capture
from scd_store.codecs import KVState


def test_capture_shapes_and_hidden_states(tiny_model, device):
    ids = torch.randint(0, 128, (20,), device=device)
    state, logits = prefill_capture(tiny_model, ids, hidden_layers=[0, 2])
    assert state.keys.shape == (3, 2, 20, 16)
    assert set(state.hidden) == {0, 2} and state.hidden[2].shape == (20, 64)
    assert logits.shape == (20, 128)
    # H_in of layer 0 is the input norm of the embeddings: recompute it independently.
    embedded = tiny_model.model.embed_tokens(ids[None])
    expected = tiny_model.model.layers[0].input_layernorm(embedded)[0]
    torch.testing.assert_close(state.hidden[0], expected)


def test_injecting_own_kv_reproduces_direct_forward(tiny_model, device):
    torch.backends.cuda.matmul.allow_tf32 = False
    ids = torch.randint(0, 128, (48,), device=device)
    with torch.no_grad():
        direct = tiny_model(input_ids=ids[None]).logits[0]
    state, _ = prefill_capture(tiny_model, ids[:32])
    continued = continue_with_prefix(tiny_model, state, ids[32:])
    assert (continued - direct[32:]).abs().max() < 1e-4


def test_foreign_kv_changes_the_logits(tiny_model, device):
    from tests.conftest import tiny_llama

    other = tiny_llama(seed=1).to(device)
    ids = torch.randint(0, 128, (40,))
    own, _ = prefill_capture(tiny_model, ids[:30])
    foreign, _ = prefill_capture(other, ids[:30])
    a = continue_with_prefix(tiny_model, own, ids[30:])
    b = continue_with_prefix(tiny_model, foreign, ids[30:])
    assert (a - b).abs().max() > 1e-3


def test_greedy_generation_matches_full_recompute(tiny_model, device):
    ids = torch.randint(0, 128, (24,), device=device)
    state, _ = prefill_capture(tiny_model, ids[:20])
    generated = generate_greedy(tiny_model, state, ids[20:], max_new_tokens=5)
    sequence = ids.tolist()
    with torch.no_grad():
        for _ in range(5):
            sequence.append(int(tiny_model(input_ids=torch.tensor([sequence], device=device)).logits[0, -1].argmax()))
    assert generated == sequence[24:]


def test_kv_of_the_wrong_shape_is_refused(tiny_model):
    state = KVState(torch.zeros(2, 2, 4, 16), torch.zeros(2, 2, 4, 16))
    with pytest.raises(ValueError, match="does not fit"):
        build_cache(tiny_model, state)


def test_bad_token_input_is_refused(tiny_model):
    with pytest.raises(ValueError, match="1-D"):
        prefill_capture(tiny_model, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="hidden layer"):
        prefill_capture(tiny_model, torch.zeros(3, dtype=torch.long), hidden_layers=[7])


def test_prefill_keeps_only_the_last_logits_asked_for(tiny_model, device):
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(3))
    _, full = prefill_capture(tiny_model, ids)
    _, last5 = prefill_capture(tiny_model, ids, logits_to_keep=5)
    assert last5.shape == (5, full.shape[-1])
    torch.testing.assert_close(last5, full[-5:], atol=1e-5, rtol=1e-5)


def test_prefix_buffer_hands_out_consecutive_slices_until_full():
    from scd_store.adapters.transformers.inject import PrefixBuffer
    from tests.conftest import tiny_llama

    model = tiny_llama()
    buffer = PrefixBuffer(model, 10)
    first, second = buffer(0, 4), buffer(1, 4)
    assert first[0].shape == (3, 2, 4, 16) and first[0].dtype == next(model.parameters()).dtype
    assert second[0].data_ptr() == buffer.keys[:, :, 4:].data_ptr()
    assert buffer(2, 4) is None  # 8 + 4 > 10: the run ends there
    first[0].fill_(1.0)
    state = buffer.state(8)
    assert state.num_tokens == 8 and bool((state.keys[:, :, :4] == 1).all()) and buffer.state(0) is None
