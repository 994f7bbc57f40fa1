"""Degenerate gates: beta = 0 (no writes), g = 0 exactly (no decay), and both.

Rule: fp64-agreement against closed forms:
- beta = 0: S_t = Diag(prod_{s<=t} alpha_s) S_0, so o_t = (Diag(exp(sum g)) S_0)^T q^_t;
- beta = 0 and g = 0: the state never changes, o_t = S_0^T q^_t;
- g = 0 alone: no closed form, but every form agrees with the recurrence (and with the
  delta rule written out directly).
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from verdicts import assert_rel_within

from k3verify import kda
from k3verify.kda.samples import KDAProblem, make_problem
from k3verify.kda.samples import problems as kda_problems
from k3verify.numerics import FP64_AGREEMENT_REL

FORMS = {
    "recurrent": lambda *a, **kw: kda.recurrent(*a, **kw),
    "chunkwise": lambda *a, **kw: kda.chunkwise(*a, chunk_size=16, **kw),
    "tiled-fp64": lambda *a, **kw: kda.tiled(*a, operand_dtype=torch.float64, tile=8, anchor="tile_middle", **kw),
}


def _closed_form_no_writes(p: KDAProblem, g: torch.Tensor) -> torch.Tensor:
    q, *_ = p.args()
    decay = torch.exp(g.cumsum(1))  # [B, T, H, K]
    S0 = p.state()
    return torch.einsum("bthk,bhkv->bthv", q * q.shape[-1] ** -0.5 * decay, S0)


@given(p=kda_problems(max_T=90, initial_state=True), form=st.sampled_from(sorted(FORMS)), zero_gate=st.booleans())
def test_beta_zero_only_decays_the_initial_state(p: KDAProblem, form: str, zero_gate: bool) -> None:
    q, k, v, g, beta = p.args()
    g = torch.zeros_like(g) if zero_gate else g
    o, _ = FORMS[form](q, k, v, g, torch.zeros_like(beta), initial_state=p.state())
    assert_rel_within(o, _closed_form_no_writes(p, g), FP64_AGREEMENT_REL)


@given(p=kda_problems(max_T=90), form=st.sampled_from(sorted(FORMS)))
def test_zero_gate_is_the_plain_delta_rule(p: KDAProblem, form: str) -> None:
    q, k, v, g, beta = p.args()
    g = torch.zeros_like(g)
    o, _ = FORMS[form](q, k, v, g, beta, initial_state=p.state())
    # The delta rule without decay, written independently of the forms under test.
    S = p.state() if p.state() is not None else torch.zeros(p.B, p.H, p.K, p.V, dtype=torch.float64)
    ref = torch.empty_like(v)
    for t in range(p.T):
        kt = k[:, t]
        err = v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + torch.einsum("bhk,bhv->bhkv", kt * beta[:, t, :, None], err)
        ref[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * p.K**-0.5, S)
    assert_rel_within(o, ref, FP64_AGREEMENT_REL)


def test_zero_gate_is_finite_in_every_tiled_dtype() -> None:
    """With g = 0 every split factor is exp(0) = 1: no dtype may overflow (structural)."""
    p = make_problem(1, 80, 2, 8, 8, seed=3)
    q, k, v, g, beta = p.args(torch.float32)
    for dtype in ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2"):
        for anchor in ("tile_start", "tile_middle"):
            o, _ = kda.tiled(q, k, v, torch.zeros_like(g), beta, operand_dtype=dtype, anchor=anchor)
            assert torch.isfinite(o).all(), (dtype, anchor)
