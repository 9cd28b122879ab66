"""Generation tests, kept in every step from step 1 on: the API, sampling, stopping rules, bad input.

Parity tiers (README.md, "How correctness is checked"): greedy ids equal HF ``generate(do_sample=False)``
on the demo checkpoint; the logits used at every step equal step 0's forward pass on the same prefix,
within float32 tolerance (|diff| <= 1e-5 + 1.3e-6 |logit|, torch.testing's defaults).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from transformers import GPT2LMHeadModel

from step0_model import GPT as Step0GPT

from . import model_runner
from .__main__ import main as cli_main
from .config import EngineArgs
from .llm import LLM
from .sampling_params import Logprob, RequestOutputKind, SamplingParams
from .sequence import CompletionOutput, RequestOutput

PROMPTS = [
    "The Python interpreter",
    "A list comprehension is",
    "In this tutorial, you will learn how to",
    "x",
    "Exceptions are raised when an error occurs. The try statement specifies exception handlers and/or "
    "cleanup code for a group of statements, while the with statement allows the execution of "
    "initialization and finalization code around a block of code.",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def llm(demo_snapshot):
    return LLM(model=str(demo_snapshot))


@pytest.fixture(scope="module")
def hf_demo(demo_snapshot):
    return GPT2LMHeadModel.from_pretrained(demo_snapshot, dtype=torch.float32).eval()


def hf_greedy(hf, prompt_ids: list[int], max_new_tokens: int, eos: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=eos,
        )
    return out[0, len(prompt_ids) :].tolist()


def test_greedy_ids_equal_hf_generate(llm, hf_demo):
    outputs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outputs):
        expected = hf_greedy(
            hf_demo, llm.tokenizer.encode(prompt), GREEDY.max_tokens, llm.tokenizer.eos_token_id
        )
        assert out.outputs[0].token_ids == expected, prompt
        assert out.outputs[0].text == llm.tokenizer.decode(
            [t for t in out.outputs[0].token_ids if t != llm.tokenizer.eos_token_id]
        )


@pytest.mark.slow
def test_greedy_ids_equal_hf_near_the_context_window(llm, hf_demo):
    """A prompt of 480 tokens and 32 more: generation runs to the 512-token window's end, "length"."""
    ids = (llm.tokenizer.encode(PROMPTS[-1]) * 20)[:480]
    out = llm.generate(
        prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    )[0]
    assert len(out.outputs[0].token_ids) == 512 - 480 and out.outputs[0].finish_reason == "length"
    with torch.inference_mode():
        full = hf_demo.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=32, min_new_tokens=32, pad_token_id=0
        )
    assert out.outputs[0].token_ids == full[0, 480:].tolist()


def test_step_logits_equal_step0_forward(llm, demo_snapshot, monkeypatch):
    """Every logits row that reaches the sampler equals step 0's forward pass over the same prefix."""
    seen = []

    sample = model_runner.ModelRunner.sample

    def recording_sample(self, seqs, logits):
        for row, seq in zip(logits, seqs):
            seen.append((row.clone(), seq.prompt_token_ids + seq.output_token_ids))
        return sample(self, seqs, logits)

    monkeypatch.setattr(model_runner.ModelRunner, "sample", recording_sample)
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.9, seed=0))
    step0 = Step0GPT.from_pretrained(str(demo_snapshot))
    assert len(seen) == 12
    for logits, prefix in seen:
        with torch.inference_mode():
            expected = step0(torch.tensor([prefix]))[0, -1]
        torch.testing.assert_close(logits, expected, rtol=1.3e-6, atol=1e-5)  # float32 tolerance


def test_same_seed_same_text_and_other_seed_differs(llm):
    params = dict(max_tokens=32, temperature=1.0, ignore_eos=True)
    a = llm.generate(PROMPTS[0], SamplingParams(seed=7, **params))[0]
    b = llm.generate(PROMPTS[0], SamplingParams(seed=7, **params))[0]
    c = llm.generate(PROMPTS[0], SamplingParams(seed=8, **params))[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].text == b.outputs[0].text
    assert a.outputs[0].token_ids != c.outputs[0].token_ids


