"""Step 7 tests: padded decode batches over persistent input buffers give step 6's outputs, and on a GPU
the replayed CUDA graphs give the eager pass's logits exactly.

On a CPU there are no graphs, but every decode-only batch still runs the padded pass that a graph would
replay, over the same persistent buffers: greedy ids equal step 6's at every batch size from 1 to
max_num_seqs (the sizes between the ladder's rungs too), with requests joining, finishing, aborted and
preempted; padding lanes write nothing but the scratch block, which no block table ever holds; a
sequence's block-table row is written when it joins and when it gains a block; one host-to-device copy
per step. With CUDA (``gpu`` tests): replay == eager, bit for bit, in fp32 and fp16 at several batch
sizes; greedy ids equal step 6's and the eager engine's; nothing compiles while serving.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

import step6_server

from . import input_batch as input_batch_module
from .__main__ import parse_args
from .api_server import build_app
from .async_engine import engine_features
from .cuda_graph import capture_sizes, padded_size
from .engine import LLMEngine
from .input_batch import PADDING_ROW, InputBatch
from .kernels import triton_usable
from .llm import LLM
from .sampling_params import SamplingParams
from .scheduler import SchedulerOutput

PROMPTS = [
    "The Python interpreter",
    "x",
    "A list comprehension is a concise way to",
    "Exceptions are raised when",
    "def fibonacci(n):",
    "import os",
    "The standard library",
    "Strings are immutable",
]
needs_triton = pytest.mark.skipif(
    not triton_usable("cuda" if torch.cuda.is_available() else "cpu"),
    reason="Triton's interpreter was not switched on before triton was imported",
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_ladder_covers_every_batch_size():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(40, step=8) == [1, 2, 4, 8, 16, 24, 32, 40]
    for max_num_seqs in (1, 5, 8, 33, 256):
        sizes = capture_sizes(max_num_seqs)
        for b in range(1, max_num_seqs + 1):
            rung = padded_size(sizes, b)
            assert rung >= b and not any(b <= s < rung for s in sizes), (max_num_seqs, b)
    with pytest.raises(ValueError, match="largest"):
        padded_size([1, 2, 4], 5)


class FakeSeq:
    """The two things ``InputBatch`` reads of a sequence: its id and its tokens."""

    def __init__(self, request_id: str, token_ids: list[int]):
        self.request_id, self.token_ids = request_id, list(token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)


def test_input_batch_rows_and_lanes():
    """Rows persist across steps (written when a sequence joins or gains a block, freed when it leaves,
    the lowest free one reused); lanes follow the scheduler's order; padding lanes point at the scratch
    slot and row; the device copy holds what the host wrote."""
    batch = InputBatch(
        max_num_seqs=4,
        max_num_tokens=16,
        max_blocks_per_seq=4,
        block_size=2,
        scratch_block=9,
        device=torch.device("cpu"),
    )
    f = batch.np
    a, b = FakeSeq("a", [11, 12, 13]), FakeSeq("b", [21])
    tables = {"a": [5, 6], "b": [7]}
    N, qsl = batch.prepare(SchedulerOutput(prefills=[a, b]), tables, num_lanes=2)
    assert (N, qsl) == (4, [0, 3, 4])
    assert f["input_ids"][:4].tolist() == [11, 12, 13, 21]
    assert f["positions"][:4].tolist() == [0, 1, 2, 0]
    assert f["slot_mapping"][:4].tolist() == [10, 11, 12, 14]  # block * 2 + offset
    assert f["seq_lens"][:2].tolist() == [3, 1] and f["rows"][:2].tolist() == [1, 2]
    assert batch.block_table_np[1, :2].tolist() == [5, 6] and batch.block_table_np[2, :1].tolist() == [7]
    assert torch.equal(batch.buffer.gpu, batch.buffer.cpu)

    a.token_ids.append(14)
    b.token_ids.append(22)
    N, qsl = batch.prepare(SchedulerOutput(decodes=[b, a]), tables, num_lanes=4)  # 2 decodes, 2 padding
    assert (N, qsl) == (4, [0, 1, 2, 3, 4])
    assert f["input_ids"][:4].tolist() == [22, 14, 0, 0]
    assert f["positions"][:4].tolist() == [1, 3, 0, 0]
    assert f["slot_mapping"][:4].tolist() == [15, 13, 18, 18]  # padding: the scratch slot, 9 * 2
    assert f["seq_lens"][:4].tolist() == [2, 4, 1, 1]
    assert f["rows"][:4].tolist() == [2, 1, PADDING_ROW, PADDING_ROW]
    assert batch.block_table_np[PADDING_ROW].tolist() == [9, 9, 9, 9]
    assert torch.equal(batch.buffer.gpu, batch.buffer.cpu)

    a.token_ids.append(15)  # position 4 starts a new block: the scheduler gave it block 8
    tables = {"a": [5, 6, 8]}  # b has finished
    batch.prepare(SchedulerOutput(decodes=[a]), tables, num_lanes=1)
    assert batch.row_of == {"a": 1} and batch.num_blocks[1] == 3
    assert batch.block_table_np[1, :3].tolist() == [5, 6, 8]
    assert f["slot_mapping"][0] == 16
    a.token_ids.append(16)
    c = FakeSeq("c", [31, 32])
    tables["c"] = [3]
    batch.prepare(SchedulerOutput(prefills=[c], decodes=[a]), tables, num_lanes=2)
    assert batch.row_of == {"a": 1, "c": 2}  # b's row, freed, is the lowest free one
    assert f["slot_mapping"][:3].tolist() == [6, 7, 17]
    assert torch.equal(batch.buffer.gpu[: batch.table_offset], batch.buffer.cpu[: batch.table_offset])
    with pytest.raises(ValueError, match="padded"):
        batch.prepare(SchedulerOutput(prefills=[c]), tables, num_lanes=2)


def drive(module, snapshot, new_tokens, abort, check=None, **engine_args) -> tuple[dict, object]:
    """A fixed script on ``module``'s engine: a request per prompt of ``PROMPTS[:len(new_tokens)]`` at
    once, request i generating new_tokens[i] tokens; two more joining at step 3 (each waits for a free
    place, then prefills beside the decodes); abort = (request id, step): that request aborted then.
    ``check(engine)`` runs after every step. Returns {request id: (generated ids, finish reason)} and
    the engine."""
    engine = module.LLMEngine(model=str(snapshot), **engine_args)
    params = lambda n: module.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    for i, n in enumerate(new_tokens):
        engine.add_request(f"r{i}", PROMPTS[i], params(n))
    outputs: dict[str, tuple[list[int], str]] = {}
    step = 0
    while engine.has_unfinished_requests():
        if step == 3:
            engine.add_request("late0", "Generators are", params(7))
            engine.add_request("late1", "for i in range(10):", params(3))
        if step == abort[1]:
            engine.abort_request(abort[0])
        for out in engine.step():
            outputs[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
        if check is not None:
            check(engine)
        step += 1
    return outputs, engine


def check_rows(engine) -> None:
    """After a step: the scratch block is in no block table, every running sequence's row mirrors its table
    in the block manager, and the padding row is all scratch block."""
    scratch = engine.block_manager.num_blocks
    batch = engine.model_runner.input_batch
    assert engine.kv_cache.k[0].shape[0] == scratch + 1
    for seq_id, table in engine.block_manager.block_tables.items():
        assert scratch not in table
        row = batch.row_of[seq_id]
        assert batch.block_table_np[row, : batch.num_blocks[row]].tolist() == table
    assert set(batch.block_table_np[PADDING_ROW].tolist()) == {scratch}


def test_greedy_equals_step6_at_every_batch_size(demo_snapshot, monkeypatch):
    """Decode-only batches of every size from max_num_seqs = 8 down to 1 (rungs 1, 2, 4, 8; 3, 5, 6, 7
    padded): eight requests finishing one by one, two joining, one aborted."""
    lanes = []
    original = InputBatch.prepare

    def recording(self, scheduled, block_tables, num_lanes):
        lanes.append((len(scheduled.prefills), len(scheduled.seqs), num_lanes))
        return original(self, scheduled, block_tables, num_lanes)

    monkeypatch.setattr(InputBatch, "prepare", recording)
    new_tokens = [3 + 2 * i for i in range(7)] + [40]  # one leaves every other step; r7 aborted at the end
    ours, _ = drive(
        sys.modules[__package__], demo_snapshot, new_tokens, ("r7", 17), check_rows, max_num_seqs=8
    )
    assert ours == drive(step6_server, demo_snapshot, new_tokens, ("r7", 17), max_num_seqs=8)[0]
    assert ours["r7"][1] == "abort" and ours["late1"][1] == "length"
    decode_only = {(S, n) for P, S, n in lanes if P == 0}
    assert {S for S, _ in decode_only} == set(range(1, 9))
    assert all(n == padded_size([1, 2, 4, 8], S) for S, n in decode_only)
    assert all(n == S for P, S, n in lanes if P > 0)  # prefills are never padded


def test_greedy_equals_step6_with_preemption(demo_snapshot):
    """A pool of 10 blocks of 4 tokens for four requests of 12 tokens: sequences are preempted (their rows
    freed) and prefilled again (new rows), and the outputs are still step 6's."""
    engine_args = dict(max_num_seqs=4, block_size=4, num_kv_blocks=10)
    ours, engine = drive(
        sys.modules[__package__], demo_snapshot, [12] * 4, ("r1", 6), check_rows, **engine_args
    )
    theirs, step6_engine = drive(step6_server, demo_snapshot, [12] * 4, ("r1", 6), **engine_args)
    assert ours == theirs
    assert engine.stats.num_preemptions == step6_engine.stats.num_preemptions > 0


