"""Reports: ``report compare`` flags planted regressions and passes a report against itself;
``report.html`` is self-contained and shows the verdicts with margins, error against
position, ULP histograms, overflow maps with their frontier, curve files and the nightly
maxima. Thresholds are compare's documented defaults (err growth > 25 % with a margin drop
> 0.05, or > 4x at >= 1 % of the limit)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from quick_forms import without_kernels

from k3verify import cli, kda
from k3verify.cli import main
from k3verify.harness import compare, report, runner
from k3verify.harness.map_files import write_map
from k3verify.harness.overflow_map import MapResult, MapSpec
from k3verify.harness.render import write_report
from k3verify.harness.rows import Row
from k3verify.harness.text import md_text
from k3verify.numerics import EXPECTED_NONFINITE, FAIL, PASS

# The harness around the rows is under test, not the kernels: Triton's interpreter off
# (conftest ``without_interpreter``).
pytestmark = pytest.mark.usefixtures("without_interpreter")

BASELINE = Path(__file__).resolve().parents[1] / "reports" / "baseline" / "cpu"
# Two modules' study files, as their entries register them (the report shows any study it finds).
DEPTH_DRIFT, ROUTING_FLIPS = "attnres_depth_drift.json", "moe_routing_flips.json"


@pytest.fixture(scope="module")
def mla_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report")
    with pytest.MonkeyPatch.context() as mp:
        without_kernels(mp, "mla")
        assert main(["run", "--modules", "mla", "--out", str(out), "--maps", str(tmp_path_factory.mktemp("no-maps"))
                     ]) == 0
    return out


def _doc(path: Path) -> dict[str, Any]:
    return json.loads((path / "report.json").read_text())


def _write(doc: dict[str, Any], folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(doc))
    return folder


def _baseline_row(doc: dict[str, Any]) -> dict[str, Any]:
    """A passing baseline-rule row with room under its limit."""
    return next(r for r in doc["rows"] if r["status"] == PASS and r["rule"] == "baseline" and 0.3 < r["margin"] < 0.8)


# --- compare ----------------------------------------------------------------------------------


def test_a_report_compared_with_itself_has_no_findings(mla_report: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = compare.compare_paths(mla_report, mla_report)
    assert result.findings == [] and result.rows_compared == len(_doc(mla_report)["rows"])
    assert main(["report", "compare", str(mla_report), str(mla_report)]) == 0
    assert "no regressions" in capsys.readouterr().out


def test_the_committed_baseline_compares_clean_with_itself() -> None:
    assert main(["report", "compare", str(BASELINE), str(BASELINE)]) == 0


def _without_fla(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` as a run without the ``fla`` extra writes it: fla-core's rows unavailable, named
    ``fla-core (missing)``, with the install hint as their reason."""
    out = copy.deepcopy(doc)
    for row in out["rows"]:
        if row["implementation"].startswith("fla-core "):
            for key in ("verdict", "margin", "metrics", "baseline_metrics", "outputs", "output", "prediction",
                        "ulp_histogram", "error_by_position", "baseline_error_by_position", "wall_s"):
                row.pop(key, None)
            row.update(implementation="fla-core (missing)", status="unavailable",
                       reason="fla-core is not installed (pip install 'k3verify[fla]')")
    return out


def test_a_missing_optional_package_reads_as_now_unavailable() -> None:
    """The quick start installs no ``[fla]``: its run compared against the baseline made with
    fla-core says "now unavailable" with the reason for each fla-core row, which is information;
    with ``strict_coverage`` each is a regression. A row removed for another cause still regresses."""
    base = report.load(BASELINE)
    new = _without_fla(base)
    fla_rows = [r for r in base["rows"] if r["implementation"].startswith("fla-core ")]
    result = compare.compare_reports(base, new)
    gone = [f for f in result.findings if f.kind == "now unavailable"]
    assert fla_rows and len(gone) == len(fla_rows) and not result.regressions, result.findings
    assert all("pip install 'k3verify[fla]'" in f.detail for f in gone)
    assert not [f for f in result.findings if f.kind in ("row removed", "new row")]
    strict = compare.compare_reports(base, new, strict_coverage=True)
    judged = [r for r in fla_rows if r["status"] != "unavailable"]  # the GPU kernel rows never had a verdict here
    assert judged and len(strict.regressions) == len(judged)
    dropped = copy.deepcopy(new)
    dropped["rows"] = [r for r in dropped["rows"] if r["implementation"] != "k3verify" or r["case"] != "hot"]
    assert any(f.kind == "row removed" for f in compare.compare_reports(base, dropped).regressions)


def _binding(row: dict[str, Any]) -> dict[str, Any]:
    """The judged output that decides a row (its top-level verdict is a copy of this one's)."""
    return row["outputs"][row["output"]]