def test_top_k_1_and_tiny_top_p_are_greedy(llm):
    greedy = llm.generate(PROMPTS[:3], GREEDY)
    top_k_1 = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=24, temperature=1.5, top_k=1, seed=1))
    tiny_top_p = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=24, temperature=1.5, top_p=1e-6, seed=2))
    for g, k, p in zip(greedy, top_k_1, tiny_top_p):
        assert g.outputs[0].token_ids == k.outputs[0].token_ids == p.outputs[0].token_ids


def test_repetition_penalty_changes_greedy_output(llm):
    plain = llm.generate(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    penalised = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, repetition_penalty=1.5)
    )[0]
    assert plain.outputs[0].token_ids != penalised.outputs[0].token_ids
    assert len(set(penalised.outputs[0].token_ids)) >= len(set(plain.outputs[0].token_ids))


def token_texts(llm, ids):
    return [llm.tokenizer.decode([i]) for i in ids]


def test_stop_string_across_token_boundary_is_not_in_output(llm):
    full = llm.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    pieces = token_texts(llm, full.outputs[0].token_ids)
    # a stop string made of the end of token 5 and the start of token 6
    k = 5
    assert len(pieces[k]) >= 2 and len(pieces[k + 1]) >= 2
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    prefix_len = len("".join(pieces[:k])) + len(pieces[k]) - 2
    expected_text = "".join(pieces)[: "".join(pieces).find(stop)]
    assert len(expected_text) <= prefix_len
    out = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop, "never-seen"])
    )[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == expected_text and stop not in out.outputs[0].text
    assert out.outputs[0].token_ids == full.outputs[0].token_ids[: len(out.outputs[0].token_ids)]
    # streaming never shows any part of the stop string either
    streamed = "".join(
        llm.stream(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=stop))
    )
    assert streamed == expected_text


def test_stop_token_ids_and_eos(llm):
    full = llm.generate(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    stop_id = full.outputs[0].token_ids[3]
    first = full.outputs[0].token_ids.index(stop_id)
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_id]))[0]
    assert out.outputs[0].finish_reason == "stop"
    assert (
        out.outputs[0].token_ids == full.outputs[0].token_ids[: first + 1]
    )  # the stop token is kept in the ids...
    # ...and, an ordinary token, in the text too (as in vLLM); its id is the stop reason
    assert out.outputs[0].text == llm.tokenizer.decode(full.outputs[0].token_ids[: first + 1])
    assert out.outputs[0].stop_reason == stop_id

    eos = llm.tokenizer.eos_token_id
    try:  # pretend that token is the end-of-sequence token
        llm.tokenizer.eos_token_id = stop_id
        by_eos = llm.generate(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0))[0]
        ignoring = llm.generate(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    finally:
        llm.tokenizer.eos_token_id = eos
    assert (
        by_eos.outputs[0].token_ids == out.outputs[0].token_ids and by_eos.outputs[0].finish_reason == "stop"
    )
    assert (
        ignoring.outputs[0].token_ids == full.outputs[0].token_ids
        and ignoring.outputs[0].finish_reason == "length"
    )


def test_max_tokens_ends_with_length_and_past_the_window_is_refused(llm):
    """max_tokens ends a request with "length", up to the window's last position; a prompt plus max_tokens
    beyond the window is refused before it runs, naming both numbers (the server's rule too)."""
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    window = llm.config.n_positions
    for prompt_len, room in ((window - 1, 1), (window - 3, 3)):
        ids = [llm.tokenizer.encode(" the")[0]] * prompt_len
        out = llm.generate(
            prompt_token_ids=[ids],
            sampling_params=SamplingParams(max_tokens=room, temperature=0, ignore_eos=True),
        )[0]
        assert len(out.outputs[0].token_ids) == room and out.outputs[0].finish_reason == "length"
        with pytest.raises(ValueError, match=rf"^max_tokens=50: .* \({prompt_len} in the prompt, 50 in the"):
            llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=50))


def test_stream_equals_generate_and_metrics(llm):
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=3)
    whole = llm.generate(PROMPTS[2], params)[0]
    assert "".join(llm.stream(PROMPTS[2], params)) == whole.outputs[0].text
    outs = list(llm.stream_outputs(PROMPTS[2], params))
    assert len(outs) == len(whole.outputs[0].token_ids) and outs[-1].finished and not outs[0].finished
    m = outs[-1].metrics
    assert m.ttft_s > 0 and len(m.token_times) == len(whole.outputs[0].token_ids)
    assert len(m.decode_latencies_s) == len(whole.outputs[0].token_ids) - 1 and all(
        d >= 0 for d in m.decode_latencies_s
    )


