"""The n-gram proposer: prompt lookup over each sequence's own ids (vLLM's ``ngram_proposer.py``).

Prompt lookup (apoorvumang/prompt-lookup-decoding): find the most recent earlier occurrence of the
sequence's last n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, and propose the k
tokens that followed it, always k (periodic past the end; no match: the last token again), so that a step
is a uniform verification (model_runner.py). Each sequence's ids are searched as a string, one character
per id (``str.rfind``: C speed, a few microseconds a sequence). The target checks every guess
(rejection_sampler.py): a wrong one costs compute, not output.
"""

from __future__ import annotations

import array
import sys

from .spec_decode import SpeculativeConfig


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
