"""The generation engine: the `LLM` class, the requests it tracks, and the decoding loop.

This step's loop keeps a KV cache: the prompt goes through the model once (prefill), filling the cache,
and every later forward pass takes only the newest token (decode), reading the others' keys and values
from the cache. Generating n tokens after a prompt of p tokens costs p + n token positions instead of
step 1's p + (p+1) + ... + (p+n-1); each decode step is one token's work plus attention over the cache.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from common.tokenizer import IncrementalDetokenizer, Tokenizer
from common.weights import resolve_model

from .kv_cache import KVCache
from .model import GPT
from .sampling import SamplingParams, sample

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def check_device(device: str) -> torch.device:
    """The torch device named ``device``: "cpu", "cuda" or "cuda:N". Raises ValueError for anything else,
    or for a GPU this machine does not have."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r}: not a device name (e.g. 'cpu', 'cuda', 'cuda:1')") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: the engines run on 'cpu' or 'cuda' only")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def as_token_ids(ids) -> list[int]:
    """A prompt given as token ids, as a list of ints; numpy and torch integers are accepted, bools are not.
    Raises ValueError for anything else."""
    try:
        if isinstance(ids, (str, bytes)) or any(isinstance(t, bool) for t in ids):
            raise TypeError
        return [operator.index(t) for t in ids]
    except TypeError:
        raise ValueError("prompt_token_ids: each prompt must be a list of integer token ids") from None