@pytest.mark.slow
@needs_triton
def test_triton_backend_padded_equals_step6(demo_snapshot):
    """The Triton kernels (through the interpreter on a CPU) over padded batches: 3 sequences in 4 lanes,
    the padding lane attending over its one scratch key."""
    params = dict(max_tokens=5, temperature=0, ignore_eos=True)
    ours = LLM(model=str(demo_snapshot), max_num_seqs=4, attention_backend="triton")
    theirs = step6_server.LLM(model=str(demo_snapshot), max_num_seqs=4, attention_backend="triton")
    ids = lambda outs: [o.outputs[0].token_ids for o in outs]  # noqa: E731
    assert ids(ours.generate(PROMPTS[:3], SamplingParams(**params))) == ids(
        theirs.generate(PROMPTS[:3], step6_server.SamplingParams(**params))
    )


def test_padding_lanes_write_only_the_scratch_block(tiny_snapshot):
    """A decode step of 3 sequences padded to 4 lanes changes exactly 3 cache slots (one per sequence)
    outside the scratch block; the padding lane wrote the scratch block."""
    engine = LLMEngine(model=str(tiny_snapshot), max_num_seqs=4, block_size=4)
    for i in range(3):
        engine.add_request(str(i), [5 + i, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    engine.step()  # the prefills
    scratch = engine.block_manager.num_blocks
    before = [t.clone() for t in engine.kv_cache.k + engine.kv_cache.v]
    engine.step()  # 3 decodes, padded to 4 lanes
    after = engine.kv_cache.k + engine.kv_cache.v
    for old, new in zip(before, after):
        changed = (old != new).flatten(2).any(-1)  # [num_blocks + 1, block_size]
        assert changed[scratch].any()
        assert changed[:scratch].sum() == 3


def test_one_host_to_device_copy_per_step(demo_snapshot, monkeypatch):
    copies, steps = [], []
    monkeypatch.setattr(
        input_batch_module.CpuGpuBuffer, "copy_to_gpu", lambda self, n: copies.append(n) or None
    )
    llm = LLM(model=str(demo_snapshot), max_num_seqs=4)
    run = llm.engine.model_runner.run
    monkeypatch.setattr(llm.engine.model_runner, "run", lambda s: steps.append(1) or run(s))
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=4, temperature=0))
    assert len(copies) == len(steps) > 0


