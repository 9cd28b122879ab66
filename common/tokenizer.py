"""GPT-2's byte-level BPE tokenizer, built with tiktoken from a snapshot's vocab.json and merges.txt.

GPT-2 (Radford et al. 2019) splits text with a regular expression into words, turns each word's UTF-8
bytes into printable characters (so that every byte sequence is representable), and merges adjacent
pieces by the priority order of merges.txt. tiktoken runs the same algorithm in Rust, given each
token's bytes and its *rank*: the piece with the lowest rank is merged first. In GPT-2's vocabulary a
token's id is its rank (the 256 single bytes first, then one id per merge in merges.txt order), so the
ids tiktoken returns are the ids the model was trained on.

*Added tokens* (``<|endoftext|>``, and those a fine-tune adds, such as ``<|im_start|>``) are not made by
merges: as in Hugging Face's tokenizers, the text is first split where an added token's text occurs, the
added token gets its own id, and the pieces between go through BPE. A model may also have more ids than its
tokenizer names (embeddings padded to a multiple of 64 are common): such an id decodes to no text.
"""

from __future__ import annotations

import codecs
import itertools
import json
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import tiktoken

# GPT-2's pre-tokenizer: contractions, letters, digits, other symbols, each with one optional leading space;
# runs of whitespace; a final run of whitespace is kept apart from the next word.
GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
END_OF_TEXT = "<|endoftext|>"
# The special tokens a Hugging Face tokenizer config can name, in the order in which transformers numbers
# those that no file gives an id; then lists of more special tokens (the name before and since
# transformers 5).
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
EXTRA_SPECIAL_TOKENS = ("additional_special_tokens", "extra_special_tokens")


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters.

    Printable Latin-1 bytes map to themselves; the other 68 (controls, space, NBSP, soft hyphen) map to
    the code points 256, 257, ... in byte order. vocab.json and merges.txt are written in these characters.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + i) for i, b in enumerate(others)})
    return table


def _token_bytes(token: str, char_to_byte: dict[str, int]) -> bytes:
    return bytes(char_to_byte[ch] for ch in token)


class AddedToken(NamedTuple):
    """A token matched by its text before BPE, as Hugging Face's ``AddedToken``.

    lstrip / rstrip: the token also takes the white space on its left / right (which then encodes to
    nothing). special: a control token (``<|endoftext|>``, ``<|im_start|>``) rather than text.
    """

    id: int
    content: str
    special: bool = False
    lstrip: bool = False
    rstrip: bool = False


def read_added_tokens(folder: Path, vocab: dict[str, int]) -> list[AddedToken]:
    """The added tokens of a tokenizer folder, read as transformers reads them.

    - ``tokenizer_config.json``'s ``added_tokens_decoder`` (written since transformers 4.34): id -> the
      token's text and flags. Without it, the older files: ``added_tokens.json`` (text -> id), a token being
      special if ``special_tokens_map.json`` or ``tokenizer_config.json`` names it.
    - Special tokens named there (``eos_token``, ``pad_token``, ..., ``additional_special_tokens``) are
      special added tokens too; one that no file numbers gets the next free id, as transformers gives it.
    - ``<|endoftext|>`` is always one, special (GPT-2's bos, eos and unk token).

    Raises ValueError, naming the file, on a file that is not valid JSON or not of this shape.
    """
    config_file = folder / "tokenizer_config.json"
    config = _read_json_object(config_file)
    added: dict[str, AddedToken] = {}
    if "added_tokens_decoder" in config:
        decoder = config["added_tokens_decoder"]
        if not isinstance(decoder, dict):
            raise ValueError(f"{config_file}: added_tokens_decoder is not an object of id -> token")
        for key, entry in decoder.items():
            if (
                not key.isdecimal()
                or not isinstance(entry, dict)
                or not isinstance(entry.get("content"), str)
            ):
                raise ValueError(
                    f"{config_file}: added_tokens_decoder[{key!r}] is not an id -> "
                    "{content, special, ...} entry"
                )
            flags = (bool(entry.get(flag)) for flag in ("special", "lstrip", "rstrip"))
            added[entry["content"]] = AddedToken(int(key), entry["content"], *flags)
        named_by = {config_file: config}
    else:
        special_tokens_map = folder / "special_tokens_map.json"
        named_by = {config_file: config, special_tokens_map: _read_json_object(special_tokens_map)}
        ids = _read_json_object(folder / "added_tokens.json")
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids.values()):
            raise ValueError(f"{folder}/added_tokens.json: expected an object of token -> integer id >= 0")
        added = {content: AddedToken(i, content) for content, i in ids.items()}

    # The special tokens the configs name, in transformers' order; a later file overrides an earlier one.
    named: dict[str, dict] = {}
    for file, raw in named_by.items():
        for key in NAMED_SPECIAL_TOKENS:
            if raw.get(key) is not None:
                named[key] = _special_token(raw[key], file, key)
    extras: list[dict] = []
    for file, raw in named_by.items():
        for key in EXTRA_SPECIAL_TOKENS:
            values = raw.get(key) or []
            values = list(values.values()) if isinstance(values, dict) else values
            if not isinstance(values, list):
                raise ValueError(f"{file}: {key} is not a list of tokens")
            extras += [_special_token(value, file, key) for value in values]
    next_id = max([*vocab.values(), *(token.id for token in added.values())], default=-1) + 1
    for token in [{"content": END_OF_TEXT}, *named.values(), *extras]:
        content = token["content"]
        if content in added:
            added[content] = added[content]._replace(special=True)
            continue
        if content in vocab:
            token_id = vocab[content]
        elif content == END_OF_TEXT:
            continue  # the Tokenizer refuses a vocabulary without it
        else:
            token_id, next_id = next_id, next_id + 1
        added[content] = AddedToken(
            token_id, content, True, bool(token.get("lstrip")), bool(token.get("rstrip"))
        )
    for token in added.values():
        if not token.content:
            raise ValueError(f"{folder}: added token {token.id} has an empty text")
    return list(added.values())


