"""What every module's registry entry must satisfy, checked the same way for each module.

``passing_rows``: the runner's verdicts on the built-in cases: no row fails, and every row
under the ``fp64-agreement`` rule is within its bound (``numerics.policy``).
``quick_map``: the quick overflow map through the one sweep engine: progress reaches the last
point, every cell carries the required keys and its map axes, and prediction and observation
never disagree away from the frontier.
"""

from __future__ import annotations

from typing import Any

from k3verify.harness import registry, runner
from k3verify.harness.overflow_map import REQUIRED_CELL_KEYS, MapOptions, MapResult, sweep_map
from k3verify.numerics import FAIL, FP64_AGREEMENT_REL


def passing_rows(module: str) -> list[dict[str, Any]]:
    """Run ``module``'s registry rows; assert none fails and fp64 rows agree to 1e-10."""
    rows = list(runner.run([registry.get(module)]))
    failed = [f"{r['form']} {r['dtype']} {r['params']} on {r['case']}: {r.get('reason') or r['verdict']['reason']}"
              for r in rows if r["status"] == FAIL]  # fmt: skip
    assert not failed, failed
    for r in rows:
        if r["rule"] == "fp64-agreement":
            assert r["verdict"]["err"] <= FP64_AGREEMENT_REL, r
    return rows


def quick_map(module: str) -> MapResult:
    """``module``'s quick overflow map, after the checks every map must pass."""
    calls = []
    result = sweep_map(registry.get(module), MapOptions(quick=True), lambda done, total: calls.append((done, total)))
    result.check()
    assert calls and calls[-1][0] == calls[-1][1] and result.cells
    spec = result.spec
    for c in result.cells:
        assert set(REQUIRED_CELL_KEYS) <= c.keys()
        assert {spec.x, spec.y, spec.panel_row, spec.panel_col, spec.figure, "frontier_adjacent"} <= c.keys()
    counts = result.meta["agreement"]["all"]
    assert counts["cells"] == len(result.cells) and counts["disagree_away"] == 0, counts
    return result
