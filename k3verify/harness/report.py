"""Reports: ``report.json`` (schema below), ``report.md`` and ``report.html`` from the run's rows.

``report.json``::

    {"schema_version": 1, "created": ISO-8601, "command": [...], "environment": {...},
     "config": {"seed": int, "modules": [...]},
     "summary": {"rows": n, "pass": n, "fail": n, "expected-nonfinite": n, "unavailable": n},
     "rows": [{"module", "implementation", "form", "dtype", "params", "case", "rule",
               "status", "verdict", "margin", "metrics", "baseline_metrics"?, "prediction"?,
               "overflow"?, "reason"?, "wall_s"?, "ulp_histogram"?, "error_by_position"?,
               "baseline_error_by_position"?, "golden"?}, ...]}

Non-finite floats are written as ``null``; ``metrics.nonfinite`` says when outputs overflowed.
Keys marked ``?`` appear only where they apply; readers ignore keys they do not know, and
``schema_version`` changes only when a key they rely on changes meaning or disappears.
``report.html`` (see :mod:`k3verify.harness.render`) adds the figures; ``report.md`` the tables.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from ..numerics import EXPECTED_NONFINITE, FAIL, PASS
from .runner import UNAVAILABLE

SCHEMA_VERSION = 1
READABLE_SCHEMAS = (1,)
STATUSES = (PASS, FAIL, EXPECTED_NONFINITE, UNAVAILABLE)


def json_safe(value: Any) -> Any:
    """Replace inf/NaN floats by ``None`` recursively (JSON has no non-finite numbers)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


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


def write(doc: dict[str, Any], out_dir: Path, *, maps_dir: Path | None = None) -> list[Path]:
    """Write ``report.json``, ``report.md`` and ``report.html`` into ``out_dir``; return the paths.

    ``maps_dir`` is where overflow maps and curve files are looked for (see :func:`render`).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "report.json"
    json_path.write_text(json.dumps(json_safe(doc), indent=1, allow_nan=False) + "\n")
    return [json_path, *render(out_dir, maps_dir=maps_dir, doc=doc)]


def render(out_dir: Path, *, maps_dir: Path | None = None, doc: dict[str, Any] | None = None) -> list[Path]:
    """(Re)write ``report.md`` and ``report.html`` in ``out_dir`` from its ``report.json``.

    The pages also show what sits beside the report: ``nightly.json`` in ``out_dir``, and the
    overflow maps and curve files (``attnres_depth_drift.json``, ``moe_routing_flips.json``) in
    ``maps_dir``.
    """
    from .render import collect_extras, html_page

    if doc is None:
        doc = load(out_dir)
    extras = collect_extras(out_dir, maps_dir)
    md_path, html_path = out_dir / "report.md", out_dir / "report.html"
    md_path.write_text(markdown(doc, nightly=extras.nightly))
    html_path.write_text(html_page(doc, extras))
    return [md_path, html_path]


def load(path: Path) -> dict[str, Any]:
    """A report document from ``report.json`` or a folder holding one."""
    path = path / "report.json" if path.is_dir() else path
    doc = json.loads(path.read_text())
    if doc.get("schema_version") not in READABLE_SCHEMAS:
        raise ValueError(f"{path}: report schema {doc.get('schema_version')!r} is not one of {READABLE_SCHEMAS}")
    return doc


def fmt(x: Any, spec: str = ".2e") -> str:
    """A number for a table cell: ``-`` when missing, ``inf``/``nan`` spelled out."""
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return format(x, spec) if isinstance(x, (int, float)) else str(x)


def params_text(row: dict[str, Any]) -> str:
    """``key=value`` pairs of a row's parameters, space-separated."""
    return " ".join(f"{k}={v}" for k, v in row.get("params", {}).items())


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """Cells of the summary table shared by the terminal and Markdown views."""
    out = []
    for r in rows:
        v = r.get("verdict") or {}
        out.append(
            [
                r["module"],
                r["implementation"],
                r["form"],
                r["dtype"],
                params_text(r),
                r["case"],
                r["rule"],
                fmt(v.get("err")),
                fmt(v.get("limit")),
                fmt(r.get("margin"), ".2f"),
                r["status"],
            ]
        )
    return out


TABLE_HEADER = [
    "module",
    "implementation",
    "form",
    "dtype",
    "params",
    "case",
    "rule",
    "err",
    "limit",
    "margin",
    "status",
]


def markdown(doc: dict[str, Any], *, nightly: dict[str, Any] | None = None) -> str:
    """Human-readable report: environment, summary, one table row per verified configuration,
    error against position, the nightly search's maxima (when given) and notes."""
    env = doc["environment"]
    lines = [
        "# k3verify report",
        "",
        f"Created {doc['created']} by `{' '.join(doc['command'])}`.",
        "",
        "## Environment",
        "",
        "| key | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in env.items()],
        "",
        "## Summary",
        "",
        " · ".join(f"{k}: {v}" for k, v in doc["summary"].items()),
        "",
        "Rules: `fp64-agreement` = normwise relative max error <= 1e-10 against the fp64 oracle; "
        "`baseline` = rms_ratio <= 2 x (same-dtype naive baseline's rms_ratio) + noise floor "
        "(the oracle rounded to the dtype); `frontier` = overflow predicted and observed. "
        "margin = 1 - err/limit.",
        "",
        "## Results",
        "",
        *_md_table(TABLE_HEADER, table_rows(doc["rows"])),
        "",
    ]
    positions = [r for r in doc["rows"] if r["dtype"] != "fp64" and len(r.get("error_by_position") or []) > 1]
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
        lines += ["## Nightly worst-case search", "", f"Profile {nightly.get('profile')}, budget "
                  f"{nightly.get('budget_s')} s; ratio = err / limit of the row's rule.", ""]
        lines += _md_table(
            ["module", "examples", "worst implementation", "err/limit", "replay"],
            [[m, str(v.get("examples")), (v.get("worst") or {}).get("implementation", "-"),
              fmt((v.get("worst") or {}).get("ratio"), ".3f"), f"`{(v.get('worst') or {}).get('replay', '-')}`"]
             for m, v in nightly.get("modules", {}).items()],
        )
        lines.append("")
    items = notes(doc["rows"])
    if items:
        lines += ["## Notes", ""]
        for head, detail, sub in items:
            lines.append(f"- **{head}**: {detail}")
            lines += [f"  - {line}" for line in sub]
        lines.append("")
    return "\n".join(lines)


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *["| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |" for cells in rows],
    ]


def _position_cells(row: dict[str, Any]) -> list[str]:
    errs = row["error_by_position"]
    finite = [(e, t) for t, e in enumerate(errs) if e is not None]
    worst, at = max(finite) if finite else (None, "-")
    return [row["module"], row["implementation"], row["form"], row["dtype"], params_text(row), row["case"],
            fmt(errs[0]), fmt(errs[-1]), fmt(worst), str(at)]


def notes(rows: list[dict[str, Any]]) -> list[tuple[str, str, list[str]]]:
    """``(row heading, reason, overflow lines)`` for every row with a reason, an overflow or a failure."""
    out = []
    for r in rows:
        if not (r.get("reason") or r.get("overflow") or (r.get("verdict") or {}).get("status") == FAIL):
            continue
        head = f"{r['module']} {r['implementation']} {r['form']} {r['dtype']} {params_text(r)} ({r['case']})"
        detail = r.get("reason") or (r.get("verdict") or {}).get("reason", "")
        out.append((head, detail, list(r.get("overflow", []))))
    return out
