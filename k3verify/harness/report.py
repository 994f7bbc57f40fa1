"""Reports: ``report.json`` (schema below), ``report.md`` and ``report.html`` from the run's rows.

``report.json``::

    {"schema_version": 2, "created": ISO-8601, "command": [...], "environment": {...},
     "config": {"seed": int, "modules": [...]},
     "summary": {"rows": n, "pass": n, "fail": n, "expected-nonfinite": n, "unavailable": n},
     "rows": [{"module", "implementation", "form", "dtype", "params", "case", "rule",
               "status", "verdict", "margin", "metrics", "baseline_metrics"?, "prediction"?,
               "overflow"?, "explanation"?, "reason"?, "wall_s"?, "ulp_histogram"?, "error_by_position"?,
               "baseline_error_by_position"?, "golden"?, "source", "output", "outputs": {name: {"status",
               "verdict", "margin", "metrics", "baseline_metrics"?}}}, ...]}

Every key a row may hold, with its type, is declared once in :mod:`k3verify.harness.rows`
(:class:`~k3verify.harness.rows.Row`), which :func:`load` checks each row against.
Non-finite floats are written as ``null``; ``metrics.nonfinite`` says when outputs overflowed.
Keys marked ``?`` appear only where they apply; readers ignore keys they do not know, and
``schema_version`` changes only when a key they rely on changes meaning or disappears.
``report.md`` holds the tables (:func:`markdown`); ``report.html`` adds the figures and both are
written with the JSON, as one set, by :mod:`k3verify.harness.render`.

The text helpers here (:func:`table_rows`, :func:`row_heading`, :func:`failure_lines`,
:func:`notes`) return plain text, escaped by each sink: :func:`markdown` through
:func:`k3verify.harness.text.md_text`, the page through ``html_text``, the terminal through
``terminal_text``. Any field of a report may hold markup or control characters.
"""

from __future__ import annotations

import datetime as _dt
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..numerics import FAIL, PASS, STATUSES, UNAVAILABLE, VERDICT_STATUSES, where_text
from .files import UsageError, read_json, require_keys
from .rows import Row, RowError
from .text import md_text

# 2: named outputs (``outputs``, ``output``) per row; readers still take 1 (one unnamed output).
SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)


