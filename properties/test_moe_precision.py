"""Low-precision Stable LatentMoE against the fp64 oracle, and where SwiGLU and SiTU overflow.

Inside the frontier every tiled row passes the ``baseline`` rule against the naive definition
stored in the same dtype (fp8: the same quantiser, bf16 elsewhere). The tiled kernel's
finiteness follows :func:`k3verify.moe.predict` on the exact magnitudes of its inputs wherever
the prediction is not within a rounding of its frontier, for SiTU and for SwiGLU.

The baseline rule compares error statistics, so drawn problems here have at least 128 outputs.
"""

from __future__ import annotations

import math

import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st
from strategies.moe import one_thread  # noqa: F401
from verdicts import assert_identical

from k3verify import moe
from k3verify.moe.inputs import FormOptions
from k3verify.moe.quantize import Caster
from k3verify.moe.samples import MoEProblem, make_problem
from k3verify.moe.samples import problems as moe_problems
from k3verify.numerics import baseline_rule, compare, facts, noise_floor, round_to

# (operand dtype, fp8 scaling)
SETTINGS = (("bf16", "per_row"), ("fp16", "per_row"), ("fp8_e4m3", "per_row"), ("fp8_e4m3", "per_tensor"),
            ("fp8_e4m3", "static"))
FRONTIER_BAND = 0.25  # ln units: closer than this, rounding of the operands may decide


@given(p=moe_problems(min_T=8, max_T=16, widths=(16, 32), activation=st.sampled_from(("situ", "swiglu")),
                      bias_scale=st.sampled_from((0.1, 3.0))),
       setting=st.sampled_from(SETTINGS), tile_m=st.sampled_from((1, 4, 16)), tile_k=st.sampled_from((4, 16, 64)))
@example(p=make_problem(16, E=16, k=4, d=32, H=12, seed=5), setting=("fp8_e4m3", "static"), tile_m=16, tile_k=16)
@example(p=make_problem(12, E=8, k=2, d=16, H=8, bias_scale=3.0, activation="swiglu"), setting=("fp16", "per_row"),
         tile_m=4, tile_k=4)
def test_tiled_passes_the_baseline_rule(p: MoEProblem, setting: tuple[str, str], tile_m: int, tile_k: int) -> None:
    """baseline: err(tiled) <= 2 err(naive in the same dtype, same quantiser) + noise floor of the
    output dtype, both against the fp64 recurrent definition."""
    dtype, scaling = setting
    ref = moe.recurrent(*p.args())
    out = moe.tiled(*p.args(), operand_dtype=dtype, fp8_scaling=scaling, tile_m=tile_m, tile_k=tile_k)
    base = moe.naive_baseline(*p.args(), dtype=dtype, fp8_scaling=scaling)
    m, mb = compare(out, ref, ulp_dtype=dtype), compare(base, ref, ulp_dtype=dtype)
    verdict = baseline_rule(m, mb, noise_floor(ref, out.dtype))
    assert verdict.passed, verdict.reason


@given(p=moe_problems(max_T=8, activation=st.sampled_from(("situ", "swiglu"))), log2_scale=st.floats(0, 70),
       setting=st.sampled_from(SETTINGS))
@example(p=make_problem(8, E=8, k=2, d=16, H=8, seed=1, activation="swiglu"), log2_scale=8.0,
         setting=("fp16", "per_row"))  # SwiGLU's hidden ~1e6 > 65504: overflow
@example(p=make_problem(8, E=8, k=2, d=16, H=8, seed=1, activation="situ"), log2_scale=8.0,
         setting=("fp16", "per_row"))  # the same input through SiTU: finite
@example(p=make_problem(8, E=8, k=2, d=16, H=8, seed=1, activation="situ"), log2_scale=9.0,
         setting=("fp8_e4m3", "static"))  # x past 448 with a static scale of 1: overflow
@example(p=make_problem(8, E=8, k=2, d=16, H=8, seed=1, activation="swiglu"), log2_scale=40.0,
         setting=("fp8_e4m3", "per_row"))  # dynamic scales: finite until fp32 itself overflows
@example(p=make_problem(8, E=8, k=2, d=16, H=8, seed=1, activation="swiglu"), log2_scale=66.0,
         setting=("bf16", "per_row"))  # g σ(g) u past fp32's range: overflow even in bf16
def test_finiteness_follows_the_prediction(p: MoEProblem, log2_scale: float, setting: tuple[str, str]) -> None:
    """Structural: finite output <=> predict() says finite (outside a FRONTIER_BAND-wide band), and
    every non-finite output is traced to a named stored tensor. Routing is the fp64 oracle's."""
    dtype, scaling = setting
    x, w, cfg = p.args()
    x = x * 2.0**log2_scale
    routing = moe.routing_for(x, w, cfg, None, torch.float64)
    # A token whose k selected scores all underflow (every logit below about −709 in fp64) gets
    # 0/0 weights under the renormalisation of docs/model.md §4 (renorm_eps = 0): a documented non-finite routing.
    assume(bool(torch.isfinite(routing.weights).all()))
    q = moe.overflow_quantities(x, w, cfg, routing=routing)
    prediction = moe.predict(q, operand_dtype=dtype, fp8_scaling=scaling)
    assume(abs(prediction.headroom) >= FRONTIER_BAND)
    y, events = moe.tiled_traced(x, w, cfg, routing=routing, operand_dtype=dtype, fp8_scaling=scaling)
    finite = bool(torch.isfinite(y).all())
    assert finite == prediction.finite, f"observed finite={finite}; predicted: {prediction.explanation()}"
    if not finite:
        assert events and events[0].describe()
        lines = moe.explain_overflow(x, w, cfg, routing=routing, operand_dtype=dtype, fp8_scaling=scaling)
        assert lines == [e.describe() for e in events]
    if cfg.activation == "situ":
        assert not any("hidden" in r for r in prediction.reasons), "SiTU's hidden is bounded by 100"


