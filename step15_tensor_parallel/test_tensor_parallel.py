"""Step 15 tests: a model split over t ranks (gloo, CPU processes, fp32) computes what the whole model does,
and every fault ends cleanly.

Each parallel layer against its unsharded version, and the whole model's logits (prefills, then decodes over
the paged cache) at t = 2 and 4 against t = 1, within 1e-5, a vocabulary that t does not divide included:
ranks spawned here, joined by gloo. Step 14's engine is the oracle of the rest: greedy ids, seeded samples,
n, logprobs and prefix hits through ``LLM(tensor_parallel_size=2)``; speculation (a draft model, which rank
0 runs whole) with an 8-bit KV cache; the server's streams. Faults: a worker killed (the stream ends with an
error, /health, every process gone, exit non-zero), a rank that cannot load its shard, the store's port in
use. Waits poll for the event with a generous bound (``SAFETY_NET_S``), never a fixed sleep.
"""

from __future__ import annotations

import collections
import contextlib
import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import load_file, save_file

import step14_data_parallel
from common.weights import DEMO_CHECKPOINT
from conftest import TINY_CONFIG

from .engine import LLMEngine
from .kv_cache import PagedKVCache
from .llm import LLM
from .model import GPT, AttentionMetadata, decode_attention_mask
from .parallel_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, shard
from .parallel_state import ALL_GATHER, TensorParallel
from .sampling_params import SamplingParams

SAFETY_NET_S = 300  # the bound of every wait for an event: a net against a hang, never a measure of speed
ENGINE_ARGS = dict(block_size=4, max_num_seqs=8)
PROMPTS = [
    "The Python interpreter",
    "A list comprehension is",
    "Exceptions are raised when an error occurs.",
    "The Python interpreter reads",  # the first's prefix: a prefix-cache hit
]
CASES = [
    (PROMPTS[0], dict(max_tokens=24, temperature=0)),
    (PROMPTS[1], dict(max_tokens=24, temperature=0.9, top_p=0.9, seed=7)),
    (PROMPTS[2], dict(max_tokens=30, temperature=0, stop=[" raised"])),
    (PROMPTS[3], dict(n=3, max_tokens=12, temperature=1.0, seed=3)),
    (PROMPTS[1], dict(max_tokens=8, temperature=0, logprobs=2)),
]


# ---------------------------------------------------------------------------------------------------------
# The layers and the model, rank by rank (spawned processes, gloo)
# ---------------------------------------------------------------------------------------------------------


def run_model(model: GPT, heads: TensorParallel) -> torch.Tensor:
    """Two prompts (5 and 9 tokens) prefilled, then one decode step of each, over a paged cache of this
    rank's heads (the torch backend): their logits, [4, V]."""
    config = model.config
    cache = PagedKVCache(heads.heads_config(config), 6, 4, "cpu", torch.float32, "auto", "torch")
    ids = torch.randint(0, config.vocab_size, (16,), generator=torch.Generator().manual_seed(1))
    tables = torch.tensor([[0, 1, 0], [2, 3, 4]])
    slots = [b * 4 + i % 4 for b, i in zip([0] * 4 + [1], range(5))] + [
        tables[1, i // 4] * 4 + i % 4 for i in range(9)
    ]
    prefill = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=[0, 5, 14],
        query_start_loc_t=torch.tensor([0, 5, 14]),
        logits_indices=torch.tensor([4, 13]),
        num_prefills=2,
        seq_lens=torch.tensor([5, 9]),
        block_tables=tables,
        max_query_len=9,
        attention_backend="torch",
        decode_mask=None,
        prefill_seq_lens=[5, 9],
    )
    positions = torch.cat([torch.arange(5), torch.arange(9)])
    first = model(ids[:14], positions, cache, prefill)  # [2, V]
    seq_lens = torch.tensor([6, 10])
    decode = AttentionMetadata(
        slot_mapping=torch.tensor([1 * 4 + 1, 4 * 4 + 1]),
        query_start_loc=[0, 1, 2],
        query_start_loc_t=torch.tensor([0, 1, 2]),
        logits_indices=torch.tensor([0, 1]),
        num_prefills=0,
        seq_lens=seq_lens,
        block_tables=tables,
        max_query_len=1,
        attention_backend="torch",
        decode_mask=decode_attention_mask(seq_lens, 12, torch.float32),
    )
    second = model(ids[14:], torch.tensor([5, 9]), cache, decode)  # [2, V]
    return torch.cat([first, second])