def summarize(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Row counts per status (every status present, zero when absent)."""
    counts = Counter(r["status"] for r in rows)
    return {"rows": len(rows), **{s: counts.get(s, 0) for s in STATUSES}}


def build(
    rows: list[dict[str, Any]], *, environment: dict[str, Any], config: dict[str, Any], command: list[str]
) -> dict[str, Any]:
    """The report document."""
    return {
        "schema_version": SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "environment": environment,
        "config": config,
        "summary": summarize(rows),
        "rows": rows,
    }


REPORT_JSON, REPORT_MD, REPORT_HTML = "report.json", "report.md", "report.html"
REPORT_FILES = (REPORT_JSON, REPORT_MD, REPORT_HTML)


def _check_row(row: Any, i: int, path: Path) -> None:
    """``UsageError`` naming the row and key unless ``row`` has the keys and types of
    :class:`~k3verify.harness.rows.Row` and its verdicts agree with each other
    (:func:`_check_verdicts`)."""
    try:
        Row.from_json(row, where=f"row {i}")
    except RowError as exc:
        raise UsageError(f"{path}: {exc}") from None
    problem = _check_verdicts(row)
    if problem:
        raise UsageError(f"{path}: row {i} ({row_heading(row)[:120]!r}) {problem}")


# A judged output has a verdict; ``unavailable`` is a row's status only (nothing was judged).
OUTPUT_STATUSES = VERDICT_STATUSES
# What a row carries when it was judged; an unavailable row has none of them.
JUDGEMENT_KEYS = ("verdict", "margin", "metrics", "baseline_metrics", "outputs", "output")
# The binding output's fields that the row repeats at the top level.
BINDING_KEYS = ("verdict", "margin", "metrics", "baseline_metrics")
# Tolerance of the margin against 1 - err/limit recomputed here (the writer's own formula gives it
# exactly; this only allows another writer's rounding).
MARGIN_RTOL = 1e-9


def _check_verdicts(row: dict[str, Any]) -> str | None:
    """What makes ``row`` contradict itself, or ``None``. The invariants are those of the rows
    ``runner.verify`` writes: a row is ``fail`` iff one of its outputs fails (a row without
    outputs: iff its verdict fails, or it has no verdict and a reason, a crash); ``output``
    names one of ``outputs``, and the row's status, verdict, margin and metrics are that
    output's; every verdict's status, margin and numbers agree (:func:`_verdict_problem`);
    an ``unavailable`` row carries no judgement at all."""
    if row["status"] == UNAVAILABLE:
        carried = [k for k in JUDGEMENT_KEYS if row.get(k) is not None]
        return f"is unavailable but carries {', '.join(carried)}" if carried else None
    outputs = row.get("outputs")
    if outputs is None:
        if row.get("output") is not None:
            return f"names output {str(row['output'])[:40]!r} but has no outputs"
        if row.get("verdict") is None:
            return None if row["status"] == FAIL and row.get("reason") else f"is {row['status']} without a verdict"
        problem = _verdict_problem(row["status"], row["verdict"], row.get("margin"), row.get("metrics"))
        return f"has {problem}" if problem else None
    if not outputs:
        return "has an empty 'outputs'"
    binding = row.get("output")
    if binding not in outputs:
        return f"names binding output {str(binding)[:40]!r}, which is not one of its outputs"
    for name, judged in outputs.items():
        problem = _verdict_problem(judged["status"], judged.get("verdict"), judged.get("margin"), judged.get("metrics"))
        if problem:
            return f"output {str(name)[:40]!r} has {problem}"
    failing = any(judged["status"] == FAIL for judged in outputs.values())
    if (row["status"] == FAIL) != failing:
        return f"is {row['status']} but its outputs {'do' if failing else 'do not'} fail"
    if row["status"] != outputs[binding]["status"]:
        return f"is {row['status']} but its binding output {str(binding)[:40]!r} is {outputs[binding]['status']}"
    for key in BINDING_KEYS:
        if row.get(key) != outputs[binding].get(key):
            return f"has a top-level {key!r} that is not its binding output {str(binding)[:40]!r}'s"
    return None


def _verdict_problem(status: str, verdict: dict[str, Any] | None, margin: Any, metrics: dict[str, Any] | None
                     ) -> str | None:
    """What is wrong with one judged verdict, or ``None``: a judged status needs a verdict of that
    status with the same margin; a pass has a numeric err at most its numeric limit and no
    non-finite output; where err and limit are numbers the margin is ``1 - err / limit``."""
    if verdict is None:
        return f"status {status} without a verdict"
    if verdict.get("status", status) != status:
        return f"status {status} but a {str(verdict['status'])[:40]!r} verdict"
    if verdict.get("margin", margin) != margin:
        return "a margin that is not its verdict's"
    err, limit = verdict.get("err"), verdict.get("limit")
    numeric = isinstance(err, (int, float)) and isinstance(limit, (int, float))
    if status == PASS:
        if not numeric:
            return "a pass verdict without a numeric err and limit"
        if not err <= limit:
            return f"a pass verdict whose err {err!r} exceeds its limit {limit!r}"
        if (metrics or {}).get("nonfinite"):
            return "a pass verdict with non-finite outputs"
    if numeric and limit > 0 and margin is not None:
        expected = 1.0 - err / limit
        if abs(margin - expected) > MARGIN_RTOL * max(1.0, abs(expected)):
            return f"margin {margin!r} where err and limit give {expected!r}"
    return None


def load(path: Path) -> dict[str, Any]:
    """A report document from ``report.json`` or a folder holding one; ``UsageError`` naming the
    path for anything that is not a readable report (JSON that is malformed or not strict,
    another schema, rows without their keys, keys of the wrong type, an unknown status, a row
    whose verdicts contradict each other, a summary that miscounts the rows)."""
    path = path / REPORT_JSON if path.is_dir() else path
    doc = require_keys(read_json(path, what="report"), {"schema_version": int, "rows": list}, path, "report")
    if doc["schema_version"] not in READABLE_SCHEMAS:
        raise UsageError(f"{path}: report schema {doc['schema_version']!r} is not one of {READABLE_SCHEMAS}")
    for i, row in enumerate(doc["rows"]):
        _check_row(row, i, path)
    for key in ("environment", "config", "summary"):
        if not isinstance(doc.get(key, {}), dict):
            raise UsageError(f"{path}: report's {key!r} is not an object")
    _check_summary(doc.get("summary", {}), doc["rows"], path)
    env, config = doc.get("environment", {}), doc.get("config", {})
    if not isinstance(env.get("math_platform") or {}, dict):
        raise UsageError(f"{path}: report's environment.math_platform is not an object")
    modules = config.get("modules")
    if modules is not None and not (isinstance(modules, list) and all(isinstance(m, str) for m in modules)):
        raise UsageError(f"{path}: report's config.modules is not a list of names")
    for key in ("created",):
        if not isinstance(doc.get(key, ""), str):
            raise UsageError(f"{path}: report's {key!r} is not text")
    if not isinstance(doc.get("command", []), list):
        raise UsageError(f"{path}: report's 'command' is not a list")
    return doc


def _check_summary(summary: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> None:
    """``UsageError`` unless every count the summary gives is the rows' own (pages show the summary)."""
    counts = summarize(rows)
    for key, value in summary.items():
        if key in counts and (not isinstance(value, int) or isinstance(value, bool) or value != counts[key]):
            raise UsageError(f"{path}: report's summary.{key} is {repr(value)[:40]} but its rows give {counts[key]}")


def fmt(x: Any, spec: str = ".2e") -> str:
    """A number for a table cell: ``-`` when missing, ``inf``/``nan`` spelled out (an integer
    beyond float range counts as infinite); anything else, a bool included, as its text."""
    if x is None:
        return "-"
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    if not -1e308 <= x <= 1e308:
        return "inf" if x > 0 else "-inf"
    return format(x, spec)


def params_text(row: dict[str, Any]) -> str:
    """``key=value`` pairs of a row's parameters, space-separated."""
    params = row.get("params")
    return " ".join(f"{k}={v}" for k, v in params.items()) if isinstance(params, dict) else ""


@dataclass(frozen=True)
class Column:
    """One column of the verdict table: its header, its cell as plain text (each sink escapes it),
    and how sinks lay it out. ``numeric``: a number or status, never cut nor split in the terminal
    and right-aligned on the page; ``nowrap``: a short name the page keeps on one line;
    ``page_only``: free text only the page's wider table shows."""

    header: str
    cell: Callable[[dict[str, Any]], str]
    numeric: bool = False
    nowrap: bool = False
    page_only: bool = False


def _verdict_field(name: str) -> Callable[[dict[str, Any]], str]:
    return lambda r: fmt((r.get("verdict") or {}).get(name))


# The verdict table's columns, once for Markdown, the page and the terminal.
COLUMNS = (
    Column("module", lambda r: r["module"], nowrap=True),
    Column("implementation", lambda r: r["implementation"]),
    Column("form", lambda r: r["form"]),
    Column("dtype", lambda r: r["dtype"], nowrap=True),
    Column("params", lambda r: params_text(r)),
    Column("case", lambda r: r["case"]),
    Column("output", lambda r: r.get("output", "-"), nowrap=True),
    Column("rule", lambda r: r["rule"], nowrap=True),
    Column("err", _verdict_field("err"), numeric=True),
    Column("limit", _verdict_field("limit"), numeric=True),
    Column("margin", lambda r: fmt(r.get("margin"), ".2f"), numeric=True),
    Column("status", lambda r: str(r["status"]), numeric=True),
    Column("reason", lambda r: r.get("reason") or (r.get("verdict") or {}).get("reason") or "", page_only=True),
    Column("source", lambda r: r.get("source") or "", page_only=True),
)
TABLE_COLUMNS = tuple(c for c in COLUMNS if not c.page_only)
TABLE_HEADER = [c.header for c in TABLE_COLUMNS]


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """Cells of the summary table shared by the terminal and Markdown views (:data:`TABLE_COLUMNS`)."""
    return [[c.cell(r) for c in TABLE_COLUMNS] for r in rows]


def markdown(doc: dict[str, Any], *, nightly: dict[str, Any] | None = None, not_shown: Sequence[str] = (),
             sections: Sequence[str] = ()) -> str:
    """Human-readable report: environment, summary, one table row per verified configuration,
    error against position, the nightly search's maxima (when given), ``sections`` (lines of
    Markdown, escaped by their writer: the decoder walk's), the files beside the report that
    were left out (``not_shown``) and notes. Every value is escaped (``md_text``)."""
    env = doc.get("environment") or {}
    command = doc.get("command", [])
    command = " ".join(map(str, command)) if isinstance(command, list) else command
    lines = [
        "# k3verify report",
        "",
        f"Created {md_text(doc.get('created', '-'))} by {md_text(command)}.",
        "",
        "## Environment",
        "",
        *_md_table(["key", "value"], [[k, v] for k, v in env.items()]),
        "",
        "## Summary",
        "",
        "Counts: " + " · ".join(f"{md_text(k)}: {md_text(v)}" for k, v in (doc.get("summary") or {}).items()),
        "",
        "Rules: `fp64-agreement` = normwise relative max error <= 1e-10 against the fp64 oracle; "
        "`baseline` = rms_ratio <= 2 x (same-dtype naive baseline's rms_ratio) + noise floor "
        "(the oracle rounded to the dtype); `frontier` = overflow predicted and observed. "
        "margin = 1 - err/limit.",
        "",
        *_failures_md(doc["rows"]),
        "## Results",
        "",
        *_md_table(TABLE_HEADER, table_rows(doc["rows"])),
        "",
    ]
    timed = speed_rows(doc["rows"])
    if timed:
        lines += ["## Speed", "", md_text(speed_note(doc["rows"])), "",
                  *_md_table(SPEED_HEADER, timed), ""]
    positions = [r for r in doc["rows"] if r["dtype"] != "fp64" and isinstance(r.get("error_by_position"), list)
                 and len(r["error_by_position"]) > 1]
    if positions:
        lines += [
            "## Error against position",
            "",
            "RMS ratio against the fp64 oracle at the first and last position, and the worst position "
            "(report.html draws the curves).",
            "",
            *_md_table(["module", "implementation", "form", "dtype", "params", "case", "first", "last", "worst",
                        "at t"], [_position_cells(r) for r in positions]),
            "",
        ]
    if nightly:
        lines += ["## Nightly worst-case search", "", f"Profile {md_text(nightly.get('profile'))}, budget "
                  f"{md_text(nightly.get('budget_s'))} s; ratio = err / limit of the row's rule.", ""]
        lines += _md_table(
            ["module", "examples", "worst implementation", "err/limit", "replay"],
            [[m, v.get("examples"), (v.get("worst") or {}).get("implementation", "-"),
              fmt((v.get("worst") or {}).get("ratio"), ".3f"), (v.get("worst") or {}).get("replay", "-")]
             for m, v in (nightly.get("modules") or {}).items()],
        )
        lines.append("")
    lines += sections
    if not_shown:
        lines += ["## Not shown", "", "Files beside the report that the pages leave out:", ""]
        lines += [f"- {md_text(item)}" for item in not_shown]
        lines.append("")
    items = notes(doc["rows"])
    if items:
        lines += ["## Notes", ""]
        for head, detail, sub in items:
            lines.append(f"- **{md_text(head)}**: {md_text(detail)}")
            lines += [f"  - {md_text(line)}" for line in sub]
        lines.append("")
    return "\n".join(lines)


SPEED_HEADER = ["row", "status", "margin", "median", "clock", "time / peer", "peer"]


def duration(seconds: Any) -> str:
    """``12.3 ms``, ``450 µs``, ``1.20 s``: a duration for a cell (``-`` when not a positive number)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < 1e30:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def speed_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """One line of cells per timed row (``run --time``): its name and verdict beside its median
    time, the clock, and its time over its peer's (with the peer's name, or why there is none)."""
    out = []
    for r in rows:
        t = r.get("time")
        if not isinstance(t, dict):
            continue
        if t.get("error"):
            median, ratio, peer = "-", "-", f"not timed: {t['error']}"
        else:
            median, ratio = duration(t.get("median_s")), fmt(t.get("ratio"), ".2f")
            peer = t.get("peer") or t.get("peer_note") or "no peer registered"
        out.append([f"{row_heading(r)} [{r.get('output', '-')}]", r["status"], fmt(r.get("margin"), ".2f"), median,
                    str(t.get("clock", "-")), ratio, peer])
    return out


def speed_note(rows: list[dict[str, Any]]) -> str:
    """What the speed table's times are, in one sentence, with the clock they were taken on."""
    clocks = {str((r.get("time") or {}).get("clock")) for r in rows if isinstance(r.get("time"), dict)} - {"None"}
    where = (" Taken on the CPU: our Triton kernels run in Triton's interpreter here, so these times measure "
             "the interpreter, not a GPU.") if "cpu" in clocks else ""
    return ("Median time of each kernel row's run on its verification case (the cast of the fp64 inputs "
            "included; small shapes: benchmarks/ times production shapes), and its time over its registered "
            f"peer's on the same case and dtype (above 1: slower than the peer). Never part of a verdict.{where}")


