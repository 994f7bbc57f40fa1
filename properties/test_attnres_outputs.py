"""Block AttnRes's named outputs: ``h`` everywhere, ``blocks`` (the stored block representations at
the end of a walk) on walks, each judged by the runner on its own.

A walk's blocks are checked exactly against the sums of the sublayer outputs the schedule stores
(in fp64 the walk forms them by the same operations in the same order), every form's blocks
against the definition's under ``fp64-agreement``, and the oracle and the same-dtype baseline
against each other for names, shapes and dtypes. An implementation that matches the oracle's
``h`` bit for bit but moves one stored block by 1 % of its RMS must fail, on ``blocks``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import example, given
from strategies.attnres import one_thread  # noqa: F401  (one_thread: autouse)
from verdicts import assert_identical

from k3verify import attnres
from k3verify.attnres.samples import WalkProblem, make_walk, walks
from k3verify.harness import registry, runner
from k3verify.harness.registry import BASELINE_RULE, FP64_RULE, Case, Implementation
from k3verify.numerics import FAIL, PASS, fp64_agreement, resolve_dtype
from k3verify.numerics.ops import rms_norm


def stored_sums(p: WalkProblem) -> torch.Tensor:
    """The blocks by the schedule's definition: ``b_0`` the embedding, ``b_j`` the sum, left to
    right, of the outputs of block ``j - 1``'s sublayers, for every block completed by the walk;
    sublayer outputs recomputed from the definition's mixtures."""
    x, B = p.inputs, p.schedule.block_sublayers
    h = p.run("recurrent").h
    y = [x["sublayers"](s, rms_norm(h[s], x["weights"].norm[s])) for s in range(p.schedule.num_sublayers)]
    blocks = [x["embedding"]]
    for j in range(len(y) // B):
        acc = y[j * B]
        for s in range(j * B + 1, (j + 1) * B):
            acc = acc + y[s]
        blocks.append(acc)
    return torch.stack(blocks)


@given(p=walks())
@example(p=make_walk(93, 24, d=4, T=1))  # K3's schedule: 7 full blocks stored, a 9-layer tail not
@example(p=make_walk(6, 3, d=4, T=1))  # 12 sublayers: the last sublayer completes a block
@example(p=make_walk(4, 1, d=4, T=1))  # Full AttnRes: every sublayer output is a stored block
def test_blocks_are_the_stored_sums(p: WalkProblem) -> None:
    """Exact equality for the recurrent form (bitwise on any host: in fp64 every rounding to the
    stream is the identity and the sums above add the same tensors in the same order, in one
    process), fp64-agreement for the two-phase and tiled forms, whose mixtures differ in the last
    bits: ``blocks`` is the stored blocks in the order they were stored, ``b_0`` first."""
    ref = stored_sums(p)
    assert ref.shape == (1 + p.schedule.num_sublayers // p.schedule.block_sublayers, p.T, p.d)
    assert_identical(p.run("recurrent").blocks, ref)
    for form in ("chunkwise", "tiled"):
        v = fp64_agreement(p.run(form).blocks, ref)
        assert v.passed, f"{form}: {v.reason}"


@pytest.mark.parametrize("stream", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("form", sorted(attnres.WALKS))
def test_blocks_are_held_in_the_stream_dtype(form: str, stream: str) -> None:
    """Exact: the blocks come back in the stream dtype, the embedding (bf16-representable) first
    and unchanged; the same-dtype plain walk returns its blocks the same way."""
    p = make_walk(5, 3, d=8, T=2, seed=5)
    x = p.inputs
    naive = attnres.naive_walk(x["embedding"], x["weights"], x["sublayers"], dtype=stream, schedule=p.schedule)
    for blocks in (p.run(form, stream_dtype=stream).blocks, naive.blocks):
        assert blocks.dtype == resolve_dtype(stream) and blocks.shape == (4, 2, 8)
        assert_identical(blocks[0].double(), x["embedding"])


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_baseline_makes_every_output_of_the_oracle(dtype: str) -> None:
    """Structural: on every case the baseline returns the oracle's output names with its shapes,
    in the stream dtype for a walk's blocks (a plain implementation stores them there)."""
    entry = registry.get("attnres")
    for name, case in entry.make_cases(0).items():
        ref, base = entry.oracle(case), entry.baseline(case, dtype, "recurrent")
        walk = "embedding" in case.inputs
        assert set(ref) == set(base) == ({"h", "blocks"} if walk else {"h"}), name
        assert all(base[k].shape == ref[k].shape for k in ref), name
        if walk:
            assert base["blocks"].dtype == resolve_dtype(dtype) and ref["blocks"].dtype == torch.float64


def test_call_runs_either_level() -> None:
    """Exact: ``call`` runs an aggregation form on an aggregation case and a walk form on a walk
    case, on inputs cast to the dtype, and returns the named outputs the forms make directly (the
    same operations on the same inputs in one process)."""
    entry = registry.get("attnres")
    cases = entry.make_cases(0)
    x = cases["sources"].inputs
    got = entry.call(attnres.aggregate_tiled, cases["sources"], torch.float32, tile=2)
    assert set(got) == {"h"}
    assert_identical(got["h"], attnres.aggregate_tiled(x["sources"].float(), x["w"].float(), x["gamma"].float(),
                                                          tile=2))
    x = cases["walk"].inputs
    got = entry.call(attnres.chunkwise, cases["walk"], torch.bfloat16)
    w = attnres.chunkwise(x["embedding"].bfloat16(), x["weights"].to(torch.bfloat16), x["sublayers"],
                          schedule=x["schedule"])
    assert set(got) == {"h", "blocks"} and torch.equal(got["h"], w.output) and torch.equal(got["blocks"], w.blocks)
    assert got["blocks"].dtype == torch.bfloat16


@pytest.mark.parametrize("block", [0, 3, -1])
@pytest.mark.parametrize(("dtype", "rule"), [("fp64", FP64_RULE), ("fp32", BASELINE_RULE)])
def test_one_block_off_fails_on_blocks(block: int, dtype: str, rule: str) -> None:
    """Runner verdict: the oracle's ``h`` exactly (passes under either rule), one stored block
    scaled by 1.01 (off by 1 % of its RMS): the row fails, and the binding output is ``blocks``."""
    entry = registry.get("attnres")
    case = entry.make_cases(0)["walk"]

    def run(c: Case) -> dict[str, torch.Tensor]:
        out = {k: v.clone() for k, v in entry.oracle(c).items()}
        out["blocks"][block] *= 1.01
        return out

    impl = Implementation(module="attnres", implementation="test", form="one block off", dtype=dtype, params={},
                          rule=rule, run=run, cases=("walk",))
    row = runner.verify(entry, impl, case)
    assert row["outputs"]["h"]["status"] == PASS, row["outputs"]["h"]
    assert row["status"] == FAIL and row["output"] == "blocks", (row["status"], row["output"])
    assert row["outputs"]["blocks"]["status"] == FAIL


def test_one_block_off_in_a_walk_run_fails_on_blocks() -> None:
    """Runner verdict: the same through a real form's row (tiled, fp32 stream) with one block of
    its own result moved by 1 % of its RMS: its ``h`` still passes, the row fails on ``blocks``."""
    entry = registry.get("attnres")
    case = entry.make_cases(0)["walk"]
    good = next(i for i in entry.implementations() if (i.form, i.dtype) == ("tiled", "fp32"))

    def run(c: Case) -> dict[str, torch.Tensor]:
        out = dict(good.run(c))
        out["blocks"] = out["blocks"].clone()
        out["blocks"][-1] *= 1.01
        return out

    assert runner.verify(entry, good, case)["status"] == PASS
    row = runner.verify(entry, dataclasses.replace(good, run=run), case)
    assert row["outputs"]["h"]["status"] == PASS
    assert row["status"] == FAIL and row["output"] == "blocks"
