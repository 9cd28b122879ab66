"""GPT-2's byte-level BPE tokenizer, built with tiktoken from a snapshot's vocab.json and merges.txt.

GPT-2 (Radford et al. 2019) splits text with a regular expression into words, turns each word's UTF-8
bytes into printable characters (so that every byte sequence is representable), and merges adjacent
pieces by the priority order of merges.txt. tiktoken runs the same algorithm in Rust, given each
token's bytes and its *rank*: the piece with the lowest rank is merged first. In GPT-2's vocabulary a
token's id is its rank (the 256 single bytes first, then one id per merge in merges.txt order), so the
ids tiktoken returns are the ids the model was trained on.
"""

from __future__ import annotations

import codecs
import json
import os
from functools import lru_cache
from pathlib import Path

import tiktoken

# GPT-2's pre-tokenizer: contractions, letters, digits, other symbols, each with one optional leading space;
# runs of whitespace; a final run of whitespace is kept apart from the next word.
GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
END_OF_TEXT = "<|endoftext|>"


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters.

    Printable Latin-1 bytes map to themselves; the other 68 (controls, space, NBSP, soft hyphen) map to
    the code points 256, 257, ... in byte order. vocab.json and merges.txt are written in these characters.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + i) for i, b in enumerate(others)})
    return table


def _token_bytes(token: str, char_to_byte: dict[str, int]) -> bytes:
    return bytes(char_to_byte[ch] for ch in token)


class Tokenizer:
    """Encode text to GPT-2 token ids and decode them back.

    Built from a snapshot folder's ``vocab.json`` (token -> id) and ``merges.txt`` (merge priority).
    ``<|endoftext|>`` is the end-of-sequence token, and is recognised when it appears in the text
    (as Hugging Face's GPT-2 tokenizer does).

    Raises ValueError if the files are missing or if their ids are not in merge order (tiktoken needs
    a token's id to be its merge rank).
    """

    def __init__(self, folder: str | os.PathLike):
        folder = Path(folder)
        try:
            with open(folder / "vocab.json", encoding="utf-8") as f:
                vocab: dict[str, int] = json.load(f)
            with open(folder / "merges.txt", encoding="utf-8") as f:
                merges = [line.split(" ") for line in f.read().splitlines() if line and not line.startswith("#version")]
        except FileNotFoundError as e:
            raise ValueError(f"{folder}: tokenizer file {Path(e.filename).name} is missing") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{folder}: vocab.json or merges.txt is not readable ({e})") from None
        if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
            raise ValueError(f"{folder}/vocab.json: expected an object of token -> integer id")

        char_to_byte = {ch: b for b, ch in byte_to_unicode().items()}
        missing = [ch for ch in char_to_byte if ch not in vocab]
        if missing:
            raise ValueError(f"{folder}/vocab.json: lacks {len(missing)} of the 256 byte tokens, e.g. {missing[0]!r}")
        ranks: dict[bytes, int] = {bytes([b]): vocab[ch] for ch, b in char_to_byte.items()}
        last_rank = -1
        for number, merge in enumerate(merges, start=1):
            if len(merge) != 2:
                raise ValueError(f"{folder}/merges.txt: merge {number} is {' '.join(merge)!r}, expected two tokens")
            left, right = merge
            token = left + right
            if token not in vocab:
                raise ValueError(f"{folder}: merge {left} {right} makes {token!r}, which vocab.json lacks")
            rank = vocab[token]
            if rank <= last_rank:
                raise ValueError(f"{folder}: token ids do not follow merges.txt order at {token!r}")
            if not set(token) <= char_to_byte.keys():
                raise ValueError(f"{folder}/merges.txt: merge {number} has characters outside GPT-2's byte alphabet")
            ranks[_token_bytes(token, char_to_byte)] = last_rank = rank
        ranked_ids = set(ranks.values())
        special = {tok: i for tok, i in vocab.items() if i not in ranked_ids}  # <|endoftext|> and any added token
        if END_OF_TEXT not in special:
            raise ValueError(f"{folder}: vocab.json has no {END_OF_TEXT} token")

        self.encoding = tiktoken.Encoding(
            name=f"gpt2-bpe:{folder}", pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=special
        )
        self.eos_token_id: int = special[END_OF_TEXT]
        self.vocab_size: int = len(vocab)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; ``<|endoftext|>`` in the text becomes the eos id."""
        return self.encoding.encode(text, allowed_special="all")

    def decode_bytes(self, token_ids: list[int]) -> bytes:
        """The UTF-8 bytes of ``token_ids``; a sequence can end inside a multi-byte character."""
        return self.encoding.decode_bytes(token_ids)

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

    def flush(self) -> str:
        """Whatever was held back, decoded as the end of the stream."""
        return self._utf8.decode(b"", final=True)
