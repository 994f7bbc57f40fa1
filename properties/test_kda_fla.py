"""Agreement with fla-core 0.6.0's CPU references (fla/ops/kda/naive.py).

Rule: relative max error <= 1e-5 — fla-core computes in fp32 whatever the input dtype, so
agreement is bounded by fp32 accumulation over the sequence, not by our fp64 forms. The test
is skipped, with the reason shown, only when fla-core is not installed; the ``tests`` nox
session installs it, so CI runs it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from verdicts import assert_rel_within

from k3verify import kda
from k3verify.adapters import fla
from k3verify.kda.samples import KDAProblem, make_problem
from k3verify.kda.samples import problems as kda_problems
from k3verify.numerics import relative_max_error

pytestmark = [
    pytest.mark.fla,
    pytest.mark.skipif(fla.unavailable_reason() is not None, reason=str(fla.unavailable_reason())),
]

FLA_REL = 1e-5


@settings(max_examples=10)
@given(p=kda_problems(min_T=1, max_T=130, K=(8, 16), V=(4, 12), initial_state=True))
def test_recurrent_and_chunkwise_match_fla_naive_recurrent(p: KDAProblem) -> None:
    """K != V and an initial state, as the acceptance asks."""
    o_fla, s_fla = fla.naive_recurrent(*p.args(), initial_state=p.state(), output_final_state=True)
    for form in (kda.recurrent, kda.chunkwise):
        o, s = form(*p.args(), initial_state=p.state(), output_final_state=True)
        assert_rel_within(o, o_fla, FLA_REL, form.__name__)
        assert_rel_within(s, s_fla.double(), FLA_REL, form.__name__)


def test_chunkwise_matches_fla_naive_chunk() -> None:
    p = make_problem(2, 150, 2, 16, 8, seed=9)
    o_fla, s_fla = fla.naive_chunk(*p.args(), initial_state=p.state(), output_final_state=True)
    o, s = kda.chunkwise(*p.args(), initial_state=p.state(), output_final_state=True)
    assert_rel_within(o, o_fla, FLA_REL)
    assert_rel_within(s, s_fla.double(), FLA_REL)


def test_fla_sees_the_same_scale_and_layout() -> None:
    """A wrong scale or a transposed state would show as O(1) disagreement, not 1e-5."""
    p = make_problem(1, 20, 1, 8, 4, seed=2)
    o_fla, _ = fla.naive_recurrent(*p.args(), initial_state=p.state(), scale=0.5)
    o, _ = kda.recurrent(*p.args(), initial_state=p.state(), scale=0.5)
    assert_rel_within(o, o_fla, FLA_REL)
    o_default, _ = kda.recurrent(*p.args(), initial_state=p.state())
    assert relative_max_error(o_default, o_fla) > 1e-2


def test_adapter_reports_a_missing_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present; the GPU adapters run in the gpu session")
    assert "CUDA" in str(fla.unavailable_reason(gpu=True))


@pytest.mark.parametrize("T", [1, 63, 64, 65])
def test_padding_keeps_fla_naive_chunk_exact(T: int) -> None:
    """The adapter pads T to 64 with inert tokens; outputs over real tokens are unchanged."""
    p = make_problem(1, T, 1, 8, 8, seed=T)
    o_pad, _ = fla.naive_chunk(*p.args(), initial_state=p.state())
    o_rec, _ = fla.naive_recurrent(*p.args(), initial_state=p.state())
    assert o_pad.shape == o_rec.shape
    assert_rel_within(o_pad, o_rec, FLA_REL)