def _consistent(doc: dict[str, Any], row: dict[str, Any]) -> None:
    """After an edit of ``row``'s outputs: each margin recomputed from its err and limit, the
    binding output's fields repeated at the top level and the summary recounted, as the runner
    writes them (``report.load`` refuses a report that contradicts itself)."""
    for judged in row["outputs"].values():
        v = judged["verdict"]
        if isinstance(v.get("err"), float) and isinstance(v.get("limit"), float):
            judged["margin"] = v["margin"] = 1 - v["err"] / v["limit"]
    for key in ("verdict", "margin", "metrics", "baseline_metrics"):
        row[key] = copy.deepcopy(_binding(row).get(key))
    row["status"] = _binding(row)["status"]
    doc["summary"] = report.summarize(doc["rows"])


def _plant(doc: dict[str, Any], how: str) -> tuple[dict[str, Any], str]:
    """A copy of ``doc`` with one regression of kind ``how``, written as the runner would write
    it; returns it and the row's subject."""
    new = copy.deepcopy(doc)
    row = _baseline_row(new)
    judged = _binding(row)
    v = judged["verdict"]
    if how == "error grew":  # x1.5 with the margin down by far more than 0.05
        v["err"] *= 1.5
    elif how == "verdict flipped":
        judged["status"] = v["status"] = FAIL
    elif how == "became non-finite":  # the overflow the frontier predicts
        judged.update(status=EXPECTED_NONFINITE, margin=None, metrics=judged["metrics"] | {"nonfinite": 7})
        judged["verdict"] = {"status": EXPECTED_NONFINITE, "rule": "frontier", "metric": "nonfinite", "err": 7.0,
                             "limit": None, "margin": None, "reason": "overflow predicted and observed"}
    elif how == "coverage lost":
        for key in ("verdict", "margin", "metrics", "baseline_metrics", "outputs", "output"):
            row.pop(key, None)
        row.update(status="unavailable", reason="a CUDA device is needed")
        new["summary"] = report.summarize(new["rows"])
    elif how == "row removed":
        new["rows"].remove(row)
        new["summary"] = report.summarize(new["rows"])
    if how in ("error grew", "verdict flipped", "became non-finite"):
        _consistent(new, row)
    # Findings about one output name it: "<row> [o]".
    output = f" [{row['output']}]" if how == "error grew" else ""
    return new, compare.row_subject(Row.from_json(row)) + output


