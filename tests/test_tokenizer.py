"""common/tokenizer.py: tiktoken built from vocab.json + merges.txt gives Hugging Face's GPT-2 ids, and
the incremental detokenizer never emits a broken UTF-8 character."""

from __future__ import annotations

import json

import pytest
from transformers import GPT2TokenizerFast

from common.tokenizer import IncrementalDetokenizer, Tokenizer, byte_to_unicode
from common.weights import DEMO_CHECKPOINT

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


def test_push_many_makes_the_text_push_makes_one_id_at_a_time(demo_tokenizers):
    """``push_many`` (a FINAL_ONLY request's tokens at once, in step 10's frontend) returns exactly what
    ``push`` of each id returns, joined: whole texts, an emoji split over byte tokens at every cut, and
    bytes that are no UTF-8 (U+FFFD where a one-at-a-time stream puts it)."""
    ours, _ = demo_tokenizers
    byte = {b: ours.encoding.encode_single_token(bytes([b])) for b in range(256)}
    streams = [ours.encode(text) for text in TEXTS]
    streams += [[byte[b] for b in "a😀b".encode()], [byte[0xF0], byte[0x9F], byte[0x41], byte[0xE2]]]
    for ids in streams:
        for cut in range(len(ids) + 1):
            one, many = IncrementalDetokenizer(ours), IncrementalDetokenizer(ours)
            expected = "".join(one.push(i) for i in ids[:cut]), "".join(one.push(i) for i in ids[cut:])
            assert (many.push_many(ids[:cut]), many.push_many(ids[cut:])) == expected
            assert many.flush() == one.flush()


def test_incomplete_tail_at_the_end_becomes_replacement_character(demo_tokenizers):
    ours, _ = demo_tokenizers
    first_byte = ours.encoding.encode_single_token("😀".encode()[:1])
    detok = IncrementalDetokenizer(ours)
    assert detok.push(first_byte) == ""
    assert detok.flush() == "\ufffd"
    assert ours.decode([first_byte]) == "\ufffd"


def test_broken_tokenizer_files_are_value_errors(demo_snapshot, tmp_path):
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


# Padded and extended vocabularies. Hugging Face's tokenizer on the same folder is the oracle: an id the
# tokenizer lacks decodes to "", an added token is encoded and decoded by its text, whichever file adds it.

ADDED_TOKEN_LAYOUTS = {
    # transformers < 4.34: added_tokens.json gives the ids, special_tokens_map.json says which are special
    "added_tokens.json": {
        "added_tokens.json": {"<|pad|>": 8192, "<|user|>": 8193, "<think>": 8194},
        "special_tokens_map.json": {
            "pad_token": "<|pad|>",
            "eos_token": "<|endoftext|>",
            "additional_special_tokens": ["<|user|>"],
        },
    },
    # transformers >= 4.34: tokenizer_config.json's added_tokens_decoder, with HF's AddedToken flags
    "added_tokens_decoder": {
        "tokenizer_config.json": {
            "added_tokens_decoder": {
                str(i): {
                    "content": content,
                    "lstrip": lstrip,
                    "rstrip": rstrip,
                    "normalized": False,
                    "single_word": False,
                    "special": special,
                }
                for i, content, lstrip, rstrip, special in [
                    (8191, "<|endoftext|>", False, False, True),
                    (8192, "<|im_start|>", False, False, True),
                    (8193, "<|im_end|>", False, False, True),
                    (8194, "<to", False, False, False),  # a prefix of the next one: the longest match wins
                    (8195, "<tool>", False, False, False),
                    (8196, "<L>", True, False, True),  # lstrip: takes the white space on its left
                    (8197, "<R>", False, True, False),  # rstrip: takes the white space on its right
                ]
            },
        },
    },
    # special tokens named in special_tokens_map.json but in neither vocab.json nor added_tokens.json:
    # HF appends them, in the order bos, eos, unk, sep, pad, cls, mask, then the additional ones
    "named special tokens": {
        "added_tokens.json": {"<y>": 8192},
        "special_tokens_map.json": {
            "mask_token": {
                "content": "<mask>",
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            },
            "pad_token": "<pad>",
            "additional_special_tokens": ["<x>", "<pad>"],
        },
    },
    "named in tokenizer_config.json": {
        "tokenizer_config.json": {
            "added_tokens_decoder": {"8192": {"content": "<a>", "special": False}},
            "pad_token": "<a>",  # named: special although added_tokens_decoder says otherwise
            "sep_token": {
                "__type": "AddedToken",
                "content": "<new>",
                "lstrip": False,
                "normalized": True,
                "rstrip": False,
                "single_word": False,
            },
            "additional_special_tokens": ["<z>"],
        },
    },
}
ADDED_TOKEN_TEXTS = [
    "Hi<|pad|>there <|user|> x<think>y<|user|><|user|>",
    "a <|im_start|>user\nhi<|im_end|> <tool>z<|endoftext|>",
    "x  <L>  y\n<L>\n<L>",
    "x  <R>  y   <R>\n\n<R>",
    "a<tool>b<to>c<to",
    "<mask><pad><x><cls><y><new><a><z> <a>",
    "emoji 😀 next to <|pad|>😀<a>",
]


