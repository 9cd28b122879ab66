"""Speculative decoding's configuration, the draft model's check and the counters (vLLM's names).

``SpeculativeConfig`` is ``EngineArgs.speculative_config`` checked (vLLM's field names); ``check_draft``
refuses a draft model whose tokenizer or window does not fit the target; ``SpecDecodingStats`` counts the
drafts verified and accepted. The proposers make cheap guesses of a sequence's next k tokens: prompt lookup
(ngram_proposer.py) or a smaller model (draft_model.py). The target checks every guess
(rejection_sampler.py): a wrong one costs compute, not output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from common.weights import GPT2Config, load_config, resolve_model

METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """What to speculate with (vLLM's names). method: "ngram" (prompt lookup) or "draft_model", required
    unless a model is given, which makes it "draft_model" (vLLM infers the method from the model);
    num_speculative_tokens: k, the guesses verified per step; prompt_lookup_min / prompt_lookup_max: the
    n-gram lengths tried, longest first ("ngram" only); model: the draft model ("draft_model" only);
    disable_by_batch_size: no speculation while the batch, the running and waiting requests up to
    max_num_seqs, is at least this (None: always; 128 by default, measured: the README's numbers).
    Sampled tokens keep the target's distribution, but a seeded request's tokens depend on which of its
    steps verified drafts, which the batch can decide (this limit; drafts cut by the token budget or the
    free blocks): the same seed gives the same tokens for the same requests, not under any load."""

    method: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    model: str | None = None
    disable_by_batch_size: int | None = 128

    @classmethod
    def make(cls, value: dict | str | None) -> SpeculativeConfig | None:
        """The checked config of ``value`` (a dict, its JSON text, or None: off). Raises ValueError
        naming the field: "speculative_config.<field>=<value>: must be ...", or "speculative_config.method:
        required ..." when neither a method nor a model is given (``{}``: vLLM refuses it too)."""
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config={value!r}: not JSON ({e})") from None
            if value is None:  # JSON's null: off
                return None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config={value!r}: must be a dict, its JSON text, or None")
        known = {f.name for f in fields(cls)}
        for name in value:
            if name not in known:
                raise ValueError(f"speculative_config.{name}: unknown field (known: {sorted(known)})")
        config = cls(**value)
        if config.method is None and config.model is not None:  # a draft model names the method
            config.method = "draft_model"
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if name in value and config.method == "draft_model":
                raise ValueError(f"speculative_config.{name}: for method 'ngram' only (not a draft's)")
        config.check()
        return config

    def check(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"speculative_config.{name}={getattr(self, name)!r}: must be {allowed}")

        count = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1  # noqa: E731
        if self.method is None:
            raise ValueError(
                f"speculative_config.method: required (one of {list(METHODS)}; or a draft model in "
                "speculative_config.model)"
            )
        if self.method not in METHODS:
            raise bad("method", f"one of {list(METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            if not count(getattr(self, name)):
                raise bad(name, "an integer >= 1")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise bad("prompt_lookup_max", f">= prompt_lookup_min ({self.prompt_lookup_min})")
        if self.disable_by_batch_size is not None and not count(self.disable_by_batch_size):
            raise bad("disable_by_batch_size", "an integer >= 1, or None")
        if self.method == "draft_model" and not isinstance(self.model, str):
            raise bad(
                "model", "the draft model (a Hub id or a local snapshot folder) for method 'draft_model'"
            )
        if self.method == "ngram" and self.model is not None:
            raise bad("model", "None for method 'ngram' (it has no draft model)")


def check_draft(model: str, target_folder, target: GPT2Config):
    """The snapshot folder of a draft model for the target in ``target_folder`` (config ``target``).
    Raises ValueError if its vocabulary or tokenizer (vocab.json, merges.txt) differs from the target's,
    since the target judges the draft's token ids as its own, or if its window is shorter, or if it is
    no GPT-2 snapshot (each message naming speculative_config.model); ConnectionError if a Hub draft cannot
    be fetched."""
    try:
        folder = resolve_model(model)
        draft = load_config(folder)
    except (ValueError, ConnectionError) as e:
        raise type(e)(f"speculative_config.model={model!r}: {e}") from None
    vocab_size, target_vocab_size = draft.vocab_size, target.vocab_size
    if vocab_size != target_vocab_size:
        raise ValueError(
            f"speculative_config.model={model!r}: its vocabulary has {vocab_size} tokens, the target's "
            f"{target_vocab_size}: a draft must share the target's tokenizer"
        )
    for name in ("vocab.json", "merges.txt"):
        if _tokenizer_file(folder / name) != _tokenizer_file(target_folder / name):
            raise ValueError(
                f"speculative_config.model={model!r}: its {name} differs from the target's: a draft must "
                "share the target's tokenizer"
            )
    if draft.n_positions < target.n_positions:
        raise ValueError(
            f"speculative_config.model={model!r}: its window ({draft.n_positions} tokens) is shorter than "
            f"the target's ({target.n_positions})"
        )
    return folder


def _tokenizer_file(path) -> object:
    """What a tokenizer file says: vocab.json's mapping, merges.txt's merges (line endings, trailing spaces
    and its "#version" line aside), so that the same tokenizer saved otherwise compares equal."""
    text = path.read_text(encoding="utf-8")
    if path.name == "vocab.json":
        return json.loads(text)
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#version")]


@dataclass
class SpecDecodingStats:
    """Verifications since the start (vLLM's ``SpecDecodingStats``): lanes verified (drafts), tokens
    proposed, of them accepted, accepted by position (index i: verifications whose draft i + 1 was
    accepted), and steps whose verification ran eagerly (not in a CUDA graph)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_eager_verify_steps: int = 0

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One lane's verification: k proposed, a (0..k) accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1
