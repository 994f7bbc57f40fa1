"""Block AttnRes as the harness sees it: registry rows, the precision map and the depth-drift curve.

Rows are judged by the runner under each implementation's rule (``fp64-agreement`` or
``baseline``; a predicted overflow is ``expected-nonfinite``). The quick map must agree with its
analytic prediction in every cell that is not frontier-adjacent and must contain both outcomes
where the physics says it should.
"""

from __future__ import annotations

import json
from pathlib import Path

from registry_contract import passing_rows, quick_map
from strategies.attnres import one_thread  # noqa: F401  (autouse fixture)

from k3verify.harness.modules import attnres as entry_module
from k3verify.harness.overflow_map import write_map
from k3verify.numerics import EXPECTED_NONFINITE


def test_every_registered_row_passes() -> None:
    """Runner verdicts: no row fails; fp64 rows within 1e-10; every form runs on an aggregation
    and on a walk; the no-max softmax is an expected overflow on ``hot`` and a pass elsewhere."""
    rows = passing_rows("attnres")
    for form in ("recurrent", "chunkwise", "tiled"):
        assert {"sources", "walk"} <= {r["case"] for r in rows if r["form"] == form}, form
    no_max = {r["case"]: r["status"] for r in rows if r["params"].get("subtract_max") is False}
    assert no_max == {"sources": "pass", "hot": EXPECTED_NONFINITE, "walk": "pass"}
    assert all(r["status"] == "pass" for r in rows if r["case"] == "hot" and r["params"].get("subtract_max", True))


def test_quick_map_agrees_with_its_prediction(tmp_path: Path) -> None:
    """Prediction vs observation: no disagreement away from the frontier; the no-max softmax
    overflows past ln(max fp32) with fp32 logits and past ln(65504) with fp16 ones, and not
    below; with max subtraction only fp16 logits overflow (past 65504); bf16 logits fail the
    baseline rule somewhere in a bf16 stream and fp32 logits nowhere. JSON + PNG are written."""
    result = quick_map("attnres")

    def finite(**where) -> dict[float, set[bool]]:
        out: dict[float, set[bool]] = {}
        for c in result.cells:
            if all(c[k] == v for k, v in where.items()):
                out.setdefault(c["logit_scale"], set()).add(c["finite"])
        return out

    assert finite(variant="no_max", logit_dtype="fp32") == {4: {True}, 12: {True}, 85: {True}, 96: {False},
                                                            131072: {False}}
    assert finite(variant="no_max", logit_dtype="fp16")[4] == {True}
    assert finite(variant="no_max", logit_dtype="fp16")[12] == {False}
    assert finite(variant="subtract_max", logit_dtype="fp16")[131072] == {False}
    assert all(v == {True} for v in finite(variant="subtract_max", logit_dtype="bf16").values())
    failures = result.meta["baseline_failures"]
    assert failures["bf16 stream, bf16 logits, subtract_max"]["failing"] > 0
    assert all(failures[f"{s} stream, fp32 logits, {v}"]["failing"] == 0 for s in ("bf16", "fp16", "fp32")
               for v in ("subtract_max", "no_max"))
    paths = write_map(result, tmp_path, {"test": True})
    assert paths[0].suffix == ".json" and any(p.suffix == ".png" for p in paths)


def test_depth_drift_curve(tmp_path: Path) -> None:
    """Structural: one entry per call (186 sublayers + the output); the first call (the embedding
    alone, bf16-representable) is exact; a bf16 stream is worse than an fp32 one at every other
    call; the JSON carries the keys the report reads."""
    drift = entry_module.depth_drift()
    n = 187
    assert len(drift["layers"]) == len(drift["sublayer"]) == len(drift["error_bf16"]) == len(drift["error_fp32"]) == n
    assert drift["layers"][0] == 1 and drift["layers"][-1] == 93 and drift["sublayer"][-1] == "output"
    assert drift["error_bf16"][0] == drift["error_fp32"][0] == 0.0
    assert all(b > f > 0 for b, f in zip(drift["error_bf16"][1:], drift["error_fp32"][1:]))
    paths = entry_module.write_depth_drift(tmp_path, drift)
    doc = json.loads(paths[0].read_text())
    assert paths[0].name == "attnres_depth_drift.json" and paths[1].suffix == ".png"
    assert {"layers", "sublayer", "error_bf16", "error_fp32", "metric"} <= doc.keys() and doc["metric"] == "rms_ratio"
