"""Train the demo checkpoint's byte-level BPE tokenizer and save it in OpenAI GPT-2's file format.

    python demo/train_tokenizer.py --data demo/data --out demo/data/tokenizer

Reads ``train.txt`` (documents separated by ``<|endoftext|>``, written by build_corpus.py) and writes
``vocab.json`` (token string -> id) and ``merges.txt`` (``#version: 0.2`` then one merge "a b" a line),
the two files ``transformers.GPT2TokenizerFast`` loads.

The id layout copies OpenAI GPT-2's, so that code written for GPT-2 (which may assume it) works unchanged:
    ids 0..255        the 256 single-byte tokens, in the order of GPT-2's bytes_to_unicode table
                      (bytes 33..126, 161..172, 174..255, then 0..32, 127..160, 173)
    ids 256..8190     the merged tokens: id 256+k is the result of the k-th line of merges.txt
    id 8191           ``<|endoftext|>``, the last id, as 50256 is in GPT-2
so there are exactly 8192 - 256 - 1 = 7935 merges.

The BPE itself is learned by the Hugging Face ``tokenizers`` trainer (models.BPE with the ByteLevel
pre-tokenizer, GPT-2's regex split, no prefix space); its own id order (special tokens first, the alphabet
sorted) is then renumbered into the layout above, keeping the merge order.

References: Sennrich et al. 2016, "Neural Machine Translation of Rare Words with Subword Units" (BPE), ACL;
Radford et al. 2019, "Language Models are Unsupervised Multitask Learners" (byte-level BPE, GPT-2).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2TokenizerFast

EOT = "<|endoftext|>"
VOCAB_SIZE = 8192
N_MERGES = VOCAB_SIZE - 256 - 1  # 7935: the vocabulary minus the bytes minus <|endoftext|>
TRAINER_SLACK = 64  # ask the trainer for a few extra merges, in case some must be skipped (see renumber)


def gpt2_byte_order() -> list[int]:
    """The 256 byte values in the order GPT-2 gives them ids 0..255.

    Printable bytes come first (they map to themselves as characters), then the rest in increasing order.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    others = [b for b in range(256) if b not in printable]
    return printable + others


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte (0..255) to a printable unicode character.

    Printable bytes map to the character of the same code point; each other byte, in increasing order,
    maps to chr(256 + n). Byte-level BPE works on these characters, so no token contains a space or a
    control character ("Ġ" is the space, byte 32).
    """
    order = gpt2_byte_order()
    table = {b: chr(b) for b in order[:188]}
    table.update({b: chr(256 + n) for n, b in enumerate(order[188:])})
    return table


def read_documents(path: Path) -> Iterator[str]:
    """Yield the documents of a corpus file (separated by the literal ``<|endoftext|>``), stripped."""
    for document in path.read_text(encoding="utf-8").split(EOT):
        if document.strip():
            yield document.strip()


def train_bpe(documents: Iterator[str], vocab_size: int) -> list[tuple[str, str]]:
    """Learn byte-level BPE merges with the Hugging Face ``tokenizers`` trainer.

    Args:
        documents: the training texts; ``<|endoftext|>`` is not part of them.
        vocab_size: the trainer's target size (special token + 256 bytes + merges).
    Returns:
        the merges in the order they were learned, as pairs of byte-level token strings.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    # tokenizers >= 0.20 stores a merge as [a, b]; older versions as the string "a b"
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in merges]


def renumber(merges: list[tuple[str, str]], n_merges: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Build GPT-2's id layout from learned merges: bytes, then one new token per merge, then EOT.

    A merge whose result already exists (the trainer can reach "abc" both as "ab"+"c" and "a"+"bc") is
    skipped, so that id 256+k is always the k-th kept merge; the list is cut at ``n_merges``.
    Raises ValueError if fewer than ``n_merges`` distinct merges were learned.
    """
    vocab = {char: i for i, char in enumerate(bytes_to_unicode()[b] for b in gpt2_byte_order())}
    kept: list[tuple[str, str]] = []
    for a, b in merges:
        if len(kept) == n_merges:
            break
        if a + b in vocab:
            continue
        assert a in vocab and b in vocab, f"merge {a!r} {b!r} uses an unknown token"
        vocab[a + b] = len(vocab)
        kept.append((a, b))
    if len(kept) < n_merges:
        raise ValueError(f"only {len(kept)} distinct merges learned, {n_merges} needed: more text?")
    vocab[EOT] = len(vocab)
    return vocab, kept


def save_gpt2_files(vocab: dict[str, int], merges: list[tuple[str, str]], out: Path) -> None:
    """Write ``vocab.json`` and ``merges.txt`` in the format of OpenAI GPT-2's encoder.json / vocab.bpe."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    lines = ["#version: 0.2"] + [f"{a} {b}" for a, b in merges]
    (out / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


def verify(out: Path, samples: list[str]) -> GPT2TokenizerFast:
    """Load the saved files with ``GPT2TokenizerFast`` and check size, the EOT id and round trips.

    Returns the loaded tokenizer. Raises AssertionError on any mismatch.
    """
    tok = GPT2TokenizerFast.from_pretrained(str(out))
    assert len(tok) == VOCAB_SIZE, len(tok)
    assert tok.encode(EOT) == [VOCAB_SIZE - 1], tok.encode(EOT)
    assert tok.convert_ids_to_tokens([0, 93, 188, 220, 255]) == ["!", "~", "Ā", "Ġ", "Ń"]
    for text in samples:
        ids = tok.encode(text)
        assert tok.decode(ids) == text, (text[:80], tok.decode(ids)[:80])
    text = samples[0][:200]
    ids = tok.encode(text)
    print(f"verified: {len(tok)} tokens, {EOT!r} -> {tok.encode(EOT)}, {len(samples)} round trips")
    print(f"  {text[:60]!r} -> {ids[:12]} ... {tok.convert_ids_to_tokens(ids[:12])}")
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description="Train the demo byte-level BPE tokenizer (GPT-2 layout).")
    parser.add_argument("--data", type=Path, default=Path("demo/data"), help="folder with train.txt")
    parser.add_argument("--out", type=Path, default=Path("demo/data/tokenizer"), help="output folder")
    args = parser.parse_args()

    learned = train_bpe(read_documents(args.data / "train.txt"), VOCAB_SIZE + TRAINER_SLACK)
    vocab, merges = renumber(learned, N_MERGES)
    kept = set(merges)
    skipped = sum(1 for m in learned[: len(merges)] if m not in kept)
    print(
        f"learned {len(learned)} merges, kept {len(merges)} ({skipped} duplicates skipped), "
        f"vocab {len(vocab)}"
    )
    save_gpt2_files(vocab, merges, args.out)

    documents = list(read_documents(args.data / "train.txt"))
    samples = [documents[i][:2000] for i in range(0, len(documents), max(1, len(documents) // 20))]
    samples += ["Hello, world!  Tabs\tand\nnewlines, ünïcödé 中文 and emoji 🐍."]
    tok = verify(args.out, samples)
    tok.model_max_length = 10**9  # documents are longer than the model's context: no warning
    n_chars = sum(len(d) for d in documents)
    n_tokens = sum(len(ids) for ids in tok(documents)["input_ids"])
    print(
        f"train.txt: {n_chars / 1e6:.2f} M characters -> {n_tokens / 1e6:.2f} M tokens "
        f"({n_chars / n_tokens:.2f} characters a token)"
    )


if __name__ == "__main__":
    main()
