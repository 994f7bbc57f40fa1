"""Low-precision Gated MLA against the fp64 oracle, and the overflow frontier of its softmax.

Inside the frontier every low-precision row passes the ``baseline`` rule against the naive
definition stored in the same dtype (for the fp8 cache: the same quantised cache, bf16
elsewhere). The tiled kernel's finiteness follows :func:`k3verify.mla.predict` on the exact
magnitudes of its inputs — for the correct online softmax and for the known-bad softmax
without max subtraction — wherever the prediction is not within a rounding of its frontier.

The baseline rule compares error statistics, so drawn problems here have at least 128 outputs.
"""

from __future__ import annotations

import math

import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st
from verdicts import assert_identical

from k3verify import mla
from k3verify.mla.samples import MLAProblem, make_problem
from k3verify.mla.samples import problems as mla_problems
from k3verify.numerics import baseline_rule, compare, facts, fp64_agreement, noise_floor, round_to, spacing
from k3verify.numerics.frontier import underflow_threshold

# name -> (form, input dtype, options, comparison dtype, fp8 cache)
ROWS = {
    "recurrent fp32": (mla.recurrent, torch.float32, {}, "fp32", False),
    "chunkwise fp32": (mla.chunkwise, torch.float32, {"chunk_size": 4}, "fp32", False),
    "tiled bf16": (mla.tiled, torch.float64, {"operand_dtype": "bf16", "tile": 8}, "bf16", False),
    "tiled fp16": (mla.tiled, torch.float64, {"operand_dtype": "fp16", "tile": 8}, "fp16", False),
    "tiled fp8 cache": (mla.tiled, torch.float64, {"operand_dtype": "bf16", "tile": 8}, "fp8_e4m3", True),
    "split-KV bf16": (mla.tiled, torch.float64, {"operand_dtype": "bf16", "tile": 4, "num_splits": 3}, "bf16", False),
    "tiled bf16 no-max": (mla.tiled, torch.float64, {"operand_dtype": "bf16", "tile": 8, "subtract_max": False},
                          "bf16", False),
}
FRONTIER_BAND = 0.25  # ln units: closer than this, rounding of the operands may decide


def _baseline(p: MLAProblem, dtype: str, fp8: bool) -> torch.Tensor:
    if fp8:
        return mla.naive_baseline(*p.args(cache=mla.quantize(p.cache)), dtype="bf16")
    return mla.naive_baseline(*p.args(), dtype=dtype)


@given(p=mla_problems(min_T=8, max_T=16, max_context=24, Dr=(4, 8)).filter(lambda p: p.H * p.T * p.Dv * p.B >= 128),
       row=st.sampled_from(sorted(ROWS)))
@example(p=make_problem((40, 0), 16, H=2, Dr=8, page_size=16, seed=11), row="tiled fp8 cache")
@example(p=make_problem((70,), 8, H=2, Dr=8, page_size=16, seed=12), row="split-KV bf16")
def test_low_precision_rows_pass_the_baseline_rule(p: MLAProblem, row: str) -> None:
    """baseline: err(form) <= 2 err(naive in the same dtype) + noise floor of the output dtype."""
    form, dtype, opts, cmp, fp8 = ROWS[row]
    cache = mla.quantize(p.cache) if fp8 else p.cache
    out = form(*p.args(dtype, cache=cache), **opts)
    ref = mla.expanded(*p.args())
    m = compare(out, ref, ulp_dtype=cmp)
    verdict = baseline_rule(m, compare(_baseline(p, cmp, fp8), ref, ulp_dtype=cmp), noise_floor(ref, out.dtype))
    assert verdict.passed, verdict.reason


def test_naive_baseline_in_fp64_is_the_definition() -> None:
    """Exact equality: with a dtype that loses nothing the baseline is the oracle bit for bit
    (on any host: rounding to fp64 is the identity, so both run the same operations on the same
    shapes in one process)."""
    p = make_problem((9, 4), 5, H=2, Dr=2, page_size=4, seed=2)
    assert_identical(mla.naive_baseline(*p.args(), dtype="fp64"), mla.expanded(*p.args()))


def _underflow_problem() -> MLAProblem:
    """One key whose score is about −150: e^s is 0 in fp32, so without max subtraction l = 0."""
    p = make_problem((0,), 1, H=1, Dr=2, page_size=2, seed=3)
    k_pe = p.entries[0, 0, p.R:]
    p.q_nope.zero_()
    p.q_pe[0, 0, 0] = -150.0 * (p.Dn + p.Dr) ** 0.5 * k_pe / k_pe.dot(k_pe)
    return p


CASES = (("bf16", False), ("fp16", False), ("bf16", True))  # (operand dtype, fp8 cache)


@given(p=mla_problems(max_T=10, max_context=30), case=st.sampled_from(CASES), subtract_max=st.booleans(),
       q_exp=st.floats(0.0, 9.0), latent_exp=st.floats(0.0, 17.0), tile=st.sampled_from((1, 4, 16)))
@example(p=make_problem((20,), 4, seed=4), case=("bf16", False), subtract_max=False, q_exp=7.0, latent_exp=0.0,
         tile=4)  # scores ~ 2^7 > ln(max bf16) = 88.7: overflow
