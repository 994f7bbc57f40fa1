"""Low-precision Block AttnRes against the fp64 definition, and the overflow frontier of the softmax.

Every low-precision form passes the ``baseline`` rule (err ≤ 2 · err(plain definition in the
same stream dtype, fp32 softmax) + noise floor of the stream dtype), for single calls and whole
walks. The known-bad variant that stores logits in bf16 must fail that rule at large logits.
The tiled form's finiteness follows :func:`k3verify.attnres.predict` on the exact magnitudes of
its inputs — with and without max subtraction, for fp32, bf16 and fp16 logits — wherever the
prediction is not within a rounding of its frontier.

The baseline rule compares error statistics, so drawn problems here have at least 128 outputs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st
from strategies.attnres import one_thread  # noqa: F401  (autouse fixture)
from verdicts import assert_identical

from k3verify import attnres
from k3verify.attnres.samples import Aggregation, aggregations, make_aggregation, make_walk
from k3verify.numerics import FAIL, baseline_rule, compare, noise_floor
from k3verify.numerics.frontier import underflow_threshold

# name -> (aggregation form, options, stream dtype)
ROWS = {
    "recurrent fp32": (attnres.aggregate, {}, "fp32"),
    "recurrent bf16": (attnres.aggregate, {}, "bf16"),
    "chunkwise bf16": (attnres.aggregate_two_phase, {}, "bf16"),
    "chunkwise fp16": (attnres.aggregate_two_phase, {}, "fp16"),
    "tiled fp32": (attnres.aggregate_tiled, {"tile": 4}, "fp32"),
    "tiled bf16": (attnres.aggregate_tiled, {"tile": 4}, "bf16"),
    "tiled bf16 tile=1": (attnres.aggregate_tiled, {"tile": 1}, "bf16"),
    "tiled fp16": (attnres.aggregate_tiled, {"tile": 3}, "fp16"),
}
LARGE = dict(min_T=8, max_T=16, widths=(16, 64))  # >= 128 outputs


def _verdict(p: Aggregation, fn, opts: dict, stream: str, **extra):
    ref = attnres.aggregate(*p.args)
    out = fn(*p.args, stream_dtype=stream, **opts, **extra)
    base = compare(attnres.naive_baseline(*p.args, dtype=stream), ref, ulp_dtype=stream)
    return baseline_rule(compare(out, ref, ulp_dtype=stream), base, noise_floor(ref, out.dtype))


@given(p=aggregations(**LARGE, logit_scale=st.floats(0.25, 128.0)), row=st.sampled_from(sorted(ROWS)))
@example(p=make_aggregation(9, 16, 64, seed=7, logit_scale=96.0), row="tiled bf16")  # past ln(max fp32)
@example(p=make_aggregation(187, 8, 16, seed=8, logit_scale=85.0), row="chunkwise bf16")  # Full AttnRes's 187
def test_low_precision_forms_pass_the_baseline_rule(p: Aggregation, row: str) -> None:
    """baseline: err(form) <= 2 err(plain definition in the same stream dtype) + noise floor."""
    fn, opts, stream = ROWS[row]
    verdict = _verdict(p, fn, opts, stream)
    assert verdict.passed, verdict.reason


def test_bf16_logits_are_caught_at_large_logits() -> None:
    """baseline: the known-bad bf16 logits fail the rule at logit scale 96 (a logit in [64, 128)
    moves by up to 0.25, half a bf16 spacing there: a 28 % change of its weight) and pass it at
    scale 1, where the same relative rounding is below the stream's own."""
    fn, opts, stream = ROWS["tiled bf16"]
    hot = _verdict(make_aggregation(9, 32, 256, seed=0, logit_scale=96.0), fn, opts, stream, logit_dtype="bf16")
    assert hot.status == FAIL, hot.reason
    cool = _verdict(make_aggregation(9, 32, 256, seed=0, logit_scale=1.0), fn, opts, stream, logit_dtype="bf16")
    assert cool.passed, cool.reason


def test_naive_baseline_in_fp64_is_the_definition() -> None:
    """Exact equality: with a dtype that loses nothing the baseline is the definition bit for bit
    (on any host: rounding to fp64 is the identity, so both run the same operations on the same
    shapes in one process)."""
    p = make_aggregation(5, 3, 16, seed=4)
    assert_identical(attnres.naive_baseline(*p.args, dtype="fp64"), attnres.aggregate(*p.args))


@pytest.mark.parametrize(("form", "opts"), [("recurrent", {}), ("chunkwise", {}), ("tiled", {"tile": 4}),
                                            ("tiled", {"tile": 4, "logit_dtype": "bf16"})])
