"""What every module's registry entry must satisfy, checked the same way for each module.

``passing_rows``: the runner's verdicts on the built-in cases: no row fails, every row under the
``fp64-agreement`` rule is within its bound (``numerics.policy``), and every row is a
:class:`~k3verify.harness.rows.Row` with no undeclared key (the writer's side of the schema).
``ROW_FACTS``: what a module's rows show beyond that (its forms, its expected overflows), checked
by the contract test after ``passing_rows``; a module without an entry gets the generic checks.
``quick_map``: the quick overflow map through the one sweep engine: progress reaches the last
point, every cell carries the required keys and its map axes, and prediction and observation
never disagree away from the frontier.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from k3verify.attnres import samples as attnres_samples
from k3verify.harness import registry, runner
from k3verify.harness.environment import one_thread
from k3verify.harness.files import json_safe
from k3verify.harness.overflow_map import REQUIRED_CELL_KEYS, MapOptions, MapResult, sweep_map
from k3verify.harness.rows import Row
from k3verify.numerics import EXPECTED_NONFINITE, FAIL, FP64_AGREEMENT_REL


def passing_rows(module: str, report: Path | None = None) -> list[dict[str, Any]]:
    """Run ``module``'s registry rows, or read them from a ``k3verify run`` report that verified it
    (its golden oracle rows left out); assert none fails, fp64 rows agree to 1e-10 and every row
    is a declared :class:`Row` (strict: a key the runner writes must be declared there)."""
    if report is not None:
        doc = json.loads(report.read_text())
        assert module in doc["config"]["modules"], f"{report} did not verify {module}"
        assert doc["config"].get("implementations") is None, f"{report} verified a selection of implementations"
        rows = [r for r in doc["rows"] if r["module"] == module and "golden" not in r]
    else:
        with one_thread():  # the cases are small: a second intra-op thread only spins on a busy box
            rows = list(runner.run([registry.get(module)]))
    for r in rows:
        Row.from_json(json_safe(r), where=f"{module} row {r['form']} {r['dtype']} on {r['case']}", strict=True)
    failed = [f"{r['form']} {r['dtype']} {r['params']} on {r['case']}: {r.get('reason') or r['verdict']['reason']}"
              for r in rows if r["status"] == FAIL]  # fmt: skip
    assert not failed, failed
    for r in rows:
        if r["rule"] == "fp64-agreement":
            assert r["verdict"]["err"] <= FP64_AGREEMENT_REL, r
    return rows


def quick_map(module: str, options: MapOptions | None = None, entry: Any = None) -> MapResult:
    """``module``'s quick overflow map (``options``: the quick grid unless given; ``entry``: the
    registry's unless given), after the checks every map must pass."""
    calls = []
    result = sweep_map(entry or registry.get(module), options or MapOptions(quick=True),
                       lambda done, total: calls.append((done, total)))
    result.check()
    assert calls and calls[-1][0] == calls[-1][1] and result.cells
    spec = result.spec
    for c in result.cells:
        assert set(REQUIRED_CELL_KEYS) <= c.keys()
        assert {spec.x, spec.y, spec.panel_row, spec.panel_col, spec.figure, "frontier_adjacent"} <= c.keys()
    counts = result.meta["agreement"]["all"]
    assert counts["cells"] == len(result.cells) and counts["disagree_away"] == 0, counts
    return result


def _mla_rows(rows: list[dict[str, Any]]) -> None:
    """The known-bad softmax (no max subtracted) is an expected overflow on the hot case and a
    pass on the default case; every correct form passes on ``hot``."""
    assert {r["form"] for r in rows} >= {"recurrent", "chunkwise", "tiled", "tiled:split-kv"}
    no_max = {r["case"]: r["status"] for r in rows if r["params"].get("subtract_max") is False}
    assert no_max == {"default": "pass", "hot": EXPECTED_NONFINITE}
    assert all(r["status"] == "pass" for r in rows
               if r["case"] == "hot" and r["params"].get("subtract_max", True) and r["status"] != "unavailable")


def _attnres_rows(rows: list[dict[str, Any]]) -> None:
    """Every form runs on an aggregation and on a walk, and every named output of the case is
    judged (aggregations: ``h``; walks: ``h`` and ``blocks``); the no-max softmax is an expected
    overflow on ``hot`` and a pass elsewhere."""
    for form in ("recurrent", "chunkwise", "tiled"):
        assert {"sources", "walk"} <= {r["case"] for r in rows if r["form"] == form}, form
    for r in (r for r in rows if r["status"] != "unavailable"):
        walk = r["case"] in (*attnres_samples.WALK_CASES, attnres_samples.K3_WALK)
        assert set(r["outputs"]) == ({"h", "blocks"} if walk else {"h"}), (r["case"], set(r["outputs"]))
    no_max = {r["case"]: r["status"] for r in rows if r["params"].get("subtract_max") is False}
    assert no_max == {"sources": "pass", "hot": EXPECTED_NONFINITE, "walk": "pass"}
    assert all(r["status"] == "pass" for r in rows
               if r["case"] == "hot" and r["params"].get("subtract_max", True) and r["status"] != "unavailable")


