"""What distillation learns from: the models run over the calibration windows once.

:func:`collect_teacher` keeps, per window, the producer's prefix state and the consumer's own
logits from the shortest cut on (independent of any code space, so a sweep shares it);
:func:`through_space` sends the producer's states through one space's real encoder and quantiser,
so training sees what the consumer will see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from scd_store.adapters.transformers.calibration.config import CalibrationConfig
from scd_store.adapters.transformers.calibration.text import calibration_windows
from scd_store.adapters.transformers.capture import prefill_capture
from scd_store.adapters.transformers.layout import layout_of
from scd_store.adapters.transformers.loading import LoadedModel
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.scd.layout import to_features
from scd_store.codecs.scd.space import CodeSpace
from scd_store.models.windows import Corpus


@dataclass(slots=True)
class TeacherData:
    """Per calibration window: the producer's prefix state, the window's tokens and the consumer's
    own logits from the shortest cut on (``first_cut``)."""

    keys: torch.Tensor  # [N, L, H, prefix, D] fp16: the producer's prefix KV
    values: torch.Tensor
    hidden: dict[int, torch.Tensor]  # layer -> [N, prefix, D] fp16: the producer's H_in
    tokens: torch.Tensor  # [N, prefix + continuation] token ids
    teacher: torch.Tensor  # [N, prefix + continuation - first_cut, V] fp16 logits of the consumer's own prefill
    own_mean: torch.Tensor  # [G, C] float64: mean of the consumer's own prefix features (past the sinks)

    @property
    def windows(self) -> int:
        return self.keys.shape[0]

    @property
    def first_cut(self) -> int:
        """Position of the teacher's first logits row (the shortest cut)."""
        return self.tokens.shape[1] - self.teacher.shape[1]


@dataclass(slots=True)
class SpaceData:
    """The teacher's producer states after one code space's quantisation, ready to train on."""

    xhat: torch.Tensor  # [N, T - sinks, G, C] fp16: the producer's features after the space's quantisation
    sink_keys: torch.Tensor  # [N, L, H, sinks, D]
    sink_values: torch.Tensor
    tokens: torch.Tensor  # [N, prefix + continuation] token ids
    teacher: torch.Tensor  # [N, prefix + continuation - first_cut, V] fp16 logits of the consumer's own prefill
    mean_shift: torch.Tensor  # [G, C]
    hidden: torch.Tensor | None  # [N, T - sinks, P, D] fp16: decoded producer H_in at the space's patch layers

    first_cut = TeacherData.first_cut


@torch.no_grad()
def collect_teacher(producer: LoadedModel, consumer: LoadedModel, corpus: Corpus, config: CalibrationConfig,
                    hidden_layers: tuple[int, ...] = (), progress: bool = True) -> TeacherData:
    """Run both models over the distillation windows once (shared by every space of a sweep)."""
    p, s = config.prefix_tokens, config.recipe.sink_tokens
    length = p + config.continuation_tokens
    layout = layout_of(producer.model)
    windows = calibration_windows(consumer.tokenizer, corpus, config.distill_windows, length, config.seed + 1,
                                  config.recipe.splits)
    keys, values, tokens, teachers = [], [], [], []
    hidden: dict[int, list[torch.Tensor]] = {layer: [] for layer in hidden_layers}
    own_total = torch.zeros(layout.groups, layout.width, dtype=torch.float64)
    for window in tqdm(windows, desc=f"distil {consumer.name}: teacher", unit="window", disable=not progress):
        produced, _ = prefill_capture(producer.model, window[:p], hidden_layers=hidden_layers, last_logits_only=True)
        own, logits = prefill_capture(consumer.model, window, logits_to_keep=length - config.first_cut)
        own_prefix = KVState(own.keys[:, :, s:p], own.values[:, :, s:p], start=s)
        own_total += to_features(own_prefix, layout).double().mean(0).cpu()
        keys.append(produced.keys.half().cpu())
        values.append(produced.values.half().cpu())
        for layer in hidden_layers:
            hidden[layer].append(produced.hidden[layer].half().cpu())
        tokens.append(window)
        teachers.append(logits.half().cpu())  # positions first_cut .. length - 1
    return TeacherData(torch.stack(keys), torch.stack(values), {k: torch.stack(v) for k, v in hidden.items()},
                       torch.stack(tokens), torch.stack(teachers), own_total / len(windows))


@torch.no_grad()
def through_space(space: CodeSpace, teacher: TeacherData, sinks: int) -> SpaceData:
    """The teacher's producer states encoded and decoded by ``space`` (what the consumer will see)."""
    missing = [layer for layer in space.patch_layers if layer not in teacher.hidden]
    if missing:
        raise ValueError(f"teacher data has no H_in at patch layers {missing}")
    basis_t = space.basis.transpose(1, 2)
    xhats, hiddens = [], []
    xhat_total = torch.zeros(space.layout.groups, space.layout.width, dtype=torch.float64)
    for i in range(teacher.windows):
        produced = KVState(teacher.keys[i].float(), teacher.values[i].float(),
                           {layer: h[i].float() for layer, h in teacher.hidden.items() if layer in space.patch_layers})
        codes = space.unpack(space.encode(produced))
        xhat = torch.bmm(space.reconstruct(codes.codes).transpose(0, 1), basis_t).transpose(0, 1) + space.mean
        xhat_total += xhat.double().mean(0)
        xhats.append(xhat.half())
        if space.hidden is not None:
            hiddens.append(space.hidden.reconstruct(codes.hidden_codes).half())
    shift = (teacher.own_mean - xhat_total / teacher.windows).float()
    return SpaceData(torch.stack(xhats), teacher.keys[:, :, :, :sinks].float(),
                     teacher.values[:, :, :, :sinks].float(), teacher.tokens, teacher.teacher, shift,
                     torch.stack(hiddens) if hiddens else None)
