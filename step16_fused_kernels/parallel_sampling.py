"""Parallel sampling: ``SamplingParams.n`` > 1 choices of one prompt (vLLM's ``ParentRequest``).

A request of n choices is n sequences under one ``ParentRequest``. Choice 0, under the request's own id,
carries the others (``Sequence.forks``, ids f"{i}_{request_id}" as vLLM's child requests) until the
scheduler admits it with room for all n; the block manager then forks them off its blocks (``fork``), so
the prompt is prefilled once. Choice i samples with its own generator, seeded seed + i, and finishes on
its own; the frontend gathers the choices' outputs (output_processor.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .sampling_params import SamplingParams


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of choice ``index`` of a request: one choice, seeded with seed + index (wrapping, as
    the generator's seed does), as vLLM's parallel sampling and the server before it did."""
    seed = None if params.seed is None else (params.seed + index) % 2**64
    return dataclasses.replace(params, n=1, seed=seed)


class ParentRequest:
    """A request of n > 1 choices (vLLM's ``ParentRequest``): its id, and its n sequences in ``choices``
    (choice 0 first). ``make_choice(request_id, params)`` makes the sequence of each other choice, which
    waits inside choice 0 (``first.forks``) until admitted; each choice gets its ``index`` and ``parent``."""

    def __init__(self, first, make_choice: Callable):
        self.request_id = first.request_id
        others = [
            make_choice(f"{i}_{first.request_id}", choice_params(first.params, i))
            for i in range(1, first.params.n)
        ]
        self.choices = [first, *others]
        for i, choice in enumerate(self.choices):
            choice.index, choice.parent = i, self
        first.forks = others

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.choices)