def test_enforce_eager_argument(demo_snapshot):
    with pytest.raises(ValueError, match="enforce_eager"):
        LLMEngine(model=str(demo_snapshot), enforce_eager="yes")
    engine = LLMEngine(model=str(demo_snapshot), enforce_eager=True)
    assert engine.model_runner.graph_runner is None
    assert parse_args([]).enforce_eager is False
    assert parse_args(["--enforce-eager"]).enforce_eager is True  # EngineArgs.from_cli_args takes it


def test_server_says_whether_cuda_graphs_are_on(demo_snapshot):
    """/v1/engine/stats (and so the page; the start-up line from the same ``engine_features``) says how the
    engine runs, from the start: on a CPU, no CUDA graphs (the GPU tests check them on)."""
    engine = LLMEngine(model=str(demo_snapshot))
    with TestClient(build_app(engine, "demo")) as client:
        features = client.get("/v1/engine/stats").json()["features"]
    assert features == {
        "device": "cpu",
        "dtype": "float32",
        "attention_backend": "torch",
        "cuda_graphs": False,
    }


# ---------------------------------------------------------------------------------------------------------
# On a GPU: the graphs themselves


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gpu_replay_equals_eager_exactly(demo_snapshot, dtype, backend):
    """The graph of each rung, replayed on the inputs of a real decode step, gives the eager pass's logits
    bit for bit (the padding lanes' too), at 13, 8, 3 and 1 sequences (rungs 16, 8, 4, 1)."""
    engine = LLMEngine(
        model=str(demo_snapshot), device="cuda", dtype=dtype, max_num_seqs=16, attention_backend=backend
    )
    runner = engine.model_runner
    for i in range(13):
        engine.add_request(str(i), PROMPTS[i % 8] + " and" * i, SamplingParams(max_tokens=8, temperature=0))
    engine.step()  # the prefills
    engine.step()  # one decode step
    for b in (13, 8, 3, 1):  # each a prefix of the one before: the others' rows are dropped
        lanes = padded_size(runner.capture_sizes, b)
        runner.input_batch.prepare(
            SchedulerOutput(decodes=engine.scheduler.running[:b]), engine.block_manager.block_tables, lanes
        )
        with torch.inference_mode():
            eager = runner.decode_forward(lanes).clone()
            replayed = runner.graph_runner.replay(lanes).clone()
        assert torch.equal(eager, replayed), (b, (eager - replayed).abs().max().item())
        assert torch.isfinite(replayed).all()