def rank_errors(rank: int, world_size: int, port: int, folders: list[str], results) -> None:
    """Rank ``rank``'s worst differences from the unsharded versions: each layer (random weights and inputs,
    the same on every rank), then each model's logits; rank 0 puts them on ``results``."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    tp, t = TensorParallel(rank, world_size), world_size
    torch.manual_seed(0)
    errors = {}
    with torch.no_grad():
        x = torch.randn(5, 16)
        full = nn.Linear(16, 24)
        column = ColumnParallelLinear(16, 24, tp)
        column.weight.data, column.bias.data = shard(full.weight, 0, rank, t), shard(full.bias, 0, rank, t)
        errors["column"] = (tp.all_gather(column(x)) - full(x)).abs().max().item()

        qkv = ColumnParallelLinear(16, 48, tp, parts=3)  # q, k, v side by side, each cut alike
        full = nn.Linear(16, 48)
        qkv.weight.data, qkv.bias.data = (shard(p, 0, rank, t, parts=3) for p in (full.weight, full.bias))
        gathered = tp.all_gather(qkv(x)).view(5, t, 3, 16 // t).transpose(1, 2).reshape(5, 48)
        errors["qkv"] = (gathered - full(x)).abs().max().item()

        x = torch.randn(5, 24)
        full = nn.Linear(24, 16)
        row = RowParallelLinear(24, 16, tp)
        row.weight.data, row.bias.data = shard(full.weight, 1, rank, t), full.bias.clone()
        errors["row"] = (row(shard(x, 1, rank, t)) - full(x)).abs().max().item()

        full = nn.Embedding(11, 8)  # 11 ids: padded to 12 over 2 or 4 ranks
        embedding = VocabParallelEmbedding(11, 8, tp)
        embedding.weight.data = shard(full.weight, 0, rank, t, padded=embedding.padded)
        ids = torch.tensor([0, 10, 5, 3, 7, 10, 1])
        errors["embedding"] = (embedding(ids) - full(ids)).abs().max().item()
        h = torch.randn(3, 8)
        errors["lm_head"] = (embedding.logits(h) - h @ full.weight.T).abs().max().item()

        counts = collections.Counter()  # the collectives of one model's two passes, by name
        for folder in folders:
            whole = run_model(GPT.from_pretrained(folder), TensorParallel())
            model = GPT.from_pretrained(folder, tp=tp)
            with counting(counts, "all_reduce", ALL_GATHER):
                ours = run_model(model, tp)
            assert ours.shape == whole.shape
            errors[Path(folder).name] = (ours - whole).abs().max().item()
    dist.destroy_process_group()
    if rank == 0:
        results.put((errors, dict(counts)))
        results.close()
        results.join_thread()  # delivered
    os._exit(0)  # as a worker leaves (worker.py): no teardown of torch.distributed's C++ threads at exit


@contextlib.contextmanager
def counting(counts: collections.Counter, *names: str):
    """Count the calls of ``torch.distributed``'s functions ``names`` into ``counts`` meanwhile."""
    originals = {name: getattr(dist, name) for name in names}

    def counted(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in names:
        setattr(dist, name, counted(name))
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)


