"""Repo-wide rules of the repository (README.md): the layout, the step rule (engine code imports no other
step; what a step does not change stays byte-identical), the cross-step chain of greedy outputs, and the
README's commands."""

from __future__ import annotations

import ast
import difflib
import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
STEPS = sorted(
    (p for p in ROOT.glob("step[0-9]*_*") if p.is_dir()), key=lambda p: int(p.name[4:].split("_")[0])
)
GENERATING_STEPS = [s for s in STEPS if s.name != "step0_model"]

# Files that a step does not change, by step: they must equal the previous step's byte for byte.
UNCHANGED_FROM_PREVIOUS = {
    "step1_generate": ["model.py"],
    "step2_kvcache": [
        "config.py",
        "sampling_params.py",
        "sampler.py",
        "sequence.py",
        "llm.py",
        "__main__.py",
        "test_generate.py",
        "test_sampling.py",
    ],
    # the batched sampler arrives with batches: sampler.py and its tests change here, then stay
    "step3_static_batch": ["sampling_params.py", "sequence.py", "llm.py", "test_generate.py"],
    # the engine's request API arrives with continuous batching: add_request / step / abort_request, the
    # output kinds (sampling_params.py), the LLM's request queues (llm.py) and their tests change here
    "step4_paged_continuous": ["sampler.py", "test_sampling.py"],
    "step5_flash_gpu": [
        "sampling_params.py",
        "sampler.py",
        "sequence.py",
        "llm.py",
        "scheduler.py",
        "block_manager.py",
        "kv_cache.py",
        "test_generate.py",
        "test_sampling.py",
    ],
    # the server changes no engine file: step 6 is step 5's engine behind HTTP
    "step6_server": [
        "sampling_params.py",
        "sampler.py",
        "sequence.py",
        "llm.py",
        "scheduler.py",
        "block_manager.py",
        "kv_cache.py",
        "model.py",
        "model_runner.py",
        "engine.py",
        "config.py",
        "kernels.py",
    ],
    # step 7 changes the model runner, the engine's start-up and arguments (config.py) and the server's line
    # that says whether graphs are on (async_engine.py), and drops the block manager's slots (its persistent
    # input buffers compute them): the rest of the engine and the server (whose files take the package's
    # name from __package__)
    "step7_cuda_graphs": [
        "sampling_params.py",
        "sampler.py",
        "sequence.py",
        "llm.py",
        "scheduler.py",
        "kv_cache.py",
        "model.py",
        "kernels.py",
        "protocol.py",
        "serving_engine.py",
        "serving_completion.py",
        "serving_chat.py",
        "metrics.py",
        "api_server.py",
        "static/index.html",
        "__main__.py",
    ],
    # step 8 changes the engine's step, the model runner's launch, the input buffers, the scheduler's finish
    # and the arguments (config.py), and the server's line that says whether async scheduling is on: the
    # sampler, the sequence, the graphs and the rest of the server stay
    "step8_async_scheduling": [
        "sampling_params.py",
        "sampler.py",
        "sequence.py",
        "llm.py",
        "block_manager.py",
        "kv_cache.py",
        "model.py",
        "kernels.py",
        "cuda_graph.py",
        "protocol.py",
        "serving_engine.py",
        "serving_completion.py",
        "serving_chat.py",
        "metrics.py",
        "api_server.py",
        "static/index.html",
        "__main__.py",
    ],
    # step 9 changes the block manager, the scheduler, sequences and SamplingParams (n), the prefill's
    # inputs and attention over cached context, and the server's n, metrics and usage (the prompt tokens
    # found cached): the sampler, the kernels, the graphs and the command line stay
    "step9_prefix_cache": [
        "sampler.py",
        "kernels.py",
        "cuda_graph.py",
        "__main__.py",
    ],
    # step 10 moves the step loop into a process of its own and the text out of it: the sequence loses
    # detokenization, stop strings and the outputs (to outputs.py), the engine returns token ids, the
    # scheduler's stats become a message, the server and LLM talk to the core; the block manager, the
    # model, its runner, the kernels, the wire types and the page stay
    "step10_engine_core": [
        "sampling_params.py",
        "sampler.py",
        "block_manager.py",
        "kv_cache.py",
        "model.py",
        "model_runner.py",
        "input_batch.py",
        "cuda_graph.py",
        "kernels.py",
        "protocol.py",
        "metrics.py",
        "static/index.html",
    ],
    # step 11 drafts tokens and verifies them in one pass: the scheduler, block manager, input batch, runner,
    # sequence, engine, config, stats, metrics and the features line change; the model, kernels, sampler,
    # processes stay
    "step11_speculative": [
        "__main__.py",
        "core_client.py",
        "cuda_graph.py",
        "kernels.py",
        "kv_cache.py",
        "llm.py",
        "model.py",
        "output_processor.py",
        "parallel_sampling.py",
        "processor.py",
        "protocol.py",
        "sampler.py",
        "sampling_params.py",
        "serving_chat.py",
        "serving_completion.py",
        "serving_engine.py",
    ],
    # step 12 stores the pool in 8 bits: the pool (kv_cache.py), the attention that reads it (model.py,
    # kernels.py), the argument (config.py), the engine's start-up and its features line change; the
    # scheduler, block manager, runner, graphs, speculation and the server stay
    "step12_quantized_kv": [
        "__main__.py",
        "api_server.py",
        "async_engine.py",
        "block_manager.py",
        "core_client.py",
        "cuda_graph.py",
        "draft_model.py",
        "input_batch.py",
        "llm.py",
        "messages.py",
        "metrics.py",
        "model_runner.py",
        "ngram_proposer.py",
        "output_processor.py",
        "parallel_sampling.py",
        "processor.py",
        "protocol.py",
        "rejection_sampler.py",
        "sampler.py",
        "sampling_params.py",
        "scheduler.py",
        "sequence.py",
        "serving_chat.py",
        "serving_completion.py",
        "serving_engine.py",
        "spec_decode.py",
        "static/index.html",
    ],
    # step 13 chunks prompts under one token budget: the scheduler, the block manager's fork and chunk runs,
    # the runner's and input batch's chunk lanes and mixed steps' graphs (cuda_graph.py), the arguments
    # (config.py), the stats and metrics change; the model, kernels, pool, speculation, sampling and the
    # server stay
    "step13_chunked_prefill": [
        "__main__.py",
        "api_server.py",
        "core_client.py",
        "draft_model.py",
        "kernels.py",
        "kv_cache.py",
        "kv_quant.py",
        "kv_write.py",
        "llm.py",
        "model.py",
        "ngram_proposer.py",
        "output_processor.py",
        "outputs.py",
        "parallel_sampling.py",
        "processor.py",
        "protocol.py",
        "rejection_sampler.py",
        "sampler.py",
        "sampling_params.py",
        "sequence.py",
        "serving_chat.py",
        "serving_completion.py",
        "serving_engine.py",
        "spec_decode.py",
        "static/index.html",
    ],
    # step 14 runs several engine cores and several frontends: the cores' processes and their sockets
    # (core_client.py, engine_core.py, the new coordinator.py), the wire (messages.py: the client's index,
    # the core's, the loads), the argument (config.py), the server's launcher (__main__.py), its figures by
    # core (async_engine.py, api_server.py, metrics.py) and LLM's (llm.py) change; the engine stays
    "step14_data_parallel": [
        "block_manager.py",
        "cuda_graph.py",
        "draft_model.py",
        "engine.py",
        "input_batch.py",
        "kernels.py",
        "kv_cache.py",
        "kv_quant.py",
        "kv_write.py",
        "model.py",
        "model_runner.py",
        "ngram_proposer.py",
        "output_processor.py",
        "outputs.py",
        "parallel_sampling.py",
        "processor.py",
        "protocol.py",
        "rejection_sampler.py",
        "sampler.py",
        "sampling_params.py",
        "scheduler.py",
        "sequence.py",
        "serving_chat.py",
        "serving_completion.py",
        "serving_engine.py",
        "spec_decode.py",
    ],
    # step 15 splits the model over t ranks: the sharded layers (the new parallel_layers.py), the group and
    # each step's broadcast (the new parallel_state.py), the workers (the new worker.py), the model, the
    # runner (a step as a plan the workers follow), the engine (rank 0), the argument (config.py) and the
    # features line (engine_core.py) change; the scheduler, the pool, the kernels and the server stay
    "step15_tensor_parallel": [
        "__main__.py",
        "api_server.py",
        "async_engine.py",
        "block_manager.py",
        "coordinator.py",
        "cuda_graph.py",
        "draft_model.py",
        "input_batch.py",
        "kernels.py",
        "kv_cache.py",
        "kv_quant.py",
        "kv_write.py",
        "launcher.py",
        "llm.py",
        "messages.py",
        "metrics.py",
        "ngram_proposer.py",
        "output_processor.py",
        "outputs.py",
        "parallel_sampling.py",
        "processor.py",
        "protocol.py",
        "rejection_sampler.py",
        "sampler.py",
        "sampling_params.py",
        "scheduler.py",
        "sequence.py",
        "serving_chat.py",
        "serving_completion.py",
        "serving_engine.py",
        "spec_decode.py",
        "static/index.html",
    ],
    # step 16 fuses a decode step's layer into five kernels: the kernels (the new fused_kernels.py;
    # kv_write.py lends them its quantizer), the model's fused pass, the runner (which steps run it), the
    # argument (config.py), the features line (engine_core.py) and its passing on (engine.py, worker.py)
    "step16_fused_kernels": [
        "__main__.py",
        "api_server.py",
        "async_engine.py",
        "block_manager.py",
        "coordinator.py",
        "core_client.py",
        "cuda_graph.py",
        "draft_model.py",
        "input_batch.py",
        "kernels.py",
        "kv_cache.py",
        "kv_quant.py",
        "launcher.py",
        "llm.py",
        "messages.py",
        "metrics.py",
        "ngram_proposer.py",
        "output_processor.py",
        "outputs.py",
        "parallel_layers.py",
        "parallel_sampling.py",
        "parallel_state.py",
        "processor.py",
        "protocol.py",
        "rejection_sampler.py",
        "sampler.py",
        "sampling_params.py",
        "scheduler.py",
        "sequence.py",
        "serving_chat.py",
        "serving_completion.py",
        "serving_engine.py",
        "spec_decode.py",
        "static/index.html",
    ],
}
# Steps whose engine change is one mechanism tested against the previous step on every path it changes (the
# previous step's outputs as the oracle) rather than by a copy of the engine tests: the test file.
MECHANISM_TESTS = {
    "step7_cuda_graphs": "test_cuda_graphs.py",
    "step8_async_scheduling": "test_async_scheduling.py",
    "step9_prefix_cache": "test_prefix_cache.py",
    "step10_engine_core": "test_engine_core.py",
    "step11_speculative": "test_speculative.py",
    "step12_quantized_kv": "test_quantized_kv.py",
    "step13_chunked_prefill": "test_chunked_prefill.py",
    "step14_data_parallel": "test_data_parallel.py",
    "step15_tensor_parallel": "test_tensor_parallel.py",
    "step16_fused_kernels": "test_fused_kernels.py",
}
# One file per serving concept, named alike in every generating step (the root README's Layout), so that a
# diff lands in the file named for its mechanism.
CONCEPT_FILES = [
    "sampling_params.py",
    "sampler.py",
    "sequence.py",
    "model.py",
    "model_runner.py",
    "engine.py",
    "config.py",
    "llm.py",
    "__main__.py",
]


