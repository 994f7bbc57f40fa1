"""Report rows as declared types (``k3verify/harness/rows.py``): every stored report reads and
writes back unchanged, the schema knows every key a writer uses, and a wrong key or type is
named. Rules: structural (no numerics are judged here).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from k3verify.harness import report
from k3verify.harness.rows import MIRRORS, MetricsRecord, Row, RowError, schema

ROOT = Path(__file__).resolve().parents[1]
# Every committed report (schema 2), and the CPU baseline as committed before named outputs (schema 1).
REPORTS = [*sorted((ROOT / "reports").rglob("report.json")), ROOT / "properties" / "data" / "report_schema1.json"]


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


@pytest.mark.parametrize("path", REPORTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_stored_report_reads_and_writes_back(path: Path) -> None:
    """Each row of each committed report (schema 1 and 2 alike) is a Row, strictly (no key that
    the schema does not declare), and its JSON form is the stored row less its nulls."""
    doc = report.load(path)
    assert doc["rows"]
    for i, stored in enumerate(doc["rows"]):
        row = Row.from_json(stored, where=f"row {i}", strict=True)
        assert row.to_json() == _without_nulls(stored)
        assert Row.from_json(row.to_json()) == row


def test_the_schema_is_derived_from_the_classes() -> None:
    keys = schema()
    assert {"baseline_form", "traceback", "time", "golden", "outputs"} <= keys.keys()
    assert "worst" in keys["outputs"]["<name>"] and "mismatch" in keys["metrics"]
    assert set(keys["verdict"]) == {f.name for f in dataclasses.fields(MIRRORS[0][1])}
    for record, source in MIRRORS:
        extra = {"mismatch"} if record is MetricsRecord else set()
        assert {f.name for f in dataclasses.fields(record)} == {f.name for f in dataclasses.fields(source)} | extra


GOOD = {"module": "kda", "implementation": "k3verify", "form": "tiled", "dtype": "bf16", "case": "default",
        "status": "pass", "rule": "baseline", "verdict": {"err": 1e-3, "limit": 2e-3, "status": "pass"},
        "outputs": {"o": {"status": "pass", "margin": 0.5, "metrics": {"n": 8, "rms_ratio": 1e-3}}}}


@pytest.mark.parametrize(("change", "message"), [
    (lambda r: r.pop("module"), "row 0 has no 'module'"),
    (lambda r: r.__setitem__("status", "passed-ish"), "status 'passed-ish'"),
    (lambda r: r["verdict"].__setitem__("err", "small"), "row 0's verdict.err is a str, not a number"),
    (lambda r: r["verdict"].__setitem__("limit", True), "row 0's verdict.limit is a bool, not a number"),
    (lambda r: r.__setitem__("overflow", "one line"), "row 0's overflow is a str, not a list"),
    (lambda r: r.__setitem__("prediction", {"finite": "yes"}), "row 0's prediction.finite is a str, not a bool"),
    (lambda r: r.__setitem__("error_by_position", [0.1, None, "x"]), "row 0's error_by_position[2] is a str"),
    (lambda r: r["outputs"]["o"].__setitem__("status", "unavailable"), "output 'o' has status 'unavailable'"),
    (lambda r: r["outputs"]["o"]["metrics"].__setitem__("n", 8.5), "row 0's outputs['o'].metrics.n is a float"),
])
def test_a_wrong_key_is_named(change, message: str) -> None:
    row = {k: (dict(v) if isinstance(v, dict) else v) for k, v in GOOD.items()}
    row["outputs"] = {"o": dict(GOOD["outputs"]["o"], metrics=dict(GOOD["outputs"]["o"]["metrics"]))}
    Row.from_json(row, where="row 0")
    change(row)
    with pytest.raises(RowError) as caught:
        Row.from_json(row, where="row 0")
    assert message in str(caught.value)


def test_an_undeclared_key_passes_a_reader_and_fails_a_writer() -> None:
    """A newer writer's key is ignored when reading; a writer checking itself (``strict``, as
    ``registry_contract.passing_rows`` does on every module's rows) is told to declare it."""
    row = dict(GOOD, novelty=1)
    assert Row.from_json(row).to_json() == Row.from_json(GOOD).to_json()
    with pytest.raises(RowError, match="keys no reader knows: novelty"):
        Row.from_json(row, strict=True)


def test_docs_name_every_row_key() -> None:
    """docs/report.md, which users read to parse report.json, names every key a row, a judged
    output or a verdict may hold (a key added to rows.py without a word there fails here)."""
    doc = (ROOT / "docs" / "report.md").read_text()
    keys = schema()
    named = {*keys, *keys["verdict"], *keys["outputs"]["<name>"]}
    assert not sorted(k for k in named if f"`{k}`" not in doc)
