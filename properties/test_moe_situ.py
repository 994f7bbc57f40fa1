"""SiTU, the bounded GLU of Stable LatentMoE (docs/model.md §4): bound, special values, zero, padding.

These are structural statements with exact answers (a bound, a value, bit equality), checked
without tolerance except where a test names the policy rule it uses.
"""

from __future__ import annotations

import math

import torch
from hypothesis import example, given
from hypothesis import strategies as st
from strategies.moe import one_thread  # noqa: F401

from k3verify import moe
from k3verify.moe.samples import MoEProblem, make_problem
from k3verify.moe.samples import problems as moe_problems
from k3verify.moe.situ import SITU_BETA1, SITU_BETA2, bound
from k3verify.numerics import facts, fp64_agreement

finite = st.floats(allow_nan=False, allow_infinity=False)
INF, NAN = math.inf, math.nan


SITU_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@st.composite
def representable(draw: st.DrawFn) -> tuple[float, float, torch.dtype]:
    """``(g, u, dtype)`` with g and u finite in ``dtype`` (within ±its max, so rounding to it stays
    finite); what lies beyond the format's range is test_situ_special_values' subject."""
    dtype = draw(st.sampled_from(SITU_DTYPES))
    limit = facts(dtype).max
    value = st.floats(min_value=-limit, max_value=limit, allow_nan=False, allow_infinity=False)
    return draw(value), draw(value), dtype


@given(case=representable())
@example(case=(1e30, 1e30, torch.float32))
@example(case=(-1e30, -1e30, torch.float32))
@example(case=(1e300, -1e300, torch.float64))
@example(case=(-1.2188, 1e30, torch.float64))  # the gate's minimum
@example(case=(3.0e38, 3.0e38, torch.bfloat16))
def test_situ_is_bounded_by_100(case: tuple[float, float, torch.dtype]) -> None:
    """Structural: |SiTU(g, u)| <= β1 β2 = 100 for every finite input representable in the dtype,
    with |gate| < 4 and the gate >= its minimum (−0.2698 at g ≈ −1.22)."""
    g, u, dtype = case
    gt, ut = torch.tensor([g], dtype=torch.float64).to(dtype), torch.tensor([u], dtype=torch.float64).to(dtype)
    assert bool(torch.isfinite(gt).all()) and bool(torch.isfinite(ut).all()), "the strategy drew a value out of range"
    y = moe.situ(gt, ut)
    assert bool(torch.isfinite(y).all())
    assert float(y.abs().max()) <= bound(SITU_BETA1, SITU_BETA2) == 100.0
    gate = moe.situ_gate(gt.to(y.dtype))
    assert -0.27 < float(gate) <= SITU_BETA1


def test_situ_gate_minimum() -> None:
    """Structural: the gate factor's range is about (−0.27, 4) (docs/model.md §4), minimum −0.2698 near g = −1.22."""
    g = torch.linspace(-40, 40, 800_001, dtype=torch.float64)
    gate = moe.situ_gate(g)
    assert -0.2699 < float(gate.min()) < -0.2697
    assert abs(float(g[gate.argmin()]) + 1.2188) < 1e-3
    assert float(gate.max()) < SITU_BETA1


def test_situ_special_values() -> None:
    """Documented behaviour (k3verify.moe.situ): infinities give the finite limits; NaN propagates.

    SiTU(+inf, +inf) = 100, SiTU(+inf, −inf) = −100, SiTU(−inf, u) = ±0, SiTU(g, ±inf) =
    ±25 gate(g); NaN in either argument gives NaN, even where the other factor is 0.
    SwiGLU: +inf for g = +inf (u > 0), NaN for g = −inf.
    """
    g = torch.tensor([INF, INF, -INF, -INF, 1.0, 1.0, NAN, 0.0, -INF, NAN], dtype=torch.float32)
    u = torch.tensor([INF, -INF, 5.0, INF, INF, -INF, 0.0, NAN, NAN, NAN], dtype=torch.float32)
    y = moe.situ(g, u)
    # The form's own gate of this very tensor: tanh and σ of 1.0 computed alone could round
    # differently (scalar libm against a vector kernel), whereas the gate of the same tensor is
    # the same operations on the same shapes, and u = ±inf multiplies it by exactly ±25.
    up = float(SITU_BETA2 * moe.situ_gate(g)[4])
    assert y[:6].tolist() == [100.0, -100.0, 0.0, 0.0, up, -up]
    assert bool(torch.isnan(y[6:]).all())
    s = moe.swiglu(g[:3], torch.tensor([1.0, 1.0, 1.0]))
    assert s[0] == INF and bool(torch.isnan(s[2]))


