"""A request in flight in the engine core (``Sequence``), with vLLM's names.

A ``Sequence`` holds one request's token ids, its sampling parameters, its random generator and its
stopping rules. ``append`` takes each sampled token and decides whether the request is done: an
end-of-sequence or stop token, ``max_tokens``, the context window. ``output`` says what is new since the
last output, as token ids (``EngineCoreOutput``; a request that wants only its final output, once): the
engine core makes no text. Text, stop strings and ``RequestOutput`` (outputs.py) are the frontend's
(output_processor.py), in the other process; a stop string the frontend finds aborts the request here. A
request of ``SamplingParams.n`` > 1 choices is n sequences under one ``ParentRequest`` (parallel_sampling.py).
"""

from __future__ import annotations

import time

import torch

from common.tokenizer import Tokenizer

from .messages import EngineCoreOutput
from .outputs import RequestMetrics
from .parallel_sampling import ParentRequest
from .sampling_params import Logprob, RequestOutputKind, SamplingParams


class Sequence:
    """One request in flight: its tokens, its sampling state and its stopping rules.

    max_model_len: the most tokens (prompt + output) the request may reach: the context window, or
    less if the KV cache is smaller. generator: the request's own ``torch.Generator`` on ``device`` if
    it has a seed (so its draws do not depend on other requests), else None. num_computed_tokens: at its
    admission, its leading tokens found in the prefix cache (a forked choice: all), after which its prefill
    computes; block_hashes: the chained hashes of its full blocks, as far as hashed (block_manager.py).
    index, parent, forks: its choice of a request of n > 1 (parallel_sampling.py), that ``ParentRequest``,
    and (choice 0, until admitted) the other choices. spec_token_ids: the drafts proposed for its next step
    (speculative decoding), never part of ``token_ids``: only the accepted ones are appended; spec_probs:
    the draft model's law of each ([k, V], sampled requests), else None.
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
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(params.seed % 2**64)
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())
        self.num_sent_tokens = 0  # what earlier outputs carried
        self.num_computed_tokens = 0
        self.block_hashes: list[int] = []
        self.index, self.parent, self.forks = 0, None, []
        self.spec_token_ids: list[int] = []
        self.spec_probs: torch.Tensor | None = None
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
        """Add a sampled token (and its logprobs, if asked for); maybe finish."""
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        if self.logprobs is not None:
            self.logprobs.append(logprobs)
        self.metrics.token_times.append(time.perf_counter())
        if token_id in self.params.stop_token_ids:
            self.finish("stop", stop_reason=token_id)
        elif token_id == self.eos_token_id:
            self.finish("stop")
        elif len(self) >= self.max_len:
            self.finish("length")

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        """End the request: reason "stop", "length" or "abort"."""
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.metrics.finished_time = time.perf_counter()

    def output(self) -> EngineCoreOutput | None:
        """What is new since the last output: token ids, their logprobs, the finish reason; under the
        request's id and the choice's index (the frontend gathers a request's n choices). A request that
        wants only its final output (FINAL_ONLY: ``LLM.generate``) and has no stop string for the frontend
        to look for needs nothing before it finishes, as in step 9: None until then, and then every token
        at once, with the times they were made (``token_times``)."""
        final_only = self.params.output_kind is RequestOutputKind.FINAL_ONLY
        if final_only and not self.params.stop and not self.finished:
            return None
        sent, self.num_sent_tokens = self.num_sent_tokens, len(self.output_token_ids)
        return EngineCoreOutput(
            request_id=(self.parent or self).request_id,
            index=self.index,
            new_token_ids=self.output_token_ids[sent:],
            new_logprobs=None if self.logprobs is None else self.logprobs[sent:],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            token_times=self.metrics.token_times[sent:] if final_only else None,
        )
