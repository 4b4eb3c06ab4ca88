"""A small real calibration: code space + distilled decoder on the real pair, bundle round trip."""

import pytest
import torch

from scd_store.adapters.transformers import continue_with_prefix, prefill_capture
from scd_store.adapters.transformers.calibrate import CalibrationConfig, distil_decoder, fit_space
from scd_store.bench.quality import load_scd_codec
from scd_store.bench.windows import eval_windows
from scd_store.codecs.scd.bundle import BundleError, load_space, save_pair, save_space

pytestmark = pytest.mark.slow


def test_small_calibration_round_trip(producer, shakespeare, tmp_path):
    config = CalibrationConfig(budget=0.25, basis_windows=3, prefix_tokens=64, continuation_tokens=8,
                               distill_windows=4, distill_steps=6)
    space = fit_space(producer, ["shakespeare"], config, "it-space", progress=False)
    assert abs(space.payload_ratio() - 0.25) < 0.01
    decoder, stats = distil_decoder(producer, shakespeare, space, "shakespeare", config, progress=False)
    assert stats["steps"] == 6 and stats["kl_last"] is not None
    save_space(tmp_path, space)
    save_pair(tmp_path, decoder)
    codec = load_scd_codec(tmp_path, producer, shakespeare)

    window = eval_windows(shakespeare.tokenizer, "shakespeare", 1, 80, seed=9)[0]
    produced, _ = prefill_capture(producer.model, window[:64])
    payload = codec.encode(produced)
    assert len(payload) < 0.3 * produced.fp16_bytes()
    decoded = codec.decode(payload)
    assert decoded.keys.shape == produced.keys.shape
    assert torch.equal(decoded.keys[:, :, :4], produced.keys[:, :, :4].half().float())  # sinks raw
    logits = continue_with_prefix(shakespeare.model, decoded, window[64:])
    assert torch.isfinite(logits).all()

    with pytest.raises(BundleError, match="producer"):
        load_space(tmp_path, producer_fingerprint=shakespeare.fingerprint)
