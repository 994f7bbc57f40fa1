"""Gated MLA as the harness sees it: registry rows on the built-in cases, and the overflow map.

Rows are judged by the runner under each implementation's rule (``fp64-agreement`` or
``baseline``; a predicted overflow is ``expected-nonfinite``). The quick overflow map must agree
with its analytic prediction in every cell that is not frontier-adjacent, and must contain
both outcomes where the physics says it should (it is not allowed to be trivially all-finite).
"""

from __future__ import annotations

from pathlib import Path

from registry_contract import passing_rows, quick_map

from k3verify.harness.overflow_map import write_map
from k3verify.numerics import EXPECTED_NONFINITE


def test_every_registered_row_passes() -> None:
    """Runner verdicts: no row fails; fp64 rows within 1e-10; the known-bad softmax is an
    expected overflow on the hot case and a pass on the default case."""
    rows = passing_rows("mla")
    assert {r["form"] for r in rows} >= {"recurrent", "chunkwise", "tiled", "tiled:split-kv"}
    no_max = {r["case"]: r["status"] for r in rows if r["params"].get("subtract_max") is False}
    assert no_max == {"default": "pass", "hot": EXPECTED_NONFINITE}
    assert all(r["status"] == "pass" for r in rows if r["case"] == "hot" and r["params"].get("subtract_max", True))


def test_quick_overflow_map_agrees_with_its_prediction(tmp_path: Path) -> None:
    """Prediction vs observation: no disagreement away from the frontier; both outcomes present
    for the no-max softmax and for fp16 operands; the correct softmax in bf16 and with the fp8
    cache never overflows on the grid; JSON + PNG are written from the MapSpec."""
    result = quick_map("mla")

    def outcomes(**where) -> set[bool]:
        return {c["finite"] for c in result.cells if all(c[k] == v for k, v in where.items())}

    assert outcomes(variant="no_max", dtype="bf16") == {True, False}
    assert outcomes(variant="subtract_max", dtype="fp16") == {True, False}
    assert outcomes(variant="subtract_max", dtype="bf16") == {True}
    assert outcomes(variant="subtract_max", dtype="fp8_e4m3") == {True}
    assert any(c["frontier_adjacent"] for c in result.cells)
    paths = write_map(result, tmp_path, {"test": True})
    assert paths[0].suffix == ".json" and any(p.suffix == ".png" for p in paths)
