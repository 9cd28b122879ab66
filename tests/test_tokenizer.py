"""common/tokenizer.py: tiktoken built from vocab.json + merges.txt gives Hugging Face's GPT-2 ids, and
the incremental detokenizer never emits a broken UTF-8 character."""

from __future__ import annotations

import pytest
from transformers import GPT2TokenizerFast

from common.tokenizer import IncrementalDetokenizer, Tokenizer, byte_to_unicode

TEXTS = [
    "",
    "Hello, world!",
    "The Python interpreter reads a module's source code and executes it.",
    "  leading spaces,   runs of   spaces, trailing spaces   ",
    "tabs\tand\t\tmore tabs\t",
    "Windows line endings\r\nare\r\n\r\nhere\r\n",
    "new\nlines\n\n\nand a final one\n",
    "contractions: I'm, you're, he's, we've, they'll, I'd, don't, can't, 'tis",
    "UPPER lower MiXeD 12345 3.14159 1,000,000 0x1F",
    "CJK: 日本語のテキスト、中文文本，한국어 텍스트",
    "Arabic: مرحبا بالعالم، هذا نص عربي",
    "emoji: 😀 👍🏽 👨‍👩‍👧 🇫🇷 ❤️",
    "symbols: ~!@#$%^&*()_+-=[]{}|;':\",./<>? ← → ∑ ∫ ≠",
    "def f(x):\n    return x ** 2  # comment\n",
    "first document<|endoftext|>second document",
    "<|endoftext|>",
    "\u00a0non-breaking\u00a0space and soft\u00adhyphen and \x00 NUL \x7f DEL",
]


@pytest.fixture(scope="module")
def demo_tokenizers(demo_snapshot):
    return Tokenizer(demo_snapshot), GPT2TokenizerFast.from_pretrained(demo_snapshot)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_hf(demo_tokenizers, text):
    ours, hf = demo_tokenizers
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ours.decode(ids) == text


@pytest.mark.real_weights
def test_ids_equal_hf_on_openai_gpt2(gpt2_snapshot):
    ours, hf = Tokenizer(gpt2_snapshot), GPT2TokenizerFast.from_pretrained(gpt2_snapshot)
    assert ours.eos_token_id == 50256 and ours.vocab_size == 50257
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text), text


def test_end_of_text_is_the_last_id(demo_tokenizers):
    ours, _ = demo_tokenizers
    assert ours.eos_token_id == ours.vocab_size - 1 == 8191
    assert ours.encode("<|endoftext|>") == [8191]


def test_byte_table_is_a_bijection_onto_printable_characters():
    table = byte_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    assert all(ch.isprintable() and not ch.isspace() for ch in table.values())
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_streams_the_same_text(demo_tokenizers, text):
    ours, _ = demo_tokenizers
    detok = IncrementalDetokenizer(ours)
    pieces = [detok.push(i) for i in ours.encode(text)] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_split_emoji_is_held_back_until_complete(demo_tokenizers):
    """An emoji is 4 UTF-8 bytes; fed one byte-token at a time, nothing shows until the 4th."""
    ours, _ = demo_tokenizers
    byte_ids = [ours.encode(ch)[0] for ch in "abc"]  # sanity: single-character tokens exist
    assert len(byte_ids) == 3
    emoji = "😀".encode()
    single_byte_token = {b: ours.encoding.encode_single_token(bytes([b])) for b in emoji}
    detok = IncrementalDetokenizer(ours)
    assert [detok.push(single_byte_token[b]) for b in emoji] == ["", "", "", "😀"]
    assert detok.flush() == ""


def test_incomplete_tail_at_the_end_becomes_replacement_character(demo_tokenizers):
    ours, _ = demo_tokenizers
    first_byte = ours.encoding.encode_single_token("😀".encode()[:1])
    detok = IncrementalDetokenizer(ours)
    assert detok.push(first_byte) == ""
    assert detok.flush() == "\ufffd"
    assert ours.decode([first_byte]) == "\ufffd"


def test_broken_tokenizer_files_are_value_errors(demo_snapshot, tmp_path):
    import json

    vocab = json.loads((demo_snapshot / "vocab.json").read_text())
    merges = (demo_snapshot / "merges.txt").read_text()
    cases = [
        ({k: v for k, v in vocab.items() if k != "!"}, merges, "byte tokens"),
        (vocab, merges + "a b c\n", "expected two tokens"),
        ("{not json", merges, "not readable"),
    ]
    for i, (v, m, message) in enumerate(cases):
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / "vocab.json").write_text(v if isinstance(v, str) else json.dumps(v))
        (folder / "merges.txt").write_text(m)
        with pytest.raises(ValueError, match=message):
            Tokenizer(folder)
