"""One AttnRes call: what the softmax mixing must and must not do, in every form.

Reorganising the same arithmetic (one-shot, two-phase, online tiles of any size, a constant
added to every logit) is held to the ``fp64-agreement`` rule in fp64. Cases with an exact answer
(a single source, equal logits, a zero source) are checked exactly or by fp64-agreement as
stated per test; the convex-hull bound uses the a-priori rounding bound of an ``N``-term convex
combination where the output is not rounded to a narrower stream.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from strategies.attnres import FORMS, MAX_SUBTRACTING, STREAMS, one_thread  # noqa: F401  (one_thread: autouse)

from k3verify import attnres
from k3verify.attnres.samples import Aggregation, aggregations, make_aggregation
from k3verify.numerics import facts, fp64_agreement, resolve_dtype, round_to

# Mixing cores on given logits: one-shot, two-phase (stored + partial), online tiles.
CORES = {
    "one-shot": attnres.mix,
    "two-phase": attnres.mix_two_phase,
    "online tile=1": partial(attnres.online_mix, tile=1),
    "online tile=4": partial(attnres.online_mix, tile=4),
}


@given(p=aggregations(), core=st.sampled_from(sorted(CORES)), c=st.floats(-60.0, 60.0))
@example(p=make_aggregation(5, 2, 8, seed=1), core="two-phase", c=700.0)  # e^{ℓ+c} alone would overflow fp64
@example(p=make_aggregation(5, 2, 8, seed=1), core="online tile=1", c=-760.0)  # ... or underflow to 0
def test_logit_shift_invariance(p: Aggregation, core: str, c: float) -> None:
    """fp64-agreement: adding one constant to every logit does not change ``h`` (softmax is
    shift invariant and every max-subtracting core must stay so, far past exp's range)."""
    ell = attnres.logits(*p.args)
    v = fp64_agreement(CORES[core](ell + c, p.sources), CORES[core](ell, p.sources))
    assert v.passed, v.reason


@given(p=aggregations(max_N=1), form=st.sampled_from(MAX_SUBTRACTING), stream=st.sampled_from(STREAMS),
       logits=st.sampled_from((None, "bf16", "fp16")))
def test_one_source_returns_it_exactly(p: Aggregation, form: str, stream: str, logits: str | None) -> None:
    """Exact equality: with one source the weight is e^0 / e^0 = 1 exactly, so ``h`` is the source
    as stored in the stream dtype, bit for bit, whatever the logit dtype."""
    fn, opts = FORMS[form]
    h = fn(*p.args, stream_dtype=stream, logit_dtype=logits, **opts)
    expected = round_to(p.sources[0], stream).to(resolve_dtype(stream))
    assert h.dtype == expected.dtype and torch.equal(h, expected)


@given(p=aggregations(max_N=1))
def test_one_source_without_max_subtraction(p: Aggregation) -> None:
    """fp64-agreement: the no-max softmax computes ``e^ℓ v / e^ℓ``, equal to ``v`` up to rounding."""
    fn, opts = FORMS["tiled no-max"]
    v = fp64_agreement(fn(*p.args, **opts), p.sources[0])
    assert v.passed, v.reason


@given(p=aggregations(), form=st.sampled_from(sorted(FORMS)), zero=st.sampled_from(("w", "gamma")))
def test_equal_logits_give_the_mean(p: Aggregation, form: str, zero: str) -> None:
    """fp64-agreement: with ``w = 0`` or ``γ = 0`` every logit is exactly 0 and ``h`` is the
    plain mean of the sources."""
    fn, opts = FORMS[form]
    args = dict(sources=p.sources, w=p.w, gamma=p.gamma) | {zero: torch.zeros_like(p.w)}
    assert bool((attnres.logits(args["sources"], args["w"], args["gamma"]) == 0).all())
    v = fp64_agreement(fn(**args, **opts), p.sources.mean(0))
    assert v.passed, v.reason


@given(p=aggregations(logit_scale=st.floats(0.25, 200.0)), form=st.sampled_from(MAX_SUBTRACTING),
       stream=st.sampled_from(STREAMS))
@example(p=make_aggregation(9, 3, 16, seed=2, logit_scale=150.0), form="tiled tile=3", stream="bf16")
def test_output_within_per_channel_range(p: Aggregation, form: str, stream: str) -> None:
    """Structural: ``h`` is a convex combination, so each channel lies within the sources' range
    (of the sources as stored). Exactly for bf16/fp16 streams: the fp32 result is rounded to the
    stream, and rounding to nearest cannot cross the representable min and max. For fp32/fp64
    streams, up to the a-priori bound of an N-term convex combination with normalised weights,
    ``(N + 4) u max|v|`` (Higham's γ_{N+4}, u the compute dtype's unit roundoff)."""
    fn, opts = FORMS[form]
    h = fn(*p.args, stream_dtype=stream, **opts).double()
    stored = round_to(p.sources, stream)
    lo, hi = stored.amin(0), stored.amax(0)
    slack = 0.0
    if stream in ("fp64", "fp32"):
        slack = (p.N + 4) * facts(stream).unit_roundoff * float(stored.abs().max())
    assert bool((h >= lo - slack).all() and (h <= hi + slack).all()), float(torch.maximum(lo - h, h - hi).max())


@given(p=aggregations(min_T=1), a=st.integers(1, 13), b=st.integers(1, 13))
def test_tile_size_invariance(p: Aggregation, a: int, b: int) -> None:
    """fp64-agreement: the tiled form with tiles of ``a`` and of ``b`` sources, and the definition."""
    runs = [attnres.aggregate_tiled(*p.args, tile=t) for t in (a, b)]
    for x in [*runs[1:], attnres.aggregate(*p.args)]:
        v = fp64_agreement(runs[0], x)
        assert v.passed, v.reason


@given(p=aggregations(logit_scale=st.floats(0.25, 400.0)))
@example(p=make_aggregation(1, 1, 1))  # a single source: the stored set is empty (m = −inf)
def test_two_phase_equals_one_shot(p: Aggregation) -> None:
    """fp64-agreement (≤ 1e-10): phase 1 over all but the last source, merged with the last."""
    v = fp64_agreement(attnres.aggregate_two_phase(*p.args), attnres.aggregate(*p.args))
    assert v.passed, v.reason


TINY = (0.0, 1e-30, 1e-310, 1e-40)  # zero, tiny, an fp64 subnormal, below bf16/fp16's range


@given(p=aggregations(), form=st.sampled_from(sorted(FORMS)), stream=st.sampled_from(STREAMS),
       tiny=st.sampled_from(TINY), where=st.integers(0, 11))
@example(p=make_aggregation(1, 2, 8), form="chunkwise", stream="fp64", tiny=0.0, where=0)
def test_near_zero_source_gives_a_finite_key(p: Aggregation, form: str, stream: str, tiny: float, where: int) -> None:
    """Structural: a source of (near) zeros has a finite key (RMSNorm's ε keeps the divisor
    positive) and a logit of about 0; no form produces a NaN. fp64-agreement with the definition
    for an fp64 stream."""
    sources = p.sources.clone()
    i = where % p.N
    sources[i] = tiny * torch.sign(sources[i])
    key = attnres.keys(sources[i], p.gamma)
    assert bool(torch.isfinite(key).all()) and float(key.abs().max()) <= 1.0
    fn, opts = FORMS[form]
    h = fn(sources, p.w, p.gamma, stream_dtype=stream, **opts)
    assert bool(torch.isfinite(h).all())
    if stream == "fp64":
        v = fp64_agreement(h, attnres.aggregate(sources, p.w, p.gamma))
        assert v.passed, v.reason


@pytest.mark.parametrize("form", sorted(FORMS))
def test_forms_keep_fp64(form: str) -> None:
    """Structural: fp64 in, fp64 out (never silently downcast)."""
    p = make_aggregation(4, 2, 8, seed=3)
    fn, opts = FORMS[form]
    assert fn(*p.args, **opts).dtype == torch.float64
