"""``LLM``: generate text offline, the entry point named as in vLLM, on top of the engine core.

``generate`` queues every prompt and steps the engine until all have finished; ``stream`` yields one
completion's text as it is generated. Every request is tokenized and validated by the frontend
(processor.py) before any of them is queued. The engine core (engine_core.py) runs in this process
(``multiprocessing=False``: ``InprocClient``) or in a child process (True: ``SyncMPClient``), which runs
the next step while this process turns the last one's ids into text (output_processor.py); the outputs
are the same either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections import deque
from collections.abc import Iterator
from numbers import Integral

from common.tokenizer import Tokenizer

from .config import EngineArgs
from .core_client import InprocClient, SyncMPClient
from .messages import EngineCoreRequest, SchedulerStats, merge_stats
from .output_processor import OutputProcessor
from .outputs import RequestOutput
from .processor import Processor
from .sampling_params import RequestOutputKind, SamplingParams, type_name


class LLM:
    """Generate text with a GPT-2 model.

    The arguments are ``LLMEngine``'s, those of ``EngineArgs`` (config.py), by name or in its order:
    ``LLM("gpt2")``, ``LLM(model="demo", device="cuda", dtype="float16", max_num_seqs=16)``; or one
    ``EngineArgs`` already made. model: "demo" (bundled), a Hub id or alias ("gpt2", "gpt2-medium", ...),
    or a local snapshot folder (see ``common.weights.resolve_model``). multiprocessing: the engine core in
    a child process (True) or in this one (False; default: see ``EngineArgs``). In process, ``engine`` is
    the ``LLMEngine`` (None otherwise); ``stats``: the scheduler's figures (see ``stats``).

    Raises ValueError on a bad model, device, dtype or engine argument; ConnectionError if a Hub model
    cannot be fetched; RuntimeError if the engine core process dies while starting. A core process that
    dies later makes the call waiting on it raise ``EngineDeadError``.
    """

    def __init__(self, *engine_args, **kwargs):
        args = EngineArgs.make(*engine_args, **kwargs)
        self.engine_core = SyncMPClient(args) if args.multiprocessing else InprocClient(args)
        self.engine = None if args.multiprocessing else self.engine_core.core.engine
        self.tokenizer = Tokenizer(args.folder) if args.multiprocessing else self.engine.tokenizer
        self.model = None if args.multiprocessing else self.engine.model
        self.config = args.hf_config
        self.processor = Processor.for_core(self.tokenizer, self.engine_core.config)
        self.output_processor = OutputProcessor(self.tokenizer)
        cores = args.data_parallel_size
        self._stats: list[SchedulerStats] = [c.stats for c in self.engine_core.configs]  # by core: the pool
        self._num_aborts_sent = [0] * cores  # by core, aborts sent to it; of them, those it had taken at
        self._num_aborts_applied = [0] * cores  # its _stats
        self._request_ids = itertools.count()
        self._outputs: dict[str, deque[RequestOutput]] = {}  # outputs not yet read, per request of this LLM

    def get_tokenizer(self):
        """The tokenizer (``common.tokenizer.Tokenizer``): encode(text) -> ids, decode(ids) -> text."""
        return self.tokenizer

    @property
    def stats(self) -> SchedulerStats:
        """The scheduler's figures after the last step read (before any: the pool), once the core has
        applied every abort sent (a stop string's, a stream closed early): reading waits for that, one step
        in process, the core's next messages in a child, so that no request ended here shows as running.
        Other requests' outputs read meanwhile wait in their queues."""
        while self.engine_core.alive and any(
            applied < sent for applied, sent in zip(self._num_aborts_applied, self._num_aborts_sent)
        ):
            self._step()
        return merge_stats(self._stats)

    def generate(
        self,
        prompts: str | list[str] | None = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        prompt_token_ids: list[int] | list[list[int]] | None = None,
    ) -> list[RequestOutput]:
        """Generate a completion for every prompt (texts, or token ids); one finished output per prompt, in
        input order.

        sampling_params: one for all prompts, or one per prompt; default ``SamplingParams()`` (vLLM's
        defaults: temperature 1.0, 16 tokens). Every request is validated before any is queued; a bad
        one raises ValueError naming it. If anything interrupts the loop, this call's unfinished requests
        are aborted, so that none is left behind.
        """
        requests = self._make_requests(
            prompts, sampling_params, prompt_token_ids, RequestOutputKind.FINAL_ONLY
        )
        outputs = []
        try:
            for text, request in requests:
                self._add(text, request)
            for _, request in requests:
                last = None
                for last in self._follow(request.request_id):  # steps the engine: every request advances
                    pass
                outputs.append(last)
        finally:
            for _, request in requests:
                self._stop(request.request_id)
        return outputs

    def stream(self, prompt: str, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one completion piece by piece, as it is generated.

        The request is validated when ``stream`` is called (ValueError), before the first token; one of
        n > 1 choices is refused (their texts would interleave: ``stream_outputs`` tells them apart).
        Closing the stream (or leaving a loop over it early) aborts the request.
        """
        if sampling_params is not None and sampling_params.n > 1:
            raise ValueError(
                f"n={sampling_params.n}: stream yields one completion's text; use stream_outputs"
            )
        return _text_deltas(self.stream_outputs(prompt, sampling_params))

    def stream_outputs(
        self, prompt: str, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Like ``stream``, but yield a ``RequestOutput`` after every token, carrying what is new (DELTA).

        The request enters the engine when the first output is asked for, and leaves it when the stream
        ends or is closed. Several streams of one ``LLM`` may be read in any interleaving.
        """
        ((text, request),) = self._make_requests([prompt], sampling_params, None, RequestOutputKind.DELTA)
        return self._stream(text, request)

    def _stream(self, text: str | None, request: EngineCoreRequest) -> Iterator[RequestOutput]:
        self._add(text, request)
        try:
            yield from self._follow(request.request_id)
        finally:
            self._stop(request.request_id)

    def _follow(self, request_id: str) -> Iterator[RequestOutput]:
        """The outputs of one request, in order, up to its final one; steps the engine whenever none is
        waiting. Each step's outputs go to their own request's queue: readers of other requests lose none."""
        queue = self._outputs[request_id]
        while True:
            while not queue:
                if request_id not in self.output_processor.requests:
                    return  # aborted, and its last output taken
                self._step()
            out = queue.popleft()
            if isinstance(out, Exception):  # the engine core refused it
                raise out
            yield out
            if out.finished:
                return

    def _step(self) -> None:
        """The next engine step's outputs (in process: the step itself), into their requests' queues; the
        choices a stop string ended are aborted in the core."""
        core_outputs = self.engine_core.get_output()
        engine = core_outputs.engine_index
        self._stats[engine] = core_outputs.stats
        self._num_aborts_applied[engine] = core_outputs.num_aborts_received
        self.output_processor.set_num_cached_tokens(core_outputs.num_cached_tokens)
        done = self.output_processor.process_outputs(core_outputs.outputs)
        for request_id, index in done.to_abort:
            self._abort(request_id, index)
        for out in done.request_outputs:
            if out.request_id in self._outputs:
                self._outputs[out.request_id].append(out)
        for state, error in done.failed:
            if state.request_id in self._outputs:
                self._outputs[state.request_id].append(RuntimeError(f"the engine core refused it: {error}"))

    def _add(self, text: str | None, request: EngineCoreRequest) -> None:
        self._outputs[request.request_id] = deque()
        self.output_processor.add_request(
            request.request_id, text, request.prompt_token_ids, request.sampling_params
        )
        self.engine_core.add_request(request)

    def _stop(self, request_id: str) -> None:
        if self.output_processor.abort_request(request_id) and self.engine_core.alive:  # unfinished
            self._abort(request_id)
        self._outputs.pop(request_id, None)

    def _abort(self, request_id: str, index: int | None = None) -> None:
        engine = self.engine_core.abort_request(request_id, index)
        if engine is not None:
            self._num_aborts_sent[engine] += 1

    def _make_requests(self, prompts, sampling_params, prompt_token_ids, output_kind) -> list:
        """One validated (prompt text or None, ``EngineCoreRequest``) per prompt (ValueError, naming the
        prompt, before anything is queued)."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass either prompts or prompt_token_ids")
        if prompts is not None:
            prompts = [prompts] if isinstance(prompts, str) else list(prompts)
            if not all(isinstance(p, str) for p in prompts):
                raise ValueError("prompts: must be strings (use prompt_token_ids= for token ids)")
        else:
            # one prompt or several: [T] or [B, T] ids, as lists, a numpy array or a torch tensor
            ids = prompt_token_ids.tolist() if hasattr(prompt_token_ids, "tolist") else prompt_token_ids
            if not isinstance(ids, (list, tuple)) or any(isinstance(p, str) for p in ids):
                raise ValueError("prompt_token_ids: must be a list of token ids, or a list of such lists")
            if len(ids) == 0:  # no prompt, or one empty prompt: refused either way, as an empty text is
                raise ValueError("prompt_token_ids is empty; give at least one token")
            flat = ids and all(isinstance(t, Integral) and not isinstance(t, bool) for t in ids)
            prompts = [ids] if flat else list(ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)) or not all(
            isinstance(p, SamplingParams) for p in sampling_params
        ):
            given = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params]
            wrong = next(p for p in given if not isinstance(p, SamplingParams))
            raise ValueError(
                f"sampling_params: expected SamplingParams or a list of them, got {type_name(wrong)}"
            )
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts")
        requests = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            params = dataclasses.replace(params, output_kind=output_kind)
            try:
                text, ids, params = self.processor.process(prompt, params)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}" if len(prompts) > 1 else str(e)) from None
            requests.append((text, EngineCoreRequest(str(next(self._request_ids)), ids, params)))
        return requests


def _text_deltas(outputs: Iterator[RequestOutput]) -> Iterator[str]:
    with contextlib.closing(
        outputs
    ):  # closing this stream closes the request's own at once, not at garbage collection
        for out in outputs:
            if out.outputs[0].text:
                yield out.outputs[0].text
