"""Causality: perturbing tokens at positions >= P never changes outputs before P.

Rule: exact equality (bit for bit) — a causal computation reads nothing from the future, so
not even rounding may differ. This holds on any host: both runs are the same operations on
tensors of the same shapes in one process (so every earlier element takes the same kernel path
and summation order), and future values reach earlier rows only multiplied by exact zeros
(masked decays e^{−inf} = 0, ``tril``), which add nothing in any order; the triangular solve
forms each row from earlier rows only. Partial tail chunks and tiles are always present (T is
drawn freely). The ``tile_middle`` anchor reads a future row's gate inside a diagonal tile; in
low precision that leaks the future into earlier outputs (FLA issue #1240). That is recorded
here as a finding: the pinned case must show the leak, and the harness must name the anchor
row that caused it.
"""

from __future__ import annotations

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from k3verify import kda
from k3verify.kda.samples import KDAProblem, make_problem
from k3verify.kda.samples import problems as kda_problems
from k3verify.kda.tiled import diagonal_anchor


def _perturbed(p: KDAProblem, P: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Inputs with every token at position >= P redrawn (gates stay valid: g <= 0)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g, beta = (t.clone() for t in p.args())
    tail = slice(P, None)
    for t in (q, k, v):
        t[:, tail] = torch.randn(t[:, tail].shape, generator=gen, dtype=t.dtype)
    q[:, tail], k[:, tail] = kda.l2norm(q[:, tail]), kda.l2norm(k[:, tail])
    g[:, tail] = p.g_min * torch.rand(g[:, tail].shape, generator=gen, dtype=g.dtype)
    beta[:, tail] = torch.rand(beta[:, tail].shape, generator=gen, dtype=beta.dtype)
    return q, k, v, g, beta


def _changed_before(form, p: KDAProblem, P: int, seed: int, dtype: torch.dtype, **kw) -> int:
    """How many outputs before position P differ after perturbing positions >= P."""
    a, _ = form(*p.args(dtype), initial_state=p.state(dtype), **kw)
    b, _ = form(*(t.to(dtype) for t in _perturbed(p, P, seed)), initial_state=p.state(dtype), **kw)
    return int((a[:, :P] != b[:, :P]).sum())


FORMS = {
    "recurrent": (kda.recurrent, {}),
    "chunkwise": (kda.chunkwise, {"chunk_size": 64}),
    "tiled bf16 tile_start": (kda.tiled, {"tile": 16, "anchor": "tile_start"}),
    "tiled bf16 row0_shift": (kda.tiled, {"tile": 16, "anchor": "row0_shift"}),
    "tiled fp16 fp32-diagonal": (kda.tiled, {"tile": 16, "operand_dtype": "fp16", "diagonal": "fp32"}),
}


@given(
    p=kda_problems(min_T=2, max_T=150, g_min=st.just(-5.0)),
    data=st.data(),
    form=st.sampled_from(sorted(FORMS)),
    dtype=st.sampled_from([torch.float64, torch.float32]),
)
@example(p=make_problem(1, 75, 1, 8, 8, seed=5), data=None, form="tiled bf16 tile_start", dtype=torch.float32)
def test_causal_forms_never_read_the_future(p: KDAProblem, data, form: str, dtype: torch.dtype) -> None:
    P = data.draw(st.integers(1, p.T - 1), label="P") if data is not None else 70
    fn, kw = FORMS[form]
    assert _changed_before(fn, p, P, seed=p.seed + 1, dtype=dtype, **kw) == 0


# A partial tail tile (T = 75: rows 64..74 of chunk 1, tile 0 holds 11 rows). Perturbing from
# P = 68 changes the gate at the middle row (64 + 8 = 72), which tile_middle reads for rows
# 64..71: in bf16 their rounding changes.
LEAK_CASE = make_problem(1, 75, 1, 8, 8, g_min=-5.0, seed=7)
LEAK_P = 68


def test_tile_middle_anchor_leaks_future_tokens_in_bf16() -> None:
    """Finding (FLA #1240): tile_middle lets tokens >= P change bf16 outputs before P."""
    changed = _changed_before(kda.tiled, LEAK_CASE, LEAK_P, seed=11, dtype=torch.float32, tile=16, anchor="tile_middle")
    assert changed > 0, "the future-row anchor no longer leaks: update FINDINGS and this test"


def test_tile_middle_leak_is_rounding_sized() -> None:
    """The leak is a rounding effect: in fp64 operands it stays at the fp64 agreement level.

    Rule: fp64-agreement between the perturbed and unperturbed outputs before P.
    """
    a, _ = kda.tiled(
        *LEAK_CASE.args(), initial_state=LEAK_CASE.state(), tile=16, anchor="tile_middle", operand_dtype=torch.float64
    )
    b, _ = kda.tiled(
        *_perturbed(LEAK_CASE, LEAK_P, 11),
        initial_state=LEAK_CASE.state(),
        tile=16,
        anchor="tile_middle",
        operand_dtype=torch.float64,
    )
    rel = float((a[:, :LEAK_P] - b[:, :LEAK_P]).abs().max() / a[:, :LEAK_P].abs().max())
    assert rel <= 1e-10


def test_tile_middle_anchor_row_is_in_the_future() -> None:
    """The harness's anchor explains the leak: for rows before the middle, the anchor row is later."""
    Gt = torch.arange(16, dtype=torch.float64).reshape(1, 16, 1).neg()  # rows 0..15 of one tile
    anchor = diagonal_anchor(Gt, "tile_middle")
    middle = int((Gt[0, :, 0] == anchor[0, 0]).nonzero())
    assert middle == 8  # rows 0..7 read row 8's prefix
