"""Step 2 tests: the KV cache changes the cost of generation, never its result.

Parity tiers (README.md, "How correctness is checked"): greedy ids identical to step 1 and to HF
``generate(use_cache=True)``; the logits of every decode step equal step 1's full recompute within fp32
tolerance: |diff| <= 1e-5 + 1.3e-6 |logit| (torch.testing's float32 defaults; the demo's logits reach
|12|, where one float32 ulp is 1e-6, and the cached path sums in another order than the full one).
"""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2LMHeadModel

import step1_generate.model

from .kv_cache import KVCache
from .llm import LLM
from .model import GPT
from .sampling_params import SamplingParams

PROMPTS = [
    "x",
    "The Python interpreter",
    "A dictionary maps keys to values. Keys must be hashable; the values can be any object.",
]


@pytest.fixture(scope="module")
def llm(demo_snapshot):
    return LLM(model=str(demo_snapshot))


@pytest.fixture(scope="module")
def step1_llm(demo_snapshot):
    return step1_generate.LLM(model=str(demo_snapshot))


def long_prompt(llm, n: int) -> list[int]:
    ids = llm.tokenizer.encode(" ".join(PROMPTS) + " ")
    return (ids * (n // len(ids) + 1))[:n]


def test_greedy_ids_equal_step1(llm, step1_llm):
    p2 = SamplingParams(max_tokens=40, temperature=0)
    p1 = step1_generate.SamplingParams(max_tokens=40, temperature=0)
    for a, b in zip(llm.generate(PROMPTS, p2), step1_llm.generate(PROMPTS, p1)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].text == b.outputs[0].text


@pytest.mark.parametrize("prompt_len, max_tokens", [(200, 40), pytest.param(500, 12, marks=pytest.mark.slow)])
def test_long_prompts_to_the_window_equal_step1_and_hf(llm, step1_llm, demo_snapshot, prompt_len, max_tokens):
    """Up to the 512-token context window: 500 + 12 tokens, then finish_reason "length"."""
    ids = long_prompt(llm, prompt_len)
    ours = llm.generate(
        prompt_token_ids=[ids],
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )[0]
    step1 = step1_llm.generate(
        prompt_token_ids=[ids],
        sampling_params=step1_generate.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )[0]
    assert ours.outputs[0].token_ids == step1.outputs[0].token_ids
    n = min(max_tokens, llm.config.n_positions - prompt_len)
    assert len(ours.outputs[0].token_ids) == n
    hf = GPT2LMHeadModel.from_pretrained(demo_snapshot, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([ids]),
            do_sample=False,
            use_cache=True,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
        )
    assert ours.outputs[0].token_ids == out[0, prompt_len:].tolist()


def test_greedy_ids_equal_hf_with_cache(llm, demo_snapshot):
    hf = GPT2LMHeadModel.from_pretrained(demo_snapshot, dtype=torch.float32).eval()
    eos = llm.tokenizer.eos_token_id
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0))):
        ids = llm.tokenizer.encode(prompt)
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([ids]),
                do_sample=False,
                use_cache=True,
                max_new_tokens=40,
                eos_token_id=eos,
                pad_token_id=eos,
            )
        assert out.outputs[0].token_ids == ref[0, len(ids) :].tolist()


def test_decode_logits_equal_full_recompute(demo_snapshot):
    """Each decode step's logits (one token through the cache) equal step 1's forward over the whole
    prefix."""
    model = GPT.from_pretrained(str(demo_snapshot))
    reference = step1_generate.model.GPT.from_pretrained(str(demo_snapshot))
    ids = torch.randint(model.config.vocab_size, (1, 60), generator=torch.Generator().manual_seed(0))
    cache = KVCache(model.config, 60, "cpu", torch.float32)
    with torch.inference_mode():
        logits = model(ids[:, :20], cache)  # prefill 20
        torch.testing.assert_close(logits, reference(ids[:, :20]), rtol=1.3e-6, atol=1e-5)
        for t in range(20, 60):  # decode 40, one token each
            step = model(ids[:, t : t + 1], cache)[0, -1]
            full = reference(ids[:, : t + 1])[0, -1]
            torch.testing.assert_close(step, full, rtol=1.3e-6, atol=1e-5, msg=f"decode step at position {t}")
    assert cache.length == 60


def test_prefill_in_two_pieces_equals_one_prefill(demo_snapshot):
    """A prompt prefilled as 13 + 24 tokens: the second piece needs the offset causal mask
    (is_causal=True would hide the cached keys from it)."""
    model = GPT.from_pretrained(str(demo_snapshot))
    ids = torch.randint(model.config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(1))
    whole, pieces = (
        KVCache(model.config, 40, "cpu", torch.float32),
        KVCache(model.config, 40, "cpu", torch.float32),
    )
    with torch.inference_mode():
        one = model(ids, whole)
        first = model(ids[:, :13], pieces)
        second = model(ids[:, 13:], pieces)
    torch.testing.assert_close(torch.cat([first, second], dim=1), one, rtol=1.3e-6, atol=1e-5)
    for layer in range(model.config.n_layer):
        torch.testing.assert_close(
            whole.k[layer][:, :, :37], pieces.k[layer][:, :, :37], rtol=1.3e-6, atol=1e-5
        )
        torch.testing.assert_close(
            whole.v[layer][:, :, :37], pieces.v[layer][:, :, :37], rtol=1.3e-6, atol=1e-5
        )


def test_seeded_sampling_equals_step1(llm, step1_llm):
    for seed in (0, 1, 2):
        kw = dict(max_tokens=30, temperature=0.9, top_k=50, top_p=0.95, seed=seed)
        a = llm.generate(PROMPTS[1], SamplingParams(**kw))[0]
        b = step1_llm.generate(PROMPTS[1], step1_generate.SamplingParams(**kw))[0]
        assert a.outputs[0].text == b.outputs[0].text and a.outputs[0].token_ids == b.outputs[0].token_ids


def test_writing_past_capacity_raises(tiny_snapshot):
    model = GPT.from_pretrained(str(tiny_snapshot))
    cache = KVCache(model.config, 10, "cpu", torch.float32)
    with torch.inference_mode():
        model(torch.zeros(1, 8, dtype=torch.long), cache)
        model(torch.zeros(1, 2, dtype=torch.long), cache)
        with pytest.raises(RuntimeError, match="overflow"):
            model(torch.zeros(1, 1, dtype=torch.long), cache)
    assert cache.length == 10


def test_cache_size_is_sized_per_request_and_follows_the_formula(llm, demo_snapshot, monkeypatch):
    """The engine allocates prompt + max_tokens positions (at most the window: more is refused): 2 x L x H x
    D x 4 bytes each."""
    sizes = []
    real = KVCache.__init__

    def recording_init(self, config, capacity, device, dtype):
        real(self, config, capacity, device, dtype)
        sizes.append((capacity, self.nbytes))

    monkeypatch.setattr(KVCache, "__init__", recording_init)
    cfg = llm.config
    llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=10, temperature=0))
    llm.generate(prompt_token_ids=[[1] * 500], sampling_params=SamplingParams(max_tokens=12, temperature=0))
    per_token = 2 * cfg.n_layer * cfg.n_head * cfg.head_dim * 4
    assert sizes == [(13, 13 * per_token), (cfg.n_positions, cfg.n_positions * per_token)]
