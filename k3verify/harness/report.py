"""Reports: ``report.json`` (schema below) and ``report.md`` from the run's rows.

``report.json``::

    {"schema_version": 1, "created": ISO-8601, "command": [...], "environment": {...},
     "config": {"seed": int, "modules": [...]},
     "summary": {"rows": n, "pass": n, "fail": n, "expected-nonfinite": n, "unavailable": n},
     "rows": [{"module", "implementation", "form", "dtype", "params", "case", "rule",
               "status", "verdict", "margin", "metrics", "baseline_metrics"?, "prediction"?,
               "overflow"?, "reason"?, "wall_s"?}, ...]}

Non-finite floats are written as ``null``; ``metrics.nonfinite`` says when outputs overflowed.
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


def write(doc: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """Write ``report.json`` and ``report.md`` into ``out_dir``; return both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "report.json", out_dir / "report.md"
    json_path.write_text(json.dumps(json_safe(doc), indent=1, allow_nan=False) + "\n")
    md_path.write_text(markdown(doc))
    return json_path, md_path


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


def markdown(doc: dict[str, Any]) -> str:
    """Human-readable report: environment, summary, one table row per verified configuration."""
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
        "| " + " | ".join(TABLE_HEADER) + " |",
        "|" + "---|" * len(TABLE_HEADER),
        *["| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |" for cells in table_rows(doc["rows"])],
        "",
    ]
    notes = [
        r for r in doc["rows"] if r.get("reason") or r.get("overflow") or r.get("verdict", {}).get("status") == FAIL
    ]
    if notes:
        lines += ["## Notes", ""]
        for r in notes:
            head = f"- **{r['module']} {r['implementation']} {r['form']} {r['dtype']} {params_text(r)} ({r['case']})**"
            detail = r.get("reason") or (r.get("verdict") or {}).get("reason", "")
            lines.append(f"{head}: {detail}")
            lines += [f"  - {line}" for line in r.get("overflow", [])]
        lines.append("")
    return "\n".join(lines)
