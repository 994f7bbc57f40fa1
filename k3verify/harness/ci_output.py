"""What CI systems read: a JUnit XML file (``--junit-xml PATH``) and, where GitHub Actions sets
``GITHUB_STEP_SUMMARY``, the Markdown summary appended to that file.

One test case per report row (``run``, ``golden verify``) or per compare finding (``report
compare``): a failed verdict or a regression is a ``<failure>`` whose message is its reason,
an unavailable row is ``<skipped>`` with its reason, everything else passes. Every string comes
from reports, plugins or goldens, so it is untrusted: the XML writer escapes it, and characters
XML 1.0 cannot hold (control characters, lone surrogates) are written as ``\\xNN`` escapes.
"""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..numerics import FAIL, UNAVAILABLE
from .report import failure_lines, row_heading
from .text import md_text, visible

STEP_SUMMARY = "GITHUB_STEP_SUMMARY"
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _xml_text(value: object) -> str:
    """``value`` as text XML 1.0 can hold, visible as :func:`~k3verify.harness.text.visible`
    makes it (bidi overrides, C1 controls and carriage returns as escapes; newlines and tabs
    kept); anything XML still forbids becomes a ``\\xNN`` escape."""
    return _NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}", visible(value, keep="\n\t"))


def _case(suite: ET.Element, classname: str, name: str, time_s: float = 0.0) -> ET.Element:
    return ET.SubElement(suite, "testcase", classname=_xml_text(classname), name=_xml_text(name),
                         time=f"{time_s:.3f}")


def _finish_suite(suite: ET.Element) -> ET.Element:
    cases = suite.findall("testcase")
    suite.set("tests", str(len(cases)))
    suite.set("failures", str(sum(c.find("failure") is not None for c in cases)))
    suite.set("skipped", str(sum(c.find("skipped") is not None for c in cases)))
    suite.set("errors", "0")
    return suite


def rows_suite(rows: Sequence[dict[str, Any]], name: str) -> ET.Element:
    """A ``<testsuite>`` of report rows: failed rows fail with every failing output's line, and
    unavailable rows are skipped with their reason."""
    suite = ET.Element("testsuite", name=_xml_text(name))
    for row in rows:
        case = _case(suite, f"k3verify.{row.get('module', '-')}", row_heading(row), float(row.get("wall_s") or 0.0))
        if row.get("status") == FAIL:
            lines = failure_lines([row]) or [str(row.get("reason") or "failed")]
            failure = ET.SubElement(case, "failure", message=_xml_text(lines[0]), type="verdict")
            failure.text = _xml_text("\n".join(lines))
        elif row.get("status") == UNAVAILABLE:
            ET.SubElement(case, "skipped", message=_xml_text(row.get("reason") or "unavailable"))
    return _finish_suite(suite)


def findings_suite(findings: Iterable[Any], name: str, rows_compared: int) -> ET.Element:
    """A ``<testsuite>`` of compare findings (``kind``, ``subject``, ``detail``, ``regression``):
    each regression fails; other findings pass; one case stands for the rows compared clean."""
    suite = ET.Element("testsuite", name=_xml_text(name))
    for f in findings:
        case = _case(suite, f"k3verify.compare.{f.kind.replace(' ', '_')}", f.subject)
        if f.regression:
            ET.SubElement(case, "failure", message=_xml_text(f"{f.kind}: {f.detail}"), type="regression")
    _case(suite, "k3verify.compare", f"{rows_compared} rows compared")
    return _finish_suite(suite)


def write_junit(path: Path, suite: ET.Element) -> None:
    """``<testsuites>`` holding ``suite``, written to ``path`` (UTF-8, with the XML declaration)."""
    root = ET.Element("testsuites", tests=suite.get("tests", "0"), failures=suite.get("failures", "0"),
                      skipped=suite.get("skipped", "0"), errors="0")
    root.append(suite)
    ET.indent(root)
    path.write_bytes(ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n")


def run_summary(title: str, doc: dict[str, Any]) -> str:
    """The Markdown a CI job page shows for a run: its counts and every failed output's line."""
    counts = " · ".join(f"{md_text(k)}: {md_text(v)}" for k, v in (doc.get("summary") or {}).items())
    lines = [f"### {md_text(title)}", "", counts, ""]
    lines += [f"- {md_text(line)}" for line in failure_lines(doc.get("rows") or [])]
    return "\n".join(lines).rstrip() + "\n"


def append_step_summary(markdown: str, environ: dict[str, str] | None = None) -> Path | None:
    """Append ``markdown`` to the file ``GITHUB_STEP_SUMMARY`` names, when it names one; returns
    that path (``None`` when unset or empty)."""
    where = (os.environ if environ is None else environ).get(STEP_SUMMARY)
    if not where:
        return None
    path = Path(where)
    with path.open("a", encoding="utf-8") as f:
        f.write(markdown.rstrip() + "\n\n")
    return path
