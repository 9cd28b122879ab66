"""common/weights.py: model specs resolve to snapshot folders; failures are fast, clear ValueErrors or
ConnectionErrors. The Hub is never contacted: its client is replaced by fakes."""

from __future__ import annotations

import huggingface_hub
import pytest
import torch

from common import weights
from common.weights import DEMO_CHECKPOINT, GPT2Config, load_config, resolve_model


def test_demo_and_local_folder_resolve(tiny_snapshot, tmp_path, monkeypatch):
    assert resolve_model("demo") == DEMO_CHECKPOINT
    assert resolve_model(str(tiny_snapshot)) == tiny_snapshot
    monkeypatch.chdir(tmp_path)  # the bundled draft by its name from any folder, not only the repository's
    assert resolve_model("demo/draft") == DEMO_CHECKPOINT.parent / "draft"


def test_config_is_read(tiny_snapshot, demo_snapshot):
    cfg = load_config(tiny_snapshot)
    assert cfg == GPT2Config(vocab_size=8192, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    assert cfg.head_dim == 8
    demo = load_config(demo_snapshot)
    assert (demo.vocab_size, demo.n_positions, demo.activation) == (8192, 512, "tanh")


def test_unsupported_config_is_refused(tiny_snapshot, tmp_path):
    text = (tiny_snapshot / "config.json").read_text()
    (tmp_path / "config.json").write_text(text.replace('"model_type": "gpt2"', '"model_type": "llama"'))
    with pytest.raises(ValueError, match="model_type"):
        load_config(tmp_path)


def test_missing_files_are_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="vocab.json.*merges.txt.*model.safetensors"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="no such folder"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no such folder"):
        resolve_model("./relative/missing")


@pytest.fixture
def fake_hub(monkeypatch):
    """Replace the two Hub calls resolve_model makes; record what they were asked."""
    calls = []

    def snapshot_download(repo_id, allow_patterns=None, local_files_only=False, revision=None):
        calls.append(("snapshot_download", repo_id, local_files_only))
        raise huggingface_hub.errors.LocalEntryNotFoundError("not in cache")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_alias_maps_to_openai_repo_and_offline_fails_fast(fake_hub, monkeypatch):
    """Offline, the lookup fails fast: one try (no retries), bounded by HUB_TIMEOUT_S (at most 5 s)."""
    asked = []

    def model_info(self, repo_id, timeout=None):
        asked.append(dict(repo_id=repo_id, timeout=timeout))
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    with pytest.raises(ConnectionError) as err:
        resolve_model("gpt2")
    assert asked == [{"repo_id": "openai-community/gpt2", "timeout": weights.HUB_TIMEOUT_S}]
    assert weights.HUB_TIMEOUT_S <= 5
    message = str(err.value)
    assert (
        "openai-community/gpt2" in message and "could not be reached" in message and "local folder" in message
    )
    assert fake_hub == [("snapshot_download", "openai-community/gpt2", True)]  # the cache was tried first


def test_unknown_hub_model_is_a_value_error(fake_hub, monkeypatch):
    def model_info(self, repo_id, timeout=None):
        error = huggingface_hub.errors.RepositoryNotFoundError.__new__(
            huggingface_hub.errors.RepositoryNotFoundError
        )
        Exception.__init__(error, "404 Client Error: Repository Not Found")
        raise error

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    with pytest.raises(ValueError, match="no such model"):
        resolve_model("nobody/no-such-model")


def test_all_aliases_are_gpt2_family():
    assert set(weights.MODEL_ALIASES) == {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "distilgpt2"}
    assert weights.MODEL_ALIASES["distilgpt2"] == "distilbert/distilgpt2"


def broken_copy(src, dst, **replace):
    """A copy of a snapshot folder with some files replaced: name -> bytes or text."""
    dst.mkdir()
    for name in ("config.json", "model.safetensors", "vocab.json", "merges.txt"):
        content = replace.get(name.replace(".", "_"), (src / name).read_bytes())
        (dst / name).write_bytes(content.encode() if isinstance(content, str) else content)
    return dst


@pytest.mark.parametrize(
    "replace, message",
    [
        (dict(config_json="{}"), "vocab_size"),
        (dict(config_json="[]"), "JSON object"),
        (dict(config_json="{not json"), "not valid JSON"),
        (dict(model_safetensors=b"garbage"), "not a readable safetensors file"),
        (dict(model_safetensors=b""), "not a readable safetensors file"),
    ],
)
def test_broken_folders_are_value_errors(tiny_snapshot, tmp_path, replace, message):
    from step0_model import GPT

    folder = broken_copy(tiny_snapshot, tmp_path / "broken", **replace)
    with pytest.raises(ValueError, match=message):
        GPT.from_pretrained(str(folder))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"n_head": 0}, "n_head=0"),
        ({"n_head": "4"}, "n_head='4'"),
        ({"n_embd": 32.0}, "n_embd=32.0"),
        ({"n_head": 5}, "multiple of n_head"),
        ({"scale_attn_weights": False}, "scale_attn_weights=false"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings=false"),
        ({"n_inner": 100}, "n_inner"),
        ({"activation_function": "swish"}, "activation_function"),
    ],
)
def test_config_values_are_checked(tiny_snapshot, tmp_path, change, message):
    import json

    raw = json.loads((tiny_snapshot / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(ValueError, match=message):
        load_config(tmp_path)


def test_invalid_hub_id_is_a_value_error(fake_hub):
    with pytest.raises(ValueError, match="valid Hub id"):
        resolve_model("gpt2 ")


# Tied weights saved under either name. GPT-2's LM head is its token embedding; what a checkpoint
# holds depends on the tool that wrote it. Every layout that HF's GPT2LMHeadModel.from_pretrained loads
# (with no missing tensor) must load here, with HF's logits.


def saved_tensors(snapshot) -> dict:
    """The tensors of a snapshot written by GPT2LMHeadModel.save_pretrained: ``transformer.``-prefixed, no
    lm_head."""
    from safetensors.torch import load_file

    tensors = load_file(snapshot / "model.safetensors")
    assert all(name.startswith("transformer.") for name in tensors) and "transformer.wte.weight" in tensors
    return tensors


def bare(tensors: dict) -> dict:
    return {name.removeprefix("transformer."): t for name, t in tensors.items()}


def causal_mask_buffers(tensors: dict) -> dict:
    """The ``h.N.attn.bias`` buffers (a [1, 1, T, T] lower-triangular mask) that OpenAI's GPT-2 on the Hub
    carries."""
    n_layer = 1 + max(int(name.split(".")[1]) for name in bare(tensors) if name.startswith("h."))
    T = bare(tensors)["wpe.weight"].shape[0]
    return {f"h.{i}.attn.bias": torch.tril(torch.ones(T, T)).view(1, 1, T, T) for i in range(n_layer)}


def without_wte(tensors: dict) -> dict:
    return {name: t for name, t in tensors.items() if not name.endswith("wte.weight")}


TIED_LAYOUTS = {
    # GPT2LMHeadModel.save_pretrained: transformer.h.0..., transformer.wte.weight, no lm_head
    "save_pretrained": lambda sd: sd,
    # openai-community/gpt2 and distilbert/distilgpt2 model.safetensors: GPT2Model names (no prefix), no
    # lm_head; gpt2 also keeps the causal-mask buffers
    "hub": lambda sd: {**bare(sd), **causal_mask_buffers(sd)},
    # the LM head saved beside the embedding (torch.save of a state dict, converted)
    "prefixed + lm_head": lambda sd: {**sd, "lm_head.weight": sd["transformer.wte.weight"].clone()},
    "bare + lm_head": lambda sd: {**bare(sd), "lm_head.weight": sd["transformer.wte.weight"].clone()},
    # tools that save a tied tensor once may keep the LM head's name rather than the embedding's
    "prefixed, lm_head only": lambda sd: {**without_wte(sd), "lm_head.weight": sd["transformer.wte.weight"]},
    "bare, lm_head only": lambda sd: {
        **without_wte(bare(sd)),
        "lm_head.weight": sd["transformer.wte.weight"],
    },
    "mixed prefixes": lambda sd: {**without_wte(sd), "wte.weight": sd["transformer.wte.weight"]},
}


def write_checkpoint(src, folder, tensors: dict, shards: int = 1):
    """``folder``: src's config and tokenizer, and ``tensors`` as model.safetensors or as ``shards`` shards
    with a model.safetensors.index.json (the LM head, if any, in the last shard, the embedding in the
    first)."""
    import json
    import shutil

    from safetensors.torch import save_file

    folder.mkdir()
    for name in ("config.json", "vocab.json", "merges.txt"):
        shutil.copy(src / name, folder / name)
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    if shards == 1:
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        return folder
    names = sorted(tensors, key=lambda n: (n == "lm_head.weight", not n.endswith("wte.weight"), n))
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {name: files[min(i * shards // len(names), shards - 1)] for i, name in enumerate(names)}
    for file in files:
        save_file(
            {n: tensors[n] for n, f in weight_map.items() if f == file},
            folder / file,
            metadata={"format": "pt"},
        )
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def hf_logits(folder, input_ids):
    from transformers import GPT2LMHeadModel

    hf, info = GPT2LMHeadModel.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info  # a layout that HF loads in full
    with torch.no_grad():
        return hf.eval()(input_ids).logits


@pytest.mark.parametrize("shards", [1, 3], ids=["one file", "sharded"])
@pytest.mark.parametrize("layout", list(TIED_LAYOUTS))
def test_tied_weight_layouts_load_as_in_hf(tiny_snapshot, tmp_path, layout, shards):
    from step0_model import GPT

    folder = write_checkpoint(
        tiny_snapshot, tmp_path / "checkpoint", TIED_LAYOUTS[layout](saved_tensors(tiny_snapshot)), shards
    )
    input_ids = torch.tensor([[5, 300, 8191, 42, 7, 1000]])
    with torch.no_grad():
        ours = GPT.from_pretrained(str(folder))(input_ids)
    torch.testing.assert_close(ours, hf_logits(folder, input_ids), atol=1e-4, rtol=0)


def untied(tiny_snapshot, folder, prefix: str):
    sd = saved_tensors(tiny_snapshot)
    tensors = sd if prefix else bare(sd)
    return write_checkpoint(
        tiny_snapshot, folder, {**tensors, "lm_head.weight": sd["transformer.wte.weight"] + 0.5}
    )


@pytest.mark.parametrize("prefix", ["transformer.", ""])
def test_untied_lm_head_is_a_value_error(tiny_snapshot, tmp_path, prefix):
    """An lm_head.weight that differs from wte.weight is a separate output matrix, which this GPT-2 cannot
    hold."""
    from step0_model import GPT

    folder = untied(tiny_snapshot, tmp_path / "untied", prefix)
    with pytest.raises(ValueError, match="differ: an untied LM head") as error:
        GPT.from_pretrained(str(folder))
    assert f"'{prefix}wte.weight'" in str(error.value) and "'lm_head.weight'" in str(error.value)


def test_a_tensor_saved_twice_must_agree(tiny_snapshot, tmp_path):
    sd = saved_tensors(tiny_snapshot)
    same = write_checkpoint(
        tiny_snapshot, tmp_path / "same", {**sd, "ln_f.weight": sd["transformer.ln_f.weight"].clone()}
    )
    other = write_checkpoint(
        tiny_snapshot, tmp_path / "other", {**sd, "ln_f.weight": sd["transformer.ln_f.weight"] * 2}
    )
    from step0_model import GPT

    GPT.from_pretrained(str(same))
    with pytest.raises(
        ValueError, match=r"'(transformer\.)?ln_f.weight' and '(transformer\.)?ln_f.weight' differ$"
    ):
        GPT.from_pretrained(str(other))


@pytest.mark.parametrize("step", ["step0_model", "step1_generate"])
def test_cli_reports_an_untied_checkpoint_in_one_line(tiny_snapshot, tmp_path, capsys, step):
    import importlib

    folder = untied(tiny_snapshot, tmp_path / "untied", "transformer.")
    main = importlib.import_module(f"{step}.__main__").main
    assert main(["Hello", "--model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "untied" in err and len(err.strip().splitlines()) == 1


def test_padded_vocabulary_loads(padded_vocab_snapshot):
    """An embedding with more rows (8256) than the tokenizer has tokens (8192) loads, with HF's logits."""
    from common.tokenizer import Tokenizer
    from step0_model import GPT

    model = GPT.from_pretrained(str(padded_vocab_snapshot))
    assert (
        model.wte.weight.shape[0] == model.config.vocab_size == 8256 > len(Tokenizer(padded_vocab_snapshot))
    )
    input_ids = torch.tensor([[5, 300, 8191, 42]])
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids), hf_logits(padded_vocab_snapshot, input_ids), atol=1e-4, rtol=0
        )


def test_snapshot_files_include_the_added_token_files():
    """A Hub download fetches the files that add tokens to vocab.json, where a model has them."""
    for name in ("tokenizer_config.json", "added_tokens.json", "special_tokens_map.json"):
        assert name in weights.SNAPSHOT_FILES
