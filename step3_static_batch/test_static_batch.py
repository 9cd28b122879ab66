"""Step 3 tests: a request's output does not depend on the batch it runs in.

Parity tiers (README.md, "How correctness is checked"): each request's greedy ids in a batch equal its solo
step 2 run and HF ``generate`` with left padding and an attention mask; seeded sampling is batch-independent.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2LMHeadModel

import step2_kvcache
from step2_kvcache import sampler as step2_sampler

from .__main__ import main as cli_main
from .config import EngineArgs
from .llm import LLM
from .model import GPT, padding_mask
from .sampler import sample
from .sampling_params import SamplingParams

PROMPTS = [
    "x",
    "The Python interpreter",
    "A list comprehension is",
    "Exceptions are raised when an error occurs.",
    "In this tutorial, you will learn how to use the standard library to read and write files, and how",
    "The",
    "Modules can import other modules.",
    "A dictionary maps keys to values. Keys must be hashable",
]


@pytest.fixture(scope="module")
def llm(demo_snapshot):
    return LLM(model=str(demo_snapshot), max_batch_size=8)


@pytest.fixture(scope="module")
def solo(demo_snapshot):
    return step2_kvcache.LLM(model=str(demo_snapshot))


def solo_ids(solo, prompt_ids, max_tokens):
    params = step2_kvcache.SamplingParams(max_tokens=max_tokens, temperature=0)
    return solo.generate(prompt_token_ids=[prompt_ids], sampling_params=params)[0].outputs[0].token_ids


@pytest.mark.parametrize("batch_size", [1, 2, 3, 8])
def test_batched_greedy_equals_solo_step2(llm, solo, batch_size):
    llm.engine.max_batch_size = batch_size
    try:
        max_tokens = [
            5 + 4 * i for i in range(len(PROMPTS))
        ]  # different lengths: rows finish at different steps
        outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=n, temperature=0) for n in max_tokens])
    finally:
        llm.engine.max_batch_size = 8
    for prompt, n, out in zip(PROMPTS, max_tokens, outs):
        assert out.prompt == prompt  # input order
        assert out.outputs[0].token_ids == solo_ids(solo, llm.tokenizer.encode(prompt), n), prompt


@pytest.mark.slow
def test_prompt_lengths_from_1_to_near_the_window(llm, solo):
    """One batch holding a 1-token prompt and a 490-token prompt (489 padding positions in row 0)."""
    base = llm.tokenizer.encode(" ".join(PROMPTS) + " ")
    lengths = [1, 17, 130, 490]
    prompts = [(base * 20)[:n] for n in lengths]
    padding_before = llm.engine.num_padding_tokens
    outs = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
    )
    for ids, out in zip(prompts, outs):
        n = min(20, llm.config.n_positions - len(ids))
        assert len(out.outputs[0].token_ids) == n
        assert out.outputs[0].token_ids == solo_ids(solo, ids, 20)
    assert llm.engine.num_padding_tokens - padding_before == sum(490 - n for n in lengths)


def test_a_row_that_reaches_the_window_keeps_stepping_safely(llm, solo):
    """Row 0 (500 tokens) stops at the 512-token window after 12 tokens; row 1 goes on for 100 steps with
    row 0 still computing beside it, past the window, without touching the position table's end."""
    ids = [[5] * 500, [5]]
    wasted_before = llm.engine.num_wasted_tokens
    outs = llm.generate(
        prompt_token_ids=ids,
        sampling_params=[SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 100)],
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 100]
    assert outs[0].outputs[0].finish_reason == outs[1].outputs[0].finish_reason == "length"
    assert outs[0].outputs[0].token_ids == solo_ids(solo, ids[0], 12) and outs[1].outputs[
        0
    ].token_ids == solo_ids(solo, ids[1], 100)
    assert llm.engine.num_wasted_tokens - wasted_before == 100 - 12


