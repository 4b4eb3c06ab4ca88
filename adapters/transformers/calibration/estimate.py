"""How long a calibration will take, measured on this machine before it starts.

A few passes are timed with the real models at the real lengths (a producer prefill, a consumer
prefill, two distillation-shaped steps with gradients into the features); the estimate is their
times multiplied by the work the plan holds. It sets no step count: quality never depends on how
fast the machine is, only the wait does.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from scd_store.adapters.transformers.calibration.config import CalibrationConfig
from scd_store.adapters.transformers.calibration.distillation import initial_map, map_structure
from scd_store.adapters.transformers.calibration.feature_cache import cache_from_features
from scd_store.adapters.transformers.capture import prefill_capture
from scd_store.adapters.transformers.compat import cache_kwarg
from scd_store.adapters.transformers.layout import layout_of
from scd_store.adapters.transformers.loading import LoadedModel
from scd_store.codecs.scd.decoder import apply_map

# what the timed passes leave out (loading the models, encoding the teacher windows through the space, the
# teacher logits' copies): a measured pair took 1.09x its estimate without headroom on cpu-epyc-avx512-2c
HEADROOM = 1.15


@dataclass(frozen=True, slots=True)
class Estimate:
    """Seconds per phase of a calibration plan, from timed passes."""

    producer_prefill_s: float
    consumer_prefill_s: float
    step_s: float
    total_s: float
    device: str

    def to_dict(self) -> dict:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}

    def line(self, consumers: int, steps: int) -> str:
        minutes = self.total_s / 60
        return (f"estimated at most ~{minutes:.1f} min on {self.device}: {consumers} consumer(s) x {steps} "
                f"distillation steps at ~{self.step_s:.2f} s, prefills ~{self.producer_prefill_s:.2f} / "
                f"{self.consumer_prefill_s:.2f} s")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _step(consumer: LoadedModel, config: CalibrationConfig) -> None:
    """One distillation-shaped step: random features of the whole coded prefix through a map of the
    structure the pair will train (``config.decoder``), the continuation, a KL to random targets, a backward."""
    layout = layout_of(consumer.model)
    b, sinks, device = config.recipe.batch_size, config.recipe.sink_tokens, consumer.device
    weight = initial_map(layout, map_structure(consumer, layout, config.map_request), device)
    x = torch.randn(b, config.prefix_tokens - sinks, layout.groups, layout.width, device=device)
    y = x + apply_map(x, weight)
    sink = torch.zeros(b, layout.num_layers, layout.kv_heads, sinks, layout.head_dim, device=device)
    cache = cache_from_features(consumer.model, y, sink, sink, layout, sinks)
    feed = torch.randint(0, consumer.model.config.vocab_size, (b, config.continuation_tokens), device=device)
    logits = consumer.model(input_ids=feed, **{cache_kwarg(consumer.model): cache}, use_cache=True).logits
    target = torch.log_softmax(torch.randn_like(logits), -1)
    F.kl_div(torch.log_softmax(logits, -1), target, log_target=True, reduction="none").sum(-1).mean().backward()


def estimate(producer: LoadedModel, consumer: LoadedModel, config: CalibrationConfig, consumers: int,
             basis_windows: int, selection_windows: int = 0) -> Estimate:
    """The time of a plan: ``basis_windows`` producer prefills for the space, per consumer the teacher
    pass, ``config.distill_steps`` steps and ``selection_windows`` x layers prefills ranking PATCH layers."""
    vocab = producer.model.config.vocab_size
    prefix = torch.randint(0, vocab, (config.prefix_tokens,))
    window = torch.randint(0, vocab, (config.prefix_tokens + config.continuation_tokens,))
    produce = min(_timed(lambda: prefill_capture(producer.model, prefix, last_logits_only=True)) for _ in range(2))
    own = min(_timed(lambda: prefill_capture(consumer.model, window, logits_to_keep=config.continuation_tokens))
              for _ in range(2))
    for param in consumer.model.parameters():
        param.requires_grad_(False)
    step = min(_timed(lambda: _step(consumer, config)) for _ in range(2))
    layers = consumer.model.config.num_hidden_layers
    per_consumer = config.distill_windows * (produce + own) + config.distill_steps * step
    per_consumer += selection_windows * layers * own
    total = HEADROOM * (basis_windows * produce + consumers * per_consumer)
    return Estimate(produce, own, step, total, str(consumer.device))