def test_layout():
    assert [s.name for s in STEPS] == [
        "step0_model",
        "step1_generate",
        "step2_kvcache",
        "step3_static_batch",
        "step4_paged_continuous",
        "step5_flash_gpu",
        "step6_server",
        "step7_cuda_graphs",
        "step8_async_scheduling",
        "step9_prefix_cache",
        "step10_engine_core",
        "step11_speculative",
        "step12_quantized_kv",
        "step13_chunked_prefill",
        "step14_data_parallel",
        "step15_tensor_parallel",
        "step16_fused_kernels",
    ]
    for step in STEPS:
        for name in ("__init__.py", "__main__.py", "model.py", "README.md"):
            assert (step / name).is_file(), f"{step.name}/{name}"
        assert list(step.glob("test_*.py")), f"{step.name} has no tests"
    assert sorted(p.name for p in (ROOT / "common").glob("*.py")) == [
        "__init__.py",
        "tokenizer.py",
        "weights.py",
    ]
    for name in ("README.md", "requirements.txt", ".ci/run", "pytest.ini", "benchmarks/README.md"):
        assert (ROOT / name).is_file(), name


@pytest.mark.parametrize("step", GENERATING_STEPS, ids=lambda s: s.name)
def test_one_file_per_serving_concept(step):
    for name in CONCEPT_FILES:
        assert (step / name).is_file(), f"{step.name}/{name}"
    if step.name in MECHANISM_TESTS:  # tested against the previous step on every path the mechanism changes
        assert (step / MECHANISM_TESTS[step.name]).is_file()
    elif "engine.py" not in UNCHANGED_FROM_PREVIOUS.get(step.name, []):  # a new engine is tested anew
        assert (step / "test_generate.py").is_file() and (step / "test_sampling.py").is_file()