def test_outputs_in_input_order_with_per_request_params(llm):
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 1, 7)]
    outs = llm.generate(PROMPTS[:3], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 1, 7]
    assert [o.prompt for o in outs] == PROMPTS[:3]
    assert len({o.request_id for o in outs}) == 3


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_tokens", 0, "max_tokens"),
        ("max_tokens", 2.5, "max_tokens"),
        ("temperature", -0.1, "temperature"),
        ("temperature", float("nan"), "temperature"),
        ("top_p", 0.0, r"top_p.*\(0, 1\]"),
        ("top_p", 1.5, "top_p"),
        ("top_k", -2, "top_k"),
        ("temperature", float("inf"), "finite"),
        ("presence_penalty", 2.5, "presence_penalty"),
        ("frequency_penalty", -3, "frequency_penalty"),
        ("logprobs", 6, "logprobs"),
        ("logprobs", -1, "logprobs"),
        ("min_p", -0.1, r"min_p.*\[0, 1\]"),
        ("min_p", 1.1, "min_p"),
        ("repetition_penalty", 0.0, "repetition_penalty"),
        ("stop", [""], "stop"),
        ("stop_token_ids", [-1], "stop_token_ids"),
        ("seed", "x", "seed"),
    ],
)
def test_bad_sampling_params_raise(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_bad_requests_raise_before_any_compute(llm, monkeypatch):
    def no_forward(*args, **kwargs):
        raise AssertionError("the model ran")

    monkeypatch.setattr(llm.model, "forward", no_forward)
    window = llm.config.n_positions
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.stream("", GREEDY)
    with pytest.raises(ValueError, match="no room"):
        llm.generate(prompt_token_ids=[[1] * window], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate(prompt_token_ids=[[1, llm.config.vocab_size]], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate("hi", SamplingParams(stop_token_ids=[10**6]))
    with pytest.raises(ValueError, match="no room"):  # one bad request in a list: nothing runs
        llm.generate(["fine", "x " * 600], GREEDY)


def test_extreme_sampling_values_do_not_crash(llm):
    """Values at the edge of float32: a temperature too small to divide by is greedy (as in vLLM), a top_p
    below float32's smallest number keeps the best token, an extreme penalty stays finite."""
    greedy = llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids
    for params in (
        SamplingParams(max_tokens=24, temperature=1e-40),
        SamplingParams(max_tokens=24, temperature=1.0, top_p=1e-300, seed=0),
    ):
        assert llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids == greedy
    for penalty in (1e-300, 1e300):
        out = llm.generate(
            PROMPTS[0], SamplingParams(max_tokens=8, temperature=1.0, repetition_penalty=penalty, seed=0)
        )[0]
        assert len(out.outputs[0].token_ids) == 8


def test_lenient_and_strict_input_forms(llm):
    import numpy as np

    ids = llm.tokenizer.encode(PROMPTS[0])
    expected = llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY)[0].outputs[0].token_ids
    assert (
        llm.generate(prompt_token_ids=ids, sampling_params=GREEDY)[0].outputs[0].token_ids == expected
    )  # one flat list
    assert (
        llm.generate(prompt_token_ids=[np.array(ids)], sampling_params=GREEDY)[0].outputs[0].token_ids
        == expected
    )
    assert (
        llm.generate(prompt_token_ids=[torch.tensor(ids)], sampling_params=GREEDY)[0].outputs[0].token_ids
        == expected
    )
    assert (
        llm.generate(prompt_token_ids=torch.tensor(ids), sampling_params=GREEDY)[0].outputs[0].token_ids
        == expected
    )
    assert [
        o.outputs[0].token_ids
        for o in llm.generate(prompt_token_ids=np.array([ids, ids]), sampling_params=GREEDY)
    ] == [expected] * 2
    flat_numpy_ints = [np.int64(t) for t in ids]  # one prompt, not len(ids) prompts
    assert (
        llm.generate(prompt_token_ids=flat_numpy_ints, sampling_params=GREEDY)[0].outputs[0].token_ids
        == expected
    )
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    for bad in ([[True, 5]], 316, np.int64(316), "316", ["316"], (t for t in ids), {316: 1}):
        with pytest.raises(ValueError, match="prompt_token_ids"):  # never a TypeError, never a text prompt
            llm.generate(prompt_token_ids=bad, sampling_params=GREEDY)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate(prompt_token_ids=[[1.5, 2]], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(PROMPTS[0], {"max_tokens": 3})
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=5)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_bad_model_device_dtype(tmp_path):
    """EngineArgs refuses a bad device or dtype with its message before it looks for the model (here there
    is none), and LLM raises what EngineArgs raises."""
    nowhere = str(tmp_path / "nothing-here")
    not_a_name = "not a device name (e.g. 'cpu', 'cuda', 'cuda:1')"
    for device, message in (
        ("meta", "the engines run on 'cpu' or 'cuda' only"),
        ("mps", "the engines run on 'cpu' or 'cuda' only"),
        (None, not_a_name),
        ("cuda:abc", not_a_name),
        ("", not_a_name),
        ("toaster", not_a_name),
    ):
        with pytest.raises(ValueError) as error:
            EngineArgs(model=nowhere, device=device)
        assert str(error.value) == f"device={device!r}: {message}"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError) as error:
            EngineArgs(model=nowhere, device="cuda")
        assert str(error.value) == "device='cuda': CUDA is not available on this machine"
    for make in (EngineArgs, LLM):
        with pytest.raises(ValueError) as error:
            make(model=nowhere, dtype="float8")
        assert str(error.value) == "dtype='float8': must be one of ['bfloat16', 'float16', 'float32']"
    with pytest.raises(ValueError, match=r"dtype=\['float32'\]: must be one of"):  # unhashable: no TypeError
        EngineArgs(model=nowhere, dtype=["float32"])
    with pytest.raises(ValueError, match="device='toaster'"):
        LLM(device="toaster")
    with pytest.raises(ValueError, match="no such folder"):
        LLM(model=nowhere)
    with pytest.raises(ValueError, match="lacks"):
        LLM(model=str(tmp_path))


def test_engine_args_resolve_what_the_parts_are_built_from(demo_snapshot):
    args = EngineArgs(model=str(demo_snapshot), dtype="bfloat16")
    assert args.folder == demo_snapshot and args.hf_config.n_positions == 512
    assert args.torch_device == torch.device("cpu") and args.torch_dtype is torch.bfloat16
    assert args.max_model_len == 512  # the context window


# A safety net against a hung process, never a measure of speed: on a loaded machine, starting Python,
# importing torch and loading the model can take minutes.
CLI_TIMEOUT_S = 600


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", __package__, *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        env=env,
    )