@dataclass
class RequestMetrics:
    """When things happened to one request, in seconds of ``time.perf_counter()``.

    ttft_s: time to first token (arrival -> first token sampled); token_times: when each output token
    was sampled; decode_latencies_s: the gaps between consecutive tokens (inter-token latency, ITL).
    """

    arrival_time: float
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None

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
class RequestOutput:
    """What a request has produced so far (or in all, once ``finish_reason`` is set).

    text: the output text (stop strings excluded); token_ids: the output token ids (a stop token
    included); delta: the text added since the previous output of this request (for streaming);
    finish_reason: None while running, "stop" (eos, a stop token or a stop string) or "length"
    (max_tokens or the context window).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics
    delta: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Sequence:
    """One request in flight: its tokens, its sampling state and its stopping rules.

    ``append`` takes each sampled token and decides whether the request is done. Stop strings are
    matched on the text, also when one spans several tokens: text that could be the beginning of a
    stop string is held back until it is known not to be one, so a stop string never reaches the
    output, not even in a stream.
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
        self.params = params
        self.max_len = min(max_model_len, len(prompt_token_ids) + params.max_tokens)  # tokens, prompt included
        self.stop_token_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else {tokenizer.eos_token_id})
        self.generator = torch.Generator(device=device)
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.text = ""  # released output text
        self.pending = ""  # decoded text held back: it may be the start of a stop string
        self.finish_reason: str | None = None
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output, the sequence the model sees."""
        return self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int) -> str:
        """Add a sampled token; return the text that can be shown now (possibly ""); maybe finish."""
        self.output_token_ids.append(token_id)
        self.metrics.token_times.append(time.perf_counter())
        if token_id in self.stop_token_ids:
            self.finish_reason = "stop"
            self.pending += self.detokenizer.flush()
        else:
            self.pending += self.detokenizer.push(token_id)
            cut = self._stop_string_index()
            if cut is not None:
                self.pending = self.pending[:cut]
                self.finish_reason = "stop"
            elif len(self) >= self.max_len:
                self.finish_reason = "length"
                self.pending += self.detokenizer.flush()
        if self.finished:
            self.metrics.finished_time = time.perf_counter()
            released, self.pending = self.pending, ""
        else:
            held = self._stop_prefix_length()
            released, self.pending = self.pending[: len(self.pending) - held], self.pending[len(self.pending) - held :]
        self.text += released
        return released

    def _stop_string_index(self) -> int | None:
        """Where the earliest stop string starts in the held-back text, or None."""
        hits = [i for s in self.params.stop if (i := self.pending.find(s)) >= 0]
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

    def output(self, delta: str = "") -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            text=self.text,
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,
            metrics=self.metrics,
            delta=delta,
        )


class LLM:
    """Generate text with a GPT-2 model: the offline entry point, named as in vLLM.

    model: "demo" (bundled), a Hub id or alias ("gpt2", "gpt2-medium", ...), or a local snapshot
    folder (see ``common.weights.resolve_model``). device: a torch device string. dtype: "float32",
    "float16" or "bfloat16".

    Raises ValueError on a bad model, device or dtype; ConnectionError if a Hub model cannot be fetched.
    """

    def __init__(self, model: str = "demo", device: str = "cpu", dtype: str = "float32"):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: must be one of {sorted(DTYPES)}")
        self.device = check_device(device)
        folder = resolve_model(model)
        self.tokenizer = Tokenizer(folder)
        self.dtype = DTYPES[dtype]
        self.model = GPT.from_pretrained(str(folder), device=self.device, dtype=self.dtype)
        self.config = self.model.config
        self._request_ids = itertools.count()

    def generate(
        self,
        prompts: str | list[str] | None = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        prompt_token_ids: list[list[int]] | None = None,
    ) -> list[RequestOutput]:
        """Generate a completion for every prompt (text, or token ids); outputs in input order.

        sampling_params: one for all prompts, or one per prompt; default ``SamplingParams()``.
        Every request is validated before any compute; a bad one raises ValueError.
        """
        sequences = self._make_sequences(prompts, sampling_params, prompt_token_ids)
        for seq in sequences:
            for _ in self._decode(seq):
                pass
        return [seq.output() for seq in sequences]

    def stream(self, prompt: str, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one completion piece by piece, as it is generated.

        The request is validated when ``stream`` is called (ValueError), before the first token.
        """
        return (out.delta for out in self.stream_outputs(prompt, sampling_params) if out.delta)

    def stream_outputs(self, prompt: str, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Like ``stream``, but yield a ``RequestOutput`` after every token (with ``delta``, metrics)."""
        (seq,) = self._make_sequences(prompt, sampling_params, None)
        return (seq.output(delta) for delta in self._decode(seq))

    def _make_sequences(self, prompts, sampling_params, prompt_token_ids) -> list[Sequence]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass either prompts or prompt_token_ids")
        if prompts is not None:
            prompts = [prompts] if isinstance(prompts, str) else list(prompts)
            if not all(isinstance(p, str) for p in prompts):
                raise ValueError("prompts: must be strings (use prompt_token_ids= for token ids)")
            token_lists = [self.tokenizer.encode(p) for p in prompts]
        else:
            if prompt_token_ids and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_token_ids):
                prompt_token_ids = [prompt_token_ids]  # one prompt given as a flat list
            token_lists = [as_token_ids(ids) for ids in prompt_token_ids]
            prompts = [None] * len(token_lists)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(token_lists)
        if not isinstance(sampling_params, (list, tuple)):
            raise ValueError(f"sampling_params: expected SamplingParams or a list of them, got {type(sampling_params).__name__}")
        if len(sampling_params) != len(token_lists):
            raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(token_lists)} prompts")
        for ids, params in zip(token_lists, sampling_params):
            self._check_request(ids, params)
        return [
            Sequence(str(next(self._request_ids)), prompt, ids, params, self.tokenizer, self.config.n_positions, self.device)
            for prompt, ids, params in zip(prompts, token_lists, sampling_params)
        ]

    def _check_request(self, ids: list[int], params: SamplingParams) -> None:
        vocab, window = self.config.vocab_size, self.config.n_positions
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        if len(ids) == 0:
            raise ValueError("prompt: is empty; give at least one token")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids: every id must be an integer in [0, {vocab})")
        if len(ids) >= window:
            raise ValueError(
                f"prompt: {len(ids)} tokens leaves no room to generate in the context window of {window} "
                f"tokens (at most {window - 1} prompt tokens)"
            )
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids: every id must be < vocab_size={vocab}")

    @torch.inference_mode()
    def _decode(self, seq: Sequence) -> Iterator[str]:
        """The decoding loop: prefill the prompt into a KV cache, then feed one new token at a time."""
        kv_cache = KVCache(self.config, seq.max_len, self.device, self.dtype)  # sized for prompt + max_tokens
        input_ids = torch.tensor([seq.token_ids], device=self.device)  # [1, T]: the prompt (prefill)
        while not seq.finished:
            logits = self.model(input_ids, kv_cache, last_only=True)[0, -1]  # [V], the scores of the token after the last one
            token_id = sample(logits, seq.params, seq.generator, seq.token_ids)
            yield seq.append(token_id)
            input_ids = torch.tensor([[token_id]], device=self.device)  # [1, 1]: only the new token (decode)