def relative_imports(path: Path) -> set[str]:
    """The modules of its own package that a module imports (``from .x import y`` -> "x")."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


def find_import_circle(folder: Path) -> list[str] | None:
    """A chain of modules of one package that leads back to its start, or None (depth-first search)."""
    graph = {p.stem: relative_imports(p) for p in folder.glob("*.py") if not p.name.startswith("test_")}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done or module not in graph:
            return None
        for imported in sorted(graph[module]):
            if circle := visit(imported, path + [module]):
                return circle
        done.add(module)
        return None

    return next((circle for module in sorted(graph) if (circle := visit(module, []))), None)


@pytest.mark.parametrize("step", STEPS, ids=lambda s: s.name)
def test_no_import_circle_inside_a_step(step):
    circle = find_import_circle(step)
    assert circle is None, f"import circle in {step.name}: {' -> '.join(circle)}"


def test_an_import_circle_is_found(tmp_path):
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("from .c import y\n")
    (tmp_path / "c.py").write_text("from . import a\n")
    assert find_import_circle(tmp_path) == ["a", "b", "c", "a"]


# The engine core's boundary (steps 10 on): the frontend (HTTP, the tokenizer and text, ``LLM``, the
# client of the core) imports no file of the engine core (the engine, its scheduler, block manager,
# sequences, pool, model, runner, kernels, drafts ...); both import the shared files: the wire
# (messages.py), the request's parameters, its outputs (outputs.py: the core's Sequence keeps its timings
# in a RequestMetrics) and the entrance checks (processor.py, run on both sides). Every other file of a step
# is the core's, a new one included. Two crossings, each named: core_client.py runs the core in process
# (InprocClient, LLM on a CPU); config.py, the engine's arguments that both sides make, sizes the pool and
# resolves the backend and the draft with the core's own helpers.
FRONTEND_FILES = [
    "__main__.py",
    "api_server.py",
    "async_engine.py",
    "core_client.py",
    "llm.py",
    "metrics.py",
    "output_processor.py",
    "protocol.py",
    "serving_chat.py",
    "serving_completion.py",
    "serving_engine.py",
]
SHARED_FILES = ["config.py", "messages.py", "outputs.py", "processor.py", "sampling_params.py"]
LATER_FRONTEND_FILES = ["launcher.py"]  # step 14 on: the processes of a server (started from the frontend)
CORE_CROSSINGS = {
    "core_client.py": {"engine_core"},
    "config.py": {"block_manager", "kv_cache", "model", "spec_decode"},
}
ENGINE_CORE_STEPS = [s for s in STEPS if (s / "engine_core.py").is_file()]


def core_imports(folder: Path) -> dict[str, list[str]]:
    """The core files that each frontend or shared file of ``folder`` imports beyond its named crossing."""
    ours = FRONTEND_FILES + SHARED_FILES + [n for n in LATER_FRONTEND_FILES if (folder / n).is_file()]
    core = {p.stem for p in folder.glob("*.py") if p.name not in ours and not p.name.startswith("test_")}
    found = {}
    for name in ours:
        crossing = relative_imports(folder / name) & (core - {"__init__"}) - CORE_CROSSINGS.get(name, set())
        if crossing:
            found[name] = sorted(crossing)
    return found


@pytest.mark.parametrize("step", ENGINE_CORE_STEPS, ids=lambda s: s.name)
def test_the_frontend_imports_no_file_of_the_engine_core(step):
    assert all((step / name).is_file() for name in FRONTEND_FILES + SHARED_FILES), step.name
    assert core_imports(step) == {}


def test_a_frontend_file_that_imports_the_core_is_found(tmp_path):
    for name in FRONTEND_FILES + SHARED_FILES:
        (tmp_path / name).write_text("from .messages import EngineCoreOutput\n")
    (tmp_path / "sequence.py").write_text("")
    (tmp_path / "engine_core.py").write_text("")
    (tmp_path / "llm.py").write_text(
        "from .sequence import RequestOutput\nfrom .engine_core import EngineCore\n"
    )
    (tmp_path / "core_client.py").write_text("from .engine_core import EngineCore\n")
    assert core_imports(tmp_path) == {"llm.py": ["engine_core", "sequence"]}


@pytest.mark.parametrize("step", STEPS, ids=lambda s: s.name)
def test_engine_code_imports_no_other_step(step):
    for path in step.glob("*.py"):
        if path.name.startswith("test_"):
            continue  # tests may use the previous step as their oracle
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for name in names:
                top = name.split(".")[0]
                assert not (re.match(r"step\d+_", top) and top != step.name), (
                    f"{path.relative_to(ROOT)} imports {name}"
                )


def modules_imported(step: Path) -> set[str]:
    """The modules of a step that its own files (engine code and tests) import: relative imports,
    ``stepN_... .x`` imports, and names built for ``importlib`` (a string constant ending in ``.x``)."""
    found = set()
    for path in step.glob("*.py"):
        found |= relative_imports(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                parts = node.module.split(".")
                if parts[0] == step.name:
                    found.update(parts[1:2] or [a.name for a in node.names])
            elif isinstance(node, ast.Import):
                found.update(a.name.split(".")[1] for a in node.names if a.name.startswith(step.name + "."))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value:
                found.add(node.value.rsplit(".", 1)[1])
    return found


@pytest.mark.parametrize("step", STEPS, ids=lambda s: s.name)
def test_every_module_of_a_step_is_imported_there(step):
    """No dead carries: an exercise module lives only in the step that teaches it, beside its tests
    (flash_decoding.py and kv_write.py in step 5), not copied into later steps that never import it."""
    modules = {p.stem for p in step.glob("*.py") if not p.name.startswith("test_")} - {"__init__", "__main__"}
    assert sorted(modules - modules_imported(step)) == [], step.name


@pytest.mark.parametrize("step", list(UNCHANGED_FROM_PREVIOUS), ids=str)
def test_unchanged_files_are_byte_identical(step):
    previous = STEPS[[s.name for s in STEPS].index(step) - 1]
    for name in UNCHANGED_FROM_PREVIOUS[step]:
        assert (ROOT / step / name).read_bytes() == (previous / name).read_bytes(), (
            f"{step}/{name} differs from {previous.name}"
        )


def test_greedy_chain_across_steps(demo_snapshot):
    """Every generating step gives the same greedy ids for the same prompts (README.md: step N vs N-1)."""
    prompts = ["The Python interpreter", "x", "A list comprehension is a concise way to"]
    results = {}
    for step in GENERATING_STEPS:  # step 6's engine is step 5's, byte for byte
        module = importlib.import_module(step.name)
        llm = module.LLM(model=str(demo_snapshot))
        outs = llm.generate(prompts, module.SamplingParams(max_tokens=20, temperature=0))
        results[step.name] = [o.outputs[0].token_ids for o in outs]
    first = results[GENERATING_STEPS[0].name]
    assert all(len(ids) > 0 for ids in first)
    for name, ids in results.items():
        assert ids == first, name


def readme_commands() -> list[str]:
    """The `python -m step...` commands of README.md's shell blocks that run offline (no --model hub id)."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, flags=re.S)
    commands = [line.strip() for block in blocks for line in block.splitlines()]
    offline = [
        c
        for c in commands
        if c.startswith("python -m step") and "--model gpt2" not in c and "--model distil" not in c
    ]
    return [c for c in offline if "--device cuda" not in c or torch.cuda.is_available()]


