"""What crosses between the frontend and the engine core process: typed messages, encoded as MessagePack.

The frontend sends ``EngineCoreRequest`` and ``EngineCoreAbort``; the core answers ``EngineCoreReady`` once,
then one ``EngineCoreOutputs`` per engine step (every request's new token ids, finish reason, logprobs, and
the step's stats), and ``EngineCoreDead`` if it fails. Token ids, never text. The messages are msgspec
Structs (``array_like``, ``tag``): decoding checks every field's type and builds nothing else, so a message
cannot run code as a pickle can (vllm #12055); the dataclasses they hold (``SamplingParams``, ``Logprob``,
``GPT2Config``) are checked field by field. Source: vLLM's ``vllm/v1/engine/__init__.py`` and
``vllm/v1/serial_utils.py``.
"""

from __future__ import annotations

import msgspec

from common.weights import GPT2Config

from .sampling_params import Logprob, SamplingParams

# ---- frontend -> core ----


class EngineCoreRequest(msgspec.Struct, array_like=True, tag="add"):
    """A request for the core: its id, its prompt as token ids (the frontend tokenized and checked it), and
    how to sample it (``sampling_params.n`` choices, run together in the core); client_index: the frontend
    that sent it (0 .. api_server_count - 1), which its outputs go back to."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    client_index: int = 0


class EngineCoreAbort(msgspec.Struct, array_like=True, tag="abort"):
    """Drop a request: every unfinished choice (index None), or one choice (a stop string ended it); sent
    by the frontend (client_index) that sent the request."""

    request_id: str
    index: int | None = None
    client_index: int = 0


EngineCoreInput = EngineCoreRequest | EngineCoreAbort

# ---- core -> frontend ----


class EngineCoreOutput(msgspec.Struct, array_like=True):
    """What one choice of a request got since its last output: the new token ids (one per step; none when
    aborted; a FINAL_ONLY request without stop strings: all of them, once, when it finishes, with
    ``token_times``, when each was made, in seconds of ``time.perf_counter()``), their logprobs if asked
    for (``{token id: Logprob}`` per token, as ``CompletionOutput.logprobs``), and the core's finish
    reason: "stop" (end of sequence or a stop token: stop_reason is the token's id, None for end of
    sequence), "length" (max_tokens or the window) or "abort". error: why the core refused the request (it
    passed the frontend's checks: the core's own word), or None."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    error: str | None = None
    token_times: list[float] | None = None


class SchedulerStats(msgspec.Struct, array_like=True):
    """The scheduler after a step (vLLM's names): requests running and waiting, the share of KV-cache
    blocks in use (0..1) and their counts, preemptions since the start, tokens in the last forward pass and
    of them prompt tokens (prefills and chunks; the rest decode and verify), steps since the start and of them
    those that ran eagerly (no CUDA graph: prefills, chunks, or no graphs),
    prompt tokens admitted since the start (queries), of them those found cached (hits), blocks cached;
    speculative decoding since the start: verifications (drafts), tokens proposed, of them accepted, accepted
    by position (index i: lanes whose draft i + 1 was accepted), steps whose verification ran eagerly.

    One type from the scheduler to the page: ``Scheduler.make_stats`` makes it, the core sends it as it is
    (in every ``EngineCoreOutputs``, and in ``EngineCoreReady`` before any request), and ``LLM.stats``,
    the server's metrics and ``/v1/engine/stats`` (every field, by its name) read it: a counter added here
    and set in ``make_stats`` reaches them all."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    num_used_blocks: int
    num_blocks: int
    num_preemptions: int
    num_batched_tokens: int
    num_prefill_tokens: int
    num_steps: int
    num_eager_steps: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_cached_blocks: int
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
    num_eager_verify_steps: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits / queries since the start (0 before any query)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Accepted / proposed tokens since the start (0 before any)."""
        n = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / n if n else 0.0

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """Tokens a verification emits on average: 1 (the target's) + the drafts accepted (0 before any)."""
        n = self.spec_decode_num_drafts
        return 1 + self.spec_decode_num_accepted_tokens / n if n else 0.0