@given(x=finite)
def test_situ_of_zero_is_zero(x: float) -> None:
    """Exact: SiTU(0, u) = 0 and SiTU(g, 0) = 0 for every finite g, u (and the same for SwiGLU)."""
    t, z = torch.tensor([x], dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    for y in (moe.situ(z, t), moe.situ(t, z), moe.swiglu(z, t), moe.swiglu(t, z)):
        assert float(y) == 0.0


def test_situ_computes_in_fp32_at_least() -> None:
    """Structural: bf16/fp16 inputs are computed in fp32 (docs/model.md §4: computed in fp32), fp64 stays fp64."""
    for dtype, expected in ((torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                            (torch.float32, torch.float32), (torch.float64, torch.float64)):
        assert moe.situ(torch.ones(2, dtype=dtype), torch.ones(2, dtype=dtype)).dtype == expected


@given(g=st.floats(-3, 3), u=st.floats(-3, 3))
def test_swiglu_is_the_large_beta_limit(g: float, u: float) -> None:
    """Analytic: |SiTU_β(g, u) − SwiGLU(g, u)| <= |SwiGLU| · (g²/β1² + u²/β2²) (tanh x = x − x³/3 + …,
    so each factor's relative error is below x²/3 · 3); with β = 10^4 and |g|, |u| <= 3 that is
    below 1.8e-7 relative, and fp64 rounding adds ~1e-16."""
    gt, ut = torch.tensor([g], dtype=torch.float64), torch.tensor([u], dtype=torch.float64)
    beta = 1e4
    s, w = float(moe.situ(gt, ut, beta1=beta, beta2=beta)), float(moe.swiglu(gt, ut))
    assert abs(s - w) <= abs(w) * (g * g + u * u) / beta**2 + 1e-15


@given(p=moe_problems(max_T=6), pad=st.integers(1, 8), garbage=st.sampled_from((0.0, 1.0, 1e30)),
       form=st.sampled_from(("recurrent", "chunkwise", "tiled")))
@example(p=make_problem(3, E=4, k=2, d=8, H=4, activation="swiglu"), pad=5, garbage=1e30, form="tiled")
def test_zero_padding_the_hidden_size_is_exact(p: MoEProblem, pad: int, garbage: float, form: str) -> None:
    """Exact (padded units) and fp64-agreement (whole output): widen every expert and the shared MLP
    by ``pad`` hidden units whose W1/W3 columns are zero. Their hidden activations are exactly 0
    (SiTU(0, 0) = 0), so any finite W2 rows — even 1e30 — contribute exactly 0. The layer output
    agrees with the unpadded one under the fp64-agreement rule (the matmuls may sum in another
    order, which is the only difference)."""
    w, cfg = p.weights, p.cfg
    E, Dl, H, d = cfg.num_experts, cfg.latent_size, cfg.expert_hidden, cfg.hidden_size
    zeros = torch.zeros(E, Dl, pad, dtype=torch.float64)
    rows = torch.full((E, pad, Dl), garbage, dtype=torch.float64)
    shared_cols = torch.zeros(d, 2 * pad, dtype=torch.float64)
    wide = p.with_config(expert_hidden=H + pad).with_weights(
        w1=torch.cat([w.w1, zeros], -1), w3=torch.cat([w.w3, zeros], -1), w2=torch.cat([w.w2, rows], -2),
        # The shared MLP is num_shared_experts (2) experts wide: pad its hidden by 2 × pad.
        shared_w1=torch.cat([w.shared_w1, shared_cols], -1), shared_w3=torch.cat([w.shared_w3, shared_cols], -1),
        shared_w2=torch.cat([w.shared_w2, torch.full((2 * pad, d), garbage, dtype=torch.float64)], -2))
    z = p.x @ w.w_latent_down
    padded_hidden = moe.situ(z @ wide.weights.w1[0][:, H:], z @ wide.weights.w3[0][:, H:])
    assert bool((padded_hidden == 0).all())
    opts = {"operand_dtype": "fp64", "tile_k": 5} if form == "tiled" else {}
    fn = getattr(moe, form)
    v = fp64_agreement(fn(*wide.args(), **opts), fn(*p.args(), **opts))
    assert v.passed, v.reason