def test_readme_has_offline_commands():
    assert any(c.startswith("python -m step1_generate") for c in readme_commands())


@pytest.mark.slow
@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_runs(command):
    args = shlex.split(command)
    result = subprocess.run(  # timeout: a safety net against a hang, not a measure (a loaded machine is slow)
        [sys.executable, *args[1:]], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def project_files(*suffixes: str) -> list[Path]:
    """The repository's own files with these suffixes (no hidden folders, caches or virtual environments)."""
    return [
        p
        for p in sorted(ROOT.rglob("*"))
        if p.suffix in suffixes
        and p.is_file()
        and not any(
            part.startswith(".") or part in ("__pycache__", "venv") for part in p.relative_to(ROOT).parts[:-1]
        )
    ]


def test_no_dangling_references():
    """Project files cite only files the repository holds: every relative link of a Markdown file resolves,
    and every capitalised Markdown file name that a file cites (README.md, NOTES.md ...) exists in it."""
    markdown = project_files(".md")
    names = {p.name for p in markdown}
    for path in markdown:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if not re.match(r"[a-z]+:", target):
                assert (path.parent / target).exists(), f"{path.relative_to(ROOT)} links {target}"
    for path in markdown + project_files(".py"):
        for name in re.findall(r"\b([A-Z][A-Z0-9_]*\.md)\b", path.read_text()):
            assert name in names, f"{path.relative_to(ROOT)} cites {name}, which the repository does not hold"


# Module docstrings longer than 10 lines, still to be cut down where their files' next change lands.
LONG_DOCSTRINGS_PENDING: set[str] = set()  # none left


def test_module_docstrings_are_short():
    """A module's docstring says what the file is now, in 10 lines or fewer (measured figures live in the
    READMEs and benchmarks/NOTES.md, not in code)."""
    benchmarks = [p for p in sorted(ROOT.glob("benchmarks/**/*.py")) if ".cache" not in p.parts]
    for path in [p for step in STEPS for p in sorted(step.glob("*.py"))] + benchmarks:
        name = str(path.relative_to(ROOT))
        if name in LONG_DOCSTRINGS_PENDING:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        assert len(doc.splitlines()) <= 10, f"{name}: a docstring of {len(doc.splitlines())} lines"


LESSON_DIFF = "diff -ruN -x __pycache__ -x 'test_*' -x README.md"


def test_readme_diff_commands_leave_out_tests_and_readmes():
    """Every diff command a README gives reads the lesson, code only (what the table below counts), from a
    step to the next: `diff -ruN -x __pycache__ -x 'test_*' -x README.md stepA stepB`."""
    names = [s.name for s in STEPS]
    found = 0
    for readme in [ROOT / "README.md", *(s / "README.md" for s in STEPS)]:
        for command in re.findall(r"diff -r[^`\n#]*", readme.read_text()):
            if not re.search(r"step\w+ +step\w+", command):
                continue  # prose about diff, not a command
            found += 1
            assert command.startswith(LESSON_DIFF + " "), f"{readme.relative_to(ROOT)}: {command}"
            a, b = command[len(LESSON_DIFF) :].split()[:2]
            assert names.index(b) == names.index(a) + 1, f"{readme.relative_to(ROOT)}: {command}"
    assert found >= len(STEPS)


def code_files(step: Path) -> dict[str, list[str]]:
    """A step's code as diffed in the README's table: every file but tests, READMEs and caches."""
    return {
        str(p.relative_to(step)): p.read_text().splitlines()
        for p in sorted(step.rglob("*"))
        if p.is_file()
        and "__pycache__" not in p.parts
        and not p.name.startswith("test_")
        and p.name != "README.md"
    }


def changed_lines(a: Path, b: Path) -> int:
    """Lines added plus lines removed going from step a to step b (what `diff -ruN` marks + or -)."""
    old, new = code_files(a), code_files(b)
    total = 0
    for name in sorted(old.keys() | new.keys()):
        for line in difflib.unified_diff(old.get(name, []), new.get(name, []), lineterm="", n=0):
            if line[:1] in "+-" and not line.startswith(("+++", "---")):
                total += 1
    return total


def readme_diff_table() -> dict[tuple[str, str], int]:
    rows = re.findall(
        r"^\| `?(step\w+)`? -> `?(step\w+)`? \| (\d[\d,]*) \|", (ROOT / "README.md").read_text(), flags=re.M
    )
    return {(a, b): int(n.replace(",", "")) for a, b, n in rows}


def test_readme_diff_table_is_current():
    """README.md's table of changed code lines per transition matches the steps as they are."""
    table = readme_diff_table()
    expected = {(a.name, b.name): changed_lines(a, b) for a, b in zip(STEPS, STEPS[1:])}
    assert table == expected
