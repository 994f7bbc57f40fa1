"""The regression gate cannot be bypassed: ``k3verify report compare`` judges every module of the
base whatever the new report says it covers, refuses reports with two rows (or map cells) of one
identity, treats a map that lost cells or changed its layout as a regression, reads only strict
JSON, refuses a row whose verdicts contradict each other, and ``--format json`` prints strict
JSON.

Rules: structural. Each reproduction of a bypass is a test here; where the class is open-ended
(which rows go missing, which row gets a twin, which field contradicts which, where a duplicate
key or an overflowing number sits) a Hypothesis strategy draws its members. The fuzz tests fix
their example count (``FUZZ_EXAMPLES``, derandomised), as in ``test_fuzz.py``;
``K3V_FUZZ_EXAMPLES=N`` runs N fresh random examples per test instead.
"""

from __future__ import annotations

import copy
import io
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from k3verify.cli import main
from k3verify.harness import compare, golden, registry, report, runner
from k3verify.harness.files import UsageError, json_safe, parse_json
from k3verify.harness.registry import Case, Implementation
from k3verify.harness.rows import Row
from k3verify.numerics import EXPECTED_NONFINITE, FAIL, PASS

FUZZ_EXAMPLES = int(os.environ.get("K3V_FUZZ_EXAMPLES", "100"))
fuzz = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize="K3V_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "reports" / "baseline" / "cpu"
COMMITTED_REPORTS = [*sorted((ROOT / "reports").rglob("report.json")), ROOT / "properties" / "data" /
                     "report_schema1.json"]
CPU_MAPS = ROOT / "reports" / "baseline" / "maps"


def _small() -> dict[str, Any]:
    """The committed CPU baseline cut to the first row of each status per module, and of the
    oracle's rows (every module, status and kind of row the gate sees, at a size fuzzing can
    afford)."""
    doc = json.loads((BASELINE / "report.json").read_text())
    rows, seen = [], set()
    for row in doc["rows"]:
        kind = (row["module"], row["status"], row["implementation"] == "oracle")
        if kind not in seen:
            seen.add(kind)
            rows.append(row)
    return doc | {"rows": rows, "summary": report.summarize(rows)}


SMALL = _small()
MODULES = sorted({r["module"] for r in SMALL["rows"]})


def _write(doc: dict[str, Any], folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(doc))
    return folder


