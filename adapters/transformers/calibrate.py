"""SCD calibration with real transformers models: fit a producer's code space, distil each
consumer's decoder end to end on the consumer's own next-token distribution.

1. Code space: producer KV on calibration windows -> per group (layer x K/V) PCA of pre-RoPE
   features (sink tokens excluded) -> component variances -> greedy bit allocation for the budget.
2. Decoder (per consumer): the producer's prefix KV is encoded and decoded through the space
   (so training sees the real quantisation); the decoder's affine maps start at the mean shift
   and are trained to minimise KL(consumer on its own prefill || consumer on the decoded cache)
   over continuation tokens, consumer frozen, gradients only into the maps.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from scd_store.adapters.transformers.capture import prefill_capture
from scd_store.adapters.transformers.compat import cache_kwarg
from scd_store.adapters.transformers.feature_cache import cache_from_features
from scd_store.adapters.transformers.loading import LoadedModel
from scd_store.adapters.transformers.sensitivity import feature_fisher
from scd_store.bench.windows import eval_windows
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.scd.decoder import PairDecoder
from scd_store.codecs.scd.layout import KVLayout, to_features
from scd_store.codecs.scd.patch import SOURCES, PatchAligner, apply_patches
from scd_store.codecs.scd.space import CodeSpace

ALLOCATIONS = ("fisher", "variance")
# coded bits against fp16 KV: with sinks and headers a 448-token payload is 24.7% of raw fp16 (<= 25%)
DEFAULT_BUDGET = 0.24


@dataclass(frozen=True, slots=True)
class CalibrationConfig:
    """Knobs of ``scd-store calibrate`` (see docs/scd.md)."""

    budget: float = DEFAULT_BUDGET
    # bit allocation weights: "variance" = reverse water-filling on variance, keys weighted key_weight against
    # values; "fisher" = each component's measured effect on the next-token distribution (lost on the
    # Python pair: docs/scd.md)
    allocation: str = "variance"
    key_weight: float = 4.0
    sensitivity_windows: int = 32  # per corpus, for the Fisher weights
    sink_tokens: int = 4
    basis_windows: int = 24  # per corpus
    # serving-length prefixes: each step trains the maps on ~444 coded tokens for little more than the
    # cost of 192 (the continuation dominates)
    prefix_tokens: int = 448
    # scored tokens after each cut: 64, as many as the quality harness scores (32 gave Shakespeare top-1 0.894 and
    # Python +2.92%; 64 gives 0.901 and +2.64%, each step ~1.4x dearer: docs/scd.md session 10)
    continuation_tokens: int = 64
    # each step cuts the coded prefix at a random length in [shortest_prefix * prefix_tokens, prefix_tokens]
    # and scores the continuation_tokens after the cut: the consumer's one causal prefill gives the teacher at every
    # cut, so each window supervises many continuations instead of one (1.0 = always the full prefix)
    shortest_prefix: float = 0.5
    distill_windows: int = 48
    # None: as many steps as fit a pair's calibration into time_budget_s (measured on the first steps, rounded
    # down to a multiple of 100, within min_steps..max_steps); quality grows with steps (docs/scd.md: Python
    # +3.57% at 300, +2.92% at 1,000), and what fits depends on the machine (a step ~0.55 s on 2 AMX cores,
    # ~1.5 s estimated on 2 AVX2 ones)
    distill_steps: int | None = None
    min_steps: int = 100  # a floor only: the budget holds on slow cores too (~200 of 64 tokens fit on 2 AVX2 ones)
    max_steps: int = 1000
    time_budget_s: float = 540.0
    batch_size: int = 2
    lr_weight: float = 1e-4
    lr_bias: float = 1e-3
    seed: int = 0
    # corpus splits windows are drawn from, never "eval"; not "train" by default: the consumer was fine-tuned
    # on it, so its own prefill there is over-confident and decoders distilled on it carry over worse
    splits: tuple[str, ...] = ("calib",)
    patch_layers: int = 0  # k: layers whose K / V the consumer regenerates (PATCH); 0 = REUSE only
    patch_source: str = "hidden"  # "hidden": code H_in at those layers; "kv": aligners on REUSE output
    patch_units: int = 128  # aligner MLP width
    lr_patch: float = 1e-3
    # weight of greedy_margin_loss next to the KL (top-1 agreement with the consumer's own prefill)
    greedy_weight: float = 0.0
    selection_windows: int = 4  # calibration windows that rank the layers for PATCH

    def __post_init__(self) -> None:
        if not 0 < self.budget <= 1:
            raise ValueError(f"budget must be in (0, 1], got {self.budget}")
        if self.prefix_tokens <= self.sink_tokens or self.continuation_tokens <= 0:
            raise ValueError("prefix must be longer than the sink tokens; continuation must be positive")
        if min(self.basis_windows, self.distill_windows, self.batch_size) <= 0:
            raise ValueError("window counts and batch size must be positive")
        if self.distill_steps is not None and self.distill_steps < 0:
            raise ValueError(f"distill_steps must be >= 0 (or None: fit the time budget), got {self.distill_steps}")
        if not 0 < self.min_steps <= self.max_steps or self.time_budget_s <= 0:
            raise ValueError("need 0 < min_steps <= max_steps and a positive time_budget_s")
        if self.patch_layers < 0 or self.patch_units <= 0 or self.selection_windows <= 0:
            raise ValueError("patch_layers must be >= 0; patch_units and selection_windows positive")
        if not self.splits or "eval" in self.splits:
            raise ValueError(f"calibration splits must be non-empty and exclude eval, got {self.splits}")
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {self.allocation!r}")
        if self.key_weight <= 0:
            raise ValueError(f"key_weight must be positive, got {self.key_weight}")
        if self.greedy_weight < 0:
            raise ValueError(f"greedy_weight must be >= 0, got {self.greedy_weight}")
        if not 0 < self.shortest_prefix <= 1:
            raise ValueError(f"shortest_prefix must be in (0, 1], got {self.shortest_prefix}")
        if self.sensitivity_windows <= 0:
            raise ValueError("sensitivity_windows must be positive")
        if self.patch_source not in SOURCES:
            raise ValueError(f"patch_source must be one of {SOURCES}, got {self.patch_source!r}")

    @property
    def first_cut(self) -> int:
        """The shortest coded prefix a distillation step trains on (always past the sinks)."""
        return min(self.prefix_tokens, max(self.sink_tokens + 1, math.ceil(self.shortest_prefix * self.prefix_tokens)))


def calibration_windows(tokenizer, corpus: str, count: int, length: int, seed: int, splits: tuple[str, ...]
                        ) -> list[torch.Tensor]:
    """``count`` windows of ``length`` tokens spread evenly over ``splits`` of ``corpus``."""
    shares = [count // len(splits) + (i < count % len(splits)) for i in range(len(splits))]
    return [w for split, share in zip(splits, shares, strict=True) if share
            for w in eval_windows(tokenizer, corpus, share, length, seed, split=split)]


def layout_of(model: torch.nn.Module) -> KVLayout:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"only default RoPE is supported, not {rope.get('rope_type')}")
    return KVLayout(config.num_hidden_layers, config.num_key_value_heads, head_dim, float(theta))


@dataclass(slots=True)
class SpaceStatistics:
    """First and second moments of the producer's features (and ``H_in`` at some layers) on
    calibration windows: every code space of a sweep (budgets, patch layers) is built from them."""

    layout: KVLayout
    mean: torch.Tensor  # [G, C] float64
    cov: torch.Tensor  # [G, C, C]
    hidden: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (mean [D], cov [D, D])
    producer_fingerprint: str
    fisher: torch.Tensor | None = None  # [G, C, C]: see adapters/transformers/sensitivity.py

    def space(self, space_id: str, config: CalibrationConfig, patch_layers: tuple[int, ...] = ()) -> CodeSpace:
        """The code space for ``config.budget`` (PATCH ``H_in`` codes at ``patch_layers``, which must be
        among the layers the statistics hold)."""
        hidden_stats = None
        if patch_layers:
            missing = [layer for layer in patch_layers if layer not in self.hidden]
            if missing:
                raise ValueError(f"no H_in statistics for patch layers {missing}")
            hidden_stats = (tuple(patch_layers), torch.stack([self.hidden[i][0] for i in patch_layers]),
                            torch.stack([self.hidden[i][1] for i in patch_layers]))
        if config.allocation == "fisher" and self.fisher is None:
            raise ValueError("Fisher bit allocation asked for, but these statistics carry no sensitivity")
        sensitivity = self.fisher if config.allocation == "fisher" else None
        return CodeSpace.from_statistics(space_id, self.layout, self.mean, self.cov, config.budget, config.key_weight,
                                         config.sink_tokens, self.producer_fingerprint, hidden_stats, sensitivity)


@torch.no_grad()
def space_statistics(producer: LoadedModel, corpora: list[str], config: CalibrationConfig,
                     hidden_layers: tuple[int, ...] = (), progress: bool = True) -> SpaceStatistics:
    """Moments of the producer's pre-RoPE K / V features (sink tokens excluded) and of ``H_in`` at
    ``hidden_layers`` over calibration windows of ``corpora``."""
    layout = layout_of(producer.model)
    g, c = layout.groups, layout.width
    total = torch.zeros(g, c, dtype=torch.float64)
    outer = torch.zeros(g, c, c, dtype=torch.float64)
    width = producer.model.config.hidden_size
    h_total = torch.zeros(len(hidden_layers), width, dtype=torch.float64)
    h_outer = torch.zeros(len(hidden_layers), width, width, dtype=torch.float64)
    count = 0
    windows = [w for corpus in corpora for w in calibration_windows(
        producer.tokenizer, corpus, config.basis_windows, config.prefix_tokens, config.seed, config.splits)]
    for window in tqdm(windows, desc="code space: producer KV", unit="window", disable=not progress):
        state, _ = prefill_capture(producer.model, window, hidden_layers=hidden_layers, last_logits_only=True)
        x = to_features(state, layout)[config.sink_tokens:].double().transpose(0, 1)  # [G, T, C]
        total += x.sum(1)
        outer += x.transpose(1, 2) @ x
        count += x.shape[1]
        if hidden_layers:
            h = torch.stack([state.hidden[layer][config.sink_tokens:] for layer in hidden_layers]).double()
            h_total += h.sum(1)
            h_outer += h.transpose(1, 2) @ h
    mean = total / count
    cov = outer / count - mean.unsqueeze(2) * mean.unsqueeze(1)
    h_mean = h_total / count
    h_cov = h_outer / count - h_mean.unsqueeze(2) * h_mean.unsqueeze(1)
    hidden = {layer: (h_mean[i], h_cov[i]) for i, layer in enumerate(hidden_layers)}
    fisher = None
    if config.allocation == "fisher":
        length = config.prefix_tokens + config.continuation_tokens
        sens_windows = [w for corpus in corpora for w in calibration_windows(
            producer.tokenizer, corpus, config.sensitivity_windows, length, config.seed + 3, config.splits)]
        fisher = feature_fisher(producer.model, layout, sens_windows, config.prefix_tokens, config.sink_tokens,
                                config.seed, progress)
    return SpaceStatistics(layout, mean, cov, hidden, producer.fingerprint, fisher)


def fit_space(producer: LoadedModel, corpora: list[str], config: CalibrationConfig, space_id: str,
              progress: bool = True, patch_layers: tuple[int, ...] = ()) -> CodeSpace:
    """PCA basis and bit allocation from the producer's KV on calibration windows of ``corpora``; with
    ``patch_layers`` (and ``patch_source="hidden"``) also the basis of ``H_in`` at those layers."""
    coded_hidden = tuple(patch_layers) if config.patch_source == "hidden" else ()
    stats = space_statistics(producer, corpora, config, coded_hidden, progress)
    return stats.space(space_id, config, coded_hidden)


@dataclass(slots=True)
class TeacherData:
    """What distillation needs from the models, independent of the code space: per calibration
    window the producer's prefix state, the window's tokens and the consumer's own logits from the
    shortest cut on (``first_cut``)."""

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


@torch.no_grad()
def collect_teacher(producer: LoadedModel, consumer: LoadedModel, corpus: str, config: CalibrationConfig,
                    hidden_layers: tuple[int, ...] = (), progress: bool = True) -> TeacherData:
    """Run both models over the distillation windows once (shared by every space of a sweep)."""
    p, s = config.prefix_tokens, config.sink_tokens
    length = p + config.continuation_tokens
    layout = layout_of(producer.model)
    windows = calibration_windows(consumer.tokenizer, corpus, config.distill_windows, length, config.seed + 1,
                                  config.splits)
    keys, values, tokens, teachers = [], [], [], []
    hidden: dict[int, list[torch.Tensor]] = {layer: [] for layer in hidden_layers}
    own_total = torch.zeros(layout.groups, layout.width, dtype=torch.float64)
    for window in tqdm(windows, desc=f"distil {consumer.name}: teacher", unit="window", disable=not progress):
        produced, _ = prefill_capture(producer.model, window[:p], hidden_layers=hidden_layers, last_logits_only=True)
        own, logits = prefill_capture(consumer.model, window, logits_to_keep=length - config.first_cut)
        own_prefix = KVState(own.keys[:, :, s:p], own.values[:, :, s:p], start=s)
        own_total += to_features(own_prefix, layout).double().mean(0)
        keys.append(produced.keys.half())
        values.append(produced.values.half())
        for layer in hidden_layers:
            hidden[layer].append(produced.hidden[layer].half())
        tokens.append(window)
        teachers.append(logits.half())  # positions first_cut .. length - 1
    return TeacherData(torch.stack(keys), torch.stack(values), {k: torch.stack(v) for k, v in hidden.items()},
                       torch.stack(tokens), torch.stack(teachers), own_total / len(windows))


@dataclass(slots=True)
class _DistillData:
    xhat: torch.Tensor  # [N, T - sinks, G, C] fp16: the producer's features after the space's quantisation
    sink_keys: torch.Tensor  # [N, L, H, sinks, D]
    sink_values: torch.Tensor
    tokens: torch.Tensor  # [N, prefix + continuation] token ids
    teacher: torch.Tensor  # [N, prefix + continuation - first_cut, V] fp16 logits of the consumer's own prefill
    mean_shift: torch.Tensor  # [G, C]
    hidden: torch.Tensor | None  # [N, T - sinks, P, D] fp16: decoded producer H_in at the space's patch layers

    first_cut = TeacherData.first_cut


@torch.no_grad()
def _through_space(space: CodeSpace, teacher: TeacherData, sinks: int) -> _DistillData:
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
    return _DistillData(torch.stack(xhats), teacher.keys[:, :, :, :sinks].float(),
                        teacher.values[:, :, :, :sinks].float(), teacher.tokens, teacher.teacher, shift,
                        torch.stack(hiddens) if hiddens else None)


def greedy_margin_loss(student: torch.Tensor, teacher: torch.Tensor, cap: float = 1.0) -> torch.Tensor:
    """Mean hinge ``relu(min(m_t, cap) - m_s)`` on the margin of the teacher's greedy token over the
    runner-up (``m_t`` in the teacher's log-probabilities, ``m_s`` in the student's). Zero wherever
    the student keeps at least the teacher's margin, so a student equal to its teacher pays nothing;
    it pushes only where the greedy choice is at risk."""
    top2 = teacher.topk(2, dim=-1)
    greedy = top2.indices[..., :1]
    teacher_margin = (top2.values[..., 0] - top2.values[..., 1]).clamp(max=cap)
    chosen = student.gather(-1, greedy).squeeze(-1)
    runner_up = student.scatter(-1, greedy, float("-inf")).amax(-1)
    return torch.relu(teacher_margin - (chosen - runner_up)).mean()


# steps timed before an automatic step count is fixed (their learning rate is the schedule's first, ~1.0x)
PROBE_STEPS = 20


def planned_steps(config: CalibrationConfig, done: int, step_seconds: float, seconds_left: float) -> int:
    """The step count of a time-budgeted distillation: ``done`` steps plus as many more as fit
    ``seconds_left`` at ``step_seconds`` each, rounded down to a multiple of 100, within the config's
    ``min_steps..max_steps``."""
    fit = done + max(0.0, seconds_left) / max(step_seconds, 1e-9)
    return int(min(config.max_steps, max(config.min_steps, fit // 100 * 100)))


def distil_decoder(producer: LoadedModel, consumer: LoadedModel, space: CodeSpace, corpus: str,
                   config: CalibrationConfig, progress: bool = True, patch_layers: tuple[int, ...] = (),
                   teacher: TeacherData | None = None, time_limit_s: float | None = None) -> tuple[PairDecoder, dict]:
    """Train ``consumer``'s decoder for ``space`` end to end; returns it with training stats.

    A PATCH space's patch layers always get "hidden" aligners; ``patch_layers`` adds "kv" aligners
    (payload-free) at those layers of a REUSE space. ``teacher`` (from :func:`collect_teacher`)
    is reused when given, so a sweep runs the models over the windows once. With
    ``config.distill_steps=None`` the step count fits ``time_limit_s`` seconds from this call's start
    (default: the config's ``time_budget_s``; see :func:`planned_steps`)."""
    start_time = time.perf_counter()
    if time_limit_s is None:
        time_limit_s = config.time_budget_s
    if teacher is None:
        teacher = collect_teacher(producer, consumer, corpus, config, space.patch_layers, progress)
    data = _through_space(space, teacher, config.sink_tokens)
    collect_seconds = time.perf_counter() - start_time
    g, c = space.layout.groups, space.layout.width
    weight = torch.zeros(g, c, c, requires_grad=True)
    bias = data.mean_shift.clone().requires_grad_(True)
    layers = consumer.model.model.layers
    patches = [PatchAligner.initial(layer, "hidden", layers[layer].self_attn, config.patch_units, config.seed)
               for layer in space.patch_layers]
    patches += [PatchAligner.initial(layer, "kv", layers[layer].self_attn, config.patch_units, config.seed)
                for layer in patch_layers if layer not in space.patch_layers]
    patch_params = [t.requires_grad_(True) for patch in patches for t in patch.trainable()]
    groups = [{"params": [weight], "lr": config.lr_weight}, {"params": [bias], "lr": config.lr_bias}]
    if patch_params:
        groups.append({"params": patch_params, "lr": config.lr_patch})
    base_lrs = [group["lr"] for group in groups]
    optimizer = torch.optim.Adam(groups)
    generator = torch.Generator().manual_seed(config.seed)
    for param in consumer.model.parameters():
        param.requires_grad_(False)
    losses = []
    n = data.xhat.shape[0]
    prefix = data.xhat.shape[1] + config.sink_tokens  # the teacher's prefix length
    first_cut = data.first_cut
    total = config.distill_steps if config.distill_steps is not None else config.max_steps
    bar = tqdm(total=total, desc=f"distil {consumer.name}: train", unit="step", disable=not progress)
    step, train_start = 0, time.perf_counter()
    while step < total:
        if config.distill_steps is None and step == min(PROBE_STEPS, total):
            now = time.perf_counter()
            total = planned_steps(config, step, (now - train_start) / step, start_time + time_limit_s - now)
            bar.total = total
            bar.refresh()
        idx = torch.randint(0, n, (config.batch_size,), generator=generator)
        cut = prefix
        if first_cut < prefix:
            cut = int(torch.randint(first_cut, prefix + 1, (1,), generator=generator))
        coded = cut - config.sink_tokens
        xhat = data.xhat[idx, :coded].float()
        y = xhat + torch.einsum("btgc,gcd->btgd", xhat, weight) + bias
        hidden = data.hidden[idx, :coded].float() if data.hidden is not None else None
        if patches:
            groups = list(y.unbind(2))
            apply_patches(groups, patches, hidden, space.patch_layers)
            y = torch.stack(groups, dim=2)
        cache = cache_from_features(consumer.model, y, data.sink_keys[idx], data.sink_values[idx], space.layout,
                             config.sink_tokens)
        feed = data.tokens[idx, cut:cut + config.continuation_tokens]
        logits = consumer.model(input_ids=feed, **{cache_kwarg(consumer.model): cache}, use_cache=True).logits
        rows = slice(cut - first_cut, cut - first_cut + config.continuation_tokens)
        teacher = F.log_softmax(data.teacher[idx, rows].float(), -1)
        student = F.log_softmax(logits, -1)
        kl = F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1).mean()
        loss = kl
        if config.greedy_weight:
            loss = kl + config.greedy_weight * greedy_margin_loss(student, teacher)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # cosine decay over the run keeps the last steps from jittering
        for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
            group["lr"] = base * 0.5 * (1 + math.cos(math.pi * step / max(1, total)))
        optimizer.step()
        losses.append(float(kl.detach()))
        if step % 10 == 0:
            bar.set_postfix(kl=f"{sum(losses[-20:]) / len(losses[-20:]):.4f}")
        bar.update(1)
        step += 1
    bar.close()
    for patch in patches:
        for t in patch.trainable():
            t.requires_grad_(False)
    decoder = PairDecoder(consumer.name, space.fingerprint, weight.detach().clone(), bias.detach().clone(),
                          consumer.fingerprint, patches)
    stats = {
        "windows": n,
        "steps": total,
        "steps_from": "fixed" if config.distill_steps is not None else f"time budget {time_limit_s:.0f} s",
        "greedy_weight": config.greedy_weight,
        "shortest_prefix": config.shortest_prefix,
        "collect_seconds": round(collect_seconds, 1),
        "train_seconds": round(time.perf_counter() - start_time - collect_seconds, 1),
        "kl_first": round(sum(losses[:20]) / max(1, len(losses[:20])), 5) if losses else None,
        "kl_last": round(sum(losses[-20:]) / max(1, len(losses[-20:])), 5) if losses else None,
    }
    return decoder, stats