def _md_table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """A Markdown table; every cell is escaped here (``md_text``), so callers pass plain values."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *["| " + " | ".join(md_text(c) for c in cells) + " |" for cells in rows],
    ]


def _position_cells(row: dict[str, Any]) -> list[str]:
    errs = row["error_by_position"]
    finite = [(e, t) for t, e in enumerate(errs) if e is not None]
    worst, at = max(finite) if finite else (None, "-")
    return [row["module"], row["implementation"], row["form"], row["dtype"], params_text(row), row["case"],
            fmt(errs[0]), fmt(errs[-1]), fmt(worst), str(at)]


def row_heading(row: dict[str, Any]) -> str:
    """``module implementation form dtype params (case)``: one row's name in a log line."""
    words = [row["module"], row["implementation"], row["form"], row["dtype"], params_text(row), f"({row['case']})"]
    return " ".join(w for w in words if w)


def failure_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per failed output: the row, the output, the verdict's reason, where its worst
    element is (with the output's axis names) and, for the primary output, its worst position."""
    lines = []
    for r in rows:
        if r.get("status") != FAIL:
            continue
        outputs = r.get("outputs") or {r.get("output", "-"): {"status": FAIL, "verdict": r.get("verdict")}}
        primary = next(iter(r.get("outputs") or {}), None)
        for name, o in outputs.items():
            if o.get("status") == FAIL:
                reason = (o.get("verdict") or {}).get("reason") or r.get("reason") or "failed"
                lines.append(f"{row_heading(r)} [{name}]: {reason}{_where(o)}"
                             f"{worst_position(r) if name == primary else ''}")
    return lines


def _failures_md(rows: list[dict[str, Any]]) -> list[str]:
    """A ``## Failures`` section, one bullet per failed output (:func:`failure_lines`), first in
    the report where a reader looks; nothing when every verdict passed."""
    lines = failure_lines(rows)
    if not lines:
        return []
    return ["## Failures", "", *(f"- {md_text(line)}" for line in lines), ""]


def _where(output: dict[str, Any]) -> str:
    """``; worst at [b=1, t=155, h=1, v=126]: got -0.0602, expected -0.0596`` (or nothing)."""
    w = output.get("worst") or {}
    if not isinstance(w, dict) or not w.get("index"):
        return ""
    return (f"; worst at {where_text(list(w['index']), list(w.get('axes') or []))}: got {fmt(w.get('got'), '.4g')}, "
            f"expected {fmt(w.get('expected'), '.4g')}")


def worst_position(row: dict[str, Any]) -> str:
    """``; worst position 37 of 64 (rms ratio 3.1e-02)`` from the row's error by position."""
    curve = row.get("error_by_position")
    if not isinstance(curve, list) or len(curve) < 2:
        return ""
    values = [v if isinstance(v, (int, float)) else math.inf for v in curve]
    at = max(range(len(values)), key=lambda i: values[i])
    return f"; worst position {at} of {len(values)} (rms ratio {fmt(values[at], '.2e')})"


def unavailable_groups(rows: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """``(reason, row headings)`` for unavailable rows, one group per distinct reason."""
    groups: dict[str, list[str]] = {}
    for r in rows:
        if r.get("status") == UNAVAILABLE:
            groups.setdefault(r.get("reason") or "no reason given", []).append(row_heading(r))
    return list(groups.items())


def notes(rows: list[dict[str, Any]]) -> list[tuple[str, str, list[str]]]:
    """``(row heading, reason, lines)`` for every row with a reason, an overflow or a failure: the
    lines say which operand overflowed, or for a finite failure what the form's trace found."""
    out = []
    for r in rows:
        if not (r.get("reason") or r.get("overflow") or (r.get("verdict") or {}).get("status") == FAIL):
            continue
        head = f"{r['module']} {r['implementation']} {r['form']} {r['dtype']} {params_text(r)} ({r['case']})"
        detail = r.get("reason") or (r.get("verdict") or {}).get("reason") or ""
        lines = [*(r.get("overflow") or []), *(r.get("explanation") or [])]
        out.append((head, str(detail), [str(line) for line in lines]))
    return out
