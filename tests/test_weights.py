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