def test_the_overflow_model_takes_the_forms_arguments() -> None:
    """Structural: ``overflow_quantities`` and ``explain_overflow`` take a form's positional inputs
    and keyword options, ``predict`` takes the options too and ignores the tiling (it does not
    move the prediction); SwiGLU at 2^8 in fp16 is predicted to overflow and explained, line for
    line the events of ``overflow_events``, starting with the expert hidden tensor."""
    p = make_problem(8, E=8, k=2, d=16, H=8, seed=1, activation="swiglu")
    x, w, cfg = p.args()
    x = x * 2.0**8
    opts = dict(operand_dtype="fp16", fp8_scaling="per_row", fp8_static_scale=1.0, tile_m=4, tile_k=8)
    q = moe.overflow_quantities(x, w, cfg, **opts)
    prediction = moe.predict(q, **opts)
    assert prediction == moe.predict(q, operand_dtype="fp16")
    lines = moe.explain_overflow(x, w, cfg, **opts)
    assert lines == [e.describe() for e in moe.overflow_events(x, w, cfg, **opts)]
    assert not prediction.finite and lines and "hidden" in lines[0], (prediction.explanation(), lines)


@given(p=moe_problems(activation=st.just("situ"), rho=st.floats(0.5, 4.0)), log2_scale=st.floats(-4, 60))
def test_situ_expert_outputs_are_bounded_whatever_the_input(p: MoEProblem, log2_scale: float) -> None:
    """Analytic bound: |p_j E_j| <= ρ · 100 max_{j,c} ‖W2_j[:, c]‖₁ for every input scale (|SiTU| <= 100
    and p_j <= ρ), so the routed experts cannot overflow a dtype that holds this bound."""
    x, w, cfg = p.args()
    q = moe.overflow_quantities(x * 2.0**log2_scale, w, cfg)
    assert q.hidden <= math.log(100.0)
    assert q.expert_out <= math.log(cfg.routed_scaling_factor) + q.situ_bound + 1e-12


def test_rmsnorm_sum_of_squares_overflow_zeroes_the_routed_output() -> None:
    """Structural, finite but wrong: SwiGLU's latent u grows like the square of the input scale; at
    2^36 a token's Σu² passes fp32's range, the RMSNorm multiplies u by rsqrt(inf) = 0 and the
    routed output of every such token is exactly 0 in bf16 — as predicted — while the fp64 oracle's
    is not. SiTU's latent is bounded, so at the same scale nothing is zeroed. (Shared path removed.)"""
    base = make_problem(8, E=8, k=2, d=16, H=8, seed=2)
    zero = {n: torch.zeros_like(getattr(base.weights, n)) for n in ("shared_w1", "shared_w3", "shared_w2")}
    for activation in ("swiglu", "situ"):
        p = base.with_config(activation=activation).with_weights(**zero)
        x, w, cfg = p.args()
        x = x * 2.0**36
        routing = moe.routing_for(x, w, cfg, None, torch.float64)
        q = moe.overflow_quantities(x, w, cfg, routing=routing)
        prediction = moe.predict(q, operand_dtype="bf16")
        y = moe.tiled(x, w, cfg, routing=routing, operand_dtype="bf16")
        assert prediction.finite and bool(torch.isfinite(y).all())
        zero_rows = (y == 0).all(-1)
        assert prediction.predicted_zeroed == (activation == "swiglu") == bool(zero_rows.any())
        assert bool((q.oracle.abs().amax(-1) > 0).all())
        assert ("RMSNorm" in prediction.explanation()) == (activation == "swiglu")


@given(setting=st.sampled_from(SETTINGS[2:]), weight=st.booleans(), log2_scale=st.integers(-20, 20),
       seed=st.integers(0, 1000))
def test_fp8_operands_are_scaled_codes(setting: tuple[str, str], weight: bool, log2_scale: int, seed: int) -> None:
    """Structural: an fp8 operand is code × scale with codes exact e4m3 values; dynamic scales
    put each row's (weight: column's; per_tensor: tensor's) largest code at ±448, so nothing
    overflows; the static scale leaves codes unscaled, so values past 448 become NaN (visible)."""
    dtype, scaling = setting
    t = torch.randn(6, 10, generator=torch.Generator().manual_seed(seed), dtype=torch.float32) * 2.0**log2_scale
    cast = Caster.make(FormOptions(operand_dtype=dtype, fp8_scaling=scaling, fp8_static_scale=1.0))
    v = cast.operand("t", t, weight=weight)
    f = facts(dtype)
    if scaling == "static" and not weight:
        over = t.abs() > f.overflow_threshold
        assert bool(torch.isnan(v[over]).all()) and torch.equal(v[~over], round_to(t, dtype)[~over])
        return
    dims = (-2, -1) if scaling == "per_tensor" else ((-2,) if weight else (-1,))
    # Bitwise on any host: amax is exact, / and * are correctly rounded and the rounding to e4m3
    # is exact, so these are the quantiser's own numbers.
    scale = t.abs().amax(dim=dims, keepdim=True) / f.max
    codes = round_to(t / scale, dtype)
    assert bool(torch.isfinite(v).all())
    assert_identical(v, codes * scale)
    assert_identical(codes.abs().amax(dim=dims), torch.full_like(codes.abs().amax(dim=dims), f.max))
