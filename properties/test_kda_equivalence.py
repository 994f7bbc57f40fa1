"""KDA forms agree with the recurrent definition in fp64.

Rule for every test here: ``fp64-agreement`` (normwise relative max error <= 1e-10).
"""

from __future__ import annotations

from functools import partial

import torch
from hypothesis import example, given
from hypothesis import strategies as st
from verdicts import assert_fp64_agrees, assert_identical

from k3verify import kda
from k3verify.kda.samples import KDAProblem, make_problem
from k3verify.kda.samples import problems as kda_problems


@given(p=kda_problems(max_T=150), chunk=st.sampled_from([1, 3, 16, 64, 100]))
@example(p=make_problem(1, 65, 1, 8, 4, seed=1), chunk=64)  # one token in the last chunk
@example(p=make_problem(1, 1, 1, 4, 4, seed=2), chunk=64)  # a single token
@example(p=make_problem(2, 64, 2, 8, 6, seed=3, initial_state=False), chunk=64)  # exact chunks, no state
def test_chunkwise_matches_recurrent(p: KDAProblem, chunk: int) -> None:
    """chunkwise(C) == recurrent for any T, chunk size, initial state; outputs and final state."""
    o_ref, s_ref = kda.recurrent(*p.args(), initial_state=p.state(), output_final_state=True)
    o, s = kda.chunkwise(*p.args(), initial_state=p.state(), output_final_state=True, chunk_size=chunk)
    assert_fp64_agrees(o, o_ref)
    assert_fp64_agrees(s, s_ref)


@given(p=kda_problems(max_T=140), c1=st.sampled_from([2, 8, 32, 64]), c2=st.sampled_from([5, 16, 48, 128]))
def test_chunk_size_invariance(p: KDAProblem, c1: int, c2: int) -> None:
    """Two chunk sizes give the same outputs."""
    o1, _ = kda.chunkwise(*p.args(), initial_state=p.state(), chunk_size=c1)
    o2, _ = kda.chunkwise(*p.args(), initial_state=p.state(), chunk_size=c2)
    assert_fp64_agrees(o1, o2)


@given(
    p=kda_problems(max_T=150, kinds=("random", "saturated")),
    tile=st.sampled_from([1, 4, 8, 16, 32, 64]),
    anchor=st.sampled_from(["tile_start", "tile_middle", "row0_shift"]),
)
@example(p=make_problem(1, 70, 1, 8, 8, g_min=-5.0, seed=4, kind="saturated"), tile=16, anchor="tile_middle")
def test_tiled_in_fp64_matches_recurrent(p: KDAProblem, tile: int, anchor: str) -> None:
    """The tiled algebra (two-level split at every anchor, any sub-tile) is exact in fp64.

    Gates stay above -8 so the largest split factor, exp(64 * 8) = exp(512), fits fp64.
    """
    o_ref, s_ref = kda.recurrent(*p.args(), initial_state=p.state(), output_final_state=True)
    o, s = kda.tiled(
        *p.args(),
        initial_state=p.state(),
        output_final_state=True,
        tile=tile,
        operand_dtype=torch.float64,
        anchor=anchor,
    )
    assert_fp64_agrees(o, o_ref)
    assert_fp64_agrees(s, s_ref)


@given(p=kda_problems(max_T=100))
def test_fp64_baselines_are_the_exact_forms(p: KDAProblem) -> None:
    """The same-dtype baselines at dtype fp64 round nothing, so they equal the oracle."""
    o_ref, _ = kda.recurrent(*p.args(), initial_state=p.state())
    o_rec, _ = kda.naive_baseline(*p.args(), dtype="fp64", initial_state=p.state())
    o_chk, _ = kda.naive_chunk_baseline(*p.args(), dtype="fp64", initial_state=p.state())
    assert_fp64_agrees(o_rec, o_ref)
    assert_fp64_agrees(o_chk, o_ref)


def test_empty_sequence_returns_the_initial_state() -> None:
    """T = 0: no output rows and the initial state unchanged, for every form."""
    p = make_problem(1, 0, 2, 4, 4)
    tiled64 = partial(kda.tiled, operand_dtype=torch.float64)
    for form in (kda.recurrent, kda.chunkwise, tiled64):
        o, s = form(*p.args(), initial_state=p.state(), output_final_state=True)
        assert o.shape == (1, 0, 2, 4)
        assert_identical(s, p.state())  # bitwise: with no token the state is only copied
