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


@pytest.mark.parametrize(("g_min", "finite"), [(-5.0, False), (-1.0, True)])
def test_naive_chunk_kda_backward_is_nan_past_the_masked_decay_frontier(g_min: float, finite: bool) -> None:
    """A finding, pinned: autograd through fla-core's ``naive_chunk_kda`` exponentiates every pair
    of a chunk before masking the pairs above the diagonal; at K3's bound -5 those reach
    ``exp(> 88.7)``, ``inf`` in fp32, and the backward's ``0 * inf`` gives NaN gradients while the
    forward stays finite. At -1 a 64-token chunk spans at most e^63 and the gradients are finite
    and within fp32 agreement of the fp64 oracle (rule: relative max error <= 1e-5, as above).
    The row's prediction (``masked_decay_prediction``) says which side of that line a case is."""
    from k3verify.harness.modules.kda_backward import masked_decay_prediction
    from k3verify.harness.registry import Case
    from k3verify.kda.recurrent import autograd_backward, recurrent_backward
    from k3verify.kda.samples import cotangents, random_inputs

    x = random_inputs(1, 128, 2, 16, 8, g_min=g_min, seed=3)
    c = cotangents(1, 128, 2, 16, 8, seed=3)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    kw = dict(do=c["do"], dht=c["dht"], initial_state=x["initial_state"])
    got = autograd_backward(fla.naive_chunk, *(t.float() for t in args), **{n: t.float() for n, t in kw.items()})
    o, _ = fla.naive_chunk(*(t.float() for t in args), initial_state=kw["initial_state"].float())
    assert torch.isfinite(o).all()  # the forward hides the overflow
    prediction = masked_decay_prediction(Case("pinned", x, {}))
    assert prediction.finite is finite, prediction.explanation
    # The gradients that pass through the pairwise decays; dv and dh0 do not (the class of the
    # Ascend chunk_kda_bwd report: NaN in dq, dk, dg and dbeta while dv stayed finite).
    nonfinite = {n for n, t in got.items() if not torch.isfinite(t).all()}
    assert nonfinite == (set() if finite else {"dq", "dk", "dg", "dbeta"}), (nonfinite, prediction.explanation)
    if finite:
        ref = recurrent_backward(*args, **kw)
        for name, t in ref.items():
            assert_rel_within(got[name].double(), t, FLA_REL, name)
