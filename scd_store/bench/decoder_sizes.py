"""``scd-store bench decoder-sizes``: one consumer's decoder bytes against its own weights, per geometry.

Computed from the models' published configs (no weights needed): parameters of a Llama-style decoder
(embeddings, attention, gated MLP, norms), served in bf16, against the decoder's bf16 map and fp32
bias in the structure :func:`~scd_store.codecs.scd.decoder.choose_structure` picks and in both structures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from scd_store.codecs.scd.decoder import SIZE_LIMIT, choose_structure, decoder_bytes


@dataclass(frozen=True, slots=True)
class Geometry:
    """What a Llama-style config says about sizes."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool

    @property
    def parameters(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        per_layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * per_layer + embeddings + self.hidden


GEOMETRIES = (
    Geometry("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, True),
    Geometry("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256, False),
    Geometry("Llama-2-7B (MHA)", 32, 4096, 32, 32, 128, 11008, 32000, False),
)


def decoder_sizes(geometries: tuple[Geometry, ...] = GEOMETRIES) -> list[dict]:
    """Per geometry: the consumer's bf16 bytes, each structure's decoder bytes, the pick and its share."""
    rows = []
    for g in geometries:
        consumer = 2 * g.parameters
        sizes = {s: decoder_bytes(2 * g.layers, g.kv_heads, g.head_dim, s) for s in ("dense", "per-head")}
        pick = choose_structure(2 * g.layers, g.kv_heads, g.head_dim, consumer)
        rows.append({**asdict(g), "parameters": g.parameters, "consumer_bf16_bytes": consumer,
                     "dense_bytes": sizes["dense"], "per_head_bytes": sizes["per-head"], "auto": pick,
                     "auto_share": round(sizes[pick] / consumer, 5), "limit": SIZE_LIMIT})
    return rows