@pytest.mark.gpu
@needs_cuda
def test_gpu_greedy_equals_eager_and_step6(demo_snapshot, capfd):
    """fp32: graphs, the eager engine and step 6 on the GPU give the same greedy ids; batches of 6 shrink
    one by one (rungs 8, 4, 2, 1 and the sizes between); the capture was printed with its memory."""
    params = [SamplingParams(max_tokens=8 + 4 * i, temperature=0, ignore_eos=True) for i in range(6)]
    graphs = LLM(model=str(demo_snapshot), device="cuda", max_num_seqs=8)
    stats = graphs.engine.model_runner.graph_runner.stats
    assert stats.sizes == [1, 2, 4, 8] and stats.memory_bytes > 0
    assert "captured 4 CUDA graphs" in capfd.readouterr().err
    eager = LLM(model=str(demo_snapshot), device="cuda", max_num_seqs=8, enforce_eager=True)
    assert engine_features(graphs.engine)["cuda_graphs"] and not engine_features(eager.engine)["cuda_graphs"]
    step6 = step6_server.LLM(model=str(demo_snapshot), device="cuda", max_num_seqs=8)
    p6 = [
        step6_server.SamplingParams(max_tokens=p.max_tokens, temperature=0, ignore_eos=True) for p in params
    ]
    ids = lambda outs: [o.outputs[0].token_ids for o in outs]  # noqa: E731
    ours = ids(graphs.generate(PROMPTS[:6], params))
    assert ours == ids(eager.generate(PROMPTS[:6], params)) == ids(step6.generate(PROMPTS[:6], p6))


NO_COMPILE_WHILE_SERVING = """
import sys, torch, triton
from step7_cuda_graphs import LLMEngine, SamplingParams
engine = LLMEngine(model=sys.argv[1], device="cuda", dtype="float16", max_num_seqs=24)  # warm-up, capture
compiled = []
triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["repr"])
g = torch.Generator().manual_seed(0)
for i, n in enumerate([1, 5, 17, 40, 64, 65, 100, 300, 3, 9, 2, 30, 7, 12, 50, 8, 20, 4, 11, 6]):
    prompt = torch.randint(0, 8000, (n,), generator=g).tolist()
    engine.add_request(str(i), prompt, SamplingParams(max_tokens=8 + 5 * i, temperature=0, ignore_eos=True))
    engine.step()
while engine.has_unfinished_requests():
    engine.step()
print(len(compiled), compiled[:3])
"""


@pytest.mark.gpu
@needs_cuda
def test_gpu_engine_compiles_nothing_while_serving(demo_snapshot):
    """In a fresh process: after the warm-up and the capture, mixed steps of every prompt length band and
    decode-only batches of every size from 20 down to 1 (replayed graphs) launch no new Triton kernel."""
    if not hasattr(getattr(__import__("triton"), "knobs", None), "runtime"):
        pytest.skip("this Triton version has no compile hook to count compilations with")
    run = subprocess.run(
        [sys.executable, "-c", NO_COMPILE_WHILE_SERVING, str(demo_snapshot)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[0] == "0", run.stdout
