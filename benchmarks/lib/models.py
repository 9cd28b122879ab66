"""The models the benchmarks run on, as local Hugging Face snapshot folders.

- ``demo``: the small trained checkpoint bundled with the repository (``demo/checkpoint``).
- ``gpt2-124m-random``: GPT-2 124M's shape (transformers' ``GPT2Config()`` defaults: 50257 tokens, 1024
  positions, 768 wide, 12 layers, 12 heads) with random weights from a fixed seed. Speed depends on the
  shape, not on the weights, so this measures what OpenAI's GPT-2 would cost without downloading it.
  It is written once into ``benchmarks/.cache/`` (git-ignored) with a synthetic 50257-token vocabulary in
  GPT-2's format, because the engines detokenize every generated id.

Any other name is taken as a local snapshot folder.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import torch

from common.tokenizer import END_OF_TEXT, byte_to_unicode
from common.weights import resolve_model

CACHE = Path(__file__).resolve().parent.parent / ".cache"
GPT2_VOCAB_SIZE = 50257  # 256 bytes + 50000 merges + <|endoftext|>

MODELS = {
    "demo": "the bundled demo checkpoint (demo/checkpoint), trained",
    "gpt2-124m-random": "GPT-2 124M's configuration with random weights (seed 0), written to "
    "benchmarks/.cache/",
}


def snapshot(name: str) -> Path:
    """The snapshot folder of a benchmark model (see ``MODELS``), writing it first if needed.

    Any other name is a local snapshot folder. Raises ValueError if it is neither (see
    ``common.weights.resolve_model``).
    """
    if name == "demo":
        return resolve_model("demo")
    if name == "gpt2-124m-random":
        return cached_random_snapshot(name, seed=0)  # transformers' GPT2Config() defaults are GPT-2 124M's
    return resolve_model(name)


def hf_model(folder: Path, device: str = "cpu", dtype: str = "float32"):
    """Hugging Face's ``GPT2LMHeadModel`` loaded from a snapshot folder in ``dtype`` ("float32", "float16",
    "bfloat16") on ``device``, in eval mode, without the loading progress bar: the benchmarks' outside
    baseline."""
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return GPT2LMHeadModel.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()


def raise_recompile_limit(limit: int = 64) -> None:
    """Let torch.compile keep a graph per shape (torch._dynamo's default, 8, would fall back to eager after
    8 shapes): HF's static-cache ``generate`` meets a new shape at every benchmark point."""
    import torch._dynamo

    name = next(n for n in ("recompile_limit", "cache_size_limit") if hasattr(torch._dynamo.config, n))
    setattr(torch._dynamo.config, name, limit)


def cached_random_snapshot(name: str, seed: int = 0, **config) -> Path:
    """``benchmarks/.cache/<name>``: a random GPT-2 written by ``write_random_snapshot``, kept between runs.

    The folder records the recipe it was made from (``benchmark_recipe.json``) and is written again when
    the recipe differs. It is written under a temporary name and renamed when complete, so an interrupted
    write is never taken for a snapshot.
    """
    folder = CACHE / name
    recipe = {"seed": seed, "config": config, "vocab": "synthetic", "vocab_size": GPT2_VOCAB_SIZE}
    recipe_file = folder / "benchmark_recipe.json"
    if recipe_file.is_file() and json.loads(recipe_file.read_text()) == recipe:
        return folder
    print(f"writing {name} (random weights, seed {seed}) to {folder} ...", flush=True)
    partial = CACHE / f"{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    write_random_snapshot(partial, seed=seed, **config)
    (partial / recipe_file.name).write_text(json.dumps(recipe))
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def write_random_snapshot(folder: Path, seed: int = 0, vocab_size: int = GPT2_VOCAB_SIZE, **config) -> Path:
    """A GPT-2 with random weights (transformers' default init, ``torch.manual_seed(seed)``) in HF layout.

    config: ``transformers.GPT2Config`` overrides (n_positions, n_embd, n_layer, n_head, ...); the rest
    are GPT-2 124M's. Writes config.json, model.safetensors and a synthetic vocab.json + merges.txt of
    ``vocab_size`` tokens (see ``write_synthetic_vocab``). Returns ``folder``.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    eos = vocab_size - 1
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, bos_token_id=eos, eos_token_id=eos, **config))
    model.save_pretrained(folder)
    write_synthetic_vocab(folder, vocab_size)
    return folder


def write_synthetic_vocab(folder: Path, vocab_size: int = GPT2_VOCAB_SIZE) -> None:
    """A made-up byte-level BPE vocabulary in GPT-2's format: vocab.json and merges.txt.

    Ids 0..255 are the 256 byte characters in GPT-2's order (the order of ``byte_to_unicode()``); then
    ``vocab_size - 257`` merges, each of two single-byte characters (all pairs in that order, first
    character slowest), each merge's result taking the next id; last, ``<|endoftext|>``. The ids follow
    the merge order, as ``common.tokenizer.Tokenizer`` requires. The text it makes is meaningless; its
    size and format are GPT-2's. Raises ValueError unless 257 <= vocab_size <= 257 + 256 * 256.
    """
    chars = list(byte_to_unicode().values())  # GPT-2's ids 0..255
    n_merges = vocab_size - len(chars) - 1
    if not 0 <= n_merges <= len(chars) ** 2:
        raise ValueError(f"vocab_size={vocab_size}: must be in [257, {257 + len(chars) ** 2}]")
    vocab = {ch: i for i, ch in enumerate(chars)}
    merges = []
    for left, right in itertools.islice(itertools.product(chars, chars), n_merges):
        vocab[left + right] = len(vocab)
        merges.append(f"{left} {right}")
    vocab[END_OF_TEXT] = len(vocab)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
