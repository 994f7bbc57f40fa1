"""``k3verify selftest``: the mutant suite runs green, and it bites.

Rules: structural (the suite's own verdicts); each mutant's verdict is the testing API's, under
the baseline rule or the input-mutation check (k3verify/harness/selftest.py declares where each
must be caught, and why it cannot be elsewhere).
"""

from __future__ import annotations

import pytest
import torch

from k3verify import moe
from k3verify.cli import main
from k3verify.harness import selftest
from k3verify.numerics import policy
from k3verify.testing import assert_matches_oracle


def test_every_mutant_is_caught_where_declared_and_no_correct_form_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["selftest", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "not as expected: 0" in out
    assert len(selftest.mutants()) >= 30 and {m.module for m in selftest.mutants()} == {"kda", "mla", "attnres", "moe"}


def test_a_blind_policy_fails_the_suite(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """With the baseline factor made huge, numerical mutants pass: the suite says so, exit 1."""
    monkeypatch.setattr(policy, "small_output_k", lambda n, k=2.0, alpha=1e-6: 1e9)
    assert main(["selftest", "--quiet", "--modules", "mla", "--format", "md"]) == 1
    out = capsys.readouterr().out
    assert "| mla | softmax scale from 576 | missed **(not as declared)**" in out, out


def test_a_kernel_may_report_the_experts_it_was_routed_to() -> None:
    """MoE's routing is handed to the kernel; returning its indices as the experts is the
    contract, not an output in an input's memory."""

    def fn(x, weights, config, *, routing, **kw):
        return moe.recurrent(x, weights, config, routing=routing, **kw), routing.indices

    assert_matches_oracle(fn, "moe", torch.float32)
