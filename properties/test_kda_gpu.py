"""fla-core's KDA Triton kernels on a CUDA device against the fp64 oracle.

Skipped, with the reason, where there is no CUDA device or no fla-core (CI has neither GPU
nor a way to get one; run these with `HYPOTHESIS_PROFILE=gpu pytest properties/test_kda_gpu.py`).
Rules: ``baseline`` (chunk_kda against the naive chunkwise form in bf16, fused_recurrent_kda
against the naive recurrence in bf16) and ``frontier`` (chunk_kda with safe_gate must be finite
exactly where our row0_shift model with fp32 factors predicts).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3verify import kda
from k3verify.adapters import fla
from k3verify.kda.samples import KDAProblem, make_problem
from k3verify.kda.samples import problems as kda_problems
from k3verify.kda.tiled import predicted_finite
from k3verify.numerics import baseline_rule, compare, noise_floor

REASON = fla.unavailable_reason(gpu=True)
# fla-core autotunes each kernel on its first call with a new shape in a process, about two
# minutes on a fresh device: under pytest-xdist (``--dist loadgroup``) these tests share one
# worker, and one shape, so that happens once.
pytestmark = [pytest.mark.skipif(REASON is not None, reason=str(REASON)), pytest.mark.xdist_group("fla-core")]


def _verdict(o: torch.Tensor, p: KDAProblem, baseline) -> object:
    ref, _ = kda.recurrent(*p.args(), initial_state=p.state())
    base, _ = baseline(*p.args(), initial_state=p.state(), dtype="bf16")
    m = compare(o, ref, ulp_dtype="bf16")
    return baseline_rule(m, compare(base, ref, ulp_dtype="bf16"), noise_floor(ref, o.dtype))


def _bf16(p: KDAProblem):
    q, k, v, g, beta = p.args()
    return q.bfloat16(), k.bfloat16(), v.bfloat16(), g.float(), beta.bfloat16()


# One shape for every test here (two sequences, two heads, production head dims): each new
# shape costs fla-core an autotuning pass; values, gates, seeds and initial states vary.
B, T, H, D = 2, 200, 2, 128
GPU_PROBLEMS = dict(min_T=T, max_T=T, K=(D,), V=(D,), B=(B,), H=(H,))


@settings(max_examples=8)
@given(p=kda_problems(**GPU_PROBLEMS, g_min=st.sampled_from([-5.0, -3.0, -1.0])))
def test_chunk_kda_within_policy(p: KDAProblem) -> None:
    o, _ = fla.chunk_gpu(*_bf16(p), initial_state=p.state(), safe_gate=True, lower_bound=-5.0)
    verdict = _verdict(o, p, kda.naive_chunk_baseline)
    assert verdict.passed, verdict.reason


@settings(max_examples=8)
@given(p=kda_problems(**GPU_PROBLEMS))
def test_fused_recurrent_kda_within_policy(p: KDAProblem) -> None:
    o, _ = fla.fused_recurrent_gpu(*_bf16(p), initial_state=p.state())
    verdict = _verdict(o, p, kda.naive_baseline)
    assert verdict.passed, verdict.reason


@pytest.mark.parametrize("g_min", [-1.0, -3.0, -5.0, -6.0, -6.5, -6.85, -6.95, -7.5, -8.0, -12.0, -20.0])
def test_chunk_kda_safe_gate_follows_the_row0_shift_frontier(g_min: float) -> None:
    p = make_problem(B, T, H, D, D, g_min=g_min, seed=0, kind="worst", initial_state=False)
    o, _ = fla.chunk_gpu(*_bf16(p), safe_gate=True, lower_bound=g_min)
    expected = predicted_finite(g_min, tile=16, operand_dtype="fp32", anchor="row0_shift")
    assert bool(torch.isfinite(o).all()) == expected
