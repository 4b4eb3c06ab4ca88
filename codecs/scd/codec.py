"""The SCD codec: a code space's encoder and one consumer's decoder behind the codec interface."""

from __future__ import annotations

import logging
import os

import torch

from scd_store.codecs.base import Codec, check_buffers
from scd_store.codecs.device_cache import published
from scd_store.codecs.head_share import HeadShare
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.paged import PagedCaches
from scd_store.codecs.scd import fused, paged_fused
from scd_store.codecs.scd.decoder import PairDecoder, apply_map, centred_codes, code_centres
from scd_store.codecs.scd.graphs import DecodeGraphs
from scd_store.codecs.scd.layout import write_token_major
from scd_store.codecs.scd.patch import aligned_kv
from scd_store.codecs.scd.range_coding import PACKING as ENTROPY_PACKING
from scd_store.codecs.scd.rope import RopeTable
from scd_store.codecs.scd.space import CODEC_ID, CodeSpace, SpaceCodes
from scd_store.codecs.tensor_pack import PayloadError, unpack

log = logging.getLogger(__name__)

# CPU decoding streams a few layers and at most _CPU_STEP_TOKENS tokens at a time so codes and features stay in cache
_CPU_STEP_BYTES = 4 << 20
_CPU_STEP_TOKENS = 512
MATMULS = ("auto", "float32", "bfloat16")
# the space's own folded matrices, shared by every per-head decoder of it in this process
_SPACE_FOLDS: dict[str, dict[tuple, tuple[torch.Tensor, ...]]] = {}


def matmul_dtype(matmul: str, device) -> torch.dtype:
    """The dtype of the decode's products: ``"auto"`` is bf16 on a CPU with bf16 dot products (AMX tiles:
    oneDNN runs them ~6x faster than fp32; AVX512-BF16: the decode 1.5x faster; bf16 holds the centred
    codes exactly), fp32 elsewhere; ``SCD_STORE_DECODE_MATMUL=float32|bfloat16`` overrides ``"auto"``."""
    if matmul == "auto":
        forced = os.environ.get("SCD_STORE_DECODE_MATMUL", "")
        if forced:
            if forced not in MATMULS[1:]:
                raise ValueError(f"SCD_STORE_DECODE_MATMUL must be one of {MATMULS[1:]}, got {forced!r}")
            return getattr(torch, forced)
        return torch.bfloat16 if torch.device(device).type == "cpu" and cpu_has_bf16_products() else torch.float32
    return getattr(torch, matmul)


