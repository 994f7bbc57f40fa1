"""Gated MLA as the harness sees it: registry rows on the built-in cases, and the overflow map.

Rows are judged by the runner under each implementation's rule (``fp64-agreement`` or
``baseline``; a predicted overflow is ``expected-nonfinite``). The quick overflow map must agree
with its analytic prediction in every cell that is not frontier-adjacent, and must contain
both outcomes where the physics says it should (it is not allowed to be trivially all-finite).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from registry_contract import quick_map

from k3verify.harness import registry
from k3verify.harness.map_files import write_map
from k3verify.harness.overflow_map import MapDefinition, MapOptions, sweep_map


def _kernels() -> list[Any]:
    """Our kernels that join MLA's map and run here (the fp16 decode kernel under the
    interpreter; bf16 and the fp8 cache too on a GPU)."""
    return [i for i in registry.get("mla").own_implementations() if i.in_map and i.unavailable() is None]


def test_quick_overflow_map_agrees_with_its_prediction(tmp_path: Path) -> None:
    """Prediction vs observation: no disagreement away from the frontier; both outcomes present
    for the no-max softmax and for fp16 operands; the correct softmax in bf16 and with the fp8
    cache never overflows on the grid; every cell keeps the old map's keys (the prediction's
    score statistics among them); JSON + PNG are written from the MapSpec. The tiled form's
    cells, every one of the quick grid; our kernels' cells beside them are the next test's."""
    entry = registry.get("mla")
    assert isinstance(entry.overflow_map, MapDefinition)
    kernels = {i.label for i in _kernels()}
    result = quick_map("mla", entry=replace(entry, own_implementations=lambda: [
        i for i in entry.own_implementations() if i.label not in kernels]))
    own = [c for c in result.cells if c["implementation"] == "k3verify tiled"]
    assert len(own) == 2 * 4 * 4 * 3 * 2 * 2  # contexts x q x latent scales x dtypes x variants x tiles
    keys = {"operand_dtype", "context", "variant", "setting", "log2_q_scale", "log2_latent_scale", "q_scale",
            "latent_scale", "max_score", "score_bound", "min_row_max", "max_lse", "binding", "headroom",
            "explanation"}
    assert all(keys <= c.keys() for c in own)
    assert all("overflow" in c for c in result.cells if not c["finite"])

    def outcomes(**where) -> set[bool]:
        return {c["finite"] for c in result.cells if all(c[k] == v for k, v in where.items())}

    assert outcomes(variant="no_max", dtype="bf16") == {True, False}
    assert outcomes(variant="subtract_max", dtype="fp16") == {True, False}
    assert outcomes(variant="subtract_max", dtype="bf16") == {True}
    assert outcomes(variant="subtract_max", dtype="fp8_e4m3") == {True}
    assert any(c["frontier_adjacent"] for c in result.cells)
    paths = write_map(result, tmp_path, {"test": True})
    assert paths[0].suffix == ".json" and any(p.suffix == ".png" for p in paths)


# Under Triton's CPU interpreter a kernel cell costs seconds (9 of the quick grid's 16 kernel cells
# launch it: 25 s of CPU), so CI takes the query scale 2^0 alone: cells finite away from the
# frontier and at it, and one refused for its non-finite cache (both outcomes), three launches.
# The whole quick grid runs under ``-m slow`` (nox -s thorough), and on a GPU in every module
# session's quick map (nox -s gpu-mla).
KERNEL_GRIDS = [pytest.param([0], id="query scale 2^0"),
                pytest.param(None, id="the quick grid", marks=pytest.mark.slow)]


@pytest.mark.parametrize("q_exps", KERNEL_GRIDS)
def test_our_kernels_cells_sit_at_every_point_they_run_and_agree(q_exps: list[float] | None) -> None:
    """Our decode kernel's rows that run here: one cell per point each (under the interpreter at
    the smallest context only), predicted like the tiled form, with no disagreement away from the
    frontier (``quick_map`` checks every cell) and both outcomes among them."""
    entry = registry.get("mla")
    kernels = _kernels()
    assert {i.form for i in kernels} <= {"kernel:decode"}
    result = quick_map("mla", MapOptions(quick=True, x_values=q_exps),
                       entry=replace(entry, own_implementations=lambda: kernels))
    own = [c for c in result.cells if c["implementation"] == "k3verify tiled"]
    theirs = [c for c in result.cells if c["implementation"] != "k3verify tiled"]
    points = {(c["context"], c["log2_q_scale"], c["log2_latent_scale"]) for c in own}
    assert len(points) == 2 * (len(q_exps) if q_exps else 4) * 4
    taken = [p for p in points if all(i.map_points({"context": p[0]}) for i in kernels)]
    assert len(theirs) == len(taken) * len(kernels) and (not kernels or taken)
    assert {(c["context"], c["log2_q_scale"], c["log2_latent_scale"]) for c in theirs} <= points
    assert all("overflow" in c for c in theirs if not c["finite"])
    if kernels:
        assert {c["finite"] for c in theirs} == {True, False}
        assert any(not c["frontier_adjacent"] for c in theirs if c["finite"])


def test_a_registered_in_map_implementation_joins_the_quick_map() -> None:
    """A registered implementation with ``in_map`` (here our tiled bf16 form posing as a plugin)
    gets a cell at every map point, keeps the point's context, is predicted by its own
    ``predict`` and agrees with it away from the frontier."""
    entry = registry.get("mla")
    plugin = replace(next(i for i in entry.own_implementations() if i.form == "tiled" and i.dtype == "bf16"),
                     implementation="plugin 0.1", source="plugin 0.1 (plugin)", in_map=True)
    result = sweep_map(replace(entry, own_implementations=lambda: [plugin]), MapOptions(quick=True))
    theirs = [c for c in result.cells if c.get("source") == plugin.source]
    assert len(theirs) == 2 * 4 * 4 and {c["context"] for c in theirs} == {16, 128}
    assert all("frontier_adjacent" in c for c in result.cells)
    assert result.meta["agreement"]["all"]["disagree_away"] == 0


def test_map_points_leave_out_the_points_an_implementation_refuses() -> None:
    """``map_points`` keeps a registered implementation off the points it refuses by design
    (no cell, so no crash counted as a disagreement), and on all the others."""
    entry = registry.get("mla")
    plugin = replace(next(i for i in entry.own_implementations() if i.form == "tiled" and i.dtype == "bf16"),
                     implementation="plugin 0.1", source="plugin 0.1 (plugin)", in_map=True,
                     map_points=lambda point: point["context"] > 16)
    result = sweep_map(replace(entry, own_implementations=lambda: [plugin]), MapOptions(quick=True))
    theirs = [c for c in result.cells if c.get("source") == plugin.source]
    assert len(theirs) == 4 * 4 and {c["context"] for c in theirs} == {128}
    assert result.meta["agreement"]["all"]["disagree_away"] == 0


def test_a_crash_agrees_only_where_overflow_is_predicted() -> None:
    """A registered cell that raises counts as non-finite: predicted non-finite there (its
    inputs overflow the kernel's fp16), it agrees; predicted finite, it disagrees."""
    entry = registry.get("mla")
    kernel = next(i for i in entry.own_implementations() if i.in_map and i.dtype == "fp16")

    def refuse(case):
        raise ValueError("refused")

    crashing = replace(kernel, implementation="crashing 0.1", source="crashing 0.1 (plugin)", run=refuse)
    result = sweep_map(replace(entry, own_implementations=lambda: [crashing]), MapOptions(quick=True))
    theirs = [c for c in result.cells if c.get("source") == crashing.source]
    assert theirs and all(not c["finite"] and c["overflow"] == "ValueError: refused" for c in theirs)
    assert {c["predicted_finite"] for c in theirs} == {True, False}
    disagree = [c for c in theirs if c["predicted_finite"]]
    assert result.meta["agreement"]["all"]["disagree_away"] + result.meta["agreement"]["all"]["disagree_adjacent"] \
        == len(disagree)
