"""Block AttnRes as the harness sees it: registry rows, the precision map and the depth-drift study.

Rows are judged by the runner under each implementation's rule (``fp64-agreement`` or
``baseline``; a predicted overflow is ``expected-nonfinite``), every named output on its own:
``h`` on every case, ``blocks`` on walks. The quick map must agree with its analytic prediction
in every cell that is not frontier-adjacent and must contain both outcomes where the physics
says it should.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from registry_contract import quick_map
from strategies.attnres import one_thread  # noqa: F401  (autouse fixture)

from k3verify.attnres import samples
from k3verify.harness import environment, plots, registry, render
from k3verify.harness.files import json_safe
from k3verify.harness.map_files import write_map
from k3verify.harness.overflow_map import MapOptions, MapResult

DEPTH_DRIFT = "attnres_depth_drift.json"  # the file name the report has always read


@pytest.fixture(scope="module")
def quick_result() -> MapResult:
    """The quick map, made once: the map test reads its cells, the study test its depth-drift
    curve (a study takes 8 s here, most of it the fp32 kernel's walk under the interpreter)."""
    with environment.one_thread():
        return quick_map("attnres")


def test_quick_map_agrees_with_its_prediction(quick_result: MapResult, tmp_path: Path) -> None:
    """Prediction vs observation: no disagreement away from the frontier; the no-max softmax
    overflows past ln(max fp32) with fp32 logits and past ln(65504) with fp16 ones, and not
    below; with max subtraction only fp16 logits overflow (past 65504); bf16 logits fail the
    baseline rule somewhere in a bf16 stream and fp32 logits nowhere. JSON + PNG are written,
    and the depth-drift study beside them."""
    result = quick_result
    # Every point swept (the shared check: progress reaches its total), each with every form of
    # ours and every kernel that runs here (the fp32 one under the interpreter), nothing else;
    # the kernels' cells agree with the prediction like the forms' (quick_map checks all cells).
    entry = registry.get("attnres")
    d, quick = entry.overflow_map, MapOptions(quick=True)
    kernels = [i for i in entry.implementations() if i.in_map and i.unavailable() is None]
    points = len(samples.QUICK_LOGIT_SCALES) * len(samples.QUICK_SOURCES)
    assert len(d.points(quick)) == points and len(result.cells) == points * (len(d.forms(quick)) + len(kernels))
    assert kernels and {c["implementation"] for c in result.cells} >= {f"{k.implementation} {k.form}" for k in kernels}

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
    assert DEPTH_DRIFT in {p.name for p in paths}  # the study, written beside the map


def test_depth_drift_study(quick_result: MapResult, tmp_path: Path) -> None:
    """Structural: the study is listed under its file name; one entry per call (186 sublayers +
    the output); the first call (the embedding alone, bf16-representable) is exact; a bf16 stream
    is worse than an fp32 one at every other call; the JSON carries the keys the report reads, the
    title it shows, and draws as a figure against depth."""
    studies = registry.get("attnres").studies
    assert set(studies) == {DEPTH_DRIFT}
    drift = studies[DEPTH_DRIFT](0, False)
    assert quick_result.meta["curves"][DEPTH_DRIFT] == drift  # the quick map asks for the same curve
    n = 187
    assert len(drift["layers"]) == len(drift["sublayer"]) == len(drift["error_bf16"]) == len(drift["error_fp32"]) == n
    assert drift["layers"][0] == 1 and drift["layers"][-1] == 93 and drift["sublayer"][-1] == "output"
    assert drift["error_bf16"][0] == drift["error_fp32"][0] == 0.0
    assert all(b > f > 0 for b, f in zip(drift["error_bf16"][1:], drift["error_fp32"][1:]))
    path = tmp_path / DEPTH_DRIFT
    path.write_text(json.dumps(json_safe(drift), allow_nan=False))
    doc = json.loads(path.read_text())
    assert {"layers", "sublayer", "error_bf16", "error_fp32", "metric"} <= doc.keys() and doc["metric"] == "rms_ratio"
    title = render.curve_title(DEPTH_DRIFT, doc)
    assert title == "Block AttnRes: error against depth"
    assert plots.png_bytes(plots.depth_figure(doc, title)).startswith(b"\x89PNG")
