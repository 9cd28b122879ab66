"""The entrance of every step, one rule for all: what ``LLM.generate`` refuses before any compute (an empty
prompt, token ids outside the vocabulary, a prompt plus max_tokens past the window), each refusal a
ValueError naming the argument; and every command line's start-up, where Ctrl-C exits quietly with 130."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_layout import GENERATING_STEPS, ROOT

STEP_NAMES = [s.name for s in GENERATING_STEPS]


@pytest.fixture(scope="module")
def llms(demo_snapshot):
    """One LLM per generating step on the demo checkpoint (8192 tokens, a 512-token window), made once."""
    made = {}

    def get(step: str):
        if step not in made:
            made[step] = importlib.import_module(step).LLM(model=str(demo_snapshot))
        return made[step]

    return get


@pytest.mark.parametrize("step", STEP_NAMES)
def test_an_empty_prompt_is_refused_naming_the_argument(llms, step):
    llm, params = llms(step), importlib.import_module(step).SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match=r"^prompt is empty"):
        llm.generate("", params)
    for empty in ([], [[]]):  # no prompt, or one empty prompt: refused as an empty text is
        with pytest.raises(ValueError, match=r"^prompt_token_ids is empty"):
            llm.generate(prompt_token_ids=empty, sampling_params=params)


@pytest.mark.parametrize("step", STEP_NAMES)
@pytest.mark.parametrize("bad", [-1, 8192, 10**9])
def test_a_token_id_outside_the_vocabulary_is_named(llms, step, bad):
    llm, params = llms(step), importlib.import_module(step).SamplingParams(max_tokens=2)
    message = rf"^prompt_token_ids: token id {bad} is out of range: .* 8192 tokens \(ids 0\.\.8191\)$"
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt_token_ids=[5, bad], sampling_params=params)
    if bad >= 0:  # a negative stop id is SamplingParams' to refuse
        with pytest.raises(ValueError, match=rf"^stop_token_ids: token id {bad} is out of range"):
            llm.generate("x", importlib.import_module(step).SamplingParams(stop_token_ids=[bad]))


@pytest.mark.parametrize("step", STEP_NAMES)
def test_prompt_plus_max_tokens_past_the_window_is_refused_naming_both(llms, step):
    """One rule in every step, the server's too: prompt + max_tokens must fit in max_model_len (the demo's
    512-token window), or the request is refused before it runs; it is never cut short silently."""
    llm, module = llms(step), importlib.import_module(step)
    message = (
        r"^max_tokens=13: the request needs 513 tokens \(500 in the prompt, 13 in the completion\), more "
        r"than max_model_len=512 \(context window: 512 tokens\)$"
    )
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt_token_ids=[5] * 500, sampling_params=module.SamplingParams(max_tokens=13))
    with pytest.raises(ValueError, match=r"^max_tokens=1000000000: the request needs 1000000001 tokens"):
        llm.generate("x", module.SamplingParams(max_tokens=10**9))
    with pytest.raises(ValueError, match=r"^prompt of 512 tokens leaves no room to generate"):
        llm.generate(prompt_token_ids=[5] * 512, sampling_params=module.SamplingParams(max_tokens=1))
    out = llm.generate(prompt_token_ids=[5] * 500, sampling_params=module.SamplingParams(max_tokens=1))
    assert len(out[0].outputs[0].token_ids) == 1  # what fits runs


@pytest.mark.parametrize("step", STEP_NAMES)
def test_another_steps_sampling_params_is_named_as_such(llms, step):
    """Each step has a SamplingParams class of its own, which isinstance tells apart: another step's, given
    to ``LLM.generate`` (alone or in a list) or to the engine, is refused naming both steps, not as
    "expected SamplingParams, got SamplingParams"."""
    llm, module = llms(step), importlib.import_module(step)
    other = STEP_NAMES[STEP_NAMES.index(step) - 1] if step != STEP_NAMES[0] else STEP_NAMES[1]
    foreign = importlib.import_module(other).SamplingParams(max_tokens=2)
    said = f"sampling_params: .*, got a SamplingParams of {other}, not of {step}$"
    with pytest.raises(ValueError, match=said):
        llm.generate("x", foreign)
    with pytest.raises(ValueError, match=said):
        llm.generate(["x", "y"], [module.SamplingParams(max_tokens=2), foreign])
    with pytest.raises(ValueError, match=r"expected SamplingParams or a list of them, got dict$"):
        llm.generate("x", {"max_tokens": 2})
    make_sequence = llm.engine.make_sequence
    request_id = ("r",) if "request_id" in inspect.signature(make_sequence).parameters else ()
    with pytest.raises(ValueError, match=said):
        make_sequence(*request_id, "x", foreign)


# Ctrl-C at a chosen point of a real command line's start-up: this module, found on PYTHONPATH as
# sitecustomize, sends the process SIGINT when it starts to import torch, or opens the tokenizer's files
# (the engine's load, after torch). A real signal at a point fixed by the process itself, not by a timer.
CTRL_C_AT = """
import os
import signal
import sys

# Ctrl-C raises KeyboardInterrupt as in a terminal, also when the test run itself ignores SIGINT (a job a
# shell started in the background: its children inherit the ignored signal, and Python then leaves it so)
signal.signal(signal.SIGINT, signal.default_int_handler)
AT = os.environ["CTRL_C_AT"]
sent = []