def write_tokenizer_folder(folder, files: dict):
    import shutil

    folder.mkdir()
    for name in ("vocab.json", "merges.txt", "config.json"):
        shutil.copy(DEMO_CHECKPOINT / name, folder / name)
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content))
    return folder


def hf_special_ids(hf) -> set[int]:
    """The ids HF treats as special: its named and additional special tokens, and added tokens marked special
    (which ``decode(skip_special_tokens=True)`` drops)."""
    return set(hf.all_special_ids) | {i for i, token in hf.added_tokens_decoder.items() if token.special}


@pytest.mark.parametrize("layout", list(ADDED_TOKEN_LAYOUTS))
def test_added_tokens_as_hf(tmp_path, layout):
    from transformers import AutoTokenizer

    folder = write_tokenizer_folder(tmp_path / "tokenizer", ADDED_TOKEN_LAYOUTS[layout])
    ours, hf = Tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert len(ours) == len(hf) > 8192
    assert ours.vocab_size == 8192 == hf.vocab_size  # vocab.json alone, as HF's vocab_size
    assert ours.special_token_ids == hf_special_ids(hf)
    assert ours.eos_token_id in ours.special_token_ids
    for text in ADDED_TOKEN_TEXTS + TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        assert ours.decode(ids) == hf.decode(ids), text
        detok = IncrementalDetokenizer(ours)
        assert "".join([detok.push(i) for i in ids] + [detok.flush()]) == hf.decode(ids)
    every_id = list(range(8180, len(hf) + 8))  # the last BPE ids, the added ones, and ids nothing names
    assert ours.decode(every_id) == hf.decode(every_id)
    assert [ours.decode([i]) for i in every_id] == [hf.decode([i]) for i in every_id]


def test_additional_special_tokens_are_special(tmp_path):
    """special_tokens_map.json's additional_special_tokens are special tokens (HF lists them in
    all_special_ids)."""
    folder = write_tokenizer_folder(tmp_path / "tokenizer", ADDED_TOKEN_LAYOUTS["added_tokens.json"])
    ours = Tokenizer(folder)
    assert ours.special_token_ids == {8191, 8192, 8193}  # <|endoftext|>, <|pad|>, <|user|>; not <think>
    assert ours.encode("<think>") == [8194] and ours.decode([8194]) == "<think>"


def test_no_added_tokens(demo_tokenizers):
    ours, hf = demo_tokenizers
    assert len(ours) == len(hf) == ours.vocab_size == 8192
    assert ours.special_token_ids == hf_special_ids(hf) == {ours.eos_token_id}


def test_ids_the_tokenizer_lacks_decode_to_nothing(demo_tokenizers):
    """A model with a padded embedding can sample an id that vocab.json does not name: it shows as "", as
    in HF."""
    ours, hf = demo_tokenizers
    ids = [39, 8196, 526, 8191, 8255, 425, 10**6]
    assert ours.decode(ids) == hf.decode(ids) == "Hel<|endoftext|>lo"
    assert ours.decode([8196]) == hf.decode([8196]) == ""
    assert ours.decode_bytes([8196, 8255]) == b""
    assert ours.decode_bytes([39, -1, 2**70, 526]) == ours.decode_bytes([39, 526])  # past a C long: none
    detok = IncrementalDetokenizer(ours)
    assert [detok.push(i) for i in ids] + [detok.flush()] == [
        "H",
        "",
        "el",
        "<|endoftext|>",
        "",
        "lo",
        "",
        "",
    ]


def test_unknown_id_inside_a_split_character(demo_tokenizers):
    """An id with no text between the bytes of one character does not break the character."""
    ours, _ = demo_tokenizers
    first, *rest = [ours.encoding.encode_single_token(bytes([b])) for b in "😀".encode()]
    detok = IncrementalDetokenizer(ours)
    assert [detok.push(i) for i in [first, 8196, *rest]] == ["", "", "", "", "😀"]
    assert ours.decode([first, 8196, *rest]) == "😀"


GENERATING_STEPS = sorted(
    p.name for p in DEMO_CHECKPOINT.parent.parent.glob("step[1-9]*_*") if (p / "__init__.py").is_file()
)


