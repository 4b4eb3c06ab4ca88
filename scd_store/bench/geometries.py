"""Llama-style model geometries for random-init timing runs (``scd-store bench decode --geometry``):
the published configs' sizes, no weights (speed does not depend on them)."""

from __future__ import annotations

# SmolLM2-135M's geometry (the prepared producer's and consumers')
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                    rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)

# Meta-Llama-3-8B's config: grouped-query attention (8 KV heads of 128), ~8.0B parameters (16 GB in bf16)
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                 rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-5)

# name on the command line -> (the model's name in reports, its LlamaConfig arguments)
GEOMETRIES: dict[str, tuple[str, dict]] = {
    "smollm2-135m": ("SmolLM2-135M", SMOLLM2_135M),
    "llama3-8b": ("Llama-3-8B", LLAMA3_8B),
}
DEFAULT_GEOMETRY = "smollm2-135m"


def geometry(name: str) -> dict:
    """A copy of the ``LlamaConfig`` arguments of geometry ``name``; ``ValueError`` for an unknown one."""
    if name not in GEOMETRIES:
        raise ValueError(f"geometry must be one of {sorted(GEOMETRIES)}, not {name!r}")
    return dict(GEOMETRIES[name][1])