def _compare(base: Path, new: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    code = main(["report", "compare", str(base), str(new), *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_line_error(err: str) -> str:
    """The single ``k3verify: error:`` line of a refused command."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("k3verify: error: ") and "Traceback" not in err, err
    return lines[0]


def _crashed(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` as the runner writes an implementation that raised: failed, with a reason, no verdict."""
    keep = ("module", "implementation", "form", "dtype", "params", "case", "case_params", "rule", "source")
    return {k: row[k] for k in keep if k in row} | {"status": FAIL, "reason": "RuntimeError: planted"}


def _with_rows(doc: dict[str, Any], rows: list[dict[str, Any]], **top: Any) -> dict[str, Any]:
    return doc | {"rows": rows, "summary": report.summarize(rows)} | top


# --- 5. every base module is compared, unless --modules narrows explicitly ---------------------


@pytest.mark.parametrize("claimed", [["nope"], ["kda"], [], None], ids=["unknown", "another", "none", "absent"])
def test_a_failing_report_cannot_claim_to_cover_other_modules(claimed: list[str] | None, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Every row of the new report fails; its ``config.modules`` names an unknown module, another
    module, none, or is absent. Each base row is still compared: one regression per row."""
    rows = [_crashed(r) for r in SMALL["rows"] if r["module"] != "kda" or claimed != ["kda"]]
    config = {k: v for k, v in SMALL["config"].items() if k != "modules"}
    new = _with_rows(SMALL, rows, config=config | ({} if claimed is None else {"modules": claimed}))
    code, out, _ = _compare(_write(SMALL, tmp_path / "base"), _write(new, tmp_path / "new"), capsys)
    assert code == 1
    result = compare.compare_reports(SMALL, new)
    flipped = [f for f in result.regressions if f.kind == "verdict flipped"]
    assert len(flipped) == len(rows) and "not compared" not in out
    if claimed == ["kda"]:  # the module it dropped is one finding
        assert [f.subject for f in result.regressions if f.kind == "module missing"] == ["kda"]


def test_a_module_missing_from_the_new_report_is_one_regression(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    new = _with_rows(SMALL, [r for r in SMALL["rows"] if r["module"] != "moe"],
                     config=SMALL["config"] | {"modules": ["attnres", "kda", "mla"]})
    code, out, _ = _compare(_write(SMALL, tmp_path / "base"), _write(new, tmp_path / "new"), capsys)
    assert code == 1 and "REGRESSION module missing: moe: none of its" in out
    (finding,) = compare.compare_reports(SMALL, new).findings
    assert finding.kind == "module missing" and finding.subject == "moe" and finding.regression


def test_modules_narrows_the_compare_explicitly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--modules`` compares the named modules only and says so; a module the base does not hold,
    or no name at all, is a usage error naming it."""
    new = _with_rows(SMALL, [r for r in SMALL["rows"] if r["module"] == "mla"])
    base, new_dir = _write(SMALL, tmp_path / "base"), _write(new, tmp_path / "new")
    assert _compare(base, new_dir, capsys)[0] == 1
    code, out, _ = _compare(base, new_dir, capsys, "--modules", "mla")
    narrowed = ("compared modules mla only (--modules); not compared: attnres, attnres_backward, kda, kda_backward, "
                "mla_backward, moe")
    assert code == 0 and narrowed in out
    code, _, err = _compare(base, new_dir, capsys, "--modules", "mla,nope")
    assert code == 2 and "--modules names 'nope'" in _one_line_error(err)
    code, _, err = _compare(base, new_dir, capsys, "--modules", ",")
    assert code == 2 and "--modules names no module" in _one_line_error(err)


@fuzz
@given(data=st.data())
def test_fuzzed_row_removals_never_compare_clean(data: st.DataObject) -> None:
    """Whatever rows vanish from the new report, and whatever modules it claims to cover, each
    vanished row is a regression, by itself or as its module's."""
    gone = data.draw(st.sets(st.integers(0, len(SMALL["rows"]) - 1), min_size=1), label="removed rows")
    claimed = data.draw(st.lists(st.sampled_from([*MODULES, "nope", ""]), max_size=4), label="config.modules")
    kept = [r for i, r in enumerate(SMALL["rows"]) if i not in gone]
    new = _with_rows(SMALL, kept, config=SMALL["config"] | {"modules": claimed})
    result = compare.compare_reports(SMALL, new)
    named = {f.subject for f in result.regressions}
    for i in gone:
        row = SMALL["rows"][i]
        assert compare.row_subject(Row.from_json(row)) in named or row["module"] in named, (row, result.findings)
    assert result.rows_compared == len(kept)


# --- 6. two rows (or cells) of one identity are refused ----------------------------------------


def _twin(doc: dict[str, Any], failing_first: bool) -> dict[str, Any]:
    """``doc`` with a failing copy of its first passing row beside it."""
    rows = copy.deepcopy(doc["rows"])
    i, row = next((i, r) for i, r in enumerate(rows) if r["status"] == PASS)
    pair = [_crashed(row), row] if failing_first else [row, _crashed(row)]
    return _with_rows(doc, rows[:i] + pair + rows[i + 1:])


@pytest.mark.parametrize("failing_first", [True, False], ids=["fail first", "pass first"])
@pytest.mark.parametrize("side", ["base", "new"])
def test_a_failing_row_beside_a_passing_twin_is_refused(failing_first: bool, side: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    twinned = _write(_twin(SMALL, failing_first), tmp_path / "twinned")
    clean = _write(SMALL, tmp_path / "clean")
    code, _, err = _compare(*((twinned, clean) if side == "base" else (clean, twinned)), capsys)
    line = _one_line_error(err)
    row = next(r for r in SMALL["rows"] if r["status"] == PASS)
    assert code == 2 and str(twinned) in line and repr(compare.row_subject(Row.from_json(row))) in line, line


@fuzz
@given(data=st.data())
def test_fuzzed_twins_are_refused(data: st.DataObject) -> None:
    """Any row given a twin (same identity, any status, anywhere in either report) is refused."""
    side = data.draw(st.sampled_from(["base", "new"]), label="side")
    rows = copy.deepcopy(SMALL["rows"])
    original = data.draw(st.sampled_from(rows), label="row")
    twin = data.draw(st.sampled_from([copy.deepcopy(original), _crashed(original),
                                      {**_crashed(original), "status": "unavailable", "reason": "gone"}]), label="twin")
    rows.insert(data.draw(st.integers(0, len(rows)), label="at"), twin)
    twinned = _with_rows(SMALL, rows)
    docs = (twinned, SMALL) if side == "base" else (SMALL, twinned)
    with pytest.raises(UsageError, match="are both"):
        compare.compare_reports(*docs)


# --- 7. overflow maps: lost cells and changed layouts are regressions --------------------------

SPEC = {"x": "g", "y": "tile", "panel_row": "dtype", "panel_col": "kind", "figure": "module", "x_label": "g",
        "y_label": "tile", "title": "toy"}
IMPLEMENTATIONS = ("toy tiled", "toy kernel")


def _map(cells: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A toy map: two implementations, each on a 3 x 2 grid, all finite as predicted."""
    if cells is None:
        cells = [{"module": "toy", "implementation": impl, "dtype": "bf16", "kind": "worst", "g": g, "tile": t,
                  "finite": True, "predicted_finite": True, "rms_ratio": 1e-3}
                 for impl in IMPLEMENTATIONS for g in (1, 2, 3) for t in (16, 32)]
    return {"schema_version": 1, "module": "toy", "spec": dict(SPEC), "cells": cells}


def _map_dirs(tmp_path: Path, base: dict[str, Any], new: dict[str, Any] | None) -> tuple[Path, Path]:
    for name, doc in (("base", base), ("new", new)):
        (tmp_path / name).mkdir()
        if doc is not None:
            (tmp_path / name / "toy_overflow_map.json").write_text(json.dumps(doc))
    return tmp_path / "base", tmp_path / "new"


def test_a_removed_map_cell_is_a_regression_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = _map()
    new = _map(base["cells"][1:])
    code, out, _ = _compare(*_map_dirs(tmp_path, base, new), capsys)
    assert code == 1
    (finding,) = compare.compare_maps(base, new).findings
    assert finding.kind == "map cell removed" and finding.regression
    assert finding.subject == "toy map cell module=toy dtype=bf16 kind=worst g=1 tile=16 [toy tiled]"
    assert "REGRESSION map cell removed: toy map cell" in out


def test_an_implementation_whose_cells_all_vanished_is_one_finding(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    base = _map()
    new = _map([c for c in base["cells"] if c["implementation"] != "toy kernel"])
    assert _compare(*_map_dirs(tmp_path, base, new), capsys)[0] == 1
    (finding,) = compare.compare_maps(base, new).findings
    assert (finding.kind, finding.subject, finding.regression) == ("map implementation missing",
                                                                   "toy map [toy kernel]", True)


@pytest.mark.parametrize("axis", [*compare.MAP_AXES, "module"])
def test_a_changed_map_layout_is_a_regression(axis: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An axis renamed (its cells carry the new name, so no cell matches), or another module."""
    base = _map()
    new = copy.deepcopy(base)
    if axis == "module":
        new["module"] = "other"
    else:
        old = new["spec"][axis]
        new["spec"][axis] = f"{old}_renamed"
        for cell in new["cells"]:
            cell[f"{old}_renamed"] = cell.pop(old, None)
    code, out, _ = _compare(*_map_dirs(tmp_path, base, new), capsys)
    assert code == 1 and "REGRESSION map layout changed" in out
    (finding,) = compare.compare_maps(base, new).findings
    assert finding.kind == "map layout changed" and finding.regression


def test_new_map_cells_and_maps_are_information(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    full = _map()
    fewer = _map([c for c in full["cells"] if c["g"] != 3])
    base, new = _map_dirs(tmp_path, fewer, full)
    (new / "other_overflow_map.json").write_text(json.dumps(_map() | {"module": "other"}))
    code, out, _ = _compare(base, new, capsys)
    assert code == 0 and "no regressions" in out
    findings = compare.compare_paths(base, new).findings
    assert sorted(f.kind for f in findings) == ["new map", "new map cells", "new map cells"]
    assert not any(f.regression for f in findings)


def test_a_map_missing_from_the_new_folder_is_a_regression(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    base, new = _map_dirs(tmp_path, _map(), None)
    code, out, _ = _compare(base, new, capsys)
    assert code == 1 and "REGRESSION map missing: toy map" in out


@pytest.mark.parametrize("side", ["base", "new"])
def test_two_cells_in_one_place_are_refused(side: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A passing duplicate of a cell that overflowed would otherwise hide it."""
    doubled = _map()
    doubled["cells"].append(doubled["cells"][0] | {"finite": False, "predicted_finite": True})
    base, new = _map_dirs(tmp_path, *((doubled, _map()) if side == "base" else (_map(), doubled)))
    code, _, err = _compare(base, new, capsys)
    line = _one_line_error(err)
    assert code == 2 and "cells 0 and 12 are both" in line and str(tmp_path / side) in line


def test_the_committed_cpu_maps_compare_clean_with_themselves(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _compare(CPU_MAPS, CPU_MAPS, capsys)
    assert code == 0 and "no regressions" in out


@fuzz
@given(data=st.data())
def test_fuzzed_cell_removals_never_compare_clean(data: st.DataObject) -> None:
    """Whatever cells vanish, each is named, by itself or as its implementation's."""
    base = _map()
    gone = data.draw(st.sets(st.integers(0, len(base["cells"]) - 1), min_size=1), label="removed cells")
    new = _map([c for i, c in enumerate(base["cells"]) if i not in gone])
    result = compare.compare_maps(base, new)
    named = {f.subject for f in result.regressions}
    for i in gone:
        cell = base["cells"][i]
        assert (compare._cell_subject("toy", cell, SPEC) in named
                or f"toy map [{cell['implementation']}]" in named), (cell, result.findings)
    assert result.cells_compared == len(base["cells"]) - len(gone)


# --- 8. strict JSON, and rows whose verdicts agree ----------------------------------------------


def _json_with(doc: dict[str, Any], marker: str, literal: str) -> str:
    """``doc`` as JSON text with the string ``marker`` replaced by the raw ``literal``."""
    text = json.dumps(doc)
    assert text.count(json.dumps(marker)) == 1
    return text.replace(json.dumps(marker), literal)


@pytest.mark.parametrize("literal", ["1e999", "-1e999", "1E400", "1" + "0" * 400])
def test_a_base_error_beyond_a_double_cannot_hide_growth(literal: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Python reads ``1e999`` as inf, which JSON's NaN/Infinity check never sees: a base error of
    inf made any growth of the new one (x10^6 in the report) look like a shrink. Refused, naming
    where it sits."""
    base = copy.deepcopy(SMALL)
    i, row = next((i, r) for i, r in enumerate(base["rows"]) if r["status"] == PASS)
    row["verdict"]["err"] = "MARKER"
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "report.json").write_text(_json_with(base, "MARKER", literal))
    code, _, err = _compare(tmp_path / "base", _write(SMALL, tmp_path / "new"), capsys)
    line = _one_line_error(err)
    assert code == 2 and f"'/rows/{i}/verdict/err'" in line and "beyond the range of a double" in line, line


@pytest.mark.parametrize("where", ["top", "row", "verdict", "output verdict"])
def test_a_duplicate_key_is_refused_naming_it(where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``"status": "fail", "status": "pass"``: Python keeps the last, other parsers the first."""
    doc = copy.deepcopy(SMALL)
    i, row = next((i, r) for i, r in enumerate(doc["rows"]) if r["status"] == PASS and r.get("outputs"))
    holder, pointer = {"top": (doc, ""), "row": (row, f"/rows/{i}"), "verdict": (row["verdict"], f"/rows/{i}/verdict"),
                       "output verdict": (row["outputs"][row["output"]]["verdict"],
                                          f"/rows/{i}/outputs/{row['output']}/verdict")}[where]
    holder["MARKER"] = 0
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "report.json").write_text(_json_with(doc, "MARKER", '"status": "fail", "status"'))
    code, _, err = _compare(_write(SMALL, tmp_path / "base"), tmp_path / "new", capsys)
    line = _one_line_error(err)
    assert code == 2 and f"at {(pointer or '/')!r}: key 'status' appears twice" in line, line


JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**64), 2**64),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6))
JSON_DOCS = st.recursive(st.dictionaries(st.text(max_size=4), JSON_SCALARS, max_size=3),
                         lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                 st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                         max_leaves=8)


def _objects(doc: Any, pointer: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every object in ``doc`` with its JSON pointer."""
    found = [(pointer, doc)] if isinstance(doc, dict) else []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        found += _objects(value, f"{pointer}/{str(key).replace('~', '~0').replace('/', '~1')}")
    return found


@fuzz
@given(doc=JSON_DOCS, data=st.data())
def test_fuzzed_duplicate_keys_and_overflowing_numbers_are_named(doc: Any, data: st.DataObject) -> None:
    """In any document, a key repeated in any object, or a number no double holds put in any
    object, is refused with the object's pointer; the document itself parses as it was."""
    assert parse_json(json.dumps(doc).encode(), "f", "doc") == doc
    objects = _objects(doc)
    if not objects:
        return
    pointer, target = data.draw(st.sampled_from(objects), label="object")
    repeat = data.draw(st.booleans(), label="repeat the key")
    # A new key for the number (an existing one would make a duplicate key instead).
    key = data.draw(st.text(max_size=4).filter(lambda k: repeat or (k not in target and k != "\x00m")), label="key")
    number = data.draw(st.sampled_from(["1e309", "-2.5e400", "1" + "0" * 320, "-1" + "0" * 330]), label="number")
    target["\x00MARKER"] = 0
    literal = f"{json.dumps(key)}: 1, {json.dumps(key)}" if repeat else f"{json.dumps(key)}: {number}, \"\\u0000m\""
    text = json.dumps(doc).replace(json.dumps("\x00MARKER"), literal)
    with pytest.raises(UsageError) as refused:
        parse_json(text.encode(), "f", "doc")
    where = pointer if repeat else f"{pointer}/{key.replace('~', '~0').replace('/', '~1')}"
    assert f"at {(where or '/')[:200]!r}: " in str(refused.value), (str(refused.value), where)
    assert ("appears twice" if repeat else "beyond the range of a double") in str(refused.value)


def test_a_pass_row_whose_outputs_have_no_error_is_refused(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The reproduction: every output's err and limit null, the top-level err 1.0."""
    doc = copy.deepcopy(SMALL)
    i, row = next((i, r) for i, r in enumerate(doc["rows"]) if r["status"] == PASS and r.get("outputs"))
    for judged in row["outputs"].values():
        judged["verdict"] |= {"err": None, "limit": None}
    row["verdict"] |= {"err": 1.0}
    code, _, err = _compare(_write(SMALL, tmp_path / "base"), _write(doc, tmp_path / "new"), capsys)
    line = _one_line_error(err)
    assert code == 2 and f"row {i} " in line and "a pass verdict without a numeric err and limit" in line, line


def _judged_rows(doc: dict[str, Any]) -> list[int]:
    return [i for i, r in enumerate(doc["rows"]) if r.get("outputs")]


# (where, field) pairs a row repeats or derives: changing one copy alone contradicts the other.
CONTRADICTIONS = [("row", "status"), ("binding", "status"), ("top verdict", "status"), ("binding verdict", "status"),
                  ("top verdict", "err"), ("binding verdict", "err"), ("top verdict", "limit"),
                  ("binding verdict", "limit"), ("row", "margin"), ("binding", "margin"),
                  ("top verdict", "margin"), ("binding verdict", "margin"), ("top metrics", "nonfinite"),
                  ("binding metrics", "nonfinite"), ("top metrics", "rms_ratio"), ("binding metrics", "rms_ratio")]
NEW_VALUES = st.one_of(st.sampled_from([PASS, FAIL, EXPECTED_NONFINITE, "unavailable", None]),
                       st.floats(allow_nan=False, allow_infinity=False), st.integers(0, 10**6))


@fuzz
@given(data=st.data())
def test_fuzzed_contradicting_rows_are_refused(data: st.DataObject, tmp_path_factory: pytest.TempPathFactory
                                               ) -> None:
    """Change one copy of anything a row repeats (status, err, limit, margin, metrics: at the top
    level, in its binding output, in either verdict) to any other valid value: ``load`` refuses
    the report, naming the row."""
    doc = copy.deepcopy(SMALL)
    i = data.draw(st.sampled_from(_judged_rows(doc)), label="row")
    row = doc["rows"][i]
    binding = row["outputs"][row["output"]]
    where, field = data.draw(st.sampled_from(CONTRADICTIONS), label="field")
    holder = {"row": row, "binding": binding, "top verdict": row["verdict"], "binding verdict": binding["verdict"],
              "top metrics": row["metrics"], "binding metrics": binding["metrics"]}[where]
    old = holder.get(field)
    value = data.draw(NEW_VALUES, label="value")
    assume(not (value == old and not isinstance(value, bool) and not isinstance(old, bool)))  # 1 and 1.0 are one
    holder[field] = value
    path = _write(doc, tmp_path_factory.mktemp("contradiction"))
    with pytest.raises(UsageError, match=rf"report\.json: row {i}[ 's]"):
        report.load(path)


def test_every_committed_report_loads() -> None:
    """The committed baselines (CPU, tensor-parallel, GPU runs and the GPU golden verdicts) and
    the schema-1 fixture satisfy every rule ``load`` now holds rows to."""
    assert len(COMMITTED_REPORTS) >= 10
    for path in COMMITTED_REPORTS:
        doc = report.load(path)
        assert doc["rows"], path


def test_golden_and_crash_rows_are_valid(tmp_path: Path) -> None:
    """The rows ``golden verify`` writes besides the runner's (the oracle against the stored
    outputs, passing and failing; a module or case without goldens; a case too large to store)
    and the runner's row for an implementation that raised all load."""
    entry = registry.get("attnres")
    case = next(iter(entry.make_cases(0).values()))
    stored = registry.as_outputs(entry.oracle(case), entry.outputs, "oracle")
    drifted = {name: t * (1 + 1e-6) for name, t in stored.items()}

    def boom(case: Case) -> Any:
        raise RuntimeError("planted")

    broken = Implementation(module="attnres", implementation="broken", form="kernel", dtype="bf16", params={},
                            rule=registry.BASELINE_RULE, run=boom, cases=(case.name,))
    rows = [golden._oracle_row(entry, case, stored, "attnres/a.safetensors"),
            golden._oracle_row(entry, case, drifted, "attnres/b.safetensors") | {"case": "drifted"},
            golden._missing_row("attnres", "walk", "no golden case for 'walk'"),
            golden._unstored_row(broken, "walk_full", "inputs exceed 2 MB"),
            runner.verify(entry, broken, case)]
    assert [r["status"] for r in rows] == [PASS, FAIL, FAIL, "unavailable", FAIL]
    doc = report.build(rows, environment={}, config={}, command=["k3verify"])
    (tmp_path / "report.json").write_text(json.dumps(json_safe(doc), allow_nan=False))
    assert len(report.load(tmp_path)["rows"]) == len(rows)


def test_a_summary_that_miscounts_its_rows_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = copy.deepcopy(SMALL)
    doc["summary"]["fail"] += 1
    code, _, err = _compare(_write(SMALL, tmp_path / "base"), _write(doc, tmp_path / "new"), capsys)
    assert code == 2 and "summary.fail is 1 but its rows give 0" in _one_line_error(err)


# --- 9. --format json is strict JSON ------------------------------------------------------------


def _strict(text: str) -> Any:
    """``text`` parsed by a parser that refuses NaN and Infinity, as strict JSON parsers do."""
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} in --format json output")

    return json.loads(text, parse_constant=refuse)


def test_run_json_is_strict_json() -> None:
    """The runner's rows hold NaN (an expected overflow's limit and margin) and inf; printed as
    ``null``, the document parses strictly and is the report ``report.json`` holds."""
    import argparse

    from rich.console import Console

    from k3verify import cli

    rows = copy.deepcopy(SMALL["rows"])
    overflowed = next(r for r in rows if r["status"] == EXPECTED_NONFINITE)
    overflowed["verdict"] |= {"limit": math.nan, "margin": math.nan}
    overflowed["margin"] = -math.inf
    buf = io.StringIO()
    code = cli._finish(rows, {"wall_s": 1.0}, None, None, Console(file=buf, width=170),
                       argparse.Namespace(format="json", quiet=False))
    assert code == 0
    doc = _strict(buf.getvalue())
    assert parse_json(buf.getvalue().encode(), "stdout", "run --format json") == doc
    printed = doc["rows"][rows.index(overflowed)]
    assert printed["verdict"]["limit"] is None and printed["margin"] is None


def test_compare_json_for_bots_names_a_missing_module(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Parsed strictly, the compare's JSON lists a module the new report dropped as a regression."""
    new = _with_rows(SMALL, [r for r in SMALL["rows"] if r["module"] != "kda"])
    code, out, _ = _compare(_write(SMALL, tmp_path / "base"), _write(new, tmp_path / "new"), capsys,
                            "--format", "json")
    doc = _strict(out)
    assert code == 1 and [(f["kind"], f["subject"]) for f in doc["regressions"]] == [("module missing", "kda")]
