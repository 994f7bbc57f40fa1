"""``report.html``: one self-contained page (inline CSS, figures as PNG data URIs, no scripts).

Sections: summary, verdict table with margins, then per module the error against token
position, the ULP histograms and the overflow maps with their analytic frontiers; then the
curve files found next to the maps (AttnRes error against depth, MoE routing flips), the
nightly worst-case search and the notes. Whatever lies outside ``report.json`` is gathered
by :func:`collect_extras`, so a page can be re-rendered from a report and a maps folder.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import plots
from .files import json_safe, read_json, staged_folder
from .map_files import load_map
from .overflow_map import MapResult, MapSpec
from .report import REPORT_FILES, REPORT_HTML, REPORT_JSON, REPORT_MD, fmt, load, markdown, notes, params_text

NIGHTLY = "nightly.json"
MAP_SUMMARY = "summary.json"
_MAP_PNG = re.compile(r"^(?P<module>.+?)_overflow_map_.+\.png$")


@dataclass
class Extras:
    """What a report page shows beyond ``report.json``."""

    maps_dir: Path | None = None
    map_images: dict[str, list[tuple[str, bytes]]] = field(default_factory=dict)  # module -> [(name, png)]
    map_agreement: dict[str, dict[str, Any]] = field(default_factory=dict)  # module -> agreement counts
    map_commits: dict[str, str | None] = field(default_factory=dict)  # module -> commit the map was made from
    curves: dict[str, Any] = field(default_factory=dict)  # curve file name -> its JSON
    nightly: dict[str, Any] | None = None


def collect_extras(report_dir: Path, maps_dir: Path | None) -> Extras:
    """Overflow-map PNGs (or, lacking them, maps drawn from ``<module>_overflow_map.json``),
    map agreement counts, curve files from ``maps_dir``, and ``nightly.json`` from ``report_dir``."""
    extras = Extras(maps_dir=maps_dir)
    nightly = report_dir / NIGHTLY
    if nightly.exists():
        extras.nightly = read_json(nightly, what="nightly results")
    if maps_dir is None or not maps_dir.is_dir():
        return extras
    for png in sorted(maps_dir.glob("*_overflow_map_*.png")):
        m = _MAP_PNG.match(png.name)
        if m:
            extras.map_images.setdefault(m["module"], []).append((png.name, plots.compact_png(png.read_bytes())))
    summary = maps_dir / MAP_SUMMARY
    if summary.exists():
        summaries = read_json(summary, what="map summary")
        extras.map_agreement |= {k: v.get("agreement", {}) for k, v in summaries.items()}
        extras.map_commits |= {k: (v.get("environment") or {}).get("git_commit") for k, v in summaries.items()}
    for path in sorted(maps_dir.glob("*_overflow_map.json")):
        doc = load_map(path)
        module = doc["module"]
        extras.map_agreement[module] = doc.get("meta", {}).get("agreement", {})
        extras.map_commits[module] = (doc.get("environment") or {}).get("git_commit")
        if module not in extras.map_images:
            extras.map_images[module] = _draw_map_doc(doc)
    # Every other JSON file beside the maps is a module's study (its curve): whatever the modules
    # register is shown, under the title the file gives.
    for path in sorted(maps_dir.glob("*.json")):
        if not path.name.endswith("_overflow_map.json") and path.name != MAP_SUMMARY:
            extras.curves[path.name] = read_json(path, what="study file")
    return extras


def curve_title(name: str, doc: Any) -> str:
    """A study's title: its own ``title``, else its file name in words."""
    title = doc.get("title") if isinstance(doc, dict) else None
    return str(title) if title else name.removesuffix(".json").replace("_", " ")


def _draw_map_doc(doc: dict[str, Any]) -> list[tuple[str, bytes]]:
    """PNG heatmaps of a map JSON written without its PNGs."""
    result = MapResult(doc["module"], doc["cells"], MapSpec(**doc["spec"]), doc.get("meta", {}))
    with tempfile.TemporaryDirectory() as tmp:
        return [(p.name, plots.compact_png(p.read_bytes())) for p in plots.draw_map(result, Path(tmp))]


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _figure(fig: Any, alt: str, caption: str, heading: str = "") -> str:
    """A figure with its caption (and an ``<h3>`` heading when given); nothing when ``fig`` is None."""
    if fig is None:
        return ""
    head = f"<h3>{html.escape(heading)}</h3>" if heading else ""
    return f"{head}<figure>{_img(plots.png_bytes(fig), alt)}<figcaption>{caption}</figcaption></figure>"


