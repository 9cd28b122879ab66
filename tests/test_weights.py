"""common/weights.py: model specs resolve to snapshot folders; failures are fast, clear ValueErrors or
ConnectionErrors. The Hub is never contacted: its client is replaced by fakes."""

from __future__ import annotations

import time

import huggingface_hub
import pytest

from common import weights
from common.weights import DEMO_CHECKPOINT, GPT2Config, load_config, resolve_model


def test_demo_and_local_folder_resolve(tiny_snapshot):
    assert resolve_model("demo") == DEMO_CHECKPOINT
    assert resolve_model(str(tiny_snapshot)) == tiny_snapshot


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
    asked = {}

    def model_info(self, repo_id, timeout=None):
        asked.update(repo_id=repo_id, timeout=timeout)
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    start = time.perf_counter()
    with pytest.raises(ConnectionError) as err:
        resolve_model("gpt2")
    assert time.perf_counter() - start < 5
    assert asked == {"repo_id": "openai-community/gpt2", "timeout": weights.HUB_TIMEOUT_S}
    assert weights.HUB_TIMEOUT_S <= 5
    message = str(err.value)
    assert "openai-community/gpt2" in message and "could not be reached" in message and "local folder" in message
    assert fake_hub == [("snapshot_download", "openai-community/gpt2", True)]  # the cache was tried first


def test_unknown_hub_model_is_a_value_error(fake_hub, monkeypatch):
    def model_info(self, repo_id, timeout=None):
        error = huggingface_hub.errors.RepositoryNotFoundError.__new__(huggingface_hub.errors.RepositoryNotFoundError)
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
