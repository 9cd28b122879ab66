"""``LLM``: generate text offline, the entry point named as in vLLM, on top of ``LLMEngine``.

``generate`` queues every prompt and steps the engine until all have finished; ``stream`` yields one
completion's text as it is generated. Every request is tokenized and validated once, by the engine,
before any of them is queued.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections import deque
from collections.abc import Iterator
from numbers import Integral

from .engine import LLMEngine
from .sampling_params import RequestOutputKind, SamplingParams, type_name
from .sequence import RequestOutput, Sequence


class LLM:
    """Generate text with a GPT-2 model.

    The arguments are ``LLMEngine``'s, those of ``EngineArgs`` (config.py), by name or in its order:
    ``LLM("gpt2")``, ``LLM(model="demo", device="cuda", dtype="float16", max_num_seqs=16)``; or one
    ``EngineArgs`` already made. model: "demo" (bundled), a Hub id or alias ("gpt2", "gpt2-medium", ...),
    or a local snapshot folder (see ``common.weights.resolve_model``).

    Raises ValueError on a bad model, device, dtype or engine argument; ConnectionError if a Hub model
    cannot be fetched.
    """

    def __init__(self, *engine_args, **kwargs):
        self.engine = LLMEngine(*engine_args, **kwargs)
        self.tokenizer = self.engine.tokenizer
        self.model = self.engine.model
        self.config = self.engine.config
        self._request_ids = itertools.count()
        self._outputs: dict[str, deque[RequestOutput]] = {}  # outputs not yet read, per request of this LLM

    def get_tokenizer(self):
        """The tokenizer (``common.tokenizer.Tokenizer``): encode(text) -> ids, decode(ids) -> text."""
        return self.tokenizer

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
        seqs = self._make_sequences(prompts, sampling_params, prompt_token_ids, RequestOutputKind.FINAL_ONLY)
        outputs = []
        try:
            for seq in seqs:
                self._add(seq)
            for seq in seqs:
                last = None
                for last in self._follow(seq.request_id):  # steps the engine: every request advances together
                    pass
                outputs.append(last)
        finally:
            for seq in seqs:
                self._stop(seq.request_id)
        return outputs

    def stream(self, prompt: str, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one completion piece by piece, as it is generated.

        The request is validated when ``stream`` is called (ValueError), before the first token.
        Closing the stream (or leaving a loop over it early) aborts the request.
        """
        return _text_deltas(self.stream_outputs(prompt, sampling_params))

    def stream_outputs(
        self, prompt: str, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Like ``stream``, but yield a ``RequestOutput`` after every token, carrying what is new (DELTA).

        The request enters the engine when the first output is asked for, and leaves it when the stream
        ends or is closed. Several streams of one ``LLM`` may be read in any interleaving.
        """
        (seq,) = self._make_sequences([prompt], sampling_params, None, RequestOutputKind.DELTA)
        return self._stream(seq)

    def _stream(self, seq: Sequence) -> Iterator[RequestOutput]:
        self._add(seq)
        try:
            yield from self._follow(seq.request_id)
        finally:
            self._stop(seq.request_id)

    def _follow(self, request_id: str) -> Iterator[RequestOutput]:
        """The outputs of one request, in order, up to its final one; steps the engine whenever none is
        waiting. Each step's outputs go to their own request's queue: readers of other requests lose none."""
        queue = self._outputs[request_id]
        while True:
            while not queue:
                if request_id not in self.engine.requests and not self.engine.aborted:
                    return  # aborted, and its last output taken, by a caller of the engine itself
                for out in self.engine.step():
                    if out.request_id in self._outputs:
                        self._outputs[out.request_id].append(out)
            out = queue.popleft()
            yield out
            if out.finished:
                return

    def _add(self, seq: Sequence) -> None:
        self._outputs[seq.request_id] = deque()
        self.engine.add_sequence(seq)

    def _stop(self, request_id: str) -> None:
        self.engine.abort_request(request_id)  # nothing happens if it has finished
        # its final output ("abort") was for this call, which reads no more: not due to anyone
        self.engine.aborted = [out for out in self.engine.aborted if out.request_id != request_id]
        self._outputs.pop(request_id, None)

    def _make_sequences(self, prompts, sampling_params, prompt_token_ids, output_kind) -> list[Sequence]:
        """One validated sequence per prompt (ValueError, naming the prompt, before anything is queued)."""
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
        seqs = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            params = dataclasses.replace(params, output_kind=output_kind)
            try:
                seqs.append(self.engine.make_sequence(str(next(self._request_ids)), prompt, params))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}" if len(prompts) > 1 else str(e)) from None
        return seqs


def _text_deltas(outputs: Iterator[RequestOutput]) -> Iterator[str]:
    with contextlib.closing(
        outputs
    ):  # closing this stream closes the request's own at once, not at garbage collection
        for out in outputs:
            if out.outputs[0].text:
                yield out.outputs[0].text
