"""The depth walk: the schedule's source lists, and every walk form against the definition.

Source lists are compared exactly against a table derived independently from docs/model.md §3's
statement of vLLM's rule. Walk forms reorganising the same arithmetic are held to the
``fp64-agreement`` rule in fp64 over every call's AttnRes output; the block-size-1 schedule is
compared bit for bit against a Full AttnRes written out here from its definition.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from strategies.attnres import FORMS, one_thread  # noqa: F401  (one_thread: autouse)
from verdicts import assert_identical

from k3verify import attnres
from k3verify.attnres.samples import WalkProblem, make_aggregation, make_walk, walks
from k3verify.numerics import fp64_agreement, resolve_dtype
from k3verify.numerics.ops import rms_norm

EMB = "b0"


def spec_table(num_layers: int, block_size: int) -> list[list[object]]:
    """Every call's sources by docs/model.md §3 read literally (layer ``l`` 0-indexed, prefix ``p``,
    ``δ`` the previous MLP output), each source as ``"b0"`` or the range of sublayer outputs
    ``(first, stop)`` it sums; attention of layer ``l`` is sublayer ``2l``, its MLP ``2l + 1``."""

    def add(p: object, r: tuple[int, int]) -> tuple[int, int]:
        assert p != EMB and p[1] == r[0], "the prefix grows by the adjacent output"
        return (p[0], r[1])

    p, delta, stored, table = EMB, None, [], []
    for l in range(num_layers):
        if delta is not None:
            p = add(p, delta)  # before attention: p ← p + δ
        if l % block_size == 0:
            stored.append(p)  # store B[l / 12] ← p
        table.append([*stored[: math.ceil(l / block_size)], p])  # B[0:n] + [p], n = ceil(l / 12)
        attn = (2 * l, 2 * l + 1)
        p = attn if l % block_size == 0 else add(p, attn)  # reset at a block start, else add
        table.append([*stored, p])  # MLP side "likewise": the stored blocks so far + [p]
        delta = (2 * l + 1, 2 * l + 2)
    table.append([*stored, add(p, delta)])  # final output AttnRes: all stored blocks + p
    return table


def as_table(schedule: attnres.Schedule) -> list[list[object]]:
    return [[EMB if s.kind == "embedding" else (s.first, s.stop) for s in c.sources] for c in schedule.calls()]


@pytest.mark.parametrize("block_size", [12, 1, 2, 5, 31, 93, 200])
def test_source_lists_match_the_spec_rule(block_size: int) -> None:
    """Exact: for every one of the 93 layers (both sides) and the output call, the source count
    and order of :meth:`Schedule.calls` equal the table derived from the schedule of docs/model.md §3."""
    assert as_table(attnres.Schedule.layers(block_size)) == spec_table(93, block_size)


def test_k3_schedule_facts() -> None:
    """Exact: K3 (93 layers, blocks of 12): 187 calls, at most 9 sources, 7 full blocks of 24
    sublayers and a 9-layer tail (18 sublayers) mixed by the output call; the attention side of
    layer l (0-indexed) mixes ceil(l/12) + 1 sources, its MLP side floor(l/12) + 2."""
    schedule = attnres.Schedule()
    calls = schedule.calls()
    assert len(calls) == 187 and schedule.max_sources == 9
    assert as_table(schedule)[-1] == [EMB, *((24 * b, 24 * (b + 1)) for b in range(7)), (168, 186)]
    for l in range(93):
        assert len(calls[2 * l].sources) == math.ceil(l / 12) + 1
        assert len(calls[2 * l + 1].sources) == l // 12 + 2
    assert [c.side for c in calls[:3]] == ["attn", "mlp", "attn"] and calls[-1].side == "output"


def test_full_attnres_sources() -> None:
    """Exact: block size 1 sublayer makes every sublayer output its own source."""
    table = as_table(attnres.Schedule.full(93))
    assert all(row == [EMB, *((i, i + 1) for i in range(s))] for s, row in enumerate(table))


@given(p=walks(), form=st.sampled_from(sorted(attnres.WALKS)))
def test_walk_forms_mix_the_scheduled_sources(p: WalkProblem, form: str) -> None:
    """Exact: every walk form mixes, at every call, the schedule's sources in the schedule's order."""
    assert p.run(form).sources == tuple(c.sources for c in p.schedule.calls())


@pytest.mark.parametrize("form", sorted(attnres.WALKS))
def test_k3_walk_forms_mix_the_scheduled_sources(form: str) -> None:
    """Exact: the same on K3's 93-layer schedule (9 sources at most, the stored buffer at most 8)."""
    p = make_walk(93, 24, d=2, T=1)
    used = p.run(form).sources
    assert used == tuple(c.sources for c in attnres.Schedule().calls())
    assert max(sum(s.kind != "partial" for s in call) for call in used) == 8


