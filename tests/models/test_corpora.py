import pytest

from scd_store.models.corpora import SHAKESPEARE_CALIB, SHAKESPEARE_EVAL, _hash_split, _shakespeare_split, documents


def test_python_splits_are_disjoint_and_cover_the_stdlib():
    names = {split: {d.name for d in documents("python", split)} for split in ("train", "calib", "eval")}
    assert names["train"] and names["calib"] and names["eval"]
    assert not names["train"] & names["eval"] and not names["train"] & names["calib"]
    assert not names["calib"] & names["eval"]
    assert all(not name.startswith(("test/", "_sysconfigdata")) for split in names.values() for name in split)


def test_split_assignment_is_stable():
    # blake2b-based: the same on every machine and process (never Python's salted hash)
    assert _hash_split("argparse.py") == _hash_split("argparse.py")
    assert [_hash_split(f"m{i}.py") for i in range(5)] == [_hash_split(f"m{i}.py") for i in range(5)]
    assert all(_shakespeare_split(p) == "eval" for p in SHAKESPEARE_EVAL)
    assert all(_shakespeare_split(p) == "calib" for p in SHAKESPEARE_CALIB)
    assert _shakespeare_split("othello") == "train"


def test_unknown_corpus_or_split_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown corpus"):
        documents("klingon", "train")
    with pytest.raises(ValueError, match="unknown split"):
        documents("python", "dev")
