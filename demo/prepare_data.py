"""Tokenize the demo corpus into flat token-id files for training.

    python demo/prepare_data.py --data demo/data --tokenizer demo/data/tokenizer

Reads ``train.txt`` and ``val.txt`` from ``--data`` (documents separated by ``<|endoftext|>``, written by
build_corpus.py), encodes every document with ``GPT2TokenizerFast`` loaded from the ``vocab.json`` and
``merges.txt`` that train_tokenizer.py saved, and writes ``train.bin`` and ``val.bin`` beside them:

    format   raw little-endian uint16 token ids, no header (read with np.fromfile(path, dtype=np.uint16))
    layout   doc_0 ids, EOS, doc_1 ids, EOS, ...   where EOS is the id of <|endoftext|> (8191)

The model trains on random windows of this stream (as GPT-2 did on WebText), so a window may cross a
document boundary; the EOS token marks it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from transformers import GPT2TokenizerFast

EOT = "<|endoftext|>"


def encode_corpus(path: Path, tokenizer: GPT2TokenizerFast) -> np.ndarray:
    """Encode a corpus file into one flat array.

    Args:
        path: text file whose documents are separated by the literal ``<|endoftext|>``.
        tokenizer: the demo tokenizer (vocabulary under 65536 ids, so uint16 holds every id).
    Returns:
        uint16 array [n_tokens]: each document's ids followed by the EOS id.
    """
    documents = [d.strip() for d in path.read_text(encoding="utf-8").split(EOT) if d.strip()]
    eos = tokenizer.convert_tokens_to_ids(EOT)
    assert len(tokenizer) <= 2**16, "token ids must fit in uint16"
    ids: list[int] = []
    for document_ids in tokenizer(documents)["input_ids"]:
        ids.extend(document_ids)
        ids.append(eos)
    return np.array(ids, dtype=np.uint16)


def main() -> None:
    parser = argparse.ArgumentParser(description="Tokenize train.txt / val.txt into uint16 .bin files.")
    parser.add_argument("--data", type=Path, default=Path("demo/data"), help="folder with train.txt, val.txt")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=Path("demo/data/tokenizer"),
        help="folder with vocab.json and merges.txt",
    )
    args = parser.parse_args()

    tokenizer = GPT2TokenizerFast.from_pretrained(str(args.tokenizer))
    tokenizer.model_max_length = 10**9  # documents are longer than the model's context: no warning
    for split in ("train", "val"):
        ids = encode_corpus(args.data / f"{split}.txt", tokenizer)
        ids.tofile(args.data / f"{split}.bin")
        n_docs = int((ids == tokenizer.eos_token_id).sum())
        print(f"{split}.bin: {len(ids):,} tokens in {n_docs} documents ({ids.nbytes / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
