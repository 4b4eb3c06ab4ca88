"""The producer side of SCD: a code space encodes prefix KV into bits over a calibrated basis."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from scd_store.codecs.base import check_tokens
from scd_store.codecs.fingerprint import tensors_fingerprint
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.scd.ecsq import EcsqQuantiser
from scd_store.codecs.scd.hidden import HiddenCode
from scd_store.codecs.scd.layout import KVLayout, to_features
from scd_store.codecs.scd.quantizer import (
    PACKING,
    PackingPlan,
    allocate_bits,
    by_component,
    dequantize,
    pack_codes,
    packed_size,
    quantize,
    unpack_sorted,
)
from scd_store.codecs.scd.range_coding import PACKING as ENTROPY_PACKING
from scd_store.codecs.scd.range_coding import CodeTables, count_tables
from scd_store.codecs.tensor_pack import PayloadError, json_int, pack, unpack

CODEC_ID = "scd"


@dataclass(slots=True)
class SpaceCodes:
    """What a payload carries, unpacked: the integer codes and the raw sink tokens."""

    start: int
    num_tokens: int
    sorted_codes: torch.Tensor  # [rows, T - sinks] uint8 in storage order with a zero row (unpack_sorted)
    sorted_row: torch.Tensor  # [groups * C] int64: each component's row in sorted_codes (PackingPlan.rows)
    sinks: KVState | None  # the first tokens' raw KV (absolute positions < sink_tokens)
    hidden_codes: torch.Tensor | None = None  # [T - sinks, patch layers * hidden size], PATCH spaces only

    @property
    def codes(self) -> torch.Tensor:
        """``[T - sinks, groups * C]`` uint8 quantiser indices (a transposed view)."""
        return by_component(self.sorted_codes, self.sorted_row).t()


def _section(tensors: dict[str, torch.Tensor], name: str, coded: int, plan: PackingPlan, device
             ) -> torch.Tensor:
    """Unpacked codes ``[rows, coded]`` in storage order of one packed section, its size checked first."""
    if not coded:
        return torch.zeros(plan.region_rows(0)[1] + 1, 0, dtype=torch.uint8, device=device)
    packed = tensors[name].to(device)
    if packed.numel() != packed_size(coded, plan):
        raise PayloadError(f"payload section {name} has the wrong size")
    return unpack_sorted(packed, coded, plan)


def _entropy_section(coder: CodeTables, tensors: dict[str, torch.Tensor], coded: int, plan: PackingPlan,
                     device, digest: object) -> torch.Tensor:
    """An entropy-coded section decoded on the host into :func:`_section`'s layout (storage-order rows)."""
    out = torch.zeros(plan.region_rows(coded)[1] + 1, coded, dtype=torch.uint8)
    if coded:
        if not isinstance(digest, str):
            raise PayloadError("a range-coded payload must carry its codes' digest")
        out[plan.rows(coded)[coder.sent]] = coder.decode_codes(tensors["words"], coded, digest)
    return out.to(device)


def sink_count(sink_tokens: int, start: int, tokens: int) -> int:
    """How many of ``tokens`` tokens from absolute position ``start`` are sinks (positions < ``sink_tokens``)."""
    return max(0, min(sink_tokens - start, tokens))


