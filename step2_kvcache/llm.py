"""``LLM``: generate text offline, the entry point named as in vLLM, on top of ``LLMEngine``.

``generate`` runs every prompt to its end; ``stream`` yields one completion's text as it is generated.
Every request is tokenized and validated once, by the engine, before any of them runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from numbers import Integral

from .engine import LLMEngine
from .sampling_params import SamplingParams, type_name
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
        defaults: temperature 1.0, 16 tokens). Every request is validated before any runs; a bad one
        raises ValueError naming it.
        """
        seqs = self._make_sequences(prompts, sampling_params, prompt_token_ids)
        for _ in self.engine.run(seqs):  # every request to its end
            pass
        return [seq.output() for seq in seqs]

    def stream(self, prompt: str, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one completion piece by piece, as it is generated.

        The request is validated when ``stream`` is called (ValueError), before the first token. It runs
        as the stream is read, and stops when the stream is closed (or a loop over it is left early);
        several streams of one ``LLM`` may be read in any interleaving.
        """
        (seq,) = self._make_sequences([prompt], sampling_params, None)
        return _text_deltas(seq, self.engine.run([seq]))

    def _make_sequences(self, prompts, sampling_params, prompt_token_ids) -> list[Sequence]:
        """One validated sequence per prompt (ValueError, naming the prompt, before anything runs)."""
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
            try:
                seqs.append(self.engine.make_sequence(str(next(self._request_ids)), prompt, params))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}" if len(prompts) > 1 else str(e)) from None
        return seqs


def _text_deltas(seq: Sequence, steps: Iterator[None]) -> Iterator[str]:
    """The new text of ``seq`` after every step that released some."""
    sent = 0
    for _ in steps:
        if len(seq.text) > sent:
            yield seq.text[sent:]
            sent = len(seq.text)