def _table(header: list[str], rows: list[list[str]], classes: list[str] | None = None) -> str:
    """An HTML table; cells are escaped here, so callers pass plain text."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = []
    for i, cells in enumerate(rows):
        cls = f' class="{classes[i]}"' if classes else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px auto;max-width:1400px;color:#222;
padding:0 16px}
h1{font-size:1.6em} h2{border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:2em} h3{margin-top:1.4em}
table{border-collapse:collapse;font-size:12.5px;margin:8px 0}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f3f3f3;position:sticky;top:0}
tr.pass td.status{color:#1a7f37;font-weight:600} tr.fail td.status{color:#c62828;font-weight:700}
tr.fail{background:#fde8e8} tr.expected-nonfinite td.status{color:#9a6700} tr.unavailable{color:#999}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap} td.nw{white-space:nowrap}
.bar{display:inline-block;height:9px;background:#4c9a2a;margin-right:6px;vertical-align:middle}
.bar.neg{background:#c62828}
.badge{display:inline-block;padding:2px 9px;border-radius:10px;margin-right:6px;font-size:13px;background:#eee}
.badge.pass{background:#dff5e1} .badge.fail{background:#fbd5d5} .badge.expected-nonfinite{background:#fff3c4}
figure{margin:10px 0} figure img{max-width:100%;border:1px solid #eee}
figcaption{font-size:12px;color:#555}
details{margin:6px 0} code,pre{font-size:12px}
.muted{color:#777;font-size:12px}
.warn{background:#fff3cd;border-left:4px solid #d39e00;padding:4px 8px;font-size:13px}
.ok{background:#eef7ee;border-left:4px solid #4c9a2a;padding:4px 8px;font-size:13px}
"""


def html_page(doc: dict[str, Any], extras: Extras) -> str:
    """The whole page as a string."""
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>k3verify report {html.escape(doc['created'])}</title><style>{CSS}</style></head><body>",
        "<h1>k3verify report</h1>",
        f"<p class='muted'>Created {html.escape(doc['created'])} by <code>{html.escape(' '.join(doc['command']))}"
        f"</code> · schema {doc['schema_version']}</p>",
        _summary(doc),
        _environment(doc),
        "<h2>Verdicts</h2>",
        "<p>Rules: <b>fp64-agreement</b>: normwise relative max error ≤ 1e-10 against the fp64 oracle; "
        "<b>baseline</b>: rms_ratio ≤ 2 × (same-dtype naive baseline's rms_ratio) + noise floor; "
        "<b>frontier</b>: overflow predicted and observed. Margin = 1 − err/limit (bar: share of the allowance "
        "left; red when failing).</p>",
        _verdicts(doc["rows"]),
    ]
    modules = list(dict.fromkeys(r["module"] for r in doc["rows"])) + [
        m for m in extras.map_images if m not in {r["module"] for r in doc["rows"]}
    ]
    for module in modules:
        module_rows = [r for r in doc["rows"] if r["module"] == module]
        parts.append(_module_section(module, module_rows, extras, doc["environment"].get("git_commit")))
    for name, study in extras.curves.items():
        parts.append(_curve_section(name, curve_title(name, study), study, extras.maps_dir))
    if extras.nightly:
        parts.append(_nightly_section(extras.nightly))
    parts.append(_notes(doc["rows"]))
    parts.append("</body></html>")
    return "\n".join(p for p in parts if p)


def _summary(doc: dict[str, Any]) -> str:
    badges = "".join(
        f"<span class='badge {html.escape(k)}'>{html.escape(k)}: {v}</span>" for k, v in doc["summary"].items()
    )
    cfg = doc.get("config", {})
    return f"<p>{badges}</p><p class='muted'>modules: {html.escape(', '.join(cfg.get('modules', [])))} · seed " \
           f"{cfg.get('seed')} · wall {cfg.get('wall_s', '-')} s</p>"


def _environment(doc: dict[str, Any]) -> str:
    rows = [[k, "-" if v is None else str(v)] for k, v in doc["environment"].items()]
    return f"<details><summary>Environment</summary>{_table(['key', 'value'], rows)}</details>"