def key_weights(groups: int, width: int, key_weight: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The allocator's distortion weight per component ``[groups, width]``: ``key_weight`` on the key groups
    (even), 1 on the value groups."""
    weights = torch.ones(groups, width, dtype=dtype)
    weights[0::2] = key_weight
    return weights


def head_group_basis(cov: torch.Tensor, layout: KVLayout, head_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues ``[G, C]`` (decreasing, clamped at 0) and orthonormal eigenvectors ``[G, C, C]`` (columns)
    of covariances ``[G, C, C]``; with ``head_groups`` > 1, of each head group's diagonal block alone, so each
    column is zero outside one group of ``kv_heads / head_groups`` heads."""
    if head_groups < 1 or layout.kv_heads % head_groups:
        raise ValueError(f"head_groups must divide the model's {layout.kv_heads} KV heads, got {head_groups}")
    cov = cov.double()
    if head_groups == 1:
        eigvals, eigvecs = torch.linalg.eigh(cov)
        return eigvals.flip(-1).clamp_min(0), eigvecs.flip(-1)
    width = layout.width // head_groups
    eigvals = torch.empty(cov.shape[:2], dtype=torch.float64, device=cov.device)
    eigvecs = torch.zeros_like(cov)
    for r in range(head_groups):
        block = slice(r * width, (r + 1) * width)
        vals, vecs = torch.linalg.eigh(cov[:, block, block])
        eigvals[:, block], eigvecs[:, block, block] = vals, vecs
    order = eigvals.argsort(dim=-1, descending=True)
    eigvals = eigvals.gather(-1, order).clamp_min(0)
    return eigvals, eigvecs.gather(2, order.unsqueeze(1).expand_as(eigvecs))


@dataclass(slots=True)
class CodeSpace:
    """A producer's calibrated basis: per group (layer x K/V) a mean, an orthonormal basis
    (columns by decreasing variance), component standard deviations and a bit budget.

    Tokens at absolute positions below ``sink_tokens`` are sent raw (fp16): attention sinks are
    never put through the basis. A PATCH space also codes ``H_in`` at its patch layers (``hidden``);
    the K / V groups of those layers then carry no bits: consumers regenerate them.

    With ``ecsq`` (:mod:`~scd_store.codecs.scd.ecsq`) components are quantised by entropy-coded scalar
    quantisers instead of fixed-rate ones (``bits`` are then their container widths); ``packing`` is
    the format :meth:`encode` writes: ``"ans-1"`` (range-coded, the fewest bytes) or ``"planes-2"``
    (fixed-rate bit planes, the fastest to unpack). Both decode to the same KV.
    """

    space_id: str
    layout: KVLayout
    mean: torch.Tensor
    basis: torch.Tensor
    sigma: torch.Tensor
    bits: torch.Tensor
    sink_tokens: int = 4
    producer_fingerprint: str = ""
    hidden: HiddenCode | None = None
    ecsq: EcsqQuantiser | None = None
    packing: str = PACKING
    tables: CodeTables | None = None
    max_positions: int = field(default=32768, repr=False, compare=False)  # bound on a payload's start + tokens
    _fingerprint: str = field(default="", repr=False)
    _plans: tuple[PackingPlan, PackingPlan | None] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        g, c = self.layout.groups, self.layout.width
        for name, shape in (("mean", (g, c)), ("basis", (g, c, c)), ("sigma", (g, c)), ("bits", (g, c))):
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"code space {name} has shape {tuple(getattr(self, name).shape)}, expected {shape}")
        if int(self.bits.min()) < 0 or int(self.bits.max()) > 8:
            raise ValueError("bits per component must be within 0..8")
        if self.sink_tokens < 0:
            raise ValueError("sink_tokens must be >= 0")
        self.bits = self.bits.to(torch.int64)
        if self.ecsq is not None:
            if self.hidden is not None:
                raise ValueError("entropy-coded quantisers are for REUSE spaces (PATCH codes H_in at fixed rate)")
            if self.ecsq.widths.numel() != g * c or not torch.equal(self.ecsq.widths.view(g, c), self.bits):
                raise ValueError("an ECSQ space's bits must be its quantisers' container widths")
        if self.tables is not None:
            if self.ecsq is not None or self.hidden is not None:
                raise ValueError("code tables are for fixed-rate REUSE spaces (an ECSQ space keeps its own)")
            if not torch.equal(self.tables.widths, self.bits.flatten()):
                raise ValueError("a space's code tables must be over its bit widths")
        if self.packing not in self.packings:
            raise ValueError(f"packing {self.packing!r} is not one of this space's {self.packings}")
        if self.hidden is not None:
            if max(self.hidden.layers) >= self.layout.num_layers:
                raise ValueError(f"patch layers {self.hidden.layers} outside the model's {self.layout.num_layers}")
            if any(int(self.bits[2 * layer : 2 * layer + 2].sum()) for layer in self.hidden.layers):
                raise ValueError("K / V groups of patch layers must carry no bits (the consumer regenerates them)")
        extra = f"{self.layout}|{self.sink_tokens}" + (f"|{self.patch_layers}" if self.patch_layers else "")
        self._fingerprint = tensors_fingerprint(self.tensors(), extra=extra)  # patch layers only in PATCH spaces' ids
        self._plans = (PackingPlan.of(self.bits), PackingPlan.of(self.hidden.bits) if self.hidden is not None else None)

    @classmethod
    def from_statistics(cls, space_id: str, layout: KVLayout, mean: torch.Tensor, cov: torch.Tensor, budget: float,
                        key_weight: float = 1.0, sink_tokens: int = 4, producer_fingerprint: str = "",
                        hidden_stats: tuple[tuple[int, ...], torch.Tensor, torch.Tensor] | None = None,
                        sensitivity: torch.Tensor | None = None, head_groups: int = 1) -> CodeSpace:
        """A space from per-group feature means ``[G, C]`` and covariances ``[G, C, C]``: the PCA basis
        (components by decreasing variance) and ``budget`` (coded bits per dimension against fp16)
        spread over the components by :func:`allocate_bits`.

        Distortion weights: with ``sensitivity`` ``[G, C, C]`` (e.g. the Fisher information of the model's
        next-token distribution with respect to each group's features) a component's weight is
        ``u^T F u``, so bits go where quantisation noise costs the most; without it (what calibration
        does), keys are weighted ``key_weight`` against values. ``hidden_stats`` = (patch
        layers, ``H_in`` means ``[P, D]``, covariances ``[P, D, D]``) makes a PATCH space: ``H_in`` is
        coded at the same bits per dimension and the patch layers' K / V groups get none.

        ``head_groups`` > 1 splits each group's KV heads into that many equal groups (tensor-parallel
        ranks) and fits a basis per head group: every component then lives on one rank's heads, so a rank
        can encode and decode its own heads alone (:func:`head_group_basis`). Bits are still allocated
        over all components together."""
        eigvals, eigvecs = head_group_basis(cov, layout, head_groups)
        if sensitivity is not None:
            if sensitivity.shape != cov.shape:
                raise ValueError(f"sensitivity {tuple(sensitivity.shape)} does not match the covariances")
            weights = torch.einsum("gcj,gcd,gdj->gj", eigvecs, sensitivity.double(), eigvecs).clamp_min(0)
        else:
            weights = key_weights(layout.groups, layout.width, key_weight, eigvals.dtype)
        hidden = None
        coded_groups = layout.groups
        if hidden_stats is not None:
            layers, h_mean, h_cov = hidden_stats
            hidden = HiddenCode.from_statistics(tuple(layers), h_mean, h_cov, budget * 16)
            for layer in hidden.layers:
                weights[2 * layer : 2 * layer + 2] = 0
            coded_groups -= 2 * len(hidden.layers)
        bits = allocate_bits(eigvals, weights, round(budget * 16 * coded_groups * layout.width))
        return cls(space_id, layout, mean.float(), eigvecs.float(), eigvals.sqrt().float(), bits, sink_tokens,
                   producer_fingerprint, hidden)

    @property
    def coder(self) -> CodeTables | None:
        """The tables range-coded payloads are coded against (an ECSQ space's, or a fixed-rate space's)."""
        return self.ecsq.coder if self.ecsq is not None else self.tables

    @property
    def packings(self) -> tuple[str, ...]:
        """The payload formats this space reads and writes."""
        return (PACKING, ENTROPY_PACKING) if self.coder is not None else (PACKING,)

    def with_packing(self, packing: str) -> CodeSpace:
        """This space writing ``packing`` payloads (the same space: the same fingerprint, both formats read)."""
        return replace(self, packing=packing)

    def with_tables(self, z: torch.Tensor, packing: str = ENTROPY_PACKING) -> CodeSpace:
        """This fixed-rate space with code tables counted on calibration coordinates ``z`` ``[T, n]`` (a
        new space: another fingerprint; the same codes, range-coded)."""
        codes = quantize(z, self.sigma.flatten().to(z), self.bits.flatten().to(z.device))
        tables = CodeTables(self.bits.flatten().clone(), count_tables(codes, self.bits.flatten()))
        return replace(self, hidden=None, ecsq=None, packing=packing, tables=tables)

    def with_ecsq(self, quantiser: EcsqQuantiser, packing: str = ENTROPY_PACKING) -> CodeSpace:
        """This space's basis with entropy-coded scalar quantisers (a new space: another fingerprint)."""
        return replace(self, bits=quantiser.widths.view_as(self.bits).clone(), hidden=None, ecsq=quantiser,
                       packing=packing, tables=None)

    @property
    def fingerprint(self) -> str:
        """Content fingerprint: blobs and decoders are bound to it."""
        return self._fingerprint

    @property
    def patch_layers(self) -> tuple[int, ...]:
        """Layers whose ``H_in`` this space codes (empty for a REUSE-only space)."""
        return self.hidden.layers if self.hidden is not None else ()

    def tensors(self) -> dict[str, torch.Tensor]:
        tensors = {"mean": self.mean, "basis": self.basis, "sigma": self.sigma, "bits": self.bits}
        if self.hidden is not None:
            tensors.update(self.hidden.tensors())
        if self.ecsq is not None:
            tensors.update(self.ecsq.tensors())
        if self.tables is not None:
            tensors["code_tables"] = self.tables.probabilities
        return tensors

    @property
    def active_components(self) -> int:
        """Leading basis components that carry bits in at least one group (the rest decode to the mean)."""
        carrying = (self.bits > 0).any(dim=0).nonzero()
        return int(carrying.max()) + 1 if carrying.numel() else 0

    @property
    def bits_per_token(self) -> int:
        """Coded bits of one (non-sink) token: the planes' widths, or for range-coded payloads the tables'
        entropy (what a token like the calibration's costs)."""
        if self.packing == ENTROPY_PACKING:
            return round(self.coder.mean_rate() * self.bits.numel())
        return int(self.bits.sum()) + (int(self.hidden.bits.sum()) if self.hidden is not None else 0)

    def payload_ratio(self) -> float:
        """Coded bits per (non-sink) token against raw fp16 KV."""
        return self.bits_per_token / (16 * self.layout.groups * self.layout.width)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Basis coordinates ``[T, groups, C]`` of features ``[T, groups, C]``."""
        centred = (features - self.mean.to(features)).transpose(0, 1)  # [G, T, C]
        return torch.bmm(centred, self.basis.to(features)).transpose(0, 1)

    def check_state(self, state: KVState) -> None:
        """Raise ``ValueError`` naming the problem unless ``state`` is KV this space can encode."""
        self.layout.check(state, f"code space {self.space_id}")
        if not (bool(torch.isfinite(state.keys).all()) and bool(torch.isfinite(state.values).all())):
            raise ValueError(f"code space {self.space_id}: KV holds NaN or inf values; refusing to encode")

    def encode(self, state: KVState) -> bytes:
        """Serialise ``state`` (the producer's prefix KV at its absolute positions)."""
        self.check_state(state)
        sinks = sink_count(self.sink_tokens, state.start, state.num_tokens)
        tensors: dict[str, torch.Tensor] = {}
        if sinks:
            tensors["sink_keys"] = state.keys[:, :, :sinks].half()
            tensors["sink_values"] = state.values[:, :, :sinks].half()
        coded = state.num_tokens - sinks
        if coded:
            rest = KVState(state.keys[:, :, sinks:], state.values[:, :, sinks:], start=state.start + sinks)
            z = self.project(to_features(rest, self.layout)).reshape(coded, -1)
            if self.ecsq is not None:
                codes = self.ecsq.quantize(z)
            else:
                codes = quantize(z, self.sigma.flatten().to(z), self.bits.flatten().to(z.device))
            if self.packing == ENTROPY_PACKING:
                tensors["words"], digest = self.coder.encode_codes(codes)
            else:
                tensors["codes"] = pack_codes(codes, self._plans[0])
            if self.hidden is not None:
                hidden_codes = self.hidden.quantize(state.hidden, sinks)
                tensors["hidden_codes"] = pack_codes(hidden_codes, self._plans[1])
        meta = {"space": self.fingerprint, "packing": self.packing, "start": state.start, "tokens": state.num_tokens,
                "sinks": sinks}
        if self.packing == ENTROPY_PACKING and coded:
            meta["codes_digest"] = digest
        return pack(CODEC_ID, meta, tensors)

    def unpack(self, payload: bytes | torch.Tensor, device: torch.device | str = "cpu",
               expect_tokens: int | None = None) -> SpaceCodes:
        """Parse a payload of this space (bytes, or a uint8 tensor on any device); raises
        :class:`PayloadError` on any mismatch (and on another token count than ``expect_tokens``)."""
        _, meta, t = unpack(payload, CODEC_ID)
        return self.codes_from(meta, t, device, expect_tokens)

    def counts(self, meta: dict, expect_tokens: int | None = None) -> tuple[int, int, int]:
        """``(start, tokens, sinks)`` of a payload's metadata, checked against this space, its position
        bound and ``expect_tokens`` (when given) before anything sized by them is allocated."""
        try:
            if meta["space"] != self.fingerprint:
                raise PayloadError(f"payload belongs to code space {meta['space']!r:.80}, not {self.fingerprint}")
            if meta.get("packing") not in self.packings:
                raise PayloadError(f"payload codes are packed as {meta.get('packing')!r:.80}; this space reads "
                                   f"{self.packings}")
            start, tokens, sinks = (json_int(meta[key], f"scd payload {key}") for key in ("start", "tokens", "sinks"))
        except (KeyError, TypeError) as exc:
            raise PayloadError(f"scd payload is inconsistent: {exc!r:.120}") from None
        check_tokens(tokens, expect_tokens)
        if start < 0 or tokens < sinks or sinks != sink_count(self.sink_tokens, start, tokens):
            raise PayloadError("payload token counts are inconsistent")
        if start + tokens > self.max_positions:
            raise PayloadError(f"payload reaches position {start + tokens}, past this process's bound "
                               f"{self.max_positions} (the engine's context length): refused before decoding")
        return start, tokens, sinks

    def codes_from(self, meta: dict, t: dict[str, torch.Tensor], device: torch.device | str = "cpu",
                   expect_tokens: int | None = None) -> SpaceCodes:
        """:meth:`unpack` after the container is parsed: check ``meta`` (:meth:`counts`) and unpack the
        sections on ``device`` (no host round trip once the header is read, so a CUDA graph can capture it)."""
        start, tokens, sinks = self.counts(meta, expect_tokens)
        coded = tokens - sinks
        try:
            plan, hidden_plan = self._plans
            if meta["packing"] == ENTROPY_PACKING:
                codes = _entropy_section(self.coder, t, coded, plan, device, meta.get("codes_digest"))
            else:
                codes = _section(t, "codes", coded, plan, device)
            hidden_codes = None
            if self.hidden is not None:
                hidden_codes = _section(t, "hidden_codes", coded, hidden_plan, device)
                hidden_codes = by_component(hidden_codes, hidden_plan.rows(coded, device)).t()
            sink_state = None
            if sinks:
                sink_state = KVState(t["sink_keys"].to(device), t["sink_values"].to(device), start=start)
                self.layout.check(sink_state)
                if sink_state.num_tokens != sinks:
                    raise PayloadError("sink section has the wrong token count")
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, PayloadError):
                raise
            raise PayloadError(f"scd payload is inconsistent: {exc}") from None
        return SpaceCodes(start, tokens, codes, plan.rows(coded, device), sink_state, hidden_codes)

    def reconstruct(self, codes: torch.Tensor) -> torch.Tensor:
        """Basis coordinates ``[T, groups, C]`` (quantiser mid-points) of integer ``codes``."""
        if self.ecsq is not None:
            zhat = self.ecsq.dequantize(codes)
        else:
            zhat = dequantize(codes, self.sigma.flatten().to(codes.device), self.bits.flatten().to(codes.device))
        return zhat.view(codes.shape[0], self.layout.groups, self.layout.width)