@pytest.mark.parametrize("stream", ["bf16", "fp16"])
def test_walk_passes_the_baseline_rule(form: str, opts: dict, stream: str) -> None:
    """baseline over a 24-layer walk: the final output against the plain walk in the stream dtype."""
    p = make_walk(24, 24, d=32, T=4, seed=3, logit_scale=8.0)
    x = p.inputs
    ref = p.run("recurrent").output
    out = p.run(form, stream_dtype=stream, **opts).output
    base = attnres.naive_walk(x["embedding"], x["weights"], x["sublayers"], dtype=stream, schedule=p.schedule).output
    verdict = baseline_rule(compare(out, ref, ulp_dtype=stream), compare(base, ref, ulp_dtype=stream),
                            noise_floor(ref, out.dtype))
    assert verdict.passed, verdict.reason


def _aligned_below(p: Aggregation, sign: float) -> Aggregation:
    """Every source aligned with ``sign · (w⊙γ)``: every logit is ``sign`` times the logit scale."""
    u = p.w * p.gamma
    sources = (u / u.norm() * p.d**0.5)[None, None] * torch.linspace(1, 2, p.N, dtype=torch.float64)[:, None, None]
    sources = sign * sources.expand(-1, p.T, -1).clone()
    return Aggregation(p.N, p.T, p.d, p.seed, p.logit_scale, sources, p.w, p.gamma)


SETTINGS = [(s, lg) for s in ("bf16", "fp16", "fp32") for lg in ("fp32", "bf16", "fp16")]


@given(p=aggregations(max_N=9, logit_scale=st.floats(1.0, 2.0**17)), setting=st.sampled_from(SETTINGS),
       subtract_max=st.booleans(), tile=st.sampled_from((1, 4)), negative=st.booleans())
@example(p=make_aggregation(3, 2, 8, seed=1, logit_scale=96.0), setting=("bf16", "fp32"), subtract_max=False,
         tile=4, negative=False)  # e^96 > max fp32: overflow without max subtraction
@example(p=make_aggregation(3, 2, 8, seed=1, logit_scale=96.0), setting=("bf16", "fp32"), subtract_max=True,
         tile=4, negative=False)  # the same with max subtraction: finite
@example(p=make_aggregation(3, 2, 8, seed=1, logit_scale=12.0), setting=("bf16", "fp16"), subtract_max=False,
         tile=1, negative=False)  # e^12 > 65504: exponentials stored in fp16 overflow
@example(p=make_aggregation(3, 2, 8, seed=1, logit_scale=70000.0), setting=("fp32", "fp16"), subtract_max=True,
         tile=4, negative=False)  # logits past 65504 overflow fp16 even with max subtraction
@example(p=make_aggregation(3, 2, 8, seed=1, logit_scale=200.0), setting=("bf16", "fp32"), subtract_max=False,
         tile=4, negative=True)  # every logit near −200: every e^ℓ underflows, Z = 0, 0/0
def test_tiled_finiteness_follows_the_prediction(p: Aggregation, setting: tuple[str, str], subtract_max: bool,
                                                 tile: int, negative: bool) -> None:
    """Structural: finite output <=> predict() says finite (outside the rounding band of a check),
    and every overflow of a stored tensor is named by the trace."""
    stream, logits = setting
    if negative:
        p = _aligned_below(p, -1.0)
    q = attnres.overflow_quantities(*p.args, stream_dtype=stream)
    prediction = attnres.predict(q, stream_dtype=stream, logit_dtype=logits, subtract_max=subtract_max)
    assume(not prediction.near_frontier)
    out, events = attnres.aggregate_tiled_traced(*p.args, stream_dtype=stream, logit_dtype=logits, tile=tile,
                                                 subtract_max=subtract_max)
    finite = bool(torch.isfinite(out).all())
    assert finite == prediction.finite, f"observed finite={finite}; predicted: {prediction.explanation()}"
    if not finite and subtract_max:
        assert events and events[0].describe(), "with max subtraction only a stored tensor can overflow"


def test_underflow_row_is_predicted_and_observed() -> None:
    """Structural: every logit near −200, below ln(smallest fp32 subnormal / 2) ≈ −103.97: the
    no-max softmax returns 0/0 = NaN and the prediction names the underflow; with max subtraction
    the output is finite and agrees with the definition."""
    p = _aligned_below(make_aggregation(3, 2, 8, seed=1, logit_scale=200.0), -1.0)
    q = attnres.overflow_quantities(*p.args)
    assert q.min_row_max < underflow_threshold("fp32")
    bad = attnres.predict(q, stream_dtype="bf16", subtract_max=False)
    assert not bad.finite and any("underflow" in r for r in bad.reasons)
    assert not bool(torch.isfinite(attnres.aggregate_tiled(*p.args, stream_dtype="bf16", subtract_max=False)).any())
    good = attnres.aggregate_tiled(*p.args)
    assert bool(torch.isfinite(good).all()) and torch.allclose(good, attnres.aggregate(*p.args), rtol=1e-12)
