"""What must not change the output: chunk, tile, split, page size, page placement, poison.

Reorganising the same arithmetic (chunk size, tile size, split count) is held to the
``fp64-agreement`` rule in fp64. The paged layout is pure addressing, so page size, page
placement and whatever sits in dead slots must give *bit-identical* outputs (exact equality),
in every form and dtype, and dead slots poisoned with NaN/inf must never reach an output.
Bitwise on any host: every form first gathers the live tokens into one ``[B, L, W]`` tensor
(dead positions selected to exact zeros, never multiplied), which does not depend on the layout,
and an fp8 cache is quantised per token (an exact amax, correctly rounded division and
conversion); everything after is the same operations on the same shapes in one process.
"""

from __future__ import annotations

import torch
from hypothesis import example, given
from hypothesis import strategies as st
from verdicts import assert_identical

from k3verify import mla
from k3verify.mla.cache import live_slots
from k3verify.mla.samples import PAGE_SIZES, MLAProblem, make_problem
from k3verify.mla.samples import problems as mla_problems
from k3verify.numerics import fp64_agreement

# (name, form, dtype of the inputs, options, fp8 cache)
FORMS = (
    ("recurrent fp64", mla.recurrent, torch.float64, {}, False),
    ("chunkwise fp64", mla.chunkwise, torch.float64, {"chunk_size": 3}, False),
    ("recurrent fp32", mla.recurrent, torch.float32, {}, False),
    ("tiled bf16", mla.tiled, torch.float64, {"tile": 4, "operand_dtype": "bf16"}, False),
    ("tiled fp16 no-max", mla.tiled, torch.float64, {"tile": 5, "operand_dtype": "fp16", "subtract_max": False}, False),
    ("split-KV bf16", mla.tiled, torch.float64, {"tile": 2, "operand_dtype": "bf16", "num_splits": 3}, False),
    ("tiled fp8 cache", mla.tiled, torch.float64, {"tile": 4, "operand_dtype": "bf16"}, True),
)
form_index = st.integers(0, len(FORMS) - 1)


def _run(p: MLAProblem, i: int, cache: mla.LatentCache) -> torch.Tensor:
    _, form, dtype, opts, fp8 = FORMS[i]
    if fp8:
        cache = mla.quantize(cache)
    return form(*p.args(dtype, cache=cache), **opts)


def _identical(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all()), f"{what}: non-finite output"
    assert_identical(a, b, f"{what}: max difference {float((a.double() - b.double()).abs().max()):.3e}")


@given(p=mla_problems(max_T=12), a=st.integers(1, 12), b=st.integers(1, 12))
def test_chunk_size_invariance(p: MLAProblem, a: int, b: int) -> None:
    """fp64-agreement between two chunk sizes of the chunked prefill."""
    v = fp64_agreement(mla.chunkwise(*p.args(), chunk_size=a), mla.chunkwise(*p.args(), chunk_size=b))
    assert v.passed, v.reason


@given(p=mla_problems(max_T=12), tiles=st.tuples(st.integers(1, 32), st.integers(1, 32)),
       splits=st.tuples(st.integers(1, 4), st.integers(1, 4)))
def test_tile_and_split_invariance(p: MLAProblem, tiles: tuple[int, int], splits: tuple[int, int]) -> None:
    """fp64-agreement between two (tile, num_splits) settings of the tiled form with fp64 operands."""
    runs = [mla.tiled(*p.args(), operand_dtype="fp64", tile=t, num_splits=s) for t, s in zip(tiles, splits)]
    v = fp64_agreement(*runs)
    assert v.passed, v.reason


@given(p=mla_problems(), i=form_index, page_size=st.sampled_from(PAGE_SIZES))
@example(p=make_problem((15, 1), 2, page_size=16), i=3, page_size=1)
def test_page_size_invariance(p: MLAProblem, i: int, page_size: int) -> None:
    """Exact equality: the same tokens cached with another page size give the same bits."""
    _identical(_run(p, i, p.cache), _run(p, i, p.layout(page_size)), f"{FORMS[i][0]}, page size {page_size}")


@given(p=mla_problems(), i=form_index, seed=st.integers(0, 1000), spare=st.integers(0, 3))
def test_page_placement_invariance(p: MLAProblem, i: int, seed: int, spare: int) -> None:
    """Exact equality: pages in order vs shuffled anywhere in a larger pool."""
    in_order = p.layout(page_order="in_order", spare_pages=0)
    shuffled = p.layout(page_order="shuffled", spare_pages=spare, seed=seed)
    _identical(_run(p, i, in_order), _run(p, i, shuffled), f"{FORMS[i][0]}, placement seed {seed}")


def _repoison(cache: mla.LatentCache, value: float) -> mla.LatentCache:
    """``cache`` with every dead slot (codes and scales of an fp8 cache too) set to ``value``."""
    dead = ~live_slots(cache)
    pool = torch.where(dead[..., None], torch.tensor(value), cache.pool.to(torch.float64)).to(cache.pool.dtype)
    scales = None if cache.scales is None else torch.where(dead, torch.tensor(value, dtype=cache.scales.dtype),
                                                           cache.scales)
    return mla.LatentCache(pool, cache.block_table, cache.seq_lens, scales)


@given(p=mla_problems(), i=form_index)
@example(p=make_problem((6,), 1, page_size=16), i=4)  # decode into a mostly dead last page
@example(p=make_problem((0, 13), 3, page_size=8), i=5)  # split-KV with a dead tail
def test_poison_in_dead_slots_is_never_read(p: MLAProblem, i: int) -> None:
    """Exact equality: dead slots holding NaN, +inf or zeros give the same, finite output."""
    cache = mla.quantize(p.cache) if FORMS[i][4] else p.cache
    assert bool((~live_slots(cache)).any()), "every problem has dead slots (a spare page at least)"
    _, form, dtype, opts, _ = FORMS[i]
    runs = {v: form(*p.args(dtype, cache=_repoison(cache, float(v))), **opts) for v in ("nan", "inf", "0")}
    _identical(runs["nan"], runs["0"], f"{FORMS[i][0]}: NaN poison vs zeros")
    _identical(runs["inf"], runs["0"], f"{FORMS[i][0]}: inf poison vs zeros")


def test_empty_part_merges_without_nan() -> None:
    """Exact equality: an empty part (no visible key) is (0, −inf) and leaves the other part unchanged.
    Exact by construction on any host: the empty part's weight is e^{−inf} = 0, the other's
    e^{L − L} = 1, and log-sum-exp of (−inf, L) is L + log(1) = L."""
    s = torch.randn(2, 3, 5, dtype=torch.float64)
    v = torch.randn(2, 5, 4, dtype=torch.float64)
    o_empty, lse_empty = mla.partial_attention(s, torch.zeros(1, 1, 5, dtype=torch.bool), v)
    assert torch.equal(o_empty, torch.zeros_like(o_empty)) and bool((lse_empty == float("-inf")).all())
    o, lse = mla.partial_attention(s, torch.ones(1, 1, 5, dtype=torch.bool), v)
    merged, total = mla.merge_partials([(o_empty, lse_empty), (o, lse)])
    assert torch.equal(merged, o) and torch.equal(total, lse)
    nothing, none_total = mla.merge_partials([(o_empty, lse_empty), (o_empty, lse_empty)])
    assert torch.equal(nothing, torch.zeros_like(nothing)) and bool((none_total == float("-inf")).all())
