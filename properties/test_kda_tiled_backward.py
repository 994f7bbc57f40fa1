"""KDA's tiled low-precision backward: exact in fp64 at every anchor, within the baseline rule in
bf16, its overflows predicted and explained, and its overflow map beside the forward's.

Rules: fp64 runs are ``fp64-agreement`` (normwise relative max error <= 1e-10 per gradient);
bf16 runs are the ``baseline`` rule against autograd through the naive bf16 chunkwise form; the
overflow checks are structural (a finite or non-finite gradient, the named operand).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from verdicts import assert_fp64_agrees

from k3verify.harness import registry
from k3verify.harness.modules import kda_backward as entry
from k3verify.harness.overflow_map import MapOptions, sweep_map
from k3verify.harness.registry import Case
from k3verify.kda import samples
from k3verify.kda.chunkwise import chunkwise_backward
from k3verify.kda.recurrent import recurrent_backward
from k3verify.kda.samples import make_problem
from k3verify.kda.samples import problems as kda_problems
from k3verify.kda.tiled import (
    ANCHORS,
    backward_overflow_quantities,
    predict_backward,
    tiled_backward,
    tiled_backward_traced,
)
from k3verify.testing import assert_matches_oracle


def _arguments(p, **extra):
    c = p.cotangents()
    return p.args(), dict(do=c["do"], dht=c["dht"], initial_state=p.state(), **extra)


@pytest.mark.parametrize("diagonal", ["matmul", "fp32"])
@pytest.mark.parametrize("anchor", ANCHORS)
def test_tiled_backward_in_fp64_matches_the_oracle(anchor: str, diagonal: str) -> None:
    """fp64 operands make the split exact up to fp64 rounding: every gradient agrees with autograd
    through the recurrence, on a partial last chunk and tiles of 8 (the row-0 anchor's shift
    included: the split's factors cancel whatever the anchor)."""
    p = make_problem(2, 100, 2, 16, 8, g_min=-3.0, seed=21)
    args, kw = _arguments(p)
    ref = recurrent_backward(*args, **kw)
    got = tiled_backward(*args, **kw, chunk_size=32, tile=8, operand_dtype="fp64", anchor=anchor, diagonal=diagonal)
    assert sorted(got) == sorted(ref)
    for name in ref:
        assert_fp64_agrees(got[name], ref[name], name)


@given(p=kda_problems(max_T=130, kinds=("random", "saturated"), g_min=st.floats(-20.0, -0.5)),
       dtype=st.sampled_from(["bf16", "fp16", "fp8_e4m3"]), anchor=st.sampled_from(ANCHORS),
       tile=st.sampled_from([4, 8, 16, 32]), upstream=st.sampled_from([1.0, 2.0**20, 2.0**40]))
@example(p=make_problem(1, 70, 2, 8, 4, g_min=-5.0, seed=3, kind="saturated"), dtype="bf16", anchor="tile_start",
         tile=16, upstream=2.0**40)  # past the accumulator's frontier only: must be predicted non-finite
def test_predicted_finite_means_finite_gradients(p, dtype: str, anchor: str, tile: int, upstream: float) -> None:
    """Wherever the backward's model predicts finite (the oracle's gradients are finite for every
    drawn problem), every gradient of the tiled backward is finite, at any gate bound, dtype,
    anchor, sub-tile and upstream scale (rule: structural)."""
    args, kw = _arguments(p)
    kw["do"], kw["dht"] = kw["do"] * upstream, kw["dht"] * upstream
    tiling = dict(chunk_size=32, tile=tile, operand_dtype=dtype, anchor=anchor)
    prediction = predict_backward(backward_overflow_quantities(*args, **kw, chunk_size=32), **tiling)
    grads = tiled_backward(*[t.float() for t in args], **{n: None if t is None else t.float() for n, t in kw.items()},
                           **tiling)
    finite = all(bool(t.isfinite().all()) for t in grads.values())
    assert finite or not prediction.finite, (prediction.explanation(), {n: int((~t.isfinite()).sum())
                                                                        for n, t in grads.items()})


def test_tiled_backward_in_fp64_handles_packed_sequences_and_the_gate() -> None:
    """The registered packed and in-kernel-gate cases: fp64 tiled = the oracle (dA_log, ddt_bias too)."""
    cases = registry.get("kda_backward").make_cases(0)
    for name in ("packed", "gate"):
        case = cases[name]
        ref = entry.oracle(case)
        got = entry.call(tiled_backward, case, torch.float64, operand_dtype="fp64", anchor="row0_shift")
        for n in ref:
            assert_fp64_agrees(got[n], ref[n], f"{name}: {n}")


def test_bf16_dots_on_the_backward_diagonal_lose_dg() -> None:
    """A pinned finding: the backward's split diagonal products include the pair ``r = c``, whose
    two halves cancel in ``dg = q dq - k dk`` only if their operands are accurate. Rounded to bf16
    (a kernel with plain bf16 dots there) they leave ``dg`` tens of times past the baseline on
    saturated gates (85x the baseline's error measured), and only ``dg``; at fp32 precision (three
    bf16 products, as fla-core 0.6.0's ``chunk_kda_bwd_kernel_intra`` computes them with safe_gate)
    every gradient passes."""
    shape = samples.MAP_SHAPE  # one sequence of 128 tokens, K = V = 32: 1.3 s for both runs
    inputs = samples.saturated_inputs(**shape, g_min=-5.0, seed=1, one_hot=False)
    case = entry.with_cotangents((inputs, dict(shape, g_min=-5.0, seed=1, gates="all at g_min")))
    kw = dict(direction="backward", baseline="chunkwise", cases=[case], timeout=None)
    assert_matches_oracle(tiled_backward, "kda", torch.bfloat16, backward_diagonal="bf16x3", **kw)
    with pytest.raises(AssertionError) as failed:
        assert_matches_oracle(tiled_backward, "kda", torch.bfloat16, backward_diagonal="operand", **kw)
    named = {n for n in entry.OUTPUTS if f"output '{n}'" in str(failed.value)}
    assert named == {"dg"}, str(failed.value)


def _loud(g_min: float, upstream: float) -> Case:
    return entry._map_case({"input": "loud" if upstream > 1 else "worst", "g_min": g_min}, 0)


def test_a_large_upstream_gradient_overflows_the_split_product_not_an_operand() -> None:
    """fla-core's ``test_gdn2_overflow.py`` class: at a gate bound where every operand of the
    forward fits bf16, an upstream gradient of 2^40 overflows the fp32 accumulator of the backward's
    split diagonal product. The model predicts it and names the check; the trace names the product
    and its tile; the same inputs with unit cotangents are finite and predicted so."""
    tiling = dict(chunk_size=64, tile=16, operand_dtype="bf16", anchor="tile_start")
    quiet, loud = _loud(-5.0, 1.0), _loud(-5.0, entry.LOUD_SCALE)
    assert predict_backward(entry.overflow_quantities(quiet), **tiling).finite
    assert bool(entry._map_run(quiet, **tiling)[0].isfinite().all())
    prediction = predict_backward(entry.overflow_quantities(loud), **tiling)
    assert not prediction.finite
    assert prediction.reasons == (prediction.reasons[0],) and "split diagonal product" in prediction.reasons[0]
    args, kw = entry.arguments(loud, torch.float32)
    grads, events = tiled_backward_traced(*args, **kw, **tiling)
    assert not bool(grads["dq"].isfinite().all())
    assert events and events[0].operand.startswith("diagonal") and events[0].arrived_nonfinite
    assert "chunk" in events[0].describe() and "tile" in events[0].describe()


def test_fp16_overflows_where_the_forward_does() -> None:
    """The backward recomputes the forward's anchored operands: past fp16's frontier its first
    overflow is the forward's diagonal key operand, predicted by the same check."""
    case = _loud(-5.0, 1.0)
    tiling = dict(chunk_size=64, tile=16, operand_dtype="fp16", anchor="tile_start")
    prediction = predict_backward(entry.overflow_quantities(case), **tiling)
    assert not prediction.finite and any("ln|operand|" in r for r in prediction.reasons)
    args, kw = entry.arguments(case, torch.float32)
    _, events = tiled_backward_traced(*args, **kw, **tiling)
    assert events[0].operand == "diagonal key operand" and not events[0].arrived_nonfinite


def test_the_quantities_come_from_the_exact_backward() -> None:
    """The cotangents the model reads are the exact backward's: a prediction made from them is
    the same whichever dtype the case's inputs were given in (they are taken in fp64)."""
    case = _loud(-4.0, 1.0)
    args, kw = entry.arguments(case, torch.float64)
    q64 = backward_overflow_quantities(*args, **kw)
    args32, kw32 = entry.arguments(case, torch.float32)
    q32 = backward_overflow_quantities(*args32, **kw32)
    for a, b in zip(q64.sequences[0], q32.sequences[0]):
        assert a.dtype == torch.float64 and torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    ref = chunkwise_backward(*args, **kw)
    assert ref["dq"].dtype == torch.float64


def test_the_backward_map_agrees_with_its_prediction_and_sits_beside_the_forward() -> None:
    """The backward map at K3's sub-tile over three gate bounds: every cell's prediction agrees
    with its observation; for unit cotangents the backward's frontier is the forward's, and the
    loud input's (upstream 2^40) is reached at a milder bound for bf16 (the accumulator check)."""
    d = registry.get("kda_backward").overflow_map
    at_16 = replace(d, forms=lambda o: [f for f in d.forms(o) if f.params["tile"] == 16])
    result = sweep_map(replace(registry.get("kda_backward"), overflow_map=at_16),
                       MapOptions(quick=True, x_values=[-0.5, -5.0, -6.0]))
    counts = result.meta["agreement"]["all"]
    assert counts["cells"] == 3 * 3 * 4 * 3 and counts["agree"] == counts["cells"], counts
    bf16 = result.meta["frontier"]["bf16"]["tile_start"]["16"]
    assert bf16["forward"] == bf16["worst"] == -6.0 and bf16["loud"] == -5.0, bf16
    assert {c["input"] for c in result.cells} == set(entry.MAP_INPUTS)


def test_tiled_backward_rows_are_registered_with_their_prediction() -> None:
    """The run's tiled backward rows: bf16 at every anchor and fp16 with and without the fp32
    diagonal, each with a prediction and an explanation."""
    tiled = [i for i in entry.own_implementations() if i.form == "tiled"]
    assert {(i.dtype, i.params.get("anchor"), i.params.get("diagonal", "matmul")) for i in tiled} == {
        *(("bf16", a, "matmul") for a in ANCHORS), ("fp16", "tile_start", "matmul"), ("fp16", "tile_start", "fp32")}
    assert all(i.predict is not None and i.explain is not None for i in tiled)


def test_the_tiling_is_validated_by_name() -> None:
    p = make_problem(1, 8, 1, 4, 4, seed=1)
    args, kw = _arguments(p)
    with pytest.raises(ValueError, match="backward_diagonal"):
        tiled_backward(*args, **kw, backward_diagonal="tf32")
    with pytest.raises(TypeError, match="do"):
        tiled_backward_traced(*args)

