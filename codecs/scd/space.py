"""The producer side of SCD: a code space encodes prefix KV into bits over a calibrated basis."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from scd_store.codecs.fingerprint import tensors_fingerprint
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.scd.layout import KVLayout, to_features
from scd_store.codecs.scd.quantizer import allocate_bits, dequantize, pack_codes, packed_size, quantize, unpack_codes
from scd_store.codecs.tensor_pack import PayloadError, pack, unpack

CODEC_ID = "scd"


@dataclass(slots=True)
class SpaceCodes:
    """What a payload carries, unpacked: the integer codes and the raw sink tokens."""

    start: int
    num_tokens: int
    codes: torch.Tensor  # [T - sinks, groups * C] uint8 quantiser indices
    sinks: KVState | None  # the first tokens' raw KV (absolute positions < sink_tokens)


@dataclass(slots=True)
class CodeSpace:
    """A producer's calibrated basis: per group (layer x K/V) a mean, an orthonormal basis
    (columns by decreasing variance), component standard deviations and a bit budget.

    Tokens at absolute positions below ``sink_tokens`` are sent raw (fp16): attention sinks are
    never put through the basis.
    """

    space_id: str
    layout: KVLayout
    mean: torch.Tensor
    basis: torch.Tensor
    sigma: torch.Tensor
    bits: torch.Tensor
    sink_tokens: int = 4
    producer_fingerprint: str = ""
    _fingerprint: str = field(default="", repr=False)

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
        self._fingerprint = tensors_fingerprint(self.tensors(), extra=f"{self.layout}|{self.sink_tokens}")

    @classmethod
    def from_statistics(cls, space_id: str, layout: KVLayout, mean: torch.Tensor, cov: torch.Tensor, budget: float,
                        key_weight: float = 1.0, sink_tokens: int = 4, producer_fingerprint: str = "") -> CodeSpace:
        """A space from per-group feature means ``[G, C]`` and covariances ``[G, C, C]``: the PCA basis
        (components by decreasing variance) and ``budget`` (coded payload vs fp16) spread over the
        components by :func:`allocate_bits`, keys' distortion weighted by ``key_weight``."""
        eigvals, eigvecs = torch.linalg.eigh(cov.double())
        eigvals, eigvecs = eigvals.flip(-1).clamp_min(0), eigvecs.flip(-1)
        weights = torch.ones_like(eigvals)
        weights[0::2] = key_weight
        bits = allocate_bits(eigvals, weights, round(budget * 16 * layout.groups * layout.width))
        return cls(space_id, layout, mean.float(), eigvecs.float(), eigvals.sqrt().float(), bits, sink_tokens,
                   producer_fingerprint)

    @property
    def fingerprint(self) -> str:
        """Content fingerprint: blobs and decoders are bound to it."""
        return self._fingerprint

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"mean": self.mean, "basis": self.basis, "sigma": self.sigma, "bits": self.bits}

    @property
    def active_components(self) -> int:
        """Leading basis components that carry bits in at least one group (the rest decode to the mean)."""
        carrying = (self.bits > 0).any(dim=0).nonzero()
        return int(carrying.max()) + 1 if carrying.numel() else 0

    @property
    def bits_per_token(self) -> int:
        return int(self.bits.sum())

    def payload_ratio(self) -> float:
        """Coded bits per (non-sink) token against raw fp16 KV."""
        return self.bits_per_token / (16 * self.layout.groups * self.layout.width)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Basis coordinates ``[T, groups, C]`` of features ``[T, groups, C]``."""
        centred = (features - self.mean.to(features)).transpose(0, 1)  # [G, T, C]
        return torch.bmm(centred, self.basis.to(features)).transpose(0, 1)

    def encode(self, state: KVState) -> bytes:
        """Serialise ``state`` (the producer's prefix KV at its absolute positions)."""
        sinks = max(0, min(self.sink_tokens - state.start, state.num_tokens))
        tensors: dict[str, torch.Tensor] = {}
        if sinks:
            tensors["sink_keys"] = state.keys[:, :, :sinks].half()
            tensors["sink_values"] = state.values[:, :, :sinks].half()
        coded = state.num_tokens - sinks
        if coded:
            rest = KVState(state.keys[:, :, sinks:], state.values[:, :, sinks:], start=state.start + sinks)
            z = self.project(to_features(rest, self.layout)).reshape(coded, -1)
            flat_bits = self.bits.flatten().to(z.device)
            codes = quantize(z, self.sigma.flatten().to(z), flat_bits)
            tensors["codes"] = pack_codes(codes, flat_bits)
        meta = {"space": self.fingerprint, "start": state.start, "tokens": state.num_tokens, "sinks": sinks}
        return pack(CODEC_ID, meta, tensors)

    def unpack(self, payload: bytes, device: torch.device | str = "cpu") -> SpaceCodes:
        """Parse a payload of this space; raises :class:`PayloadError` on any mismatch."""
        _, meta, t = unpack(payload, CODEC_ID)
        try:
            if meta["space"] != self.fingerprint:
                raise PayloadError(f"payload belongs to code space {meta['space']}, not {self.fingerprint}")
            start, tokens, sinks = int(meta["start"]), int(meta["tokens"]), int(meta["sinks"])
            coded = tokens - sinks
            if start < 0 or coded < 0 or sinks != max(0, min(self.sink_tokens - start, tokens)):
                raise PayloadError("payload token counts are inconsistent")
            flat_bits = self.bits.flatten()
            if coded:
                packed = t["codes"].to(device)
                if packed.numel() != packed_size(coded, flat_bits):
                    raise PayloadError("payload code section has the wrong size")
                codes = unpack_codes(packed, coded, flat_bits)
            else:
                codes = torch.zeros(0, flat_bits.numel(), dtype=torch.uint8, device=device)
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
        return SpaceCodes(start, tokens, codes, sink_state)

    def reconstruct(self, codes: torch.Tensor) -> torch.Tensor:
        """Basis coordinates ``[T, groups, C]`` (quantiser mid-points) of integer ``codes``."""
        flat_bits = self.bits.flatten().to(codes.device)
        zhat = dequantize(codes, self.sigma.flatten().to(codes.device), flat_bits)
        return zhat.view(codes.shape[0], self.layout.groups, self.layout.width)