def _special_token(value, file: Path, key: str) -> dict:
    """A special token as a config names it: its text, or HF's AddedToken as a JSON object."""
    token = {"content": value} if isinstance(value, str) else value
    if not isinstance(token, dict) or not isinstance(token.get("content"), str):
        raise ValueError(f"{file}: {key} is {value!r}, expected a token's text or an object with its content")
    return token


def _read_json_object(path: Path) -> dict:
    """The JSON object in ``path``; {} if there is no such file. Raises ValueError if it is not one."""
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected an object")
    return raw


class Tokenizer:
    """Encode text to GPT-2 token ids and decode them back.

    Built from a snapshot folder's ``vocab.json`` (token -> id) and ``merges.txt`` (merge priority), plus
    the added tokens of ``tokenizer_config.json``, ``added_tokens.json`` and ``special_tokens_map.json``
    when the folder has them (see ``read_added_tokens``). ``<|endoftext|>`` is the end-of-sequence token;
    it and every added token are recognised when their text appears in the text (as Hugging Face's GPT-2
    tokenizer does). ``special_token_ids``: the eos id and the added tokens marked special, which an
    engine may choose not to show; ``decode`` shows them, as HF's ``decode`` does by default.

    Raises ValueError if the files are missing or malformed, or if their ids are not in merge order
    (tiktoken needs a token's id to be its merge rank).
    """

    def __init__(self, folder: str | os.PathLike):
        folder = Path(folder)
        try:
            with open(folder / "vocab.json", encoding="utf-8") as f:
                vocab: dict[str, int] = json.load(f)
            with open(folder / "merges.txt", encoding="utf-8") as f:
                merges = [
                    line.split(" ")
                    for line in f.read().splitlines()
                    if line and not line.startswith("#version")
                ]
        except FileNotFoundError as e:
            raise ValueError(f"{folder}: tokenizer file {Path(e.filename).name} is missing") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{folder}: vocab.json or merges.txt is not readable ({e})") from None
        if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
            raise ValueError(f"{folder}/vocab.json: expected an object of token -> integer id")

        char_to_byte = {ch: b for b, ch in byte_to_unicode().items()}
        missing = [ch for ch in char_to_byte if ch not in vocab]
        if missing:
            raise ValueError(
                f"{folder}/vocab.json: lacks {len(missing)} of the 256 byte tokens, e.g. {missing[0]!r}"
            )
        ranks: dict[bytes, int] = {bytes([b]): vocab[ch] for ch, b in char_to_byte.items()}
        last_rank = -1
        for number, merge in enumerate(merges, start=1):
            if len(merge) != 2:
                raise ValueError(
                    f"{folder}/merges.txt: merge {number} is {' '.join(merge)!r}, expected two tokens"
                )
            left, right = merge
            token = left + right
            if token not in vocab:
                raise ValueError(f"{folder}: merge {left} {right} makes {token!r}, which vocab.json lacks")
            rank = vocab[token]
            if rank <= last_rank:
                raise ValueError(f"{folder}: token ids do not follow merges.txt order at {token!r}")
            if not set(token) <= char_to_byte.keys():
                raise ValueError(
                    f"{folder}/merges.txt: merge {number} has characters outside GPT-2's byte alphabet"
                )
            ranks[_token_bytes(token, char_to_byte)] = last_rank = rank
        added = read_added_tokens(folder, vocab)
        eos = [token.id for token in added if token.content == END_OF_TEXT]
        if not eos:
            raise ValueError(f"{folder}: vocab.json has no {END_OF_TEXT} token")

        # BPE alone: tiktoken never sees the added tokens, which encode() splits off first.
        self.encoding = tiktoken.Encoding(
            name=f"gpt2-bpe:{folder}", pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens={}
        )
        # Added tokens, longest first: where two start at the same place, the longer one wins (as in HF).
        added.sort(key=lambda token: len(token.content), reverse=True)
        self._added_ids = [token.id for token in added]
        self._added_pattern = re.compile(
            "|".join(
                (r"\s*" if token.lstrip else "")
                + f"({re.escape(token.content)})"
                + (r"\s*" if token.rstrip else "")
                for token in added
            )
        )
        # Decoding is a table lookup, id -> bytes: vocab.json's tokens, then the added tokens' text.
        self._id_to_bytes: dict[int, bytes] = {
            i: _token_bytes(tok, char_to_byte) if set(tok) <= char_to_byte.keys() else tok.encode()
            for tok, i in vocab.items()
        }
        self._id_to_bytes.update({token.id: token.content.encode() for token in added})
        self.eos_token_id: int = eos[0]
        self.special_token_ids: set[int] = {token.id for token in added if token.special} | {
            self.eos_token_id
        }
        self.vocab_size: int = len(
            vocab
        )  # vocab.json's tokens, as HF's vocab_size; len(tokenizer) adds the added ones

    def __len__(self) -> int:
        """How many ids have a text: vocab.json's and the added tokens' (HF's ``len(tokenizer)``)."""
        return len(self._id_to_bytes)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: an added token's text (e.g. ``<|endoftext|>``) becomes its id, the rest
        BPE."""
        ids: list[int] = []
        start = 0
        for match in self._added_pattern.finditer(text):
            ids += self.encoding.encode_ordinary(text[start : match.start()])
            ids.append(self._added_ids[match.lastindex - 1])  # the group that matched names the token
            start = match.end()
        return ids + self.encoding.encode_ordinary(text[start:])

    def decode_bytes(self, token_ids: list[int]) -> bytes:
        """The UTF-8 bytes of ``token_ids``; a sequence can end inside a multi-byte character.

        An id that the tokenizer does not name (a model's embedding can be padded past its vocabulary)
        has no bytes, as in Hugging Face's ``decode``.
        """
        try:  # tiktoken's table, in one native call
            return self.encoding.decode_bytes(token_ids)
        except (KeyError, OverflowError, TypeError):  # an id it lacks (added, padding), not an int, < 0
            return b"".join(map(self._id_to_bytes.get, token_ids, itertools.repeat(b"")))

    def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``; bytes that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(token_ids).decode("utf-8", errors="replace")


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text without ever emitting a broken character.

    One token can end in the middle of a multi-byte UTF-8 character (an emoji is often split over two
    or three tokens). ``push`` returns only complete characters and holds the partial tail back until
    the next token completes it; ``flush`` returns what is left at the end (an incomplete tail becomes
    U+FFFD, as in ``Tokenizer.decode``). The concatenation of all returned strings equals
    ``tokenizer.decode(all_ids)``.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """The new complete text after appending ``token_id``; may be ``""``."""
        return self._utf8.decode(self.tokenizer.decode_bytes([token_id]))

    def push_many(self, token_ids: list[int]) -> str:
        """The new complete text after appending every id of ``token_ids``, in one call: what ``push``
        of each would return, joined."""
        return self._utf8.decode(self.tokenizer.decode_bytes(token_ids))

    def flush(self) -> str:
        """Whatever was held back, decoded as the end of the stream."""
        return self._utf8.decode(b"", final=True)