def env_running_first(folder: Path, code: str) -> dict:
    """The environment of a child Python that runs ``code`` before anything else (a sitecustomize.py put
    in ``folder``, which goes first on PYTHONPATH)."""
    (folder / "sitecustomize.py").write_text(code)
    path = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


# Any use of the network ends the child at once, with status 97 and a line on stderr (an audit hook).
NO_NETWORK = """
import os, sys

def refuse(event, args):
    if event in ("socket.getaddrinfo", "socket.gethostbyname", "socket.connect"):
        os.write(2, f"network used: {event} {args!r}\\n".encode())
        os._exit(97)

sys.addaudithook(refuse)
"""

# The child's stdout takes the prompt and the first generated text; its next write waits until the test
# closes the child's stdin (as output to a terminal that stopped reading waits). The CLI is then still
# generating when the test acts (Ctrl-C, a closed pipe), however a loaded machine schedules the two.
HOLD_OUTPUT = """
import signal
import sys

# Ctrl-C raises KeyboardInterrupt as in a terminal, also when the test run itself ignores SIGINT (a job a
# shell started in the background: its children inherit the ignored signal, and Python then leaves it so)
signal.signal(signal.SIGINT, signal.default_int_handler)

class HeldOutput:
    def __init__(self, stream):
        self.stream, self.texts = stream, 0

    def write(self, text):
        self.texts += bool(text)
        if self.texts == 3:  # the prompt, the first generated text, then this one
            sys.stdin.read()  # until EOF
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)

sys.stdout = HeldOutput(sys.stdout)
"""


