"""Speculative decoding's configuration and its proposer: cheap guesses of a sequence's next k tokens.

``SpeculativeConfig`` is ``EngineArgs.speculative_config`` checked (vLLM's field names). ``NgramProposer``
is prompt lookup (apoorvumang/prompt-lookup-decoding; vLLM's ``ngram_proposer.py``): find the most recent
earlier occurrence of the sequence's last n tokens, n from ``prompt_lookup_max`` down to
``prompt_lookup_min``, and propose the k tokens that followed it, always k (periodic past the end; no match:
the last token again), so that a step is a uniform verification (model_runner.py). Each sequence's ids are
searched as a string, one character per id (``str.rfind``: C speed, a few microseconds a sequence). The
target checks every guess (rejection_sampler.py): a wrong one costs compute, not output.
"""

from __future__ import annotations

import array
import json
import sys
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


class NgramProposer:
    """Prompt lookup over each sequence's own ids (prompt and output), one sequence at a time.
    ``propose(ids, k)``: one sequence's k proposed ids (k >= 1)."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose_all(self, seqs: list, ks: list[int]) -> None:
        """Set each sequence's ``spec_token_ids``: ``propose`` of its ids with its k."""
        for seq, k in zip(seqs, ks):
            seq.spec_token_ids = self.propose(seq.token_ids, k)

    def rollback(self, seq_id: str, num_tokens: int) -> None:
        """Nothing to roll back: prompt lookup keeps no state (draft_model.py's keeps keys)."""

    def release(self, seq_id: str) -> None:
        """Nothing to give back: prompt lookup keeps no state."""

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """k ids: those that followed the most recent earlier occurrence of the last n ids, for the largest
        n in [min_n, max_n] that has one; [] if k < 1. token_ids: [L] the sequence so far (L >= 1, each
        id < 0x110000).

        Always k, so that every lane of a step verifies 1 + k tokens and the step replays a CUDA graph (a
        uniform verification, model_runner.py): a match whose continuation reaches the end of the ids
        after d < k tokens goes on periodically with period d (what repeated once is guessed to repeat
        again: ids[L + j] = ids[L + j - d]); no match at all proposes the last id k times. These are guesses
        like any other: the verification keeps the output exact whatever the drafts are. The ids are one
        string, character i = chr(ids[i]) (``as_text``), searched backwards for its last n characters by
        ``str.rfind``: no array per step, no Python loop over the ids (a few microseconds a sequence).
        """
        L = len(token_ids)
        if k < 1:
            return []
        text = as_text(token_ids)  # [L]
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            at = text.rfind(text[L - n :], 0, L - 1)  # the latest window before the suffix, or -1
            if at >= 0:
                start = at + n  # what followed it, d = L - start ids of it
                return [token_ids[start + j % (L - start)] for j in range(k)]  # [k], periodic past the end
        return [token_ids[-1]] * k


UTF32 = "utf-32-le" if sys.byteorder == "little" else "utf-32-be"  # the byte order of array's 4-byte ints


def as_text(ids: list[int]) -> str:
    """ids [L] (each < 0x110000) as a string of L characters, character i = chr(ids[i]): ``"".join(map(chr,
    ids))``, built in C (4 bytes an id, decoded as UTF-32; lone surrogates are ids like any other).
    Raises OverflowError on a negative id."""
    return array.array("I", ids).tobytes().decode(UTF32, "surrogatepass")