@pytest.mark.parametrize("how", ["error grew", "verdict flipped", "became non-finite", "coverage lost", "row removed"])
def test_a_planted_regression_is_flagged(
    how: str, mla_report: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new, subject = _plant(_doc(mla_report), how)
    assert main(["report", "compare", str(mla_report), str(_write(new, tmp_path / "new"))]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION" in out and how in out and "1 regression(s)" in out
    (finding,) = compare.compare_reports(_doc(mla_report), new).regressions
    assert finding.kind == how and finding.subject == subject


def test_changes_within_the_thresholds_are_not_regressions(mla_report: Path) -> None:
    base = _doc(mla_report)
    new = copy.deepcopy(base)
    judged = _binding(_baseline_row(new))
    judged["verdict"]["err"] *= 1.2  # under the 25 % growth threshold
    judged["margin"] = 1 - judged["verdict"]["err"] / judged["verdict"]["limit"]
    assert compare.compare_reports(base, new).regressions == []
    improved = copy.deepcopy(base)
    better = _binding(_baseline_row(improved))
    better["verdict"]["err"], better["margin"] = 0.0, 1.0
    findings = compare.compare_reports(base, improved).findings
    assert [f.kind for f in findings] == ["error shrank"] and not findings[0].regression


def test_large_growth_counts_even_with_a_small_margin_drop() -> None:
    """err x5 at 1 % of the limit: the margin falls by 0.008 only, but two bits were lost."""
    row = {"module": "m", "implementation": "i", "form": "f", "dtype": "bf16", "params": {}, "case": "c",
           "rule": "baseline", "status": PASS, "metrics": {"nonfinite": 0},
           "verdict": {"err": 0.002, "limit": 1.0, "metric": "rms_ratio"}, "margin": 0.998}
    worse = row | {"verdict": row["verdict"] | {"err": 0.01}, "margin": 0.99}
    doc = {"config": {"modules": ["m"]}, "rows": [row]}
    (finding,) = compare.compare_reports(doc, doc | {"rows": [worse]}).findings
    assert finding.kind == "error grew" and finding.regression
    tiny = row | {"verdict": row["verdict"] | {"err": 0.0005}, "margin": 0.9995}  # x5 below 1 % of the limit
    (moved,) = compare.compare_reports(doc | {"rows": [tiny]}, doc | {"rows": [row]}).findings
    assert moved.kind == compare.WITHIN and not moved.regression  # listed for the reader, not a regression


def _with_platform(doc: dict[str, Any], record: dict[str, str] | None) -> dict[str, Any]:
    return doc | {"environment": dict(doc.get("environment", {}), math_platform=record)}


ELSEWHERE = {"cpu": "AuthenticAMD 25/17/1 AMD EPYC", "blas": "mkl: Intel(R) Architecture processors"}


@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
def test_rounding_noise_rows_keep_only_the_two_bit_rule_across_platforms(dtype: str) -> None:
    """An fp32 row's error is fp32 rounding noise: another host's summation order redrew the
    fla-core recurrent row from 1.657e-7 to 2.175e-7 (x1.31, margin 0.636 -> 0.253) with no code
    change. Across platforms that is information; on one platform, or beyond 4x, a regression."""
    row = {"module": "m", "implementation": "i", "form": "f", "dtype": dtype, "params": {}, "case": "c",
           "rule": "baseline", "status": PASS, "metrics": {"nonfinite": 0},
           "verdict": {"err": 1.657e-7, "limit": 4.549e-7, "metric": "rms_ratio"}, "margin": 0.636}
    redrawn = row | {"verdict": row["verdict"] | {"err": 2.175e-7, "limit": 2.901e-7}, "margin": 0.253}
    doc = {"config": {"modules": ["m"]}, "rows": [row], "environment": {"math_platform": {"cpu": "here"}}}
    same = doc | {"rows": [redrawn]}
    (finding,) = compare.compare_reports(doc, same).findings
    assert finding.regression and finding.kind == "error grew"
    across = _with_platform(same, ELSEWHERE)
    result = compare.compare_reports(doc, across)
    assert result.regressions == [] and "math platform differs" in result.notes[0]
    beyond = _with_platform(doc | {"rows": [row | {"verdict": row["verdict"] | {"err": 8e-7, "limit": 4.549e-7},
                                                   "margin": -0.76, "status": PASS}]}, ELSEWHERE)
    (finding,) = compare.compare_reports(doc, beyond).regressions
    assert finding.kind == "error grew"


@pytest.fixture(scope="module")
def noisy_kda_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``k3verify run --modules kda`` with noise of 2^-8 (relative rms) planted in the tiled
    form's bf16 output: its error grows by about 29 %."""
    real = kda.tiled

    def noisy(*args: Any, **kw: Any) -> tuple[torch.Tensor, Any]:
        o, state = real(*args, **kw)
        if kw.get("operand_dtype") == "bf16":
            gen = torch.Generator().manual_seed(0)
            noise = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
            o = o + 2.0**-8 * o.pow(2).mean().sqrt() * noise
        return o, state

    out = tmp_path_factory.mktemp("noisy")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kda, "tiled", noisy)
        main(["run", "--modules", "kda", "--out", str(out), "--maps", str(tmp_path_factory.mktemp("no-maps"))])
    return _doc(out)


@pytest.mark.parametrize("platform", ["same", "other"])
def test_planted_bf16_noise_fails_the_compare_on_any_platform(
    noisy_kda_run: dict[str, Any], platform: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rule: compare thresholds (err growth > 25 % with a margin drop > 0.05). The committed CPU
    baseline against the noisy run, once as if on the baseline's platform, once on another."""
    here = {"cpu": "GenuineIntel here"}
    base = _write(_with_platform(report.load(BASELINE), here), tmp_path / "base")
    new = _write(_with_platform(noisy_kda_run, here if platform == "same" else ELSEWHERE), tmp_path / "new")
    assert main(["report", "compare", str(base), str(new)]) == 1
    out = capsys.readouterr().out
    assert ("same math platform" in out) == (platform == "same")
    flagged = [f.subject for f in compare.compare_paths(base, new).regressions if f.kind == "error grew"]
    assert any(" tiled bf16 " in f and "anchor=tile_start" in f and "(default)" in f for f in flagged), out
    if platform == "other":  # and nothing else: fp32 rows redrawn by this host's order are not flagged
        assert all(" tiled bf16 " in f for f in flagged), out


def test_new_rows_and_missing_modules(mla_report: Path) -> None:
    """A new report's ``config.modules`` decides nothing: a base module without rows in it is a
    regression (it used to be "not compared" when the new report named other modules)."""
    base = _doc(mla_report)
    added = copy.deepcopy(base["rows"][0]) | {"module": "newmod"}
    new = base | {"rows": [*base["rows"], added], "config": base["config"] | {"modules": ["mla", "newmod"]}}
    (finding,) = compare.compare_reports(base, new).findings
    assert finding.kind == "new row" and not finding.regression
    failing = new | {"rows": [*base["rows"], added | {"status": FAIL}]}
    assert compare.compare_reports(base, failing).regressions
    narrower = base | {"rows": [], "config": base["config"] | {"modules": ["kda"]}}
    (finding,) = compare.compare_reports(base, narrower).findings
    assert finding.kind == "module missing" and finding.subject == "mla" and finding.regression


def test_rows_without_the_newer_optional_keys_compare(mla_report: Path) -> None:
    base = _doc(mla_report)
    old = copy.deepcopy(base)
    for r in old["rows"]:
        for key in ("ulp_histogram", "error_by_position", "baseline_error_by_position"):
            r.pop(key, None)
    assert compare.compare_reports(old, base).findings == []


def _map(finite: list[bool], predicted: list[bool]) -> dict[str, Any]:
    cells = [{"module": "toy", "dtype": "bf16", "tile": 16, "g": g, "kind": "worst", "finite": f,
              "predicted_finite": p, "rms_ratio": 1e-3 if f else None} for g, f, p in zip((1, 2, 3), finite, predicted)]
    spec = {"x": "g", "y": "tile", "panel_row": "dtype", "panel_col": "kind", "figure": "module"}
    return {"module": "toy", "spec": spec, "cells": cells}


def test_map_cells_that_became_non_finite_are_flagged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = _map([True, True, False], [True, True, False])
    assert compare.compare_maps(base, base).findings == []
    new = _map([True, False, False], [True, True, False])
    kinds = sorted(f.kind for f in compare.compare_maps(base, new).regressions)
    assert kinds == ["map cell became non-finite", "map prediction now wrong"]
    for name, doc in (("base", base), ("new", new)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "toy_overflow_map.json").write_text(json.dumps(doc))
    assert main(["report", "compare", str(tmp_path / "base"), str(tmp_path / "new")]) == 1
    assert "map cell became non-finite" in capsys.readouterr().out


def test_a_checkerboard_map_draws_its_marks_and_frontier_as_one_artist_per_panel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Structural: a map is untrusted input. On a checkerboard, where every cell's prediction is
    missed and the frontier runs along every edge, each panel holds one artist of "x" marks with
    every missed cell in it and one collection of frontier segments with every edge: drawing once
    made an artist per cell and per edge (minutes and gigabytes at the grid limit)."""
    import matplotlib.pyplot as plt
    from matplotlib.collections import LineCollection

    from k3verify.harness import plots

    n = 12
    cells = [{"module": "kda", "dtype": "bf16", "tile": t, "g_min": float(g), "input": "worst", "anchor": a,
              "finite": (t + g) % 2 == 0, "predicted_finite": (t + g) % 2 == 1, "rms_ratio": 1e-3}
             for a in ("tile_start", "chunk_start") for t in range(n) for g in range(n)]
    spec = MapSpec(x="g_min", y="tile", panel_row="dtype", panel_col="anchor", figure="input", x_label="g",
                   y_label="tile", title="checkerboard")
    figures: list[Any] = []
    monkeypatch.setattr(plt, "close", figures.append)  # the figure kept to be read
    plots.draw_map(MapResult("kda", cells, spec), tmp_path)
    monkeypatch.undo()
    assert len(figures) == 1
    axes = figures[0].axes[:2]  # the two panels (the colour bar after them)
    for ax in axes:
        marks = [line for line in ax.lines if line.get_marker() == "x"]
        assert len(marks) == 1 and len(marks[0].get_xdata()) == n * n
        fronts = [c for c in ax.collections if isinstance(c, LineCollection)]
        assert len(fronts) == 1 and len(fronts[0].get_segments()) == 2 * n * (n - 1)
    plt.close(figures[0])


def test_compare_without_reports_is_a_usage_error(tmp_path: Path) -> None:
    assert main(["report", "compare", str(tmp_path), str(tmp_path)]) == 2


# --- rendering --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def maps_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A toy overflow map (PNG + JSON) and the two curve files other modules write."""
    out = tmp_path_factory.mktemp("maps")
    cells = [
        {"module": "kda", "dtype": "bf16", "tile": t, "g_min": g, "input": "worst", "anchor": "tile_start",
         "finite": t * g < 88, "predicted_finite": t * g < 88, "rms_ratio": 1e-3 if t * g < 88 else None}
        for t in (4, 16, 32) for g in (1.0, 3.0, 5.0, 8.0)
    ]
    spec = MapSpec(x="g_min", y="tile", panel_row="dtype", panel_col="anchor", figure="input", x_label="|g_min|",
                   y_label="tile", title="toy")
    write_map(MapResult("kda", cells, spec), out, {})
    (out / DEPTH_DRIFT).write_text(json.dumps({"title": "Block AttnRes: error against depth",
        "layers": list(range(1, 9)), "sublayer": ["attn", "mlp"] * 4, "metric": "rms_ratio",
        "error_bf16": [1e-3 * 1.2**i for i in range(8)], "error_fp32": [1e-7 * 1.1**i for i in range(8)],
        "error_bf16_naive": [2e-3 * 1.2**i for i in range(8)],
    }))
    flips = [{"log2_input_scale": e, "bf16_vs_fp32": {"changed_pairs": 0.01 * e, "changed_tokens": 0.1 * e}}
             for e in range(4)]
    (out / ROUTING_FLIPS).write_text(json.dumps({"title": "Stable LatentMoE: routing flips",
                                                  "definition": "fractions", "by_scale": flips}))
    return out


def test_html_is_self_contained_and_shows_every_section(mla_report: Path, maps_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    out.mkdir()
    (out / "report.json").write_text((mla_report / "report.json").read_text())
    nightly = {"profile": "nightly", "budget_s": 60, "modules": {"mla": {"examples": 9, "wall_s": 15, "worst": {
        "implementation": "mla/k3verify:tiled[bf16]", "ratio": 0.61, "err": 1e-3, "limit": 2e-3,
        "replay": "python properties/worst_case.py mla '{\"seed\": 5}'"}}}}
    (out / "nightly.json").write_text(json.dumps(nightly))
    assert main(["report", "render", str(out), "--maps", str(maps_dir)]) == 0
    page = (out / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page
    assert not re.search(r"""(src|href)=["']?(https?:|//|file:)""", page)  # nothing fetched from outside
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    # position and ULP histograms; the toy map is KDA's and the studies AttnRes's and MoE's,
    # modules this run did not verify: named as left out, not drawn
    assert len(images) == 2 and all(len(i) > 1000 for i in images)
    assert "Overflow maps of modules this run did not verify are left out: kda" in page
    assert "Studies of modules this run did not verify are left out: " in page
    assert "Block AttnRes: error against depth" not in page and "routing flips</h2>" not in page
    assert "not drawn" not in page
    doc = _doc(mla_report)
    assert page.count("<tr id='row-") == len(doc["rows"])
    for r in doc["rows"]:
        if isinstance(r.get("margin"), float) and r["status"] == PASS:
            assert f"{r['margin']:.3f}</td>" in page
    for text in ("Error against token position", "ULP histograms", "Nightly worst-case search", "worst_case.py mla"):
        assert text in page, text
    md = (out / "report.md").read_text()
    assert "## Error against position" in md and "## Nightly worst-case search" in md


def test_a_map_json_without_its_png_is_drawn(maps_dir: Path, mla_report: Path, tmp_path: Path) -> None:
    only_json = tmp_path / "maps"
    only_json.mkdir()
    (only_json / "kda_overflow_map.json").write_text((maps_dir / "kda_overflow_map.json").read_text())
    doc = report.load(mla_report)
    for row in doc["rows"]:  # the page draws the maps of the modules that ran
        row["module"] = "kda"
    paths = write_report(doc, tmp_path / "r", maps_dir=only_json)
    page = paths[-1].read_text()
    assert "kda_overflow_map_input-worst.png" in page and "Overflow map" in page


def test_a_run_without_figures_says_so_and_render_draws_them(mla_report: Path, maps_dir: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``run --no-figures``: the same verdicts, a page with no image that says how to draw them,
    and ``report render`` on the folder then draws what the default run draws."""
    out = tmp_path / "r"
    without_kernels(monkeypatch, "mla")
    assert main(["run", "--modules", "mla", "--out", str(out), "--maps", str(maps_dir), "--no-figures"]) == 0
    page = (out / "report.html").read_text()
    assert "data:image/png" not in page and "k3verify report render on this folder draws them" in page
    verdicts = lambda doc: [(r["form"], r["dtype"], r["case"], r["status"]) for r in doc["rows"]]  # noqa: E731
    assert verdicts(_doc(out)) == verdicts(_doc(mla_report))
    assert main(["report", "render", str(out), "--maps", str(maps_dir)]) == 0
    page = (out / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 2 and "were not drawn" not in page


def test_render_without_a_report_is_a_usage_error(tmp_path: Path) -> None:
    assert main(["report", "render", str(tmp_path)]) == 2


def test_a_schema_1_baseline_still_compares_with_a_new_run(mla_report: Path) -> None:
    """The CPU baseline as it was committed before named outputs (schema 1: one unnamed output per
    row; trimmed to the keys compare reads) against a fresh schema-2 run of MLA: every old row
    matches, the old top-level verdict is compared with the new primary output, and the new
    secondary output (``cache``) is information, not a regression."""
    old = json.loads((Path(__file__).parent / "data" / "report_schema1.json").read_text())
    assert old["schema_version"] == 1
    new = _doc(mla_report)
    assert new["schema_version"] == 2
    result = compare.compare_reports(old, new, modules=["mla"])
    assert result.rows_compared == sum(r["module"] == "mla" for r in old["rows"]) > 0
    assert result.regressions == [], result.regressions
    kinds = {f.kind for f in result.findings}
    # Another math path (ATEN_CPU_CAPABILITY, another CPU) moves errors within the thresholds;
    # rows added since (MLA's kernel rows) are new rows: information too.
    assert kinds <= {"new output", "new row", "error shrank", "error grew", compare.WITHIN} and "new output" in kinds


# --- what a CI log and a pull request show ------------------------------------------------------


def _printed(rows: list[dict[str, Any]], fmt: str = "table", quiet: bool = False, width: int = 80) -> tuple[int, str]:
    import argparse
    import io

    from rich.console import Console

    from k3verify import cli

    buf = io.StringIO()
    args = argparse.Namespace(format=fmt, quiet=quiet)
    code = cli._finish(rows, {"wall_s": 1.0}, None, None, Console(file=buf, width=width), args)
    return code, buf.getvalue()


def test_a_failed_row_ends_the_log_with_its_reason(mla_report: Path) -> None:
    """Rule: structural. Failures come last, one line each with the output and the reason; equal
    unavailable reasons are printed once with the rows they cover; brackets survive; at 80
    columns no number is cut."""
    rows = copy.deepcopy(_doc(mla_report)["rows"])
    bad = next(r for r in rows if r["status"] == PASS and r["rule"] == "baseline")
    name = bad["output"]
    bad["status"] = bad["outputs"][name]["status"] = FAIL
    bad["outputs"][name]["verdict"]["reason"] = "rms_ratio 9.9e-03 > 2x4.1e-03 + 1e-04"
    reason = "fla-core is not installed: pip install 'k3verify[fla]'"
    for r in rows[:2]:
        r |= {"status": "unavailable", "reason": reason}
    code, text = _printed(rows)
    assert code == 1
    lines = text.splitlines()
    assert lines[-2].startswith("rows: ") and lines[-1] == "1 verdict(s) failed", lines[-3:]
    assert lines[-3].startswith(f"FAIL {report.row_heading(bad)} [{name}]: rms_ratio 9.9e-03 > 2x4.1e-03 + 1e-04; "
                                "worst at [b="), lines[-3]
    assert text.count(reason) == 1 and f"unavailable (2): {reason}" in text
    assert "…" not in text and f"{report.fmt(bad['verdict']['err'])}" in text  # 80 columns: a line per row
    assert "…" not in _printed(rows, width=170)[1]  # a table, names folded, numbers whole
    code, quiet = _printed(rows, quiet=True)
    assert len(quiet.splitlines()) < len(lines) - len(rows) and quiet.splitlines()[-3:] == lines[-3:]


def test_run_formats_for_tools(mla_report: Path) -> None:
    """Rule: structural. ``--format json`` prints the report document, ``md`` its Markdown."""
    rows = _doc(mla_report)["rows"]
    code, text = _printed(rows, fmt="json")
    assert code == 0 and json.loads(text)["summary"]["rows"] == len(rows)
    code, text = _printed(rows, fmt="md")
    assert code == 0 and "| module |" in text


def test_compare_as_a_pull_request_comment_and_for_bots(
    noisy_kda_run: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rule: compare thresholds, as in the planted-noise test; here only the output formats."""
    here = {"cpu": "GenuineIntel here"}
    base = _write(_with_platform(report.load(BASELINE), here), tmp_path / "base")
    noisy = copy.deepcopy(noisy_kda_run)
    # And one fp64 row whose error moved by 1 %: under every threshold, listed but collapsed.
    moved = next(r for r in noisy["rows"] if r["dtype"] == "fp64" and r["status"] == PASS and "outputs" in r)
    for o in moved["outputs"].values():
        o["verdict"] = o["verdict"] | {"err": o["verdict"]["err"] * 1.01}
    _consistent(noisy, moved)
    # As if from another host: fp32 rows redrawn by this host's math path are not flagged, so
    # the regressions are the planted ones on any host.
    new = _write(_with_platform(noisy, ELSEWHERE), tmp_path / "new")
    assert main(["report", "compare", str(base), str(new), "--format", "md"]) == 1
    md = capsys.readouterr().out
    assert md.startswith("### k3verify: ") and "regression(s)" in md.splitlines()[0]
    assert "**Regressions**" in md and "| error grew | kda k3verify tiled bf16" in md
    # Fields are escaped Markdown (report fields are untrusted: test_injection.py).
    assert "<details><summary>Moved within the thresholds" in md and md_text(report.row_heading(moved)) in md
    assert main(["report", "compare", str(base), str(new), "--format", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["regressions"] and all(f["regression"] for f in doc["regressions"])
    assert set(doc) >= {"improvements", "changes", "within_thresholds", "notes", "rows_compared"}
    assert main(["report", "compare", str(base), str(new)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("compared ")
    tail = lines[-1 - len(doc["regressions"]) : -1]  # one line per regression, just before the count
    assert all(line.startswith("REGRESSION ") for line in tail), lines[-8:]
    assert any(line.startswith("REGRESSION error grew: kda k3verify tiled bf16") for line in tail)


def test_columns_decides_the_layout(mla_report: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:  # fmt: skip
    """Rule: structural. Piped output is 170 columns wide unless ``COLUMNS`` says otherwise; the
    verdicts are a table only where it fits with no cell folded, else one line per row with every
    number whole (at 170 columns MLA's rows need more). (The rows are those of the module's real
    run; the run itself is replayed, the oracle rows are made anew.)"""
    rows = [r for r in _doc(mla_report)["rows"] if r["implementation"] != "oracle"]
    monkeypatch.setattr(runner, "plan", lambda *a, **k: rows)
    monkeypatch.setattr(runner, "run", lambda *a, **k: iter(copy.deepcopy(rows)))
    written: list[dict[str, Any]] = []

    def kept(doc: dict[str, Any], out_dir: Path, **kwargs: Any) -> list[Path]:
        """The report the run would write, kept; its pages (3 s of figures a run) are the page
        tests' business."""
        written.append(doc)
        return [out_dir / name for name in report.REPORT_FILES]

    monkeypatch.setattr(cli, "write_report", kept)
    (tmp_path / "none").mkdir()
    args = ["run", "--modules", "mla", "--out", str(tmp_path / "r"), "--maps", str(tmp_path / "none")]
    monkeypatch.setenv("COLUMNS", "400")
    assert main(args) == 0
    wide = capsys.readouterr().out
    printed = len(written[-1]["rows"])  # the replayed rows and the oracle's
    table = [line for line in wide.splitlines() if line[:1] in "┃│"]
    assert "k3verify verdicts" in wide and len(table) == printed + 1, len(table)  # a line per row: none folded
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(args) == 0
    piped = capsys.readouterr().out
    lines = [line for line in piped.splitlines() if re.match(r"^(pass|fail|unavailable|expected)", line)]
    assert "k3verify verdicts" not in piped and len(lines) == printed
    monkeypatch.setenv("COLUMNS", "80")
    assert main(args) == 0
    narrow = capsys.readouterr().out
    assert "k3verify verdicts" not in narrow and "…" not in narrow
    assert re.search(r"^pass +\d\.\d\de-\d\d +\d\.\d\de-\d\d +\d\.\d\d  mla k3verify ", narrow, re.M), narrow[:400]


def test_a_failure_line_says_where() -> None:
    """The FAIL line and the Markdown's Failures section name the worst element by the output's
    axes and the worst position; a passing report has no Failures section."""
    from k3verify.harness import registry

    def off(q, k, v, g, beta, **kw):
        o, state = kda.chunkwise(q, k, v, g, beta, **kw)
        o = o.clone()
        o[0, 5, 1, 3] += 1.0
        return o, state

    entry = registry.get("kda")
    impl = registry.implementation("kda", off, name="plugin-off", dtype="fp32", baseline="chunkwise")
    row = runner.verify(entry, impl, entry.make_cases(0)["default"])
    (line,) = report.failure_lines([row])
    assert "[o]" in line and "worst at [b=0, t=5, h=1, v=3]" in line and "worst position 5 of " in line, line
    doc = {"rows": [row], "summary": {}, "environment": {}}
    assert "## Failures" in report.markdown(doc)
    clean = runner.verify(entry, registry.implementation("kda", kda.chunkwise, name="fine", dtype="fp32",
                                                         baseline="chunkwise"), entry.make_cases(0)["default"])
    assert clean["status"] == PASS and "## Failures" not in report.markdown({"rows": [clean], "summary": {}})


def test_the_compare_comment_folds_notes_and_small_moves() -> None:
    """The PR comment: notes under a <details> (not a blockquote), a new failing row with its
    reason, no double space where a row has no params, and more than five small moves summarised
    by their count, their largest factor and the largest five."""
    base = report.load(BASELINE)
    new = copy.deepcopy(base)
    passing = [r for r in new["rows"] if r["status"] == PASS and r["rule"] == "baseline" and "outputs" in r]
    for row in passing[:8]:
        for o in row["outputs"].values():
            o["verdict"] = o["verdict"] | {"err": o["verdict"]["err"] * 1.01}
        _consistent(new, row)
    added = copy.deepcopy(passing[8])
    added["case"] = "planted"
    added["status"] = FAIL
    for o in added["outputs"].values():
        o["status"] = FAIL
        o["verdict"] = o["verdict"] | {"status": FAIL, "reason": "rms_ratio 9.0e-02 > limit"}
    added["verdict"] = added["outputs"][added["output"]]["verdict"]
    new["rows"].append(added)
    result = compare.compare_reports(base, new)
    md = compare.markdown(result, "base", "new")
    assert "> Note" not in md and "<details><summary>Notes (" in md
    assert "| new row |" in md and "fail: rms\\_ratio 9.0e-02 &gt; limit" in md
    assert "  (" not in md
    moved = re.search(r"<details><summary>Moved within the thresholds \((\d+); the largest 5 below, every one "
                      r"within x1\.01\)", md)
    assert moved and int(moved.group(1)) >= 8, md[-800:]


def test_the_page_puts_failures_first_and_groups_what_did_not_run(tmp_path: Path) -> None:
    """report.html: a Failures section before the verdict table, each failure linked to its row,
    failed rows first in the table with a reason and a source column, unavailable rows grouped by
    reason, and only the modules that ran get a section (no maps of the others)."""
    from k3verify.harness import registry
    from k3verify.harness.render import Extras, html_page

    def off(q, k, v, g, beta, **kw):
        o, state = kda.chunkwise(q, k, v, g, beta, **kw)
        return o * 1.01, state

    entry = registry.get("kda")
    case = entry.make_cases(0)["default"]
    good = runner.verify(entry, registry.implementation("kda", kda.chunkwise, name="fine", dtype="fp32",
                                                        baseline="chunkwise"), case)
    bad = runner.verify(entry, registry.implementation("kda", off, name="plugin-off", dtype="fp32",
                                                       baseline="chunkwise"), case)
    gone = [dict(good, implementation=f"gpu-only {i}", status="unavailable", reason="needs CUDA") for i in range(3)]
    for row in gone:
        for key in ("verdict", "margin", "metrics", "outputs", "output"):
            row.pop(key, None)
    page = html_page({"rows": [good, bad, *gone], "summary": {}, "environment": {}}, Extras())
    assert page.index("<h2 id='failures'>Failures (1)</h2>") < page.index("<h2>Verdicts</h2>")
    assert "<a href='#row-1'>kda plugin-off kernel fp32 (default) [o]" in page and "worst at [b=" in page
    table = page[page.index("<h2>Verdicts</h2>"):]
    assert table.index("id='row-1'") < table.index("id='row-0'")  # the failure first
    assert "<th>reason</th><th>source</th>" in page
    assert page.count("needs CUDA (3 rows)") == 1 and "Unavailable here (3 rows, 1 reasons)" in page
    assert "id='module-mla'" not in page and "id='module-kda'" in page


def test_maps_fall_back_module_by_module(tmp_path: Path) -> None:
    """After a fresh map of one module (KDA), the page shows it from the fresh folder and every
    other module's map and the studies from the committed baseline maps, each saying where it
    came from; the fresh folder's KDA map is not replaced by the baseline's."""
    from k3verify.harness.render import collect_extras

    baseline = BASELINE.parent / "maps"
    fresh = tmp_path / "maps"
    fresh.mkdir()
    worst = "kda_overflow_map_input-worst.png"
    (fresh / worst).write_bytes((baseline / worst).read_bytes())
    extras = collect_extras(tmp_path, fresh, [baseline])
    assert extras.map_dirs["kda"] == fresh and extras.map_dirs["mla"] == baseline, extras.map_dirs
    assert {"attnres_depth_drift.json", "moe_routing_flips.json"} <= set(extras.curves)
    assert [name for name, _ in extras.map_images["kda"]] == [worst]  # the baseline's other KDA figure stays out
    only_fresh = collect_extras(tmp_path, fresh)
    assert set(only_fresh.map_dirs) == {"kda"} and not only_fresh.curves


def test_a_report_figure_is_its_canvas_in_at_most_256_colours() -> None:
    """Rule: structural. A page figure is drawn once at 100 dpi: its PNG is exactly the canvas
    (no tight bounding box re-measured around it) and carries a palette of at most 256 colours."""
    import io

    import matplotlib.pyplot as plt
    from PIL import Image

    from k3verify.harness import plots

    fig, ax = plt.subplots(figsize=(3.2, 2.1), layout="constrained")
    ax.imshow([[0.0, 1.0], [2.0, 3.0]], cmap="magma")
    ax.set_title("a title")
    image = Image.open(io.BytesIO(plots.png_bytes(fig)))
    assert image.size == (320, 210)
    assert image.mode == "P" and len(image.getcolors(256) or []) >= 2
    assert not plt.get_fignums(), "the figure is closed"