class EngineCoreOutputs(msgspec.Struct, array_like=True, tag="outputs"):
    """One engine step: the outputs of every request it advanced (and of requests aborted or refused since
    the step before), the scheduler's stats after it, when the step began (``time.perf_counter``: the
    machine's monotonic clock, comparable across its processes on Linux), how many requests and how many
    aborts the core has taken from its socket since it started (the frontend counts the requests still on
    their way, and knows when the stats show its aborts applied), and, by request id, the prompt tokens
    that the requests prefilled in this step found in the prefix cache (those that found any: vLLM's
    ``num_cached_tokens``, said once per request rather than in every output). With several frontends each
    gets the outputs of its own requests, and counts of its own requests and aborts; engine_index: the
    core that sent it (0 .. data_parallel_size - 1)."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    timestamp: float
    num_received: int
    num_aborts_received: int
    num_cached_tokens: dict[str, int]
    engine_index: int = 0


class EngineCoreReady(msgspec.Struct, array_like=True, tag="ready"):
    """Sent once, when the engine has loaded: what the frontend needs of the resolved configuration (the
    snapshot folder for its tokenizer, the model's config, the limits its checks use), the core's pid, how
    the engine runs (``engine_features``: the start-up line, /v1/engine/stats and the page show it), and the
    scheduler's stats before any request (its pool: the frontend's figures are right from the start)."""

    pid: int
    folder: str
    hf_config: GPT2Config
    max_model_len: int
    max_num_seqs: int
    num_kv_blocks: int
    block_size: int
    features: dict[str, str | bool | int]
    stats: SchedulerStats
    engine_index: int = 0


class EngineCoreDead(msgspec.Struct, array_like=True, tag="dead"):
    """The core's last word, sent before its sockets close: it failed to start (``during_startup``) or a
    step raised (then it exits 1), or SIGTERM or SIGINT stopped it (error_type "ShutdownRequested"; exit 0).
    error_type: the exception's class name ("ValueError", ...); message: its text. The frontend's monitor
    sends one too, for the core, when the process has died without a word (``kill -9``)."""

    error_type: str
    message: str
    during_startup: bool = False


EngineCoreEvent = EngineCoreReady | EngineCoreOutputs | EngineCoreDead

# ---- cores -> coordinator -> frontends (data parallelism) ----


class EngineCoreLoad(msgspec.Struct, array_like=True, tag="load"):
    """A core's scheduler stats after a step, for the coordinator (coordinator.py)."""

    engine_index: int
    stats: SchedulerStats


class EngineLoads(msgspec.Struct, array_like=True, tag="loads"):
    """The coordinator's publication: every core's latest stats (None: not heard from yet), by index."""

    stats: list[SchedulerStats | None]


def merge_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """Several cores' stats as one (``LLM.stats``, the totals of ``/v1/engine/stats``): counts added, the
    KV-cache usage over every pool's blocks, the accepted drafts by position added position by position."""
    if len(stats) == 1:
        return stats[0]
    per_pos = [s.spec_decode_num_accepted_tokens_per_pos for s in stats]
    fields = {
        f: sum(getattr(s, f) for s in stats)
        for f in SchedulerStats.__struct_fields__
        if f != "spec_decode_num_accepted_tokens_per_pos"
    }
    blocks = fields["num_blocks"]
    fields["kv_cache_usage"] = fields["num_used_blocks"] / blocks if blocks else 0.0
    fields["spec_decode_num_accepted_tokens_per_pos"] = [
        sum(p[i] for p in per_pos if i < len(p)) for i in range(max(map(len, per_pos)))
    ]
    return SchedulerStats(**fields)


def input_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def input_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the frontend sends: an ``EngineCoreRequest`` or an ``EngineCoreAbort``; raises
    ``msgspec.ValidationError`` on anything else."""
    return msgspec.msgpack.Decoder(EngineCoreInput)


def output_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def output_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the core sends: ``EngineCoreReady``, ``EngineCoreOutputs`` or ``EngineCoreDead``."""
    return msgspec.msgpack.Decoder(EngineCoreEvent)


def load_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what a core sends the coordinator: an ``EngineCoreLoad``."""
    return msgspec.msgpack.Decoder(EngineCoreLoad)


def loads_decoder() -> msgspec.msgpack.Decoder:
    """Decodes the coordinator's publication: an ``EngineLoads``."""
    return msgspec.msgpack.Decoder(EngineLoads)