def start_held_cli(folder: Path, *args: str) -> tuple[subprocess.Popen, threading.Timer]:
    """The CLI in a child process whose output holds (``HOLD_OUTPUT``), and a started watchdog that kills
    it after CLI_TIMEOUT_S (a safety net: a hung CLI fails its test, not the whole run; cancel it after)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", __package__, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env_running_first(folder, HOLD_OUTPUT),
    )
    watchdog = threading.Timer(CLI_TIMEOUT_S, proc.kill)
    watchdog.start()
    return proc, watchdog


def test_cli_streams_text_then_summary(llm, run_main):
    """In this process (the README's commands and the Ctrl-C and pipe cases below run it as a process)."""
    status, out, err = run_main(cli_main, ["The Python interpreter", "--max-tokens", "12"])
    assert status == 0, err
    expected = llm.generate("The Python interpreter", SamplingParams(max_tokens=12, temperature=0))[0]
    assert out == "The Python interpreter" + expected.outputs[0].text + "\n"
    summary = err.strip().splitlines()[-1]
    assert summary.startswith(
        f"[{len(expected.prompt_token_ids)} prompt tokens, {len(expected.outputs[0].token_ids)} generated"
    )
    assert "TTFT" in summary and "tok/s" in summary


@pytest.mark.parametrize(
    "args",
    [
        ["", "--max-tokens", "4"],
        ["hi", "--max-tokens", "0"],
        ["hi", "--temperature", "-1"],
        ["hi", "--top-p", "2"],
        ["hi", "--top-k", "-3"],
        ["hi", "--min-p", "7"],
        ["hi", "--repetition-penalty", "0"],
        ["hi", "--model", "/no/such/dir"],
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(args, run_main):
    status, out, err = run_main(cli_main, args)  # in this process; as a process: below
    assert status == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")


def test_cli_hub_model_offline_fails_fast_with_one_line(tmp_path):
    """HF_HUB_OFFLINE=1 makes huggingface_hub refuse the network: the message says the Hub is unreachable.
    It fails at once: nothing even looks a host up (no connection, no retry to wait for)."""
    env = {**env_running_first(tmp_path, NO_NETWORK), "HF_HUB_OFFLINE": "1"}
    result = run_cli("hi", "--model", "nobody/no-such-model-here", env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "could not be reached" in lines[0] and "local folder" in lines[0]


def test_outputs_have_vllm_shapes(llm):
    """RequestOutput(request_id, prompt, prompt_token_ids, outputs=[CompletionOutput(index, text, token_ids,
    finish_reason, logprobs)], finished, metrics), as vLLM returns them; get_tokenizer() as in vLLM."""
    (out,) = llm.generate(PROMPTS[0], GREEDY)
    assert isinstance(out, RequestOutput) and out.finished and out.prompt == PROMPTS[0]
    assert out.prompt_token_ids == llm.get_tokenizer().encode(PROMPTS[0])
    (completion,) = out.outputs
    assert isinstance(completion, CompletionOutput) and completion.index == 0
    assert completion.finish_reason == "length" and completion.logprobs is None
    assert completion.text == llm.get_tokenizer().decode(completion.token_ids)
    by_ids = llm.generate(prompt_token_ids=[out.prompt_token_ids], sampling_params=GREEDY)[0]
    assert by_ids.prompt is None and by_ids.outputs[0].token_ids == completion.token_ids


def test_top_k_minus_one_is_off(llm):
    params = dict(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    off = llm.generate(PROMPTS[0], SamplingParams(top_k=0, **params))[0].outputs[0].token_ids
    assert llm.generate(PROMPTS[0], SamplingParams(top_k=-1, **params))[0].outputs[0].token_ids == off


def test_output_kinds_cumulative_delta_final_only(demo_snapshot, llm):
    """CUMULATIVE outputs carry everything so far, DELTA only what is new, FINAL_ONLY one output at the end;
    all three add up to the same completion."""
    engine = llm.engine
    whole = llm.generate(PROMPTS[1], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[
        0
    ].outputs[0]
    got = {}
    for kind in RequestOutputKind:
        engine.add_request(
            f"kind-{kind.name}",
            PROMPTS[1],
            SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, output_kind=kind),
        )
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out.outputs[0])
    cumulative, delta, final = got["kind-CUMULATIVE"], got["kind-DELTA"], got["kind-FINAL_ONLY"]
    assert len(cumulative) == len(delta) == 10 and len(final) == 1
    assert [len(c.token_ids) for c in cumulative] == list(range(1, 11))
    assert all(len(d.token_ids) == 1 for d in delta)
    assert "".join(d.text for d in delta) == cumulative[-1].text == final[0].text == whole.text
    assert sum((d.token_ids for d in delta), []) == final[0].token_ids == whole.token_ids
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE  # vLLM's default
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")


def test_abort_ends_with_an_abort_output(llm):
    """An aborted request's last output says finish_reason "abort" (as in vLLM); the others carry on."""
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.add_request("keep", PROMPTS[0], params)
    engine.add_request("drop", PROMPTS[1], params)
    engine.step()
    engine.abort_request("drop")
    engine.abort_request("drop")  # twice, and unknown ids, are ignored
    engine.abort_request("no-such-request")
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    assert finals["drop"].finish_reason == "abort"
    assert finals["keep"].finish_reason == "length"
    assert finals["keep"].token_ids == llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids
    engine.add_request("last", PROMPTS[2], params)  # the only request, aborted: its output is still due
    engine.step()
    engine.abort_request("last")
    assert engine.has_unfinished_requests()
    finals = [out for _ in range(3) if engine.has_unfinished_requests() for out in engine.step()]
    assert [(o.request_id, o.outputs[0].finish_reason) for o in finals] == [("last", "abort")]
    assert not engine.has_unfinished_requests()


def test_logprobs_of_greedy_tokens_equal_log_softmax_of_hf_logits(llm, hf_demo):
    """logprobs=n returns, per generated token, the sampled token's log-probability and the n most likely
    (greedy: from the model's own distribution), equal to log_softmax of HF's logits at that position."""
    out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=8, temperature=0, logprobs=3, ignore_eos=True))[
        0
    ]
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 8
    ids = out.prompt_token_ids + completion.token_ids
    with torch.inference_mode():
        expected = torch.log_softmax(hf_demo(torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, V]
    for i, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = expected[len(out.prompt_token_ids) - 1 + i]
        top = torch.topk(row, 3)
        assert set(entry) == {token_id} | set(top.indices.tolist())
        assert entry[token_id].rank == 1 and isinstance(entry[token_id], Logprob)  # greedy: the best token
        for t, lp in entry.items():
            assert abs(lp.logprob - row[t].item()) <= 1e-4
            assert lp.decoded_token == llm.tokenizer.decode([t])


def test_cli_ctrl_c_ends_quietly_with_status_130(tmp_path):
    """Ctrl-C while the CLI generates (its output held: it cannot finish first): status 130, no traceback."""
    import signal

    prompt = "The Python interpreter"
    proc, watchdog = start_held_cli(tmp_path, prompt, "--max-tokens", "400", "--ignore-eos")
    try:
        assert proc.stdout.read(len(prompt)) == prompt  # generating now
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=CLI_TIMEOUT_S)  # closes stdin: only now may the output go on
    finally:
        watchdog.cancel()
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("args", [["hi", "--max-tokens", "abc"], ["hi", "--no-such-option"]])
def test_cli_bad_option_is_one_line_and_exit_2(args, run_main):
    status, out, err = run_main(cli_main, args)
    assert status == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")


def test_cli_bad_option_as_a_process():
    """The bad-input cases above call ``main`` in this process: the real process exits with status 2 and
    one line too (argparse's SystemExit here; main's returned 2 in test_cli_hub_model_offline_...)."""
    result = run_cli("hi", "--max-tokens", "abc")
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")


def test_cli_output_into_a_closed_pipe_is_quiet(tmp_path):
    """`python -m <step> ... | head -c 10`: the reader leaves early (the CLI's output held until then: it
    has more to write); no BrokenPipeError traceback."""
    proc, watchdog = start_held_cli(tmp_path, "The Python interpreter", "--max-tokens", "40", "--ignore-eos")
    try:
        assert proc.stdout.read(5) == "The P"
        proc.stdout.close()  # the reader is gone
        _, stderr = proc.communicate(timeout=CLI_TIMEOUT_S)  # closes stdin: the output goes on, into it
    finally:
        watchdog.cancel()
        proc.kill()
    assert proc.returncode == 1, stderr  # the CLI's status for a reader that went away
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr
