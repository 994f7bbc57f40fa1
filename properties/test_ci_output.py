"""CI outputs: ``--junit-xml`` for ``run``, ``golden verify`` and ``report compare``, and the
GitHub step summary.

The JUnit file is read back with a JUnit reader written here from the format's definition
(``testsuites`` > ``testsuite`` > ``testcase`` with ``failure`` or ``skipped`` children): its
counts must equal the report's, a failed row must carry its reason, and untrusted names (control
characters, XML markup) must come back as text. Rules: structural.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from k3verify.cli import main
from k3verify.harness import ci_output


def _read_junit(path: Path) -> dict[str, object]:
    """What a JUnit consumer reads: totals and, per case, its outcome and message."""
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites"
    cases = []
    for suite in root.findall("testsuite"):
        for case in suite.findall("testcase"):
            failure, skipped = case.find("failure"), case.find("skipped")
            outcome = "failure" if failure is not None else "skipped" if skipped is not None else "pass"
            message = (failure if failure is not None else skipped).get("message") if outcome != "pass" else ""
            cases.append((case.get("classname"), case.get("name"), outcome, message))
    totals = {k: int(root.get(k)) for k in ("tests", "failures", "skipped", "errors")}
    assert _read_with_junitparser(path) == {"totals": totals, "cases": cases}
    return {"totals": totals, "cases": cases}


def _read_with_junitparser(path: Path) -> dict[str, object]:
    """The same file as junitparser (a JUnit library CI tools use) reads it: it must agree."""
    from junitparser import Failure, JUnitXml, Skipped

    xml = JUnitXml.fromfile(str(path))
    xml.update_statistics()  # counted from the cases themselves, not the file's attributes
    cases = []
    for suite in xml:
        for case in suite:
            (result, *_) = case.result or [None]
            outcome = "failure" if isinstance(result, Failure) else "skipped" if isinstance(result, Skipped) else "pass"
            cases.append((case.classname, case.name, outcome, result.message if result is not None else ""))
    totals = {"tests": xml.tests, "failures": xml.failures, "skipped": xml.skipped, "errors": xml.errors}
    return {"totals": totals, "cases": cases}


def test_run_writes_junit_with_the_reports_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    summary = tmp_path / "summary.md"
    monkeypatch.setenv(ci_output.STEP_SUMMARY, str(summary))
    code = main(["run", "--modules", "attnres_backward", "--implementations", "k3verify", "--out", str(tmp_path / "r"),
                 "--goldens", "none", "--quiet", "--junit-xml", str(tmp_path / "run.xml")])
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    read = _read_junit(tmp_path / "run.xml")
    counts = doc["summary"]
    assert code == 0 and read["totals"] == {"tests": counts["rows"], "failures": counts["fail"],
                                            "skipped": counts["unavailable"], "errors": 0}
    assert {c[0] for c in read["cases"]} == {"k3verify.attnres_backward"}
    text = summary.read_text()
    assert text.startswith("### k3verify run") and f"rows: {counts['rows']}" in text


def test_a_failed_row_fails_its_case_with_the_reason(tmp_path: Path) -> None:
    row = {"module": "mla", "implementation": "evil\x1b[31m <b>&\u202e\x9b1m\r", "form": "kernel", "dtype": "bf16",
           "params": {},
           "case": "default", "status": "fail", "output": "o",
           "outputs": {"o": {"status": "fail", "verdict": {"reason": "rms_ratio 9e-02 > 2x4e-03 + 1e-04"}}},
           "verdict": {"reason": "rms_ratio 9e-02 > 2x4e-03 + 1e-04"}}
    unavailable = dict(row, status="unavailable", reason="needs CUDA", case="decode")
    unavailable.pop("outputs")
    ci_output.write_junit(tmp_path / "x.xml", ci_output.rows_suite([row, unavailable], "t"))
    read = _read_junit(tmp_path / "x.xml")
    assert read["totals"] == {"tests": 2, "failures": 1, "skipped": 1, "errors": 0}
    (failed, skipped) = read["cases"]
    # Escapes, C1 controls, bidi overrides and carriage returns all come out visible.
    assert failed[2] == "failure" and "rms_ratio 9e-02" in failed[3]
    assert "evil\\x1b[31m <b>&\\u202e\\x9b1m\\x0d" in failed[1], failed[1]
    assert skipped[2:] == ("skipped", "needs CUDA")


def test_compare_writes_junit_of_its_findings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = Path("reports/baseline/cpu")
    summary = tmp_path / "summary.md"
    monkeypatch.setenv(ci_output.STEP_SUMMARY, str(summary))
    assert main(["report", "compare", str(base), str(base), "--junit-xml", str(tmp_path / "c.xml")]) == 0
    read = _read_junit(tmp_path / "c.xml")
    assert read["totals"]["failures"] == 0 and read["totals"]["tests"] >= 1
    assert "no regressions" in summary.read_text() or "regression" in summary.read_text().lower()


def test_a_junit_path_in_a_missing_folder_is_refused_before_the_run(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["run", "--modules", "moe", "--junit-xml", str(tmp_path / "nowhere" / "x.xml")])
    assert info.value.code == 2 and "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["report.json", "report.md"])
def test_a_junit_path_that_is_one_of_the_reports_files_is_refused(tmp_path: Path, name: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Structural: ``--junit-xml OUT/report.json`` once wrote the XML over the report just
    written (exit 0, "wrote report.json"); it is a usage error before anything is computed, and
    the folder keeps what it held."""
    out = tmp_path / "r"
    out.mkdir()
    (out / name).write_text("kept")
    assert main(["run", "--modules", "attnres_backward", "--goldens", "none", "--no-figures", "--out", str(out),
                 "--junit-xml", str(out / name)]) == 2
    assert "is the command's own" in capsys.readouterr().err and (out / name).read_text() == "kept"


def test_emoji_codes_in_untrusted_text_stay_text(capsys: pytest.CaptureFixture[str]) -> None:
    """Structural: a module name, a plugin's name or a report's field printed by the command line
    is text: rich turned ``:smile:`` into an emoji (a failing row could print a check mark)."""
    assert main(["list", "--modules", "nope:white_check_mark:"]) == 2
    err = capsys.readouterr().err
    assert "nope:white_check_mark:" in err and "\u2705" not in err, err


@pytest.mark.parametrize("where", ["folder", "missing/summary.md"])
def test_a_step_summary_that_cannot_be_written_is_refused_before_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        where: str) -> None:  # fmt: skip
    """Structural: ``GITHUB_STEP_SUMMARY`` naming a folder, or a file in a missing folder, was
    found only after the rows were computed; it is a usage error naming the variable, and no
    report is written."""
    (tmp_path / "folder").mkdir()
    monkeypatch.setenv(ci_output.STEP_SUMMARY, str(tmp_path / where))
    assert main(["run", "--modules", "attnres_backward", "--goldens", "none", "--no-figures", "--out",
                 str(tmp_path / "r")]) == 2
    assert "$GITHUB_STEP_SUMMARY names" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
