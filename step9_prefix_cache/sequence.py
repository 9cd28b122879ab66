"""A request in flight (``Sequence``) and what it hands back (``RequestOutput``), with vLLM's names.

A ``Sequence`` holds one request's token ids, its sampling parameters, its random generator and its
stopping rules. ``append`` takes each sampled token: it turns tokens into text as they come (a token
can end inside a UTF-8 character, so text is released only once complete), and decides whether the
request is done: an end-of-sequence or stop token, a stop string, ``max_tokens``, the context window.
Stop strings are matched on the text, also when one spans several tokens: text that could be the
beginning of a stop string is held back until it is known not to be one, so a stop string never
reaches the output, not even in a stream. A request of ``SamplingParams.n`` > 1 choices is n sequences
under one ``ParentRequest`` (parallel_sampling.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from common.tokenizer import IncrementalDetokenizer, Tokenizer

from .parallel_sampling import ParentRequest
from .sampling_params import Logprob, RequestOutputKind, SamplingParams


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


class Sequence:
    """One request in flight: its tokens, its sampling state and its stopping rules.

    max_model_len: the most tokens (prompt + output) the request may reach: the context window, or
    less if the KV cache is smaller. generator: the request's own ``torch.Generator`` on ``device`` if
    it has a seed (so its draws do not depend on other requests), else None. num_computed_tokens: at its
    admission, its leading tokens found in the prefix cache (a forked choice: all), after which its prefill
    computes; block_hashes: the chained hashes of its full blocks, as far as hashed (block_manager.py).
    index, parent, forks: its choice of a request of n > 1 (parallel_sampling.py), that ``ParentRequest``,
    and (choice 0, until admitted) the other choices.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        max_model_len: int,
        device: torch.device,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.token_ids = list(prompt_token_ids)  # prompt + output, the sequence the model sees
        self.params = params
        self.max_len = min(
            max_model_len, len(prompt_token_ids) + params.max_tokens
        )  # tokens, prompt included
        self.eos_token_id = None if params.ignore_eos else tokenizer.eos_token_id
        self.special_token_ids = tokenizer.special_token_ids  # never shown as text
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(params.seed % 2**64)
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.text = ""  # released output text
        self.pending = ""  # decoded text held back: it may be the start of a stop string
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())
        self.num_sent_tokens = 0  # what earlier DELTA outputs carried
        self.num_sent_chars = 0
        self.num_computed_tokens = 0
        self.block_hashes: list[int] = []
        self.index, self.parent, self.forks = 0, None, []
        if params.n > 1:
            ParentRequest(
                self,
                lambda choice_id, choice_params: Sequence(
                    choice_id, prompt, prompt_token_ids, choice_params, tokenizer, max_model_len, device
                ),
            )

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int, logprobs: dict[int, Logprob] | None = None) -> None:
        """Add a sampled token (and its logprobs, if asked for); release text; maybe finish."""
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        if self.logprobs is not None:
            self.logprobs.append(logprobs)
        self.metrics.token_times.append(time.perf_counter())
        if token_id not in self.special_token_ids:
            self.pending += self.detokenizer.push(token_id)
        hit = None
        if token_id in self.params.stop_token_ids:
            self.finish("stop", stop_reason=token_id)
        elif token_id == self.eos_token_id:
            self.finish("stop")
        elif self.params.stop and (hit := self._first_stop_string()) is not None:
            cut, stop = hit
            self.finish("stop", stop_reason=stop)
            self.pending = self.pending[:cut]
        elif len(self) >= self.max_len:
            self.finish("length")
        if self.finished:
            if hit is None:  # text after a stop string is dropped; anything else is flushed
                self.pending += self.detokenizer.flush()
            released, self.pending = self.pending, ""
        elif not self.params.stop:  # nothing to hold back
            released, self.pending = self.pending, ""
        else:
            held = self._stop_prefix_length()
            released, self.pending = (
                self.pending[: len(self.pending) - held],
                self.pending[len(self.pending) - held :],
            )
        self.text += released

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        """End the request: reason "stop", "length" or "abort"."""
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.metrics.finished_time = time.perf_counter()

    def _first_stop_string(self) -> tuple[int, str] | None:
        """(where it starts, which) for the earliest stop string in the held-back text, or None."""
        hits = [(i, s) for s in self.params.stop if (i := self.pending.find(s)) >= 0]
        return min(hits) if hits else None

    def _stop_prefix_length(self) -> int:
        """Length of the longest end of the held-back text that begins some stop string."""
        longest = 0
        for s in self.params.stop:
            for n in range(min(len(s) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def output(self) -> RequestOutput | None:
        """The output due now under the request's ``output_kind``: everything so far (CUMULATIVE), what
        is new since the last output (DELTA), or nothing until the request has finished (FINAL_ONLY)."""
        kind = self.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        tokens, chars = (
            (self.num_sent_tokens, self.num_sent_chars) if kind is RequestOutputKind.DELTA else (0, 0)
        )
        self.num_sent_tokens, self.num_sent_chars = len(self.output_token_ids), len(self.text)
        completion = CompletionOutput(
            index=self.index,
            text=self.text[chars:],
            token_ids=self.output_token_ids[tokens:],
            finish_reason=self.finish_reason,
            logprobs=None if self.logprobs is None else self.logprobs[tokens:],
            stop_reason=self.stop_reason,
        )
        out = RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.finished,
            metrics=self.metrics,
        )
        return out if self.parent is None else self.parent.make_output(out)  # one choice of n > 1
