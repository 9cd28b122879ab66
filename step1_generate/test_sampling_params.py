"""SamplingParams' validation and defaults (vLLM's), kept in step 1 only: ``sampling_params.py`` is the
same file in every step (tests/test_layout.py checks it) but for step 4's ``output_kind``, tested there."""

from __future__ import annotations

import math

import pytest

from .sampling_params import SamplingParams


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_tokens", 0, "max_tokens"),
        ("max_tokens", 2.5, "max_tokens"),
        ("max_tokens", True, "max_tokens"),
        ("temperature", -0.1, "temperature"),
        ("temperature", float("nan"), r"temperature.*finite"),
        ("temperature", float("inf"), r"temperature.*finite"),
        ("temperature", True, "temperature"),
        ("top_k", -2, r"top_k.*-1"),
        ("top_k", 1.5, "top_k"),
        ("top_k", False, "top_k"),
        ("top_p", 0.0, r"top_p.*\(0, 1\]"),
        ("top_p", 1.5, "top_p"),
        ("top_p", float("nan"), "top_p"),
        ("min_p", -0.1, r"min_p.*\[0, 1\]"),
        ("min_p", 1.1, "min_p"),
        ("min_p", float("nan"), "min_p"),
        ("repetition_penalty", 0.0, "repetition_penalty"),
        ("repetition_penalty", float("inf"), r"repetition_penalty.*finite"),
        ("presence_penalty", 2.5, r"presence_penalty.*\[-2, 2\]"),
        ("presence_penalty", -2.5, "presence_penalty"),
        ("presence_penalty", float("nan"), "presence_penalty"),
        ("frequency_penalty", 2.5, r"frequency_penalty.*\[-2, 2\]"),
        ("frequency_penalty", -math.inf, "frequency_penalty"),
        ("frequency_penalty", True, "frequency_penalty"),
        ("logprobs", 6, r"logprobs.*\[0, 5\]"),
        ("logprobs", -1, "logprobs"),
        ("logprobs", 2.0, "logprobs"),
        ("logprobs", True, "logprobs"),
        ("stop", [""], "stop"),
        ("stop", 5, "stop"),
        ("stop_token_ids", [-1], "stop_token_ids"),
        ("stop_token_ids", [True], "stop_token_ids"),
        ("ignore_eos", 1, "ignore_eos"),
        ("seed", "x", "seed"),
        ("seed", 2**64, "seed"),
        ("seed", -(2**63) - 1, "seed"),
        ("seed", 1.0, "seed"),
    ],
)
def test_bad_sampling_params_raise(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_defaults_and_edge_values_are_vllms():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p) == (16, 1.0, 0, 1.0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.logprobs) == (
        1.0,
        0.0,
        0.0,
        None,
    )
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.seed) == ([], [], False, None)
    assert (
        SamplingParams(stop="x").stop == ["x"]
        and SamplingParams(stop=None, stop_token_ids=None).stop_token_ids == []
    )
    for ok in [dict(top_k=-1), dict(presence_penalty=-2, frequency_penalty=2), dict(logprobs=0),
               dict(logprobs=5), dict(seed=2**64 - 1), dict(seed=-(2**63)), dict(temperature=0),
               dict(min_p=1)]:  # fmt: skip
        SamplingParams(**ok)
