"""Random-init producer and consumer checkpoints for the device check's ``scd-store calibrate --device cuda``
steps (no model files travel to the GPU machine): SmolLM2-135M's geometry (``--tiny``: two small layers,
for the CPU dry run), a byte-level tokenizer built offline, the consumer a perturbed copy of the producer
(a stand-in fine-tune), and a calibration text drawn from this repository's own sources.

    python benchmarks/device_models.py OUT_DIR [--tiny]   # writes OUT_DIR/{producer,consumer,text.txt}
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SMOLLM2_LIKE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, rope_theta=100000.0, tie_word_embeddings=True)
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, rope_theta=10000.0, tie_word_embeddings=True)


def byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Every byte a token (256 of them) plus an end-of-text token: no download, any text encodes."""
    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                                                 pre_tokenizers.Split("", "isolated")])
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                bos_token="<|endoftext|>", unk_token="<|endoftext|>")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    tokenizer = byte_tokenizer()
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=4096, rms_norm_eps=1e-5,
                                      **(TINY if args.tiny else SMOLLM2_LIKE))
    torch.manual_seed(0)
    producer = transformers.LlamaForCausalLM(config)
    consumer = transformers.LlamaForCausalLM(config)
    consumer.load_state_dict(producer.state_dict())
    with torch.no_grad():  # a fine-tune's drift: every weight moved by a few percent of its spread
        for p in consumer.parameters():
            p.add_(torch.randn_like(p) * 0.05 * p.std().clamp_min(1e-3))
    for name, model in (("producer", producer), ("consumer", consumer)):
        model.save_pretrained(str(args.out / name))
        tokenizer.save_pretrained(str(args.out / name))
    root = Path(__file__).resolve().parent.parent
    sources = sorted(p for d in ("codecs", "scd_store", "adapters") for p in (root / d).rglob("*.py"))
    (args.out / "text.txt").write_text("\n\n".join(p.read_text() for p in sources))
    print(f"wrote {args.out}/producer, consumer ({sum(p.numel() for p in producer.parameters()) / 1e6:.1f}M "
          f"parameters) and text.txt")


if __name__ == "__main__":
    main()