def full_attnres(p: WalkProblem) -> torch.Tensor:
    """Full AttnRes from its definition: call s mixes the embedding and every earlier sublayer output."""
    x = p.inputs
    e, weights, f = x["embedding"], x["weights"], x["sublayers"]
    outputs, hs = [], []
    for s in range(p.schedule.num_calls):
        h = attnres.aggregate(torch.stack([e, *outputs]), weights.w[s], weights.gamma[s])
        hs.append(h)
        if s < p.schedule.num_sublayers:
            outputs.append(f(s, rms_norm(h, weights.norm[s])))
    return torch.stack(hs)


@given(p=walks(max_block=1))
def test_block_size_one_is_full_attnres(p: WalkProblem) -> None:
    """Exact equality for the recurrent form (bitwise on any host: with blocks of one sublayer it
    runs the same operations on the same shapes as the Full AttnRes above, in one process),
    fp64-agreement for the two-phase and tiled forms: block size 1 ≡ Full AttnRes."""
    ref = full_attnres(p)
    assert_identical(p.run("recurrent").h, ref)
    for form in ("chunkwise", "tiled"):
        v = fp64_agreement(p.run(form).h, ref)
        assert v.passed, f"{form}: {v.reason}"


@given(p=walks())
@example(p=make_walk(93, 24, d=4, T=1))  # K3's schedule
@example(p=make_walk(5, 10, d=4, T=1))  # one block holds every sublayer: the output call merges a partial
@example(p=make_walk(6, 3, d=4, T=1))  # 12 sublayers: the output call starts a block (no partial)
def test_two_phase_walk_equals_one_shot(p: WalkProblem) -> None:
    """fp64-agreement (≤ 1e-10) over every call's AttnRes output: two-phase vs the definition."""
    v = fp64_agreement(p.run("chunkwise").h, p.run("recurrent").h)
    assert v.passed, v.reason


@given(p=walks(), tiles=st.tuples(st.integers(1, 10), st.integers(1, 10)))
def test_tiled_walk_tile_size_invariance(p: WalkProblem, tiles: tuple[int, int]) -> None:
    """fp64-agreement over every call: tiles of two sizes, and the definition."""
    a, b = (p.run("tiled", tile=t).h for t in tiles)
    for x in (b, p.run("recurrent").h):
        v = fp64_agreement(a, x)
        assert v.passed, v.reason


@pytest.mark.parametrize("stream", ["fp64", "fp32", "bf16", "fp16"])
@pytest.mark.parametrize("form", sorted(attnres.WALKS))
def test_first_call_and_output_dtype(form: str, stream: str) -> None:
    """Exact: call 0 mixes the embedding alone and returns it; the output is in the stream dtype."""
    p = make_walk(2, 3, d=8, T=2, seed=5)
    w = p.run(form, stream_dtype=stream)
    assert_identical(w.h[0], p.inputs["embedding"].to(w.h.dtype))  # bf16-representable embedding
    assert w.output.dtype == resolve_dtype(stream) and w.h.shape == (p.schedule.num_calls, 2, 8)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_production_width(form: str) -> None:
    """fp64-agreement at K3's width d = 7168 with its 9 sources; the bf16 stream stays finite."""
    p = make_aggregation(9, 2, 7168, seed=1, logit_scale=16.0)
    fn, opts = FORMS[form]
    v = fp64_agreement(fn(*p.args, **opts), attnres.aggregate(*p.args))
    assert v.passed, v.reason
    h = fn(*p.args, stream_dtype="bf16", **opts)
    assert h.shape == (2, 7168) and h.dtype == torch.bfloat16 and bool(torch.isfinite(h).all())