def test_equals_hf_generate_with_left_padding(llm, demo_snapshot):
    tok = llm.tokenizer
    ids = [tok.encode(p) for p in PROMPTS[:5]]
    longest = max(map(len, ids))
    pad = tok.eos_token_id
    input_ids = torch.tensor([[pad] * (longest - len(x)) + x for x in ids])
    attention_mask = torch.tensor([[0] * (longest - len(x)) + [1] * len(x) for x in ids])
    hf = GPT2LMHeadModel.from_pretrained(demo_snapshot, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf.generate(
            input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=16,
            min_new_tokens=16,
            pad_token_id=pad,
        )
    outs = llm.generate(PROMPTS[:5], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for row, out in enumerate(outs):
        assert out.outputs[0].token_ids == ref[row, longest:].tolist()


def test_seeded_sample_is_batch_independent(llm):
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=11)
    alone = llm.generate(PROMPTS[2], params)[0]
    others = [SamplingParams(max_tokens=n, temperature=0.7, seed=s) for n, s in ((3, 1), (30, 2), (9, None))]
    other_prompts = [PROMPTS[0], PROMPTS[4], PROMPTS[6]]
    for position in range(4):
        prompts = other_prompts[:position] + [PROMPTS[2]] + other_prompts[position:]
        out = llm.generate(prompts, others[:position] + [params] + others[position:])[position]
        assert (
            out.outputs[0].text == alone.outputs[0].text
            and out.outputs[0].token_ids == alone.outputs[0].token_ids
        )


def test_seeded_sample_equals_step2s_plain_sampler(llm, solo):
    """The batched sampler arrives in this step; step 2 samples one row at a time. Both draw from each
    request's own generator alike, so a seeded request with penalties and filters gives step 2's tokens
    and logprobs, in a batch too."""
    fields = dict(max_tokens=24, temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.3,
                  presence_penalty=0.5, frequency_penalty=0.4, logprobs=2, seed=1234)  # fmt: skip
    plain = solo.generate(PROMPTS[2], step2_kvcache.SamplingParams(**fields))[0].outputs[0]
    batch = [SamplingParams(max_tokens=9, temperature=0.7, seed=1), SamplingParams(**fields),
             SamplingParams(max_tokens=30, temperature=0)]  # fmt: skip
    batched = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[4]], batch)[1].outputs[0]
    assert len(set(plain.token_ids)) > 1 and batched.token_ids == plain.token_ids
    assert batched.text == plain.text
    for got, want in zip(batched.logprobs, plain.logprobs, strict=True):
        assert list(got) == list(want)  # the same tokens: the sampled one, then the top 2
        for token_id, logprob in got.items():
            assert (logprob.rank, logprob.decoded_token) == (
                want[token_id].rank,
                want[token_id].decoded_token,
            )
            assert logprob.logprob == pytest.approx(want[token_id].logprob, abs=1e-5)


def test_batched_sampler_equals_step2s_plain_sampler_row_by_row():
    """On random logits: every seeded or greedy row of a batch gets the id that step 2's plain sampler
    gives it alone, with the same logprobs (within float32 rounding)."""
    torch.manual_seed(0)
    rows = [dict(temperature=0, repetition_penalty=1.5, logprobs=3),
            dict(temperature=0.8, top_k=20, seed=1, logprobs=1),
            dict(temperature=1.2, top_p=0.7, min_p=0.01, seed=2),
            dict(presence_penalty=1.0, frequency_penalty=-0.5, seed=3, logprobs=5),
            dict(temperature=0, presence_penalty=-2, frequency_penalty=2)]  # fmt: skip
    params = [SamplingParams(**row) for row in rows]
    plain_params = [step2_kvcache.SamplingParams(**row) for row in rows]
    prompts = [[1, 2, 3, 2], [7], [4, 4, 9], [5, 6], [8, 1]]
    outputs = [[2, 2, 5], [], [9, 1], [6, 6, 6, 3], [1, 0]]
    batch_gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
    plain_gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
    for _ in range(4):  # several steps: the generators advance, the outputs grow
        logits = torch.randn(len(params), 500) * 3
        out = sample(logits, params, batch_gens, prompts, outputs)
        for i, p in enumerate(plain_params):
            token_id, want = step2_sampler.sample(logits[i], p, plain_gens[i], prompts[i], outputs[i])
            assert out.token_ids[i] == token_id, (i, p)
            got = out.logprobs[i]
            assert (got is None) == (want is None)
            if got is not None:
                assert (got.token_id, got.rank, [t for t, _ in got.top]) == (
                    want.token_id, want.rank, [t for t, _ in want.top])  # fmt: skip
                torch.testing.assert_close(
                    torch.tensor([got.logprob] + [lp for _, lp in got.top]),
                    torch.tensor([want.logprob] + [lp for _, lp in want.top]),
                    atol=1e-5,
                    rtol=0,
                )
            outputs[i].append(token_id)


