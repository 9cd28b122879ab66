"""Step 0 tests: our forward pass gives Hugging Face's logits, and loads every checkpoint layout.

Parity tier (README.md, "How correctness is checked"): fp32 logits vs HF ``GPT2LMHeadModel`` on the same
snapshot, max abs diff <= 1e-4, on prompts of length 1, a few tokens, and the full context window.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2LMHeadModel

from common.weights import load_config

from .__main__ import main as cli_main
from .model import GPT

TOL = 1e-4


def hf_logits(folder, input_ids: torch.Tensor) -> torch.Tensor:
    hf = GPT2LMHeadModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(input_ids).logits  # [B, T, V]


def prompts_for(folder, seed: int = 0) -> list[torch.Tensor]:
    """Token id batches of length 1, 7 and the whole context window."""
    cfg = load_config(folder)
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(cfg.vocab_size, (1, n), generator=g) for n in (1, 7, cfg.n_positions)] + [
        torch.randint(cfg.vocab_size, (3, 5), generator=g)  # a batch of three
    ]


@pytest.mark.parametrize("snapshot", ["tiny_snapshot", "demo_snapshot"])
def test_logits_match_hf(snapshot, request):
    folder = request.getfixturevalue(snapshot)
    model = GPT.from_pretrained(str(folder))
    for input_ids in prompts_for(folder):
        with torch.inference_mode():
            ours = model(input_ids)
        theirs = hf_logits(folder, input_ids)
        assert ours.shape == theirs.shape
        diff = (ours - theirs).abs().max().item()
        assert diff <= TOL, f"T={input_ids.shape[1]}: max |diff| {diff:.2e}"


@pytest.mark.real_weights
def test_logits_match_hf_on_openai_gpt2(gpt2_snapshot):
    model = GPT.from_pretrained(str(gpt2_snapshot))
    for input_ids in prompts_for(gpt2_snapshot):
        with torch.inference_mode():
            diff = (model(input_ids) - hf_logits(gpt2_snapshot, input_ids)).abs().max().item()
        assert diff <= TOL


def test_demo_predicts_in_domain_text(demo_snapshot):
    """The trained demo model is far better than chance on its own domain (sanity of the weights)."""
    from common.tokenizer import Tokenizer

    tok = Tokenizer(demo_snapshot)
    ids = torch.tensor(
        [tok.encode("The Python interpreter reads the source code of a module and executes it.")]
    )
    with torch.inference_mode():
        logits = GPT.from_pretrained(str(demo_snapshot))(ids)
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()
    assert loss < 0.6 * torch.log(torch.tensor(tok.vocab_size)).item()  # uniform guessing: ln(8192) = 9.0


def as_gpt2model_layout(src, dst):
    """Rewrite a GPT2LMHeadModel snapshot the way OpenAI's GPT-2 is stored on the Hub: no "transformer."
    prefix, and the causal-mask buffers h.N.attn.bias saved as tensors."""
    dst.mkdir()
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(src / "model.safetensors").items()}
    cfg = load_config(src)
    for i in range(cfg.n_layer):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(cfg.n_positions, cfg.n_positions)).view(
            1, 1, cfg.n_positions, cfg.n_positions
        )
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    for name in ("config.json", "vocab.json", "merges.txt"):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def test_loads_hub_layout_and_shards(tiny_snapshot, tmp_path):
    """OpenAI's layout (GPT2Model names + mask buffers) and a sharded checkpoint give the same weights."""
    reference = GPT.from_pretrained(str(tiny_snapshot)).state_dict()
    hub_layout = as_gpt2model_layout(tiny_snapshot, tmp_path / "hub")
    sharded = tmp_path / "sharded"
    GPT2LMHeadModel.from_pretrained(tiny_snapshot).save_pretrained(sharded, max_shard_size="40KB")
    for name in ("vocab.json", "merges.txt"):
        (sharded / name).write_bytes((tiny_snapshot / name).read_bytes())
    assert (sharded / "model.safetensors.index.json").is_file()
    assert (
        len(set(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values()))
        > 1
    )
    for folder in (hub_layout, sharded):
        loaded = GPT.from_pretrained(str(folder)).state_dict()
        assert loaded.keys() == reference.keys()
        for k in reference:
            assert torch.equal(loaded[k], reference[k]), k


def test_conv1d_weights_are_transposed(tiny_snapshot):
    """HF's Conv1D stores [in, out]; our nn.Linear holds [out, in]: c_fc is [4C, C] after loading."""
    hf = load_file(tiny_snapshot / "model.safetensors")
    ours = GPT.from_pretrained(str(tiny_snapshot))
    assert torch.equal(ours.h[0].mlp.c_fc.weight, hf["transformer.h.0.mlp.c_fc.weight"].t())
    assert ours.h[0].mlp.c_fc.weight.shape == (4 * 32, 32)


def test_bad_checkpoints_raise_value_error(tiny_snapshot, tmp_path):
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    for name in ("config.json", "vocab.json", "merges.txt"):
        (no_weights / name).write_bytes((tiny_snapshot / name).read_bytes())
    with pytest.raises(ValueError, match="model.safetensors"):
        GPT.from_pretrained(str(no_weights))

    truncated = tmp_path / "truncated"
    truncated.mkdir()
    tensors = load_file(tiny_snapshot / "model.safetensors")
    del tensors["transformer.h.1.mlp.c_fc.weight"]
    save_file(tensors, truncated / "model.safetensors")
    for name in ("config.json", "vocab.json", "merges.txt"):
        (truncated / name).write_bytes((tiny_snapshot / name).read_bytes())
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        GPT.from_pretrained(str(truncated))

    with pytest.raises(ValueError, match="no such folder"):
        GPT.from_pretrained(str(tmp_path / "does-not-exist"))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(  # timeout: a safety net against a hang, not a measure (a loaded machine is slow)
        [sys.executable, "-m", __package__, *args], capture_output=True, text=True, timeout=600
    )


def test_cli_top_tokens_and_check(tiny_snapshot):
    result = run_cli("The Python interpreter", "--model", str(tiny_snapshot), "--top", "5", "--check")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "5 most likely next tokens" in lines[0]
    probs = [float(line.split("%")[0]) for line in lines[1:6]]
    assert probs == sorted(probs, reverse=True) and 0 < probs[0] <= 100
    diff = float(lines[-1].rsplit(":", 1)[1])
    assert diff <= TOL


def test_cli_bad_input_exits_2(tiny_snapshot, tmp_path, run_main):
    for args in (["", "--model", str(tiny_snapshot)], ["hi", "--model", str(tmp_path / "nope")]):
        status, _, err = run_main(cli_main, args)  # in this process; as a process: below
        assert status == 2
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1


def test_cli_bad_input_as_a_process(tmp_path):
    result = run_cli("hi", "--model", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1