@example(p=make_problem((20,), 4, seed=4), case=("bf16", False), subtract_max=True, q_exp=7.0, latent_exp=0.0,
         tile=4)  # the same with max subtraction: finite
@example(p=make_problem((20,), 4, seed=5), case=("fp16", False), subtract_max=False, q_exp=4.0, latent_exp=0.0,
         tile=4)  # scores ~ 16-60 > ln(65504) = 11.1: overflow in fp16 only
@example(p=make_problem((20,), 4, seed=5), case=("bf16", False), subtract_max=False, q_exp=4.0, latent_exp=0.0,
         tile=4)  # ... and finite in bf16
@example(p=make_problem((5,), 2, seed=6), case=("fp16", False), subtract_max=True, q_exp=0.0, latent_exp=17.0,
         tile=16)  # latents past 65504: fp16 operands overflow even with max subtraction
@example(p=make_problem((5,), 2, seed=6), case=("bf16", True), subtract_max=True, q_exp=0.0, latent_exp=17.0,
         tile=16)  # the fp8 cache's per-token scale absorbs any latent magnitude
@example(p=_underflow_problem(), case=("bf16", False), subtract_max=False, q_exp=0.0, latent_exp=0.0,
         tile=1)  # a row whose only score is −150: l = 0, 0/0 = NaN
def test_tiled_finiteness_follows_the_prediction(p: MLAProblem, case: tuple[str, bool], subtract_max: bool,
                                                 q_exp: float, latent_exp: float, tile: int) -> None:
    """Structural: finite output <=> predict() says finite (outside a FRONTIER_BAND-wide band),
    and every non-finite output is traced to a named stored tensor."""
    operand, fp8 = case
    c = p.cache
    cache = mla.LatentCache(c.pool * 2.0**latent_exp, c.block_table, c.seq_lens)
    if fp8:
        cache = mla.quantize(cache)
    args = (p.q_nope * 2.0**q_exp, p.q_pe * 2.0**q_exp, cache, p.w_uk, p.w_uv)
    prediction = mla.predict(mla.overflow_quantities(*args), operand_dtype=operand, subtract_max=subtract_max)
    assume(abs(prediction.headroom) >= FRONTIER_BAND)
    o, events = mla.tiled_traced(*args, operand_dtype=operand, tile=tile, subtract_max=subtract_max)
    finite = bool(torch.isfinite(o).all())
    assert finite == prediction.finite, f"observed finite={finite}; predicted: {prediction.explanation()}"
    if not finite:
        assert events or not subtract_max, "a non-finite output with max subtraction must come from an operand"
        if events:
            assert events[0].describe()


def test_underflow_row_is_predicted_and_observed() -> None:
    """Structural: the pinned underflow row — max score below ln(smallest fp32 subnormal / 2) —
    is non-finite without max subtraction, and the prediction names the underflow. With max
    subtraction (fp64 operands) it agrees with the definition under the fp64-agreement rule: the
    single key's softmax weight is exactly 1 in both, but the tiled form applies W_UV to õ in a
    batched product per head and the definition to ĉ in one product over all heads (its expanded
    values), which BLAS may sum in different orders."""
    p = _underflow_problem()
    q = mla.overflow_quantities(*p.args())
    assert q.min_row_max < underflow_threshold("fp32") < q.max_score + 100
    bad = mla.predict(q, operand_dtype="bf16", subtract_max=False)
    assert not bad.finite and any("underflow" in r for r in bad.reasons)
    assert not bool(torch.isfinite(mla.tiled(*p.args(), operand_dtype="bf16", subtract_max=False)).any())
    good = mla.tiled(*p.args(), operand_dtype="fp64")
    v = fp64_agreement(good, mla.expanded(*p.args()))
    assert v.passed, v.reason


@given(p=mla_problems(max_context=10), latent_exp=st.integers(-8, 20))
def test_fp8_cache_quantiser(p: MLAProblem, latent_exp: int) -> None:
    """Structural: per-token scale = amax / max(e4m3) in fp32, codes are e4m3 values within
    ±max, and each dequantised number is within half an e4m3 spacing (times the scale) of the input."""
    x = p.entries.to(torch.float32) * 2.0**latent_exp
    codes, scales = mla.quantize_entries(x)
    f = facts("fp8_e4m3")
    amax = x.abs().amax(-1)
    # Bitwise on any host: amax is exact and the division correctly rounded.
    assert_identical(scales, torch.where(amax > 0, amax / f.max, torch.ones_like(amax)))
    c = codes.to(torch.float32)
    assert float(c.abs().max()) <= f.max
    assert_identical(round_to(c, "fp8_e4m3"), c)
    err = (x.double() - c.double() * scales.double()[..., None]).abs()
    # Half a spacing of the code, plus the fp32 rounding of x / s (relative 2^-24 of the code).
    allowed = scales.double()[..., None] * (spacing(c, "fp8_e4m3") / 2 + c.double().abs() * 2.0**-23)
    assert bool((err <= allowed).all()), float((err - allowed).max())
    assert math.isclose(float(c.abs().amax(-1).max()), f.max, rel_tol=2.0**-3)
