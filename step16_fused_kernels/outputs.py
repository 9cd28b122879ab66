"""What a request hands back, with vLLM's names (``vllm/outputs.py``): ``RequestOutput``, its
``CompletionOutput`` per choice, and ``RequestMetrics``.

The frontend builds them (output_processor.py) from the token ids the engine core sends; the core's
``Sequence`` keeps its own timings and prefix-cache hits in a ``RequestMetrics``. So both sides import
this file, and it imports nothing of either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .sampling_params import Logprob


@dataclass
class RequestMetrics:
    """When things happened to one request, in seconds of ``time.perf_counter()``, and what its prompt
    found in the prefix cache.

    arrival_time: when the request was added; first_scheduled_time: when it first entered a forward
    pass (so queue time = first_scheduled_time - arrival_time); token_times: when each output token
    was sampled; finished_time: when it finished. ttft_s: time to first token (arrival -> first token);
    decode_latencies_s: the gaps between consecutive tokens (inter-token latency, ITL).
    num_cached_tokens: the prompt tokens found in the prefix cache at its first admission (vLLM's name).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    num_cached_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.arrival_time if self.token_times else None

    @property
    def decode_latencies_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first one, per second of decoding; None with fewer than two tokens."""
        if len(self.token_times) < 2:
            return None
        return (len(self.token_times) - 1) / (self.token_times[-1] - self.token_times[0])


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's ``CompletionOutput``).

    text: the output text (special tokens and stop strings left out; a stop token from
    ``stop_token_ids`` that is an ordinary token stays in, as in vLLM); token_ids: the output ids (a
    stop token included); finish_reason: None while running, "stop" (end of sequence, a stop token or
    a stop string), "length" (max_tokens or the context window) or "abort"; stop_reason: the stop
    string or stop token id that ended it (None at the end-of-sequence token); logprobs: None unless
    ``SamplingParams.logprobs`` was set, else one dict per token of token_ids, holding the sampled id
    and the n most likely ids. With ``RequestOutputKind.DELTA`` text, token_ids and logprobs hold only
    what is new since the request's previous output.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What a request has produced (vLLM's ``RequestOutput``): its prompt, its completions in ``outputs``
    (one per choice of ``SamplingParams.n`` in a final output, ordered by index; in a streamed one, those of
    the choice that produced it), whether it has finished (every choice), and its timings."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache (vLLM's name; OpenAI's usage.prompt_tokens_details)."""
        return self.metrics.num_cached_tokens
