"""Find a GPT-2 checkpoint on disk, read its config, and load its safetensors weights.

Every step loads its model through this module, so that the steps differ only in the mechanism they
teach. A *model spec* is one of:

- ``"demo"``: the small checkpoint bundled with this repository (``demo/checkpoint``), so that
  everything runs offline on a fresh machine; ``"demo/draft"``: its bundled draft model (step 11), from
  any working directory;
- a Hugging Face Hub id (``"openai-community/gpt2"``) or one of the short aliases in ``MODEL_ALIASES``
  (``"gpt2"``, ``"gpt2-medium"``, ``"gpt2-large"``, ``"gpt2-xl"``, ``"distilgpt2"``), fetched once through
  ``huggingface_hub`` into its usual cache (only the files listed in ``SNAPSHOT_FILES``);
- a local folder laid out like a Hub snapshot: ``config.json``, ``model.safetensors`` (or shards plus
  ``model.safetensors.index.json``), ``vocab.json`` and ``merges.txt`` (and, if the tokenizer adds tokens,
  ``tokenizer_config.json``, ``added_tokens.json`` or ``special_tokens_map.json``).

The mapping from Hugging Face tensor names to a step's own modules is not done here: each step's
``model.py`` does it, so that a reader sees it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_CHECKPOINT = REPO_ROOT / "demo" / "checkpoint"
BUNDLED = {"demo": DEMO_CHECKPOINT, "demo/draft": REPO_ROOT / "demo" / "draft"}  # spec -> its folder

MODEL_ALIASES = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
    "distilgpt2": "distilbert/distilgpt2",
}

# The only files an inference engine needs; the Hub repos also hold TF, Flax, ONNX and PyTorch-pickle copies
# (some in sub-folders, which these top-level names do not match). The last three, where a model has them,
# add tokens to vocab.json (see common.tokenizer.read_added_tokens).
SNAPSHOT_FILES = [
    "config.json",
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "added_tokens.json",
    "special_tokens_map.json",
]
HUB_TIMEOUT_S = 5.0

# config.json's activation_function -> the `approximate` argument of torch.nn.functional.gelu.
GELU_APPROXIMATION = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class GPT2Config:
    """The hyper-parameters of a GPT-2 model, read from a snapshot's ``config.json``.

    vocab_size: number of token ids; n_positions: context window in tokens; n_embd: width C of the
    residual stream; n_layer: number of transformer blocks; n_head: attention heads per block (head
    size C / n_head); layer_norm_epsilon: LayerNorm's epsilon; activation: the MLP's GELU variant, as
    the ``approximate`` argument of ``torch.nn.functional.gelu`` ("tanh" for GPT-2's gelu_new).
    """

    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    layer_norm_epsilon: float = 1e-5
    activation: str = "tanh"

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> GPT2Config:
        """Read a Hugging Face GPT-2 ``config.json``.

        Raises ValueError, naming the file and the field, if it is not valid JSON, not a GPT-2 config,
        has a size that is not a positive integer, or uses an option this code does not implement.
        """
        raw = _read_json(path)
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a JSON object")
        if raw.get("model_type", "gpt2") != "gpt2":
            raise ValueError(f"{path}: model_type is {raw['model_type']!r}, only 'gpt2' is supported")
        activation = raw.get("activation_function", "gelu_new")
        if activation not in GELU_APPROXIMATION:
            raise ValueError(
                f"{path}: activation_function {activation!r} is not one of {sorted(GELU_APPROXIMATION)}"
            )
        unsupported = {  # options of HF's GPT2Config that change the computation, at their non-default values
            "scale_attn_by_inverse_layer_idx": True,
            "reorder_and_upcast_attn": True,
            "add_cross_attention": True,
            "scale_attn_weights": False,
            "tie_word_embeddings": False,
        }
        for option, value in unsupported.items():
            if raw.get(option) is value:
                raise ValueError(f"{path}: {option}={str(value).lower()} is not supported")
        sizes = {name: raw.get(name) for name in ("vocab_size", "n_embd", "n_layer", "n_head")}
        sizes["n_positions"] = raw.get("n_positions", raw.get("n_ctx"))
        for name, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{path}: {name}={value!r}, expected an integer >= 1")
        if sizes["n_embd"] % sizes["n_head"]:
            raise ValueError(
                f"{path}: n_embd={sizes['n_embd']} is not a multiple of n_head={sizes['n_head']}"
            )
        if raw.get("n_inner") not in (None, 4 * sizes["n_embd"]):
            raise ValueError(
                f"{path}: n_inner={raw['n_inner']!r} is not supported (the MLP is 4 x n_embd wide)"
            )
        eps = raw.get("layer_norm_epsilon", 1e-5)
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1:
            raise ValueError(f"{path}: layer_norm_epsilon={eps!r}, expected a number in (0, 1)")
        return cls(**sizes, layer_norm_epsilon=float(eps), activation=GELU_APPROXIMATION[activation])


def _read_json(path: str | os.PathLike):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def resolve_model(spec: str | os.PathLike) -> Path:
    """Turn a model spec (see the module docstring) into a local snapshot folder.

    A Hub model is looked up in the local Hugging Face cache first, then downloaded with
    ``huggingface_hub.snapshot_download`` (its progress bars; only ``SNAPSHOT_FILES``).

    Raises ValueError for a folder that lacks a needed file or a Hub id that does not exist, and
    ConnectionError, within about ``HUB_TIMEOUT_S`` seconds, when the Hub cannot be reached and the
    model is not in the cache.
    """
    spec = str(spec)
    if spec in BUNDLED:
        return _checked_folder(BUNDLED[spec], spec)
    local = Path(spec).expanduser()
    if local.is_dir() and spec.strip():  # "" would be the current folder
        return _checked_folder(local, spec)
    if local.exists() or spec.startswith((".", "/", "~")) or spec.count("/") > 1 or not spec.strip():
        raise ValueError(
            f"model {spec!r}: no such folder (expected a folder with config.json and *.safetensors)"
        )
    return _checked_folder(_download(MODEL_ALIASES.get(spec, spec)), spec)


def _download(repo_id: str) -> Path:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:  # a complete copy in the local cache: no network at all
        folder = Path(snapshot_download(repo_id, allow_patterns=SNAPSHOT_FILES, local_files_only=True))
        if missing_files(folder) == []:
            return folder
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        pass
    try:
        info = HfApi().model_info(repo_id, timeout=HUB_TIMEOUT_S)
    except RepositoryNotFoundError:
        raise ValueError(
            f"model {repo_id!r}: no such model on the Hugging Face Hub (or it is private)"
        ) from None
    except HFValidationError:
        raise ValueError(
            f"model {repo_id!r}: neither a local folder nor a valid Hub id (such as 'gpt2')"
        ) from None
    except Exception as e:  # connection refused, DNS failure, time-out, HF_HUB_OFFLINE=1, Hub error 5xx
        raise ConnectionError(
            f"model {repo_id!r}: the Hugging Face Hub could not be reached ({type(e).__name__}) "
            f"and the model is not in the local cache. Download it on a machine with a network, or pass "
            f"a local folder (--model /path/to/folder with config.json, model.safetensors, vocab.json, "
            f"merges.txt)."
        ) from None
    return Path(snapshot_download(repo_id, revision=info.sha, allow_patterns=SNAPSHOT_FILES))


def missing_files(folder: Path) -> list[str]:
    missing = [name for name in ("config.json", "vocab.json", "merges.txt") if not (folder / name).is_file()]
    if (
        not (folder / "model.safetensors").is_file()
        and not (folder / "model.safetensors.index.json").is_file()
    ):
        missing.append("model.safetensors (or model.safetensors.index.json with its shards)")
    return missing


def _checked_folder(folder: Path, spec: str) -> Path:
    missing = missing_files(folder)
    if missing:
        raise ValueError(f"model {spec!r}: folder {folder} lacks {', '.join(missing)}")
    return folder


def load_config(folder: str | os.PathLike) -> GPT2Config:
    """The ``GPT2Config`` of a snapshot folder (see ``GPT2Config.from_json``)."""
    return GPT2Config.from_json(Path(folder) / "config.json")


def load_safetensors(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a snapshot, by their Hugging Face names (e.g. ``h.0.attn.c_attn.weight``).

    Reads ``model.safetensors``, or every shard named in ``model.safetensors.index.json``. Tensors are
    memory-mapped from the files by safetensors and copied once, when a step moves them to its own
    parameters. Raises ValueError if a shard named by the index is missing or a file is not safetensors.
    """
    return {name: tensor[:] for name, tensor in open_safetensors(folder).items()}


def open_safetensors(folder: str | os.PathLike) -> dict:
    """Every tensor of a snapshot as a safetensors slice, by its Hugging Face name: nothing is read until
    it is indexed (``slice[:]``: the whole tensor; ``slice[:, a:b]``: those columns only, as a tensor;
    ``get_shape()``: its shape), so that a rank of tensor parallelism reads only its shards (step 15).
    The files named as ``load_safetensors`` reads them; raises ValueError as it does."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        raw = _read_json(index)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: expected a JSON object with a weight_map")
        shards = sorted(set(weight_map.values()))
    else:
        shards = ["model.safetensors"]
    tensors: dict = {}
    for shard in shards:
        if not (folder / shard).is_file():
            raise ValueError(f"{folder}: shard {shard} named in {index.name} is missing")
        try:
            f = safe_open(folder / shard, framework="pt")  # open while its slices live
            for name in f.keys():
                tensors[name] = f.get_slice(name)
        except SafetensorError as e:
            raise ValueError(f"{folder / shard}: not a readable safetensors file ({e})") from None
    return tensors