def ctrl_c(event, args):
    at = (event == "import" and args[0] == AT) or (event == "open" and str(args[0]).endswith(AT))
    if at and not sent and "--parent-pid" not in sys.argv:  # not step 10's engine core: its own session
        sent.append(event)
        os.kill(os.getpid(), signal.SIGINT)


sys.addaudithook(ctrl_c)
"""
CLI_ARGS = {"step0_model": ["x"], **{s: ["x", "--max-tokens", "2"] for s in STEP_NAMES}}
for step in STEP_NAMES[5:]:  # steps 6 on: the server
    CLI_ARGS[step] = ["--port", "0"]
SAFETY_NET_S = 600  # a hung process fails its test instead of the run; never a measure


@pytest.mark.parametrize("at", ["torch", "vocab.json"], ids=["torch-import", "model-load"])
@pytest.mark.parametrize("step", list(CLI_ARGS))
def test_ctrl_c_during_start_up_exits_quietly_with_130(tmp_path, step, at):
    (tmp_path / "sitecustomize.py").write_text(CTRL_C_AT)
    env = {**os.environ, "CTRL_C_AT": at}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", step, *CLI_ARGS[step]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=SAFETY_NET_S,
    )
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr


SERVER_STEPS = {s.name for s in GENERATING_STEPS if (s / "api_server.py").is_file()}


@pytest.mark.parametrize("step", STEP_NAMES)
def test_engine_arguments_are_declared_once_in_engine_args(step, demo_snapshot, run_main):
    """EngineArgs (config.py) declares each engine argument once: the command line's flags (the server's
    too) are made from its fields, with their defaults and checks, and come back through from_cli_args;
    LLMEngine and LLM take its arguments as they are (no default of their own, no signature probe)."""
    config, cli = importlib.import_module(f"{step}.config"), importlib.import_module(f"{step}.__main__")
    module, prompt = importlib.import_module(step), [] if step in SERVER_STEPS else ["x"]
    declared = [arg for arg in dataclasses.fields(config.EngineArgs) if arg.init]
    parsed = cli.parse_args([*prompt, "--model", str(demo_snapshot)])
    assert all(getattr(parsed, arg.name) == arg.default for arg in declared[1:])  # every flag, its default
    made = config.EngineArgs.from_cli_args(parsed)
    assert made == config.EngineArgs(model=str(demo_snapshot)) and config.EngineArgs.make(made) is made
    for make in (module.LLMEngine, module.LLM):
        assert all(p.default is inspect.Parameter.empty for p in inspect.signature(make).parameters.values())
    assert "inspect.signature" not in Path(cli.__file__).read_text()
    for arg in declared:  # a value its check refuses: argparse's one line, exit status 2, nothing loaded
        if arg.metadata["check"] is not None and "type" in arg.metadata["flag"]:
            status, out, err = run_main(cli.main, [*prompt, "--" + arg.name.replace("_", "-"), "0"])
            assert status == 2 and out == "" and len(err.strip().splitlines()) == 1, err
            assert f"must be {arg.metadata['check'][1]}" in err


@pytest.mark.parametrize("step", STEP_NAMES)
def test_llm_takes_engine_args_by_position_name_or_made(step, demo_snapshot):
    module, config = importlib.import_module(step), importlib.import_module(f"{step}.config")
    made = config.EngineArgs(model=str(demo_snapshot))
    for llm in (module.LLM(str(demo_snapshot)), module.LLM(model=str(demo_snapshot)), module.LLM(made)):
        assert llm.engine.args == made
    with pytest.raises(ValueError, match="^dtype='int8': must be one of"):
        module.LLM(str(demo_snapshot), "cpu", "int8")


# A Python without the web stack: importing any of these modules fails, as on a GPU box that has torch only.
WITHOUT_THE_WEB_STACK = """
import importlib
import sys

WEB = {"fastapi", "starlette", "uvicorn", "pydantic", "pydantic_core", "prometheus_client"}


class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in WEB:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: not installed)", name=name)


sys.meta_path.insert(0, NotInstalled())
for step in sys.argv[2:]:
    module = importlib.import_module(step)
    params = module.SamplingParams(max_tokens=2, temperature=0)
    out = module.LLM(model=sys.argv[1]).generate("The Python interpreter", params)[0]
    assert len(out.outputs[0].token_ids) == 2, step
    if "build_app" in module.__all__:  # the server needs the web stack: it says which module is missing
        try:
            module.build_app
        except ModuleNotFoundError as e:
            assert e.name.split(".")[0] in WEB, e
        else:
            raise AssertionError(f"{step}.build_app imported without the web stack")
    print(step, "ok")
assert not WEB & {name.split(".")[0] for name in sys.modules}
"""


def test_every_step_imports_and_generates_with_torch_alone(demo_snapshot):
    """``import stepN_...`` and a generation need torch only: the server's modules (FastAPI, uvicorn,
    pydantic, prometheus_client) are imported when the server starts, so the engine runs without them."""
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_THE_WEB_STACK, str(demo_snapshot), *STEP_NAMES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=SAFETY_NET_S,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [word for step in STEP_NAMES for word in (step, "ok")]
