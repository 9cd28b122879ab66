"""Shared pytest fixtures: model snapshots on local disk. Tests never touch the network.

- ``tiny_snapshot``: a small GPT-2 with random weights (fixed seed), written in Hugging Face layout by
  transformers, with the demo checkpoint's tokenizer. For logit-level comparisons.
- ``demo_snapshot``: the bundled, trained demo checkpoint. For greedy token-id comparisons (random
  weights have near-ties that make argmax comparisons flaky).
- ``padded_vocab_snapshot``: a tiny random GPT-2 whose embedding (8256 rows) is larger than its tokenizer
  (the demo's 8192 tokens), tilted so that it emits an id the tokenizer lacks.
- ``gpt2_snapshot``: OpenAI's GPT-2 124M, if a local copy exists (the folder named by the environment
  variable GPT2_SNAPSHOT, or the Hugging Face cache); tests that use it skip otherwise.
- ``run_main``: runs a command line's ``main(argv)`` in this process, as a fresh Python would run it, for
  tests of its answers that need no process of their own (a fresh Python takes seconds to import torch).

Hypothesis runs with the profile "suite": no deadline and no too-slow health check (both measure wall
time, which a loaded machine stretches).
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest

# Idle OpenMP threads sleep instead of spinning: on a busy machine spinning threads fight over the cores
# (2 cores, two test runs at once: 7x slower); alone it costs nothing. Read when torch loads, so set first;
# the CLI's child processes inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if not torch.cuda.is_available():  # step 5's Triton kernels run through Triton's interpreter on the CPU; the
    os.environ.setdefault(
        "TRITON_INTERPRET", "1"
    )  # switch is read when triton is first imported (transformers does)

from common.weights import DEMO_CHECKPOINT

try:  # property tests (step 4's scheduler): no time limit per example, the suite runs on loaded machines too
    from hypothesis import HealthCheck, settings

    settings.register_profile("suite", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("suite")
except ImportError:  # hypothesis is needed only by the tests that import it
    pass

TINY_CONFIG = dict(n_positions=64, n_embd=32, n_layer=2, n_head=4)


def write_random_snapshot(folder: Path, seed: int = 0, **config) -> Path:
    """A GPT-2 with random weights in HF layout (config.json, model.safetensors, vocab.json, merges.txt)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    vocab_size = 8192  # the demo checkpoint's tokenizer
    cfg = GPT2Config(
        vocab_size=vocab_size, bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1, **config
    )
    model = GPT2LMHeadModel(cfg)
    with torch.no_grad():  # larger than the default init, so that logits differ visibly between tokens
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(DEMO_CHECKPOINT / name, folder / name)
    (folder / "generation_config.json").unlink(missing_ok=True)
    return folder


@pytest.fixture(scope="session")
def tiny_snapshot(tmp_path_factory) -> Path:
    return write_random_snapshot(tmp_path_factory.mktemp("tiny-gpt2"), **TINY_CONFIG)


PADDED_VOCAB_SIZE = 8256  # the demo tokenizer's 8192 ids, padded to a multiple of 64
UNNAMED_TOKEN_ID = 8196  # one of the 64 padding ids: the model can emit it, vocab.json does not name it


@pytest.fixture(scope="session")
def padded_vocab_snapshot(tmp_path_factory) -> Path:
    """A tiny GPT-2 whose embedding is larger than its tokenizer, as checkpoints trained with embeddings
    padded to a multiple of 64 are: vocab_size=8256 over the demo's 8192-token vocab.json. Its final
    LayerNorm's bias points at the embedding row of ``UNNAMED_TOKEN_ID``, so that decoding emits that id
    (greedy: always; sampled at temperature 1: almost always). Weights otherwise random, HF layout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("padded-vocab-gpt2")
    torch.manual_seed(0)
    eos = 8191
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=PADDED_VOCAB_SIZE, bos_token_id=eos, eos_token_id=eos, **TINY_CONFIG)
    )
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
        direction = torch.nn.functional.normalize(torch.randn(TINY_CONFIG["n_embd"]), dim=0)
        model.transformer.ln_f.bias.copy_(5.0 * direction)
        model.transformer.wte.weight[UNNAMED_TOKEN_ID] = (
            5.0 * direction
        )  # its logit: about 25, the others' about 0 +- 1
    model.save_pretrained(folder)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(DEMO_CHECKPOINT / name, folder / name)
    (folder / "generation_config.json").unlink(missing_ok=True)
    return folder


@pytest.fixture(scope="session")
def demo_snapshot() -> Path:
    return DEMO_CHECKPOINT


@pytest.fixture(scope="session")
def gpt2_snapshot() -> Path:
    folder = os.environ.get("GPT2_SNAPSHOT")
    if folder:
        return Path(folder)
    try:
        from huggingface_hub import snapshot_download

        from common.weights import SNAPSHOT_FILES, missing_files

        path = Path(
            snapshot_download("openai-community/gpt2", allow_patterns=SNAPSHOT_FILES, local_files_only=True)
        )
        if not missing_files(path):
            return path
    except Exception:
        pass
    pytest.skip("OpenAI GPT-2 is not on this machine: set GPT2_SNAPSHOT to a local snapshot folder")


@pytest.fixture
def run_main(capsys):
    """``run_main(main, argv) -> (exit status, stdout, stderr)``: ``main`` called in this process. The status
    is what ``main`` returns or the code of the SystemExit it raises (argparse's errors); a Python warning,
    which a fresh Python would print on stderr, is added to stderr (those a fresh Python hides are left out).
    Whatever else the process does (its ``if __name__ == "__main__"`` block) needs a test of the process."""

    def run(main, argv: list[str]) -> tuple[int, str, str]:
        capsys.readouterr()  # what came before is not the command's
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for hidden in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.filterwarnings("ignore", category=hidden)
            try:
                status = main(list(argv))
            except SystemExit as e:
                status = e.code
        out, err = capsys.readouterr()
        err += "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)
        return status, out, err

    return run