@pytest.fixture(scope="module")
def odd_vocab_snapshot(tmp_path_factory) -> Path:
    """A tiny random GPT-2 of 8195 ids (the demo's tokenizer names 8192 of them): no t > 1 divides it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("odd-vocab")
    torch.manual_seed(0)
    GPT2LMHeadModel(
        GPT2Config(vocab_size=8195, bos_token_id=8191, eos_token_id=8191, **TINY_CONFIG)
    ).save_pretrained(folder)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(DEMO_CHECKPOINT / name, folder / name)
    return folder


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_layer_and_the_model_split_over_ranks_equal_the_whole(
    world_size, demo_snapshot, odd_vocab_snapshot
):
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    folders = [str(demo_snapshot), str(odd_vocab_snapshot)]
    ranks = [
        context.Process(target=rank_errors, args=(rank, world_size, store.port, folders, results))
        for rank in range(world_size)
    ]
    for proc in ranks:
        proc.start()
    errors, counts = results.get(timeout=SAFETY_NET_S)
    for proc in ranks:
        proc.join(SAFETY_NET_S)
        assert proc.exitcode == 0
    # per pass: two all-reduces a layer (the demo's 6, the tiny model's 2) and the embedding's; one gather
    passes = 2
    assert counts == {
        "all_reduce": passes * ((2 * 6 + 1) + (2 * 2 + 1)),
        ALL_GATHER: passes * 2,
    }
    assert set(errors) == {
        "column",
        "qkv",
        "row",
        "embedding",
        "lm_head",
        Path(folders[0]).name,
        "odd-vocab0",
    }
    assert all(error < 1e-5 for error in errors.values()), errors


def test_a_head_count_that_t_does_not_divide_is_refused(demo_snapshot):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3: must divide the model's n_head=4"):
        LLM(model=str(demo_snapshot), tensor_parallel_size=3)


# ---------------------------------------------------------------------------------------------------------
# LLM over two ranks
# ---------------------------------------------------------------------------------------------------------


def as_tuples(outputs) -> list:
    """Every field of every choice; logprobs within 1e-4 nats."""

    def logprobs(c):
        return c.logprobs and [
            {t: pytest.approx(lp.logprob, abs=1e-4) for t, lp in entry.items()} for entry in c.logprobs
        ]

    return [
        [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, logprobs(c)) for c in out.outputs]
        for out in outputs
    ]


def run(llm_or_oracle, module, cases=CASES):
    prompts, fields = zip(*cases)
    return llm_or_oracle.generate(list(prompts), [module.SamplingParams(**f) for f in fields])


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {
            "kv_cache_dtype": "int8",
            "speculative_config": {"method": "draft_model", "num_speculative_tokens": 3},
        },
    ],
    ids=["defaults", "int8-draft-model"],
)
def test_two_ranks_give_step14s_outputs(demo_snapshot, extra):
    """Greedy, seeded, stop strings, n, logprobs, prefix hits; with an 8-bit cache and drafts verified."""
    args = {**ENGINE_ARGS, **extra}
    if "speculative_config" in extra:
        args["speculative_config"] = {**extra["speculative_config"], "model": str(demo_snapshot)}
    oracle = step14_data_parallel.LLM(model=str(demo_snapshot), **args)
    expected = as_tuples(run(oracle, step14_data_parallel))
    llm = LLM(model=str(demo_snapshot), tensor_parallel_size=2, **args)
    again = [(PROMPTS[2] + " Then", dict(max_tokens=8, temperature=0))]  # its first blocks are cached
    expected += as_tuples(run(oracle, step14_data_parallel, again))
    try:
        ours = run(llm, sys.modules[__package__])
        assert as_tuples(ours + run(llm, sys.modules[__package__], again)) == expected
        stats = llm.stats
        assert stats.prefix_cache_hits > 0
        if "speculative_config" in extra:
            assert stats.spec_decode_num_drafts > 0
    finally:
        llm.engine_core.shutdown()


# ---------------------------------------------------------------------------------------------------------
# Faults
# ---------------------------------------------------------------------------------------------------------


def gone(pid: int) -> bool:
    """Whether a process has exited (a zombie nobody reaped counts as exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            found.append(int(stat.parent.name))
    return found


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + SAFETY_NET_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_the_server_streams_step14s_ids_and_a_worker_killed_ends_everything(demo_snapshot):
    """Two ranks behind the server: its greedy ids are step 14's; then rank 1 killed mid-stream: the
    stream ends with an error event and [DONE], /health fails, the server exits non-zero, no process
    is left."""
    oracle = step14_data_parallel.LLM(model=str(demo_snapshot), **ENGINE_ARGS)
    expected = oracle.generate(
        [PROMPTS[0]], step14_data_parallel.SamplingParams(max_tokens=16, temperature=0)
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", __package__, "--port", "0", "--model", str(demo_snapshot)]
        + ["--tensor-parallel-size", "2", "--block-size", "4", "--max-num-seqs", "8"],
        cwd=Path(__file__).parent.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = "".join(proc.stdout.readline() for _ in range(4))
        url = re.search(r"http://127\.0\.0\.1:\d+", lines)
        assert url, lines + proc.stderr.read()
        url = url.group(0)
        core = int(re.search(r"engine core: pid (\d+)", lines).group(1))
        (worker,) = children(core)
        body = {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=SAFETY_NET_S).json()
        assert answer["choices"][0]["text"] == expected[0].outputs[0].text

        body = {"prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=SAFETY_NET_S) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        os.kill(worker, signal.SIGKILL)
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
        with contextlib.suppress(httpx.TransportError):  # refused once the server has gone
            assert httpx.get(f"{url}/health", timeout=SAFETY_NET_S).status_code == 503
        assert proc.wait(SAFETY_NET_S) != 0
        stderr = proc.stderr.read()
        assert "tensor-parallel rank 1" in stderr and "killed by SIGKILL" in stderr, stderr
        timed = (
            r"tensor parallel: 2 ranks over gloo; an all-reduce of \[1, 256\] takes \d+ us, of \[8, 256\] "
        )
        assert re.search(timed + r"\d+ us; 13 a step", stderr), stderr  # said at start-up
        wait_until(lambda: gone(core) and gone(worker), "a process was left behind")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(SAFETY_NET_S)


def test_a_rank_that_cannot_load_its_shard_stops_the_start(demo_snapshot, tmp_path):
    """An LM head that differs from the embedding only in rank 1's half of the vocabulary: rank 0 loads,
    rank 1 says why; the engine raises that, and no worker is left."""
    folder = tmp_path / "untied-in-rank-1"
    folder.mkdir()
    for name in os.listdir(demo_snapshot):
        if name != "model.safetensors":
            (folder / name).symlink_to(Path(demo_snapshot) / name)
    tensors = load_file(Path(demo_snapshot) / "model.safetensors")
    wte = next(name for name in tensors if name.endswith("wte.weight"))
    head = tensors[wte].clone()
    head[-1] += 1.0  # the last id: rank 1's
    save_file({**tensors, "lm_head.weight": head}, folder / "model.safetensors")
    before = set(children(os.getpid()))
    with pytest.raises(
        ValueError, match=r"tensor-parallel rank 1 failed to start: ValueError: .*untied LM head"
    ):
        LLMEngine(model=str(folder), tensor_parallel_size=2, multiprocessing=False, **ENGINE_ARGS)
    wait_until(lambda: set(children(os.getpid())) <= before, "a worker was left behind")


@pytest.mark.parametrize(
    "variable, value, error",
    [
        ("MASTER_PORT", "busy", r"cannot listen at 127\.0\.0\.1:\d+ \(.*\); MASTER_ADDR must be an address"),
        ("MASTER_PORT", "abc", r"MASTER_PORT='abc': must be a port number, 0\.\.65535"),
        ("MASTER_PORT", "99999", r"MASTER_PORT='99999': must be a port number"),
        ("MASTER_ADDR", "192.0.2.1", r"cannot listen at 192\.0\.2\.1:0 .*MASTER_ADDR must be an address"),
    ],
)
def test_a_store_that_cannot_listen_is_a_clear_error(demo_snapshot, monkeypatch, variable, value, error):
    """A port in use or not a port, an address of another machine (TEST-NET-1): ValueError before any
    worker starts, not a hang."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    monkeypatch.setenv(variable, str(busy.getsockname()[1]) if value == "busy" else value)
    before = set(children(os.getpid()))
    with pytest.raises(ValueError, match=error):
        LLMEngine(model=str(demo_snapshot), tensor_parallel_size=2, multiprocessing=False, **ENGINE_ARGS)
    assert set(children(os.getpid())) <= before
    busy.close()


# ---------------------------------------------------------------------------------------------------------
# On GPUs: t = 1 on one (CUDA graphs, the Triton kernels), t = 2 where two are lent (NCCL)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize(
    "extra",
    [{}, {"kv_cache_dtype": "int8", "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}],
    ids=["defaults", "int8-ngram"],
)
def test_gpu_ranks_give_step14s_ids(demo_snapshot, world_size, extra):
    """Greedy ids through the graphs (decode, verification, mixed steps), the all-reduces captured in them."""
    if world_size > torch.cuda.device_count():
        pytest.skip(f"needs {world_size} CUDA GPUs")
    args = dict(device="cuda", dtype="float32", **ENGINE_ARGS, **extra)
    prompts = [PROMPTS[i % len(PROMPTS)] * (1 + i % 3) for i in range(12)]  # decodes beside prompts
    params = [dict(max_tokens=24 + 4 * i, temperature=0, ignore_eos=True) for i in range(12)]
    oracle = step14_data_parallel.LLM(model=str(demo_snapshot), **args)
    expected = oracle.generate(prompts, [step14_data_parallel.SamplingParams(**p) for p in params])
    del oracle
    llm = LLM(model=str(demo_snapshot), tensor_parallel_size=world_size, **args)
    try:
        ours = llm.generate(prompts, [SamplingParams(**p) for p in params])
        assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in expected]
    finally:
        llm.engine_core.shutdown()
