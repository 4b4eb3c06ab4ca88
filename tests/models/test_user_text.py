import json

import pytest

from scd_store.models.user_text import TextError, UserText, read_documents
from scd_store.models.windows import count_windows, eval_windows


class WordTokenizer:
    """One id per whitespace-separated word; a chat template that tags each turn."""

    eos_token_id = 0
    chat_template = "tags"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [len(w) for w in text.split()]}

    def apply_chat_template(self, messages, tokenize=False):
        return " ".join(f"<{m['role']}> {m['content']}" for m in messages)


def test_txt_files_folders_and_jsonl_with_text_or_messages(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("alpha beta gamma")
    (tmp_path / "docs" / "b.md").write_text("delta")
    (tmp_path / "docs" / "skip.bin").write_bytes(b"\0")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join([json.dumps({"text": "one two"}), "",
                                json.dumps({"messages": [{"role": "user", "content": "hi there"},
                                                         {"role": "assistant", "content": "hello"}]})]))
    docs = read_documents((str(tmp_path / "docs"), str(chats)))
    assert [d.text for d in docs[:3]] == ["alpha beta gamma", "delta", "one two"]
    assert docs[3].render(WordTokenizer()) == "<user> hi there <assistant> hello"


@pytest.mark.parametrize(("content", "match"), [
    ("", "empty"),
    ("{not json", "not JSON"),
    (json.dumps({"messages": [{"role": "user"}]}), "messages"),
    (json.dumps([1, 2]), "messages"),
])
def test_bad_text_is_a_clear_error_naming_the_file(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(TextError, match=match):
        read_documents((str(path),))


def test_missing_paths_and_unknown_kinds_are_refused(tmp_path):
    with pytest.raises(TextError, match="no such file"):
        read_documents((str(tmp_path / "nope.txt"),))
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(TextError, match="expected"):
        read_documents((str(tmp_path / "model.bin"),))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TextError, match="no .txt"):
        read_documents((str(tmp_path / "empty"),))
    with pytest.raises(TextError, match="no text paths"):
        UserText(())


def test_short_documents_are_packed_and_long_ones_cut_alone(tmp_path):
    (tmp_path / "long.txt").write_text(" ".join(["w"] * 25))  # 25 tokens: 2 windows of 10 on its own
    for i in range(6):  # 6 short notes of 3 tokens + a separator each: 24 packed tokens, 2 windows
        (tmp_path / f"note{i}.txt").write_text("a bb ccc")
    text, tokenizer = UserText((str(tmp_path),)), WordTokenizer()
    assert count_windows(tokenizer, text, (10,)) == {10: 4}
    windows = eval_windows(tokenizer, text, 4, 10, seed=0)
    assert sorted(w.tolist() for w in windows)[0] == [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    assert [1, 2, 3, 0, 1, 2, 3, 0, 1, 2] in [w.tolist() for w in windows]
    assert eval_windows(tokenizer, text, 4, 10, seed=0)[0].tolist() == windows[0].tolist()  # reproducible
    with pytest.raises(ValueError, match="only 4 windows"):
        eval_windows(tokenizer, text, 5, 10, seed=0)
