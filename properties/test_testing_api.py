"""k3verify.testing, the API for users' own test suites, and its pytest plugin: a correct kernel
passes, a kernel 1 % off fails with a message that gives the rule, err, limit, margin, the worst
element and the mismatch fraction, and every named output is judged (a correct ``o`` with a
wrong ``final_state`` fails). Rules: the baseline rule (fp32, bf16) as ``k3verify run`` applies
it; the messages are checked structurally."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from hypothesis import given, settings

from k3verify import kda
from k3verify.testing import assert_matches_oracle, strategy


def test_a_correct_kernel_passes_through_the_plugin_fixture(k3verify_oracle) -> None:
    rows = k3verify_oracle.assert_matches(kda.chunkwise, module="kda", dtype=torch.bfloat16, baseline="chunkwise")
    assert [r["status"] for r in rows] == ["pass"]
    assert set(rows[0]["outputs"]) == {"o", "final_state"}


def _scaled(q, k, v, g, beta, *, o_gain: float = 1.0, state_gain: float = 1.0, **kw):
    o, S = kda.chunkwise(q, k, v, g, beta, **kw)
    return o * o_gain, S * state_gain


def test_a_kernel_one_percent_off_fails_with_a_readable_message() -> None:
    with pytest.raises(AssertionError) as info:
        assert_matches_oracle(partial(_scaled, o_gain=1.01), "kda", torch.float32, baseline="chunkwise")
    message = str(info.value)
    for part in ("output 'o'", "rule baseline", "err ", "limit ", "margin ", "worst element at (", "got ",
                 "expected ", "mismatch fraction"):
        assert part in message, (part, message)
    assert "output 'final_state'" not in message


def test_a_wrong_final_state_fails_even_with_a_correct_output() -> None:
    with pytest.raises(AssertionError, match="output 'final_state'") as info:
        assert_matches_oracle(partial(_scaled, state_gain=1.01), "kda", torch.float32, baseline="chunkwise")
    assert "output 'o'" not in str(info.value)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(case=strategy("kda"))
def test_a_property_test_in_three_lines(case) -> None:
    """Rule: baseline (fp32, chunkwise family), on drawn cases."""
    assert_matches_oracle(kda.chunkwise, "kda", torch.float32, cases=[case], baseline="chunkwise")


def test_unwritten_memory_reads_as_nan() -> None:
    """The autouse NaN-poisoned-memory fixture (properties/conftest.py): a k3verify function that
    leaves an allocated slot unwritten returns NaN there, so its test fails."""
    scope = {"__name__": "k3verify.example", "torch": torch}
    exec("def partial_copy(x):\n    out = torch.empty_like(x)\n    out[:-1] = x[:-1]\n    return out\n", scope)
    y = scope["partial_copy"](torch.ones(4))
    assert bool(torch.isnan(y[-1])) and not bool(torch.isnan(y[:-1]).any())