def _margin_cell(margin: Any) -> str:
    if not isinstance(margin, (int, float)) or margin is None or math.isnan(margin):
        return "<td class='num'>-</td>"
    if math.isinf(margin):
        return f"<td class='num'><span class='bar neg' style='width:60px'></span>{fmt(margin, '.2f')}</td>"
    width = round(60 * min(max(abs(margin), 0.0), 1.0))
    neg = " neg" if margin < 0 else ""
    return f"<td class='num'><span class='bar{neg}' style='width:{width}px'></span>{margin:.3f}</td>"


def _verdicts(rows: list[dict[str, Any]]) -> str:
    header = ["module", "implementation", "form", "dtype", "params", "case", "output", "rule", "err", "limit",
              "margin", "status"]
    body = []
    for r in rows:
        v = r.get("verdict") or {}
        cells = [r["module"], r["implementation"], r["form"], r["dtype"], params_text(r), r["case"],
                 r.get("output", "-"), r["rule"]]
        # module, dtype, output and rule never wrap; the free-text columns may
        tds = "".join(
            f"<td{' class=nw' if i in (0, 3, 6, 7) else ''}>{html.escape(str(c))}</td>" for i, c in enumerate(cells)
        )
        tds += f"<td class='num'>{fmt(v.get('err'))}</td><td class='num'>{fmt(v.get('limit'))}</td>"
        tds += _margin_cell(r.get("margin"))
        tds += f"<td class='status'>{html.escape(r['status'])}</td>"
        body.append(f"<tr class='{html.escape(r['status'])}'>{tds}</tr>")
    head = "".join(f"<th>{h}</th>" for h in header)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _module_section(module: str, rows: list[dict[str, Any]], extras: Extras, report_commit: str | None) -> str:
    parts = [f"<h2 id='module-{html.escape(module)}'>{html.escape(module)}</h2>"]
    parts.append(_figure(
        plots.position_figure(rows, f"{module}: error against token position"),
        f"{module} error against position",
        "RMS ratio of each position's output against the fp64 oracle; dashed, in colours of their own: the "
        "same-dtype naive baselines the baseline rule compares against. fp64 rows and single-token cases are left out.",
        "Error against token position",
    ))
    parts.append(_figure(
        plots.ulp_figure(rows, f"{module}: ULP histograms"),
        f"{module} ULP histograms",
        "Share of outputs per band of |error| in ULPs of the row's dtype at the oracle value (fp64 rows count "
        "fp64 ULPs). Rows with non-finite outputs have no histogram.",
        "ULP histograms",
    ))
    images = extras.map_images.get(module, [])
    if images:
        parts.append("<h3>Overflow map</h3>" + _map_provenance(module, extras, report_commit))
        agreement = extras.map_agreement.get(module)
        if agreement:
            table = [[k, v.get("cells"), v.get("agree"), v.get("disagree_adjacent"), v.get("disagree_away")]
                     for k, v in agreement.items() if isinstance(v, dict)]
            parts.append("<p>Analytic prediction against observation:</p>" + _table(
                ["subset", "cells", "agree", "disagree next to the frontier", "disagree away from it"], table))
        parts += [
            f"<figure>{_img(png, name)}<figcaption>{html.escape(name)}: colour log10 rms_ratio vs the fp64 oracle, "
            "red overflow, black line the analytic frontier, white x a missed prediction</figcaption></figure>"
            for name, png in images
        ]
    return "\n".join(p for p in parts if p)


def _map_provenance(module: str, extras: Extras, report_commit: str | None) -> str:
    """Where a module's maps come from, and whether they describe the code this report ran: a
    warning for committed baseline maps or maps made from another commit."""
    where = html.escape(str(extras.maps_dir))
    commit = extras.map_commits.get(module)
    redo = f"<code>k3verify overflow-map --module {html.escape(module)}</code> maps the code under test"
    if extras.maps_dir is not None and "baseline" in extras.maps_dir.resolve().parts:
        return (f"<p class='warn'>Committed baseline maps from {where}, not made by this run: they show the "
                f"code of commit {html.escape(str(commit or 'unknown')[:10])}. {redo}.</p>")
    if commit and report_commit and commit != report_commit:
        return (f"<p class='warn'>Maps from {where}, made from commit {html.escape(commit[:10])}; this report ran "
                f"commit {html.escape(report_commit[:10])}. {redo}.</p>")
    made = f", made from this report's commit {html.escape(commit[:10])}" if commit and commit == report_commit else ""
    return f"<p class='ok'>Maps from {where}{made}.</p>"