def _moe_rows(rows: list[dict[str, Any]]) -> None:
    """Recurrent, chunkwise, tiled, router and grouped-expert kernel rows exist; exactly the two
    predicted overflows (SwiGLU in fp16 at 2^8, a static fp8 scale at 2^8) are expected-nonfinite;
    every case routes alike in fp32 and fp64, so every row's ``experts`` (judged by the mismatch
    rule) match the oracle's on every token."""
    rows = [r for r in rows if r["status"] != "unavailable"]  # bf16 kernels need a GPU
    assert {r["form"] for r in rows} == {"recurrent", "chunkwise", "tiled", "kernel:router", "kernel:grouped"}
    for r in rows:
        assert r["case_params"]["fp32_routing_equals_fp64"], r["case"]
        assert set(r["outputs"]) == {"y", "experts"}, r["outputs"].keys()
        assert r["outputs"]["experts"]["metrics"]["mismatch"] == 0.0, (r["form"], r["dtype"], r["case"])
    expected = {(r["dtype"], r["params"].get("fp8_scaling"), r["case"]) for r in rows
                if r["status"] == EXPECTED_NONFINITE}
    assert expected == {("fp16", None, "scaled_swiglu"), ("fp8_e4m3", "static", "scaled")}
    skewed = next(r for r in rows if r["case"] == "skewed")
    assert skewed["case_params"]["idle_experts"] > 0


def _kda_backward_rows(rows: list[dict[str, Any]]) -> None:
    """Every row says it is a backward; each of our forms ran on the four cases, the gate's
    parameters judged on the gate case only; fla-core's chunk reference is the predicted NaN
    (in dq, dk, dg, dbeta; dv finite) wherever it ran. The tiled backward passes in bf16 at every
    anchor; in fp16 it is the predicted overflow at K3's bound, and passes with fp32 diagonal tiles."""
    assert {r.get("direction") for r in rows} == {"backward"}
    ours = [r for r in rows if r["implementation"] == "k3verify"]
    assert {r["case"] for r in ours} == {"default", "saturated", "packed", "gate"}
    for r in ours:
        assert ({"dA_log", "ddt_bias"} <= set(r["outputs"])) == (r["case"] == "gate"), (r["case"], sorted(r["outputs"]))
    tiled = [r for r in ours if r["form"] == "tiled"]
    assert {r["params"]["anchor"] for r in tiled if r["dtype"] == "bf16"} == {"tile_start", "tile_middle", "row0_shift"}
    for r in tiled:
        past = r["dtype"] == "fp16" and r["params"].get("diagonal", "matmul") == "matmul"
        assert r["status"] == (EXPECTED_NONFINITE if past else "pass"), (r["dtype"], r["params"], r["case"])
        assert r["prediction"]["finite"] is not past, r["prediction"]
    fla_chunk = [r for r in rows if r["implementation"].startswith("fla-core") and r["form"].startswith("chunkwise")]
    for r in fla_chunk:
        if r["status"] == "unavailable":
            continue
        assert r["status"] == EXPECTED_NONFINITE and not r["prediction"]["finite"], r
        assert r["outputs"]["dv"]["status"] == "pass" and r["outputs"]["dq"]["status"] == EXPECTED_NONFINITE


def _mla_backward_rows(rows: list[dict[str, Any]]) -> None:
    """Every row says it is a backward and judges the five gradients; the tiled bf16 backward
    passes on both cases with δ from the stored bf16 output and from fp32."""
    assert {r.get("direction") for r in rows} == {"backward"}
    for r in (r for r in rows if r["status"] != "unavailable"):
        assert set(r["outputs"]) == {"dq_nope", "dq_pe", "dkv", "dw_uk", "dw_uv"}, sorted(r["outputs"])
    tiled = {(r["params"]["delta"], r["case"]): r["status"] for r in rows if r["form"] == "tiled"}
    assert tiled == {(d, c): "pass" for d in ("output", "fp32") for c in ("default", "hot")}, tiled


ROW_FACTS: dict[str, Callable[[list[dict[str, Any]]], None]] = {
    "mla": _mla_rows, "attnres": _attnres_rows, "moe": _moe_rows, "kda_backward": _kda_backward_rows,
    "mla_backward": _mla_backward_rows,
}