def test_no_nan_or_inf_with_heavy_padding(demo_snapshot):
    model = GPT.from_pretrained(str(demo_snapshot))
    ids = torch.randint(model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    num_pads = torch.tensor([63, 40, 1, 0])  # row 0 is all padding but one token
    with torch.inference_mode():
        logits = model(ids, num_pads=num_pads)
    assert torch.isfinite(logits).all()
    # the real tokens' logits equal an unpadded forward of the same tokens
    with torch.inference_mode():
        for row, n in enumerate(num_pads.tolist()):
            alone = model(ids[row : row + 1, n:])
            assert (logits[row, n:] - alone[0]).abs().max().item() <= 1e-4


def test_padding_mask_hides_padding_from_every_query():
    mask = padding_mask(torch.tensor([2, 0]), start=0, T=4)[:, 0]  # [B, T, S]
    # row 0: positions 0, 1 are padding; real queries 2, 3 see only real keys up to themselves
    assert mask[0].int().tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    assert mask[1].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    decode = padding_mask(torch.tensor([2, 0]), start=4, T=1)[:, 0]  # one new token after 4 cached
    assert decode.int().tolist() == [[[0, 0, 1, 1, 1]], [[1, 1, 1, 1, 1]]]


def test_stop_rules_per_row_and_waste_is_counted(llm, solo):
    full = llm.generate(PROMPTS[1], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    stop_text = llm.tokenizer.decode(full.outputs[0].token_ids[4:6])
    params = [
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop_text]),  # stops at a string
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),  # runs to 30
        SamplingParams(
            max_tokens=30, temperature=0, stop_token_ids=[full.outputs[0].token_ids[2]]
        ),  # stops at a token
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),  # stops at length 7
    ]
    padding_before, wasted_before = llm.engine.num_padding_tokens, llm.engine.num_wasted_tokens
    outs = llm.generate([PROMPTS[1]] * 4, params)
    assert outs[0].outputs[0].finish_reason == "stop" and stop_text not in outs[0].outputs[0].text
    assert outs[0].outputs[0].text == full.outputs[0].text[: full.outputs[0].text.find(stop_text)]
    assert (
        outs[1].outputs[0].token_ids == full.outputs[0].token_ids
        and outs[1].outputs[0].finish_reason == "length"
    )
    assert (
        outs[2].outputs[0].token_ids == full.outputs[0].token_ids[:3]
        and outs[2].outputs[0].finish_reason == "stop"
    )
    assert (
        outs[3].outputs[0].token_ids == full.outputs[0].token_ids[:7]
        and outs[3].outputs[0].finish_reason == "length"
    )
    # the batch ran 30 steps; every row that finished early kept computing until then
    assert llm.engine.num_wasted_tokens - wasted_before == sum(30 - len(o.outputs[0].token_ids) for o in outs)
    assert llm.engine.num_padding_tokens == padding_before  # same prompt: no padding


def test_batches_form_in_arrival_order(llm, monkeypatch):
    sizes = []
    runner = llm.engine.model_runner
    real = runner.allocate_kv_cache

    def recording(batch):
        sizes.append([seq.request_id for seq in batch])
        return real(batch)

    monkeypatch.setattr(runner, "allocate_kv_cache", recording)
    llm.engine.max_batch_size = 3
    try:
        outs = llm.generate(PROMPTS[:7], SamplingParams(max_tokens=2, temperature=0))
    finally:
        llm.engine.max_batch_size = 8
    ids = [o.request_id for o in outs]
    assert sizes == [ids[0:3], ids[3:6], ids[6:7]]


def test_bad_max_batch_size(tmp_path):
    """Refused by EngineArgs with its message, before the model is looked for (here there is none)."""
    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(ValueError) as error:
            EngineArgs(model=str(tmp_path / "nothing-here"), max_batch_size=bad)
        assert str(error.value) == f"max_batch_size={bad!r}: must be an integer >= 1"
    with pytest.raises(ValueError, match="max_batch_size=0"):
        LLM(max_batch_size=0)


def test_cli_several_prompts_and_file(llm, tmp_path, run_main):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("A list comprehension is\n\nThe\n")
    args = ["The Python interpreter", "--prompts-file", str(prompts_file), "--max-tokens", "6"]
    status, stdout, stderr = run_main(cli_main, [*args, "--max-batch-size", "2"])  # in this process
    assert status == 0, stderr
    expected = llm.generate(
        ["The Python interpreter", "A list comprehension is", "The"],
        SamplingParams(max_tokens=6, temperature=0),
    )
    for out in expected:
        assert out.prompt + out.outputs[0].text in stdout
    assert stdout.count("--- request") == 3
    summary = stderr.strip().splitlines()[-1]
    assert "3 requests" in summary and "batches of up to 2" in summary and "padding positions" in summary
