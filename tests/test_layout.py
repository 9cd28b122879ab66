"""Repo-wide rules of the repository (README.md): the layout, the step rule (engine code imports no other step; what a step
does not change stays byte-identical), the cross-step chain of greedy outputs, and the README's commands."""

from __future__ import annotations

import ast
import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STEPS = sorted((p for p in ROOT.glob("step[0-9]*_*") if p.is_dir()), key=lambda p: int(p.name[4:].split("_")[0]))
GENERATING_STEPS = [s for s in STEPS if s.name != "step0_model"]

# Files that a step does not change, by step: they must equal the previous step's byte for byte.
UNCHANGED_FROM_PREVIOUS = {
    "step1_generate": ["model.py"],
    "step2_kvcache": ["sampling.py", "__main__.py", "test_generate.py"],
    "step3_static_batch": ["sampling.py", "test_generate.py"],
    "step4_paged_continuous": ["sampling.py", "test_generate.py"],
}


def test_layout():
    assert [s.name for s in STEPS[:5]] == [
        "step0_model", "step1_generate", "step2_kvcache", "step3_static_batch", "step4_paged_continuous",
    ]
    for step in STEPS:
        for name in ("__init__.py", "__main__.py", "model.py", "README.md"):
            assert (step / name).is_file(), f"{step.name}/{name}"
        assert list(step.glob("test_*.py")), f"{step.name} has no tests"
    assert sorted(p.name for p in (ROOT / "common").glob("*.py")) == ["__init__.py", "tokenizer.py", "weights.py"]
    for name in ("README.md", "requirements.txt", ".ci/run", "pytest.ini", "benchmarks/README.md"):
        assert (ROOT / name).is_file(), name


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
                assert not (re.match(r"step\d+_", top) and top != step.name), f"{path.relative_to(ROOT)} imports {name}"


@pytest.mark.parametrize("step", list(UNCHANGED_FROM_PREVIOUS), ids=str)
def test_unchanged_files_are_byte_identical(step):
    previous = STEPS[[s.name for s in STEPS].index(step) - 1]
    for name in UNCHANGED_FROM_PREVIOUS[step]:
        assert (ROOT / step / name).read_bytes() == (previous / name).read_bytes(), f"{step}/{name} differs from {previous.name}"


def test_greedy_chain_across_steps(demo_snapshot):
    """Every generating step gives the same greedy ids for the same prompts (README.md: step N vs N-1)."""
    prompts = ["The Python interpreter", "x", "A list comprehension is a concise way to"]
    results = {}
    for step in GENERATING_STEPS:
        module = importlib.import_module(step.name)
        llm = module.LLM(model=str(demo_snapshot))
        outs = llm.generate(prompts, module.SamplingParams(max_tokens=20, temperature=0))
        results[step.name] = [o.token_ids for o in outs]
    first = results[GENERATING_STEPS[0].name]
    assert all(len(ids) > 0 for ids in first)
    for name, ids in results.items():
        assert ids == first, name


def readme_commands() -> list[str]:
    """The `python -m step...` commands of README.md's shell blocks that run offline (no --model hub id)."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, flags=re.S)
    commands = [line.strip() for block in blocks for line in block.splitlines()]
    return [c for c in commands if c.startswith("python -m step") and "--model gpt2" not in c and "--model distil" not in c]


def test_readme_has_offline_commands():
    assert any(c.startswith("python -m step1_generate") for c in readme_commands())


@pytest.mark.slow
@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_runs(command):
    args = shlex.split(command)
    result = subprocess.run([sys.executable, *args[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