def cpu_has_bf16_products() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX tiles or AVX512-BF16)."""
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


class ScdCodec(Codec):
    """Encodes with ``space``; decodes into ``decoder``'s consumer KV (REUSE).

    Decoding is a batched matmul over layers and tensors (integer codes in, consumer features
    out, only the components that carry bits), then one pass that moves heads and rotates keys
    straight into the output cache tensors; on a CPU a few layers at a time, so each step's codes
    and features stay in cache, on an accelerator all layers at once. ``matmul``: the products'
    dtype (:func:`matmul_dtype`; ``"auto"`` is bf16 on CPUs with AMX tiles or AVX512-BF16, on centred codes).
    """

    codec_id = CODEC_ID

    def __init__(self, space: CodeSpace, decoder: PairDecoder | None = None, *, cuda_graphs: bool = True,
                 fused_kernel: bool = False, matmul: str = "auto"):
        if matmul not in MATMULS:
            raise ValueError(f"matmul must be one of {MATMULS}, got {matmul!r}")
        if decoder is not None and decoder.space_fingerprint != space.fingerprint:
            raise ValueError(f"decoder of {decoder.consumer} belongs to another code space")
        if decoder is not None:
            hidden = sorted(p.layer for p in decoder.patches if p.source == "hidden")
            if hidden != sorted(space.patch_layers):
                raise ValueError(f"decoder of {decoder.consumer} patches H_in at layers {hidden}, the code space "
                                 f"codes H_in at {sorted(space.patch_layers)}")
        self.space = space
        self.decoder = decoder
        self.matmul = matmul
        self._rope = RopeTable(space.layout.head_dim, space.layout.rope_theta, space.layout.rope)
        self._matrices: dict[tuple, tuple[torch.Tensor, ...]] = {}  # folded (and centred) matrices per device
        self._patches: dict[str, dict] = {}
        # REUSE decodes on CUDA are launch-bound at serving lengths: replay them as CUDA graphs
        # one RoPE table and one dense folded matrix: what the fused kernels (fused, paged_fused) compute
        self.reuse_only = decoder is not None and not decoder.patches and space.hidden is None \
            and not space.layout.per_layer_rope and decoder.structure == "dense"
        # opt-in until measured on a GPU: checked against the PyTorch path under Triton's interpreter only
        self.fused_kernel = fused_kernel and self.reuse_only
        self.graphs = DecodeGraphs(self) if cuda_graphs and self.reuse_only and torch.cuda.is_available() else None

    def encode(self, state: KVState) -> bytes:
        return self.space.encode(state)

    @property
    def _per_head(self) -> bool:
        return self.decoder.structure == "per-head"

    def _cache(self) -> dict[tuple, tuple[torch.Tensor, ...]]:
        """Where folded matrices live: this codec's (a dense map is folded in) or the space's (per-head maps
        are applied after the product, so every consumer of the space shares one fold)."""
        return _SPACE_FOLDS.setdefault(self.space.fingerprint, {}) if self._per_head else self._matrices

    def _folded(self, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder's folded matrices cut to the components that carry bits, contiguous."""
        key, cache = (str(device), dtype), self._cache()
        if key not in cache:
            matrix, offset = self.decoder.folded(self.space, device, dtype, with_map=not self._per_head)
            active = self.space.active_components
            cache[key] = published((matrix[:, :active].contiguous(), offset.unsqueeze(1).contiguous()), device)
        return cache[key]

    def _heads(self, device, dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A per-head decoder's map and bias ``([G, H, D, D], [G, 1, C])`` on ``device``; None for a dense one."""
        if not self._per_head:
            return None
        key = (str(device), dtype, "heads")
        if key not in self._matrices:
            self._matrices[key] = published((self.decoder.weight.to(device=device, dtype=dtype).contiguous(),
                                             self.decoder.bias.to(device=device, dtype=dtype).unsqueeze(1)
                                             .contiguous()), device)
        return self._matrices[key]

    def _centred(self, device, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`_folded` for centred codes (``decoder.folded(centred=True)``) in a low-precision
        ``dtype``, with each active component's ``2^(b - 1)`` as uint8 ``[G * active, 1]``."""
        key, cache = (str(device), dtype, "centred"), self._cache()
        if key not in cache:
            matrix, offset = self.decoder.folded(self.space, device, dtype, centred=True, with_map=not self._per_head)
            active = self.space.active_components
            centres = code_centres(self.space)[:, :active].reshape(-1, 1).to(device=device, dtype=torch.uint8)
            cache[key] = published((matrix[:, :active].contiguous(), offset.unsqueeze(1).contiguous(), centres),
                                   device)
        return cache[key]

    def _patched(self, layer: int, features: torch.Tensor, hidden: torch.Tensor | None, device) -> None:
        """Overwrite layer ``layer``'s K / V features ``[2, T, C]`` with its aligner's output."""
        key = str(device)
        if key not in self._patches:
            self._patches[key] = published({p.layer: p.to(device) for p in self.decoder.patches}, device)
        k, v = aligned_kv(self._patches[key][layer], features[0], features[1], hidden, self.space.patch_layers)
        features[0], features[1] = k, v

    def _tile(self, tokens: int, device, element_size: int = 4) -> tuple[int, int]:
        """``(layers, tokens)`` decoded per batched matmul: everything at once on an accelerator; on a
        CPU at most ``_CPU_STEP_TOKENS`` tokens and as many layers as keep one step's codes and
        features within a few MiB of cache (long prefixes go in token chunks, so a 2,048-token
        decode costs ~4.6x a 448-token one instead of ~6.7x)."""
        layers = self.space.layout.num_layers
        if torch.device(device).type != "cpu":
            return layers, tokens
        span = min(tokens, _CPU_STEP_TOKENS)
        per_layer = 2 * span * self.space.layout.width * element_size * 2
        return max(1, min(layers, _CPU_STEP_BYTES // max(1, per_layer))), span

    @torch.no_grad()
    def decode(self, payload: bytes | torch.Tensor, *, device="cpu", dtype=torch.float32,
               expect_tokens: int | None = None) -> KVState:
        """Rebuild the consumer's KV; ``payload`` is bytes or a uint8 tensor (a GPU tier's blob: no
        host copy). On CUDA, REUSE decodes of up to ``graphs.max_tokens`` tokens replay a CUDA graph.
        A payload of another token count than ``expect_tokens`` is refused before anything is allocated."""
        self._require_decoder()
        if self.graphs is not None and torch.device(device).type == "cuda":
            _, meta, tensors = unpack(payload, CODEC_ID)
            self.space.counts(meta, expect_tokens)
            # range-coded codes are decoded on the host first: nothing to capture
            state = None if meta["packing"] == ENTROPY_PACKING else self.graphs.decode(meta, tensors,
                                                                                         torch.device(device), dtype)
            if state is not None:
                return state
            return self.decode_codes(self.space.codes_from(meta, tensors, device), device, dtype)
        return self.decode_codes(self.space.unpack(payload, device, expect_tokens), device, dtype)

    @torch.no_grad()
    def decode_into(self, payload: bytes | torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    expect_tokens: int | None = None, heads: HeadShare | None = None) -> KVState:
        """:meth:`decode` written straight into an engine's buffers (any strides; no copy, and no fresh
        output pages: on a CPU those cost a long prefix more than the decode's maths). The payload's token
        count is checked against ``expect_tokens`` and the buffers' before its sections are unpacked. On
        CUDA this runs eagerly (CUDA graphs own their output buffers). A share of the heads (``heads``: a
        tensor-parallel rank's) decodes every head, then keeps its own (:meth:`Codec.decode_into`)."""
        self._require_decoder()
        if heads is not None and not heads.is_whole:
            return super().decode_into(payload, keys, values, expect_tokens, heads)
        _, meta, tensors = unpack(payload, CODEC_ID)
        tokens = self.space.counts(meta, expect_tokens)[1]
        layout = self.space.layout
        check_buffers((layout.num_layers, layout.kv_heads, tokens, layout.head_dim), keys, values)
        codes = self.space.codes_from(meta, tensors, keys.device)
        return self.decode_codes(codes, keys.device, keys.dtype, out=(keys, values))

    @torch.no_grad()
    def decode_paged(self, payload: bytes | torch.Tensor, caches: PagedCaches, slots: torch.Tensor,
                     expect_tokens: int | None = None, heads: HeadShare | None = None) -> int:
        """:meth:`Codec.decode_paged`: the payload's codes unpacked on the caches' device and written through
        the slot table by the paged fused kernel (:func:`paged_fused.decode_paged`: one launch for every layer
        where Triton runs, its PyTorch reference elsewhere). A share of the heads decodes every head, then
        scatters its own (:meth:`Codec.decode_paged`)."""
        self._require_decoder()
        if heads is not None and not heads.is_whole:
            return super().decode_paged(payload, caches, slots, expect_tokens, heads)
        _, meta, tensors = unpack(payload, CODEC_ID)
        tokens = self.space.counts(meta, slots.shape[0] if expect_tokens is None else expect_tokens)[1]
        codes = self.space.codes_from(meta, tensors, caches.device)
        paged_fused.decode_paged(self, codes, caches, slots)
        return tokens

    def _require_decoder(self) -> None:
        if self.decoder is None:
            raise ValueError("this SCD codec has no consumer decoder: it can encode only")

    def product_dtype(self, device) -> torch.dtype:
        """The dtype of the decode's matmuls on ``device`` (:func:`matmul_dtype`); fp32 where PATCH
        aligners read the features."""
        if self.decoder is not None and self.decoder.patches:
            return torch.float32
        return matmul_dtype(self.matmul, device)

    def angles(self, start: int, tokens: int, device, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE half tables for ``tokens`` coded tokens from absolute position ``start``."""
        return self._rope.halves(start, tokens, device, dtype)

    @torch.no_grad()
    def decode_codes(self, codes: SpaceCodes, device, dtype: torch.dtype,
                     angles: tuple[torch.Tensor, torch.Tensor] | None = None,
                     out: tuple[torch.Tensor, torch.Tensor] | None = None) -> KVState:
        """Unpacked codes to KV, into ``out`` (checked key and value buffers) when given. ``angles``: the
        coded tokens' RoPE half tables when the caller supplies them (a CUDA graph's inputs), else
        read from the table at the codes' positions."""
        layout = self.space.layout
        sinks = codes.sinks.num_tokens if codes.sinks is not None else 0
        shape = (layout.num_layers, layout.kv_heads, codes.num_tokens, layout.head_dim)
        if out is None:
            out = torch.empty(shape, device=device, dtype=dtype), torch.empty(shape, device=device, dtype=dtype)
        keys, values = out
        if sinks:
            keys[:, :, :sinks] = codes.sinks.keys
            values[:, :, :sinks] = codes.sinks.values
        coded = codes.num_tokens - sinks
        if not coded:
            return KVState(keys, values, start=codes.start)
        try:
            layout.check_positions(codes.start, codes.num_tokens)
        except ValueError as exc:
            raise PayloadError(str(exc)) from None
        matrix, offset = self._folded(device, torch.float32)
        active = matrix.shape[1]
        rows = codes.sorted_row.view(layout.groups, layout.width)[:, :active]  # 0-bit components: the zero row
        if angles is None:
            angles = self.angles(codes.start + sinks, coded, device)
        cos, sin = angles
        if self.fused_kernel and fused.available(device, layout.head_dim):
            folded = matrix if dtype == torch.float32 else self._folded(device, fused.matrix_dtype(dtype))[0]
            try:
                fused.fused_decode(codes.sorted_codes, rows, folded, offset.view(layout.groups, layout.width), cos,
                                   sin, keys[:, :, sinks:], values[:, :, sinks:])
                return KVState(keys, values, start=codes.start)
            except Exception as exc:  # noqa: BLE001 - a kernel that does not build costs speed, not the decode
                log.warning("fused SCD decode kernel unavailable (%s); using the PyTorch path", exc)
                self.fused_kernel = False
        hidden = None
        if self.space.hidden is not None:
            hidden = self.space.hidden.reconstruct(codes.hidden_codes)  # [T, P, D]
        patched = {p.layer for p in self.decoder.patches}
        product = self.product_dtype(device)
        step, span = self._tile(coded, device, product.itemsize)
        centres = None
        if product != torch.float32:
            matrix, offset, centres = self._centred(device, product)
        heads = self._heads(device, product)
        # one step's gathered codes, their float copy and its features, reused by every step
        gathered = torch.empty(2 * step * active * span, device=device, dtype=torch.uint8)
        as_float = torch.empty(2 * step * active * span, device=device, dtype=product)
        features = torch.empty(2 * step * span * layout.width, device=device, dtype=product)
        # bf16 products: one step's keys widened for the rotation (write_token_major)
        scratch = torch.empty(step * span * layout.width, device=device) if product != torch.float32 else None
        for first in range(0, layout.num_layers, step):
            last = min(layout.num_layers, first + step)
            n, groups = 2 * (last - first), slice(2 * first, 2 * last)
            index, step_offset, step_matrix = rows[groups].flatten(), offset[groups], matrix[groups]
            step_keys, step_values = keys[first:last, :, sinks:], values[first:last, :, sinks:]
            step_centres = centres[2 * first * active:2 * last * active] if centres is not None else None
            for lo in range(0, coded, span):
                hi = min(coded, lo + span)
                t = hi - lo
                size = n * active * t
                q = torch.index_select(codes.sorted_codes[:, lo:hi], 0, index, out=gathered[:size].view(n * active, t))
                if step_centres is None:
                    q = as_float[:size].view(n, active, t).copy_(q.view(n, active, t))
                else:
                    q = centred_codes(q, step_centres, as_float[:size].view(n * active, t)).view(n, active, t)
                f = torch.baddbmm(step_offset, q.transpose(1, 2), step_matrix,
                                  out=features[:n * t * layout.width].view(n, t, layout.width))
                if heads is not None:  # y = x_hat + x_hat W + b, one map per KV head
                    f.add_(apply_map(f.transpose(0, 1), heads[0][groups]).transpose(0, 1)).add_(heads[1][groups])
                for layer in patched.intersection(range(first, last)):
                    pair = 2 * (layer - first)
                    self._patched(layer, f[pair:pair + 2], None if hidden is None else hidden[lo:hi], device)
                step_cos, step_sin = cos[..., lo:hi, :], sin[..., lo:hi, :]
                if layout.per_layer_rope:
                    step_cos, step_sin = step_cos[first:last], step_sin[first:last]
                write_token_major(f, layout, step_cos, step_sin, step_keys[:, :, lo:hi], step_values[:, :, lo:hi],
                                  scratch)
        return KVState(keys, values, start=codes.start)
