"""Model specs: catalog names, checkpoint directories, PEFT adapters; consumers that do not fit are refused."""

import json

import pytest
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from scd_store.models.sources import ModelSource, ModelSpecError, check_pair, resolve


def checkpoint(path, layers=2, words=("a", "b", "c")):
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(path))
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=16)
    config.save_pretrained(str(path))
    return path


def adapter(path, kind="LORA", weights=True):
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": kind, "r": 4}))
    if weights:
        (path / "adapter_model.safetensors").write_bytes(b"")
    return path


def test_checkpoints_and_adapters_resolve_with_their_names(tmp_path):
    base = resolve(str(checkpoint(tmp_path / "base")))
    assert (base.name, base.adapter, base.in_catalog) == ("base", None, False)
    named = resolve(f"my-bot={tmp_path / 'base'}")
    assert named.name == "my-bot" and named.path == base.path
    lora = resolve(str(adapter(tmp_path / "legal")), base=base)
    assert (lora.name, lora.path, lora.adapter) == ("legal", base.path, tmp_path / "legal")


@pytest.mark.parametrize(("make", "match"), [
    (lambda p: p / "missing", "not a checkpoint directory"),
    (lambda p: adapter(p / "ia3", kind="IA3"), "only PEFT LoRA"),
    (lambda p: adapter(p / "empty", weights=False), "no adapter_model.safetensors"),
])
def test_specs_that_name_nothing_loadable_are_refused(tmp_path, make, match):
    base = ModelSource("base", checkpoint(tmp_path / "base"))
    with pytest.raises(ModelSpecError, match=match):
        resolve(str(make(tmp_path)), base=base)
    with pytest.raises(ModelSpecError, match="must be letters"):
        resolve(f"bad name={tmp_path / 'base'}")
    with pytest.raises(ModelSpecError, match="unknown model"):
        resolve("no-such-catalog-model")


def test_adapters_need_a_base(tmp_path):
    with pytest.raises(ModelSpecError, match="needs a base"):
        resolve(str(adapter(tmp_path / "lora")))


def test_a_consumer_must_share_the_producers_architecture_and_tokenizer(tmp_path):
    producer = resolve(str(checkpoint(tmp_path / "p")))
    check_pair(producer, resolve(str(checkpoint(tmp_path / "same"))))
    with pytest.raises(ModelSpecError, match="num_hidden_layers"):
        check_pair(producer, resolve(str(checkpoint(tmp_path / "deeper", layers=3))))
    with pytest.raises(ModelSpecError, match="tokenizes text differently"):
        check_pair(producer, resolve(str(checkpoint(tmp_path / "other-words", words=("x", "y", "z")))))