def completion(output):
    """The completion of one ``RequestOutput``: ``output.outputs[0]`` in vLLM's shape, else the output
    itself."""
    return output.outputs[0] if hasattr(output, "outputs") else output


@pytest.mark.parametrize("step", GENERATING_STEPS)
@pytest.mark.parametrize("added_tokens", [False, True], ids=["unnamed", "added"])
def test_generation_emitting_ids_beyond_the_tokenizer(padded_vocab_snapshot, tmp_path, step, added_tokens):
    """vocab_size=8256 over an 8192-token vocab.json: sampling such an id used to raise KeyError in the
    detokenizer. Now it shows as "" or, if added_tokens.json names it, as its text; both as HF decodes
    them."""
    import importlib
    import shutil

    from transformers import AutoTokenizer

    from conftest import UNNAMED_TOKEN_ID

    folder = padded_vocab_snapshot
    if added_tokens:
        folder = tmp_path / "with-added-tokens"
        shutil.copytree(padded_vocab_snapshot, folder)
        names = ["<a>", "<b>", "<c>", "<d>", "<|user|>"]  # ids 8192 ... 8196
        (folder / "added_tokens.json").write_text(
            json.dumps({name: 8192 + i for i, name in enumerate(names)})
        )
    hf = AutoTokenizer.from_pretrained(folder)
    module = importlib.import_module(step)
    llm = module.LLM(model=str(folder))
    (out,) = llm.generate(
        ["Hello"], module.SamplingParams(max_tokens=60, temperature=1.0, seed=7, ignore_eos=True)
    )
    ids = completion(out).token_ids
    assert UNNAMED_TOKEN_ID in ids
    assert completion(out).text == hf.decode(
        ids, skip_special_tokens=True
    )  # the engine shows no special token
    streamed = "".join(
        llm.stream("Hello", module.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    )
    assert streamed == hf.decode([UNNAMED_TOKEN_ID] * 5) == ("<|user|>" * 5 if added_tokens else "")


def test_step0_cli_prints_an_id_the_tokenizer_lacks(padded_vocab_snapshot, capsys):
    from conftest import UNNAMED_TOKEN_ID
    from step0_model.__main__ import main

    assert main(["Hello", "--model", str(padded_vocab_snapshot), "--top", "3"]) == 0
    assert f"{UNNAMED_TOKEN_ID}  ''" in capsys.readouterr().out


@pytest.mark.parametrize(
    "files, message",
    [
        ({"added_tokens.json": ["<a>"]}, "added_tokens.json: expected an object"),
        ({"added_tokens.json": {"<a>": "8192"}}, "added_tokens.json: expected an object"),
        ({"added_tokens.json": {"<a>": -1}}, "added_tokens.json: expected an object"),
        ({"added_tokens.json": {"": 8192}}, "empty"),
        (
            {"tokenizer_config.json": {"added_tokens_decoder": {"x": {"content": "<a>"}}}},
            "added_tokens_decoder",
        ),
        ({"tokenizer_config.json": {"added_tokens_decoder": {"8192": "<a>"}}}, "added_tokens_decoder"),
        ({"tokenizer_config.json": {"pad_token": 3}}, "pad_token"),
        ({"special_tokens_map.json": {"additional_special_tokens": "<a>"}}, "additional_special_tokens"),
        ({"special_tokens_map.json": "<a>"}, "special_tokens_map.json: expected an object"),
    ],
)
def test_broken_added_token_files_are_value_errors(tmp_path, files, message):
    folder = write_tokenizer_folder(tmp_path / "tokenizer", files)
    with pytest.raises(ValueError, match=message):
        Tokenizer(folder)


def test_unreadable_tokenizer_config_is_a_value_error(tmp_path):
    folder = write_tokenizer_folder(tmp_path / "tokenizer", {})
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json: not valid JSON"):
        Tokenizer(folder)


@pytest.mark.parametrize("step", ["step0_model", "step1_generate"])
def test_a_prompt_with_an_added_token_the_model_lacks_is_refused(demo_snapshot, tmp_path, step, run_main):
    """A tokenizer that adds a token past the model's embedding (vocab.json 8,192 ids, model 8,192 rows,
    added_tokens.json id 8192): a prompt holding that token is a one-line error, not an IndexError
    (the step's command line, run in this process: an exception would fail the test)."""
    import importlib
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(demo_snapshot, folder)
    (folder / "added_tokens.json").write_text(json.dumps({"<|user|>": 8192}))
    main = importlib.import_module(f"{step}.__main__").main
    status, _, err = run_main(main, ["<|user|> hello", "--model", str(folder)])
    assert status == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "vocabulary" in lines[0], err