def _curve_section(name: str, title: str, doc: Any, maps_dir: Path | None) -> str:
    parts = [f"<h2>{html.escape(title)}</h2><p class='muted'>{html.escape(str((maps_dir or Path()) / name))}</p>"]
    try:
        # Curves against depth (a "layers" axis) are drawn as such; any other study as its series.
        is_depth = isinstance(doc, dict) and "layers" in doc
        fig = plots.depth_figure(doc, title) if is_depth else plots.series_figure(doc, title)
    except (KeyError, TypeError, ValueError) as exc:  # a curve file of another shape still shows as data
        fig, parts = None, [*parts, f"<p class='muted'>not drawn: {html.escape(repr(exc))}</p>"]
    parts.append(_figure(fig, title, html.escape(name)))
    if isinstance(doc, dict):
        scalars = [[k, json.dumps(v)] for k, v in doc.items() if not isinstance(v, (list, dict))]
        if scalars:
            parts.append(_table(["key", "value"], scalars))
    parts.append(f"<details><summary>{html.escape(name)}</summary><pre>{html.escape(json.dumps(doc, indent=1))}"
                 "</pre></details>")
    return "\n".join(parts)


def _nightly_section(nightly: dict[str, Any]) -> str:
    rows = []
    for module, m in nightly.get("modules", {}).items():
        w = m.get("worst") or {}
        rows.append([module, m.get("examples"), fmt(m.get("wall_s"), ".0f"), w.get("implementation", "-"),
                     fmt(w.get("ratio"), ".3f"), fmt(w.get("err")), fmt(w.get("limit")), w.get("replay", "-")])
    head = (f"<h2>Nightly worst-case search</h2><p class='muted'>profile {html.escape(str(nightly.get('profile')))}, "
            f"budget {nightly.get('budget_s')} s, created {html.escape(str(nightly.get('created')))}; ratio = err / "
            "limit of the row's rule (1 = at the limit).</p>")
    return head + _table(["module", "examples", "wall s", "worst implementation", "err/limit", "err", "limit",
                          "replay"], rows)


def _notes(rows: list[dict[str, Any]]) -> str:
    items = notes(rows)
    if not items:
        return ""
    lis = []
    for head, detail, lines in items:
        sub = "".join(f"<li><code>{html.escape(x)}</code></li>" for x in lines)
        lis.append(f"<li><b>{html.escape(head)}</b>: {html.escape(detail)}{f'<ul>{sub}</ul>' if sub else ''}</li>")
    return f"<h2>Notes</h2><ul>{''.join(lis)}</ul>"


# --- the report set: report.json, report.md, report.html --------------------------------


def write_report(doc: dict[str, Any], out_dir: Path, *, maps_dir: Path | None = None) -> list[Path]:
    """Write ``report.json``, ``report.md`` and ``report.html`` into ``out_dir`` as one set (the
    folder is swapped in whole: an interrupt leaves the previous three); return the paths.

    ``maps_dir`` is where overflow maps and curve files are looked for (see :func:`render_report`).
    """
    return _write_set(out_dir, doc, maps_dir, with_json=True)


def render_report(out_dir: Path, *, maps_dir: Path | None = None) -> list[Path]:
    """(Re)write ``report.md`` and ``report.html`` in ``out_dir`` from its ``report.json``.

    The pages also show what sits beside the report: ``nightly.json`` in ``out_dir``, and the
    overflow maps and curve files (``attnres_depth_drift.json``, ``moe_routing_flips.json``) in
    ``maps_dir``.
    """
    return _write_set(out_dir, load(out_dir), maps_dir, with_json=False)


def _write_set(out_dir: Path, doc: dict[str, Any], maps_dir: Path | None, *, with_json: bool) -> list[Path]:
    extras = collect_extras(out_dir, maps_dir)
    pages = {REPORT_MD: markdown(doc, nightly=extras.nightly), REPORT_HTML: html_page(doc, extras)}
    if with_json:
        pages[REPORT_JSON] = json.dumps(json_safe(doc), indent=1, allow_nan=False) + "\n"
    with staged_folder(out_dir, carry=lambda name: name not in pages) as stage:
        for name, text in pages.items():
            (stage / name).write_text(text, encoding="utf-8")
    return [out_dir / name for name in REPORT_FILES if name in pages]
