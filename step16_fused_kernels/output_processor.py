"""The frontend's half of a request: token ids from the engine core -> text, stop strings, ``RequestOutput``.

Per choice (``ChoiceState``, the text half of step 9's ``Sequence``): incremental detokenization (UTF-8
held back until complete) and stop strings matched on the text, also across tokens (text that could begin
a stop string is held back); a stop string found ends the choice at its token and asks the core to abort
it. Per request (``RequestState``): the n choices and the outputs due under ``output_kind``;
``stream_interval`` (vLLM's name) sends a DELTA every N tokens, the first at once. ``RequestOutputCollector``:
a handler that lags finds the deltas merged into one output. Source: vLLM's
``vllm/v1/engine/output_processor.py`` and ``detokenizer.py``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from common.tokenizer import IncrementalDetokenizer, Tokenizer

from .messages import EngineCoreOutput
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import Logprob, RequestOutputKind, SamplingParams


class ChoiceState:
    """One choice of a request, as the frontend sees it: its token ids, its text, its finish.

    The core decides the finishes that need no text (end of sequence, stop tokens, max_tokens, the
    window, abort); this adds the stop strings (``append``)."""

    def __init__(self, index: int, params: SamplingParams, tokenizer: Tokenizer, arrival_time: float):
        self.index = index
        self.params = params
        self.special_token_ids = tokenizer.special_token_ids  # never shown as text
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.output_token_ids: list[int] = []
        self.text = ""  # released output text
        self.pending = ""  # decoded text held back: it may be the start of a stop string
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.finished = False  # finish_reason is set (an attribute, not a property: read for every token)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.num_sent_tokens = 0  # what earlier DELTA outputs carried
        self.num_sent_chars = 0

    def append(
        self,
        token_ids: list[int],
        logprobs: list[dict[int, Logprob]] | None,
        finish_reason: str | None,
        stop_reason: int | None,
        token_times: list[float] | None = None,
    ) -> None:
        """Add the tokens the core sampled for this choice since its last output (``EngineCoreOutput``: one
        a step; a FINAL_ONLY request's all at once, made at ``token_times``, else now), with the core's
        finish at the last of them (or None); release text. A stop string may finish the choice at any of
        them (the tokens after it are dropped), so with stop strings the text is made token by token;
        without, all at once (``push_many``: the same text, in one call). The core's order is step 9's: a
        stop token or the end of sequence ends it before any stop string is looked for; a stop string
        before max_tokens or the window."""
        hit, kept, special = None, len(token_ids), self.special_token_ids
        if self.params.stop:
            for i, token_id in enumerate(token_ids):
                if token_id not in special:
                    self.pending += self.detokenizer.push(token_id)
                if i == len(token_ids) - 1 and finish_reason == "stop":  # a stop token or end of sequence
                    break
                if (hit := self._first_stop_string()) is not None:
                    kept, (cut, stop) = i + 1, hit
                    self.finish("stop", stop_reason=stop)
                    self.pending = self.pending[:cut]
                    break
        else:
            shown = token_ids if special.isdisjoint(token_ids) else [t for t in token_ids if t not in special]
            self.pending += self.detokenizer.push_many(shown)
        self.output_token_ids += token_ids[:kept]
        if self.logprobs is not None:
            self.logprobs += logprobs[:kept]
        self.metrics.token_times += token_times[:kept] if token_times else [time.perf_counter()] * kept
        if not self.finished and finish_reason is not None:
            self.finish(finish_reason, stop_reason)
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
        """End the choice: reason "stop", "length" or "abort"."""
        self.finished = True
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

    def completion(self) -> CompletionOutput:
        """This choice's ``CompletionOutput`` under its ``output_kind`` (DELTA: what is new since then)."""
        kind = self.params.output_kind
        tokens, chars = (
            (self.num_sent_tokens, self.num_sent_chars) if kind is RequestOutputKind.DELTA else (0, 0)
        )
        self.num_sent_tokens, self.num_sent_chars = len(self.output_token_ids), len(self.text)
        return CompletionOutput(
            index=self.index,
            text=self.text[chars:],
            token_ids=self.output_token_ids[tokens:],
            finish_reason=self.finish_reason,
            logprobs=None if self.logprobs is None else self.logprobs[tokens:],
            stop_reason=self.stop_reason,
        )


class RequestState:
    """One request of the frontend: its prompt and its n choices. stream_interval: DELTA outputs every N
    tokens of a choice (its first and its last at once)."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        stream_interval: int = 1,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        now = time.perf_counter()
        self.choices = [ChoiceState(i, params, tokenizer, now) for i in range(params.n)]  # seeds: the core's
        self.stream_interval = stream_interval

    @property
    def finished(self) -> bool:
        return all(choice.finished for choice in self.choices)

    def due(self, choice: ChoiceState) -> bool:
        """Whether an output is due after ``choice`` advanced, under the request's ``output_kind``: at
        every token (CUMULATIVE: everything so far; DELTA: what is new since the last output, every
        ``stream_interval`` tokens), or once, when the request has finished (FINAL_ONLY: the last choice
        to finish outputs every choice's)."""
        kind = self.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY:
            return choice.finished and self.finished
        return (
            kind is not RequestOutputKind.DELTA
            or self.stream_interval == 1
            or choice.finished
            or choice.num_sent_tokens == 0
            or len(choice.output_token_ids) - choice.num_sent_tokens >= self.stream_interval
        )

    def output(self, choice: ChoiceState, finished: bool) -> RequestOutput:
        """The output of ``choice`` (a choice of n > 1 outputs its own completion under the request's id;
        with FINAL_ONLY, every choice's); finished: it is the request's last."""
        several = self.params.output_kind is RequestOutputKind.FINAL_ONLY and len(self.choices) > 1
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[c.completion() for c in (self.choices if several else [choice])],
            finished=finished,
            metrics=choice.metrics,
        )


@dataclass
class ProcessedOutputs:
    """What a call's outputs made: request_outputs (the outputs due, for the caller to route), to_abort
    ((request id, choice index) of choices a stop string ended, to abort in the core), failed ((state,
    the core's error) of requests the core refused; their states are gone)."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    to_abort: list[tuple[str, int]] = field(default_factory=list)
    failed: list[tuple[RequestState, str]] = field(default_factory=list)


class OutputProcessor:
    """The frontend's requests in flight (``requests``, by id) and what the core's outputs make of them.

    ``add_request`` before the request is sent to the core; ``process_outputs`` for every
    ``EngineCoreOutputs``; ``abort_request`` when the frontend drops a request (a client gone). A request
    leaves ``requests`` when every choice has finished here; the core's later outputs for it are ignored.
    """

    def __init__(self, tokenizer: Tokenizer, stream_interval: int = 1):
        if not isinstance(stream_interval, int) or isinstance(stream_interval, bool) or stream_interval < 1:
            raise ValueError(f"stream_interval={stream_interval!r}: must be an integer >= 1")
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.requests: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> RequestState:
        interval = self.stream_interval
        state = RequestState(request_id, prompt, prompt_token_ids, params, self.tokenizer, interval)
        self.requests[request_id] = state
        return state

    def abort_request(self, request_id: str) -> bool:
        """Forget a request (its outputs from now on are ignored); whether it was unfinished here."""
        return self.requests.pop(request_id, None) is not None

    def set_num_cached_tokens(self, counts: dict[str, int]) -> None:
        """Record the prompt tokens each request found in the prefix cache (the core's word, by request id,
        from the step that prefilled it): its outputs carry them (``RequestOutput.num_cached_tokens``)."""
        for request_id, num_cached_tokens in counts.items():
            if (state := self.requests.get(request_id)) is not None:
                for choice in state.choices:
                    choice.metrics.num_cached_tokens = num_cached_tokens

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Advance each output's choice (text, stop strings); return the outputs due, and which choices to
        abort in the core. ``outputs``: one step's, or several steps' in order (a frontend behind the
        core): then a choice's outputs due are one, holding all that is new (built once, at the end)."""
        done, due = ProcessedOutputs(), {}  # choice -> (its request, finished) of the outputs due, in order
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:
                continue  # finished here already (a stop string), or aborted by the frontend
            if out.error is not None:
                del self.requests[out.request_id]
                done.failed.append((state, out.error))
                continue
            choice = state.choices[out.index]
            if choice.finished:
                continue  # tokens the core made after a stop string, before the abort reached it
            if out.new_token_ids:
                choice.append(
                    out.new_token_ids, out.new_logprobs, out.finish_reason, out.stop_reason, out.token_times
                )
            else:  # aborted in the core
                choice.finish(out.finish_reason or "abort", out.stop_reason)
            if choice.finished and out.finish_reason is None:  # a stop string: the core goes on till told
                done.to_abort.append((out.request_id, out.index))
            finished = choice.finished and state.finished
            if state.due(choice):  # (again: to the end, so that a request's finished output is its last)
                due.pop(choice, None)
                due[choice] = state, finished
            if finished:
                del self.requests[out.request_id]
        done.request_outputs = [state.output(c, finished) for c, (state, finished) in due.items()]
        return done


class RequestOutputCollector:
    """The outputs of one server request (its engine requests, one per prompt) waiting for the handler
    (vLLM's ``RequestOutputCollector``). ``put`` merges a DELTA output into the one its request already has
    waiting, so a handler that lags takes one output per request, holding everything new; a handler that
    keeps up takes each engine step's. ``fail`` ends it: ``get`` raises the error once nothing is waiting.
    Event loop only."""

    def __init__(self):
        self.waiting: dict[str, RequestOutput] = {}  # by request id, in arrival order
        self.error: BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        merged = self.waiting.get(out.request_id)
        if merged is None:
            self.waiting[out.request_id] = out
        else:
            merge_delta(merged, out)
        self.ready.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.ready.set()

    async def get(self) -> list[RequestOutput]:
        """Everything waiting, oldest request first (waits if nothing is); raises the error of ``fail``."""
        while not self.waiting:
            if self.error is not None:
                raise self.error
            self.ready.clear()
            await self.ready.wait()
        outs, self.waiting = list(self.waiting.values()), {}
        return outs


def merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    """Append DELTA output ``new`` to ``into`` (the same request): each choice's text, ids and logprobs
    concatenated, its finish taken from the newer; a choice ``into`` lacks is added."""
    by_index = {c.index: c for c in into.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            into.outputs.append(c)
            continue
        old.text += c.text
        old.token_ids = old.token_ids + c.token_ids
        if old.logprobs is not None and c.logprobs is not None:
            old.logprobs = old.logprobs + c.logprobs
        old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
    into.finished, into.metrics = new.finished, new.metrics
