"""``report.html``: one self-contained page (inline CSS, figures as PNG data URIs, no scripts).

Sections: summary, verdict table with margins, then per module the error against token
position, the ULP histograms and the overflow maps with their analytic frontiers; then the
decoder walk (``decoder_walk.json`` of ``k3verify walk``), the curve files found next to the
maps (AttnRes error against depth, MoE routing flips), the nightly worst-case search and the
notes. Whatever lies outside ``report.json`` is gathered by :func:`collect_extras`, so a page
can be re-rendered from a report, the files beside it and a maps folder.

A report, its ``nightly.json`` and ``decoder_walk.json`` and a maps folder are untrusted input
(a CI artifact of someone's pull request): every string from them reaches the page through
:func:`k3verify.harness.text.html_text` (``report.md`` through ``md_text``, figures through
``plot_text``), and the maps folder is read through
:class:`k3verify.harness.map_files.MapsFolder`: no symlink, only regular files of known names,
each size-bounded. A file that cannot be shown (a symlink, a FIFO, too large, malformed, a PNG
that does not decode within its pixel bound) is named under "Not shown" on both pages instead.
"""

from __future__ import annotations

import base64
import json
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from ..numerics import FAIL, UNAVAILABLE
from . import registry
from .files import UsageError, json_safe, staged_folder
from .map_files import (
    MAP_JSON,
    MAP_PNG,
    MAX_MAP_BYTES,
    MAX_PNG_BYTES,
    MAX_STUDY_BYTES,
    MapsFolder,
    check_map,
    drawable_map,
    maps_entries,
)
from .report import (
    COLUMNS,
    REPORT_FILES,
    REPORT_HTML,
    REPORT_JSON,
    REPORT_MD,
    SPEED_HEADER,
    STATUSES,
    Column,
    failure_lines,
    fmt,
    load,
    markdown,
    notes,
    speed_note,
    speed_rows,
    unavailable_groups,
)
from .text import html_text, md_text
from .walk_page import (
    ATTRIBUTION_HEADER,
    ATTRIBUTION_NOTE,
    DECODE_HEADER,
    GROWTH_NOTE,
    JOB_HEADER,
    ROUTING_HEADER,
    ROUTING_NOTE,
    WALK_FILE,
    attribution_table,
    check_walk,
    decode_table,
    describe,
    divergence_rows,
    fp64_text,
    growth_table,
    job_rows,
    routing_rows,
    walk_markdown,
)


def _plots() -> ModuleType:
    """:mod:`~k3verify.harness.plots`, imported on first use: matplotlib and Pillow were 0.7 s of
    every command's start (``k3verify list``: 3.05 s without them, 3.75 s with, on the 2-core
    development machine), and most commands draw nothing."""
    from . import plots

    return plots

NIGHTLY = "nightly.json"
MAX_NIGHTLY_BYTES = 4 * 1024 * 1024
# A study is shown in full (its JSON in a <pre>), so its nesting is bounded too.
MAX_STUDY_DEPTH = 32
NotShown = Callable[[str], None]


@dataclass
class Extras:
    """What a report page shows beyond ``report.json``."""

    maps_dir: Path | None = None
    map_dirs: dict[str, Path] = field(default_factory=dict)  # module -> the folder its maps came from
    map_images: dict[str, list[tuple[str, bytes]]] = field(default_factory=dict)  # module -> [(name, png)]
    map_agreement: dict[str, dict[str, Any]] = field(default_factory=dict)  # module -> agreement counts
    map_commits: dict[str, str | None] = field(default_factory=dict)  # module -> commit the map was made from
    curves: dict[str, Any] = field(default_factory=dict)  # curve file name -> its JSON
    curve_dirs: dict[str, Path] = field(default_factory=dict)  # curve file name -> the folder it came from
    nightly: dict[str, Any] | None = None
    walk: dict[str, Any] | None = None  # decoder_walk.json (k3verify walk), checked
    not_shown: list[str] = field(default_factory=list)  # "<path>: <why>", one per file left out


# Whether the pages being written draw their figures (``k3verify run --no-figures`` writes them
# without: drawing is about a third of a default run on two cores, and a CI job that only
# compares reports reads none of them).
_FIGURES: ContextVar[bool] = ContextVar("figures", default=True)
NO_FIGURES_NOTE = ("Figures were not drawn (k3verify run --no-figures): k3verify report render on this folder "
                   "draws them.")


def _draw(make: Callable[..., Any], *args: Any) -> Any:
    """``make(*args)`` (a figure), or ``None`` when the pages are written without figures."""
    return make(*args) if _FIGURES.get() else None


def study_names() -> set[str]:
    """The study files registered modules write beside their maps (``ModuleEntry.studies``)."""
    return set(study_owners())


def study_owners() -> dict[str, str]:
    """Each registered study file's module."""
    return {name: entry.name for entry in registry.select(None) for name in entry.studies}


def collect_extras(report_dir: Path, maps_dir: Path | None, fallbacks: Sequence[Path] = (),
                   walk: Any = None) -> Extras:
    """Overflow-map PNGs (or, lacking them, maps drawn from ``<module>_overflow_map.json``),
    map agreement counts, the registered modules' studies from ``maps_dir``, and
    ``nightly.json`` and ``decoder_walk.json`` from ``report_dir`` (``walk`` instead of the
    latter when given: a document about to be written there); then, module by module and study
    by study, what ``maps_dir`` lacks from each of ``fallbacks`` in turn (``extras.map_dirs``
    says which folder each module's maps came from). A file that cannot be shown is named in
    ``not_shown``; no file other than these is opened."""
    extras = Extras(maps_dir=maps_dir)
    if os.path.lexists(report_dir / NIGHTLY):
        _shown(extras, lambda: _read_nightly(report_dir, extras))
    if walk is not None:
        _shown(extras, lambda: _take_walk(walk, report_dir / WALK_FILE, extras))
    elif os.path.lexists(report_dir / WALK_FILE):
        _shown(extras, lambda: _read_walk(report_dir, extras))
    for path in [p for p in (maps_dir, *fallbacks) if p is not None]:
        try:
            folder = MapsFolder(path)
        except UsageError as exc:  # checked before the run (cli); gone or swapped since
            extras.not_shown.append(str(exc))
            continue
        with folder:
            _read_maps_folder(folder, path, extras, first=path == maps_dir)
    return extras


def _read_maps_folder(folder: MapsFolder, path: Path, extras: Extras, *, first: bool) -> None:
    """Everything of ``folder`` for a module or study the page has nothing of yet (all of it for
    the first folder)."""
    entries = maps_entries(folder.names(), study_names())
    had = set(extras.map_images) | set(extras.map_agreement) | set(extras.map_commits)

    def wanted(module: str) -> bool:
        if first or module not in had:
            extras.map_dirs.setdefault(module, path)
            return True
        return False

    for name in entries["png"]:
        module = MAP_PNG.match(name)["module"]
        if wanted(module) and _FIGURES.get():
            _shown(extras, lambda n=name, m=module: extras.map_images.setdefault(m, []).append(
                (n, _read_png(folder, n))))
    for name in entries["summary"]:  # one file for every module: only the modules wanted are merged
        _shown(extras, lambda n=name: _read_summary(folder, n, extras, keep=None if first else had))
    for name in entries["map"]:
        if wanted(MAP_JSON.match(name)["module"]):
            _shown(extras, lambda n=name: _read_map(folder, n, extras))
    for name in entries["study"]:
        if first or name not in extras.curves:
            extras.curve_dirs.setdefault(name, path)
            _shown(extras, lambda n=name: _read_study(folder, n, extras))


def _shown(extras: Extras, read: Callable[[], Any]) -> None:
    """Run ``read``; a file it refuses (``UsageError``, naming the file) is named in
    ``extras.not_shown`` instead of stopping the page."""
    try:
        read()
    except UsageError as exc:
        extras.not_shown.append(str(exc))


def _read_png(folder: MapsFolder, name: str) -> bytes:
    """A map image from the folder, re-encoded (:func:`plots.compact_png`); ``UsageError``
    naming it when it is refused or does not decode within the pixel bound."""
    data = folder.read(name, MAX_PNG_BYTES, "map image")
    try:
        return _plots().compact_png(data)
    except ValueError as exc:
        raise UsageError(f"{folder.path / name}: map image is {exc}") from None


def _read_nightly(report_dir: Path, extras: Extras) -> None:
    with MapsFolder(report_dir, "report folder") as folder:
        doc = folder.read_json(NIGHTLY, MAX_NIGHTLY_BYTES, "nightly results")
    path = report_dir / NIGHTLY
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: nightly results are a JSON {type(doc).__name__}, not an object")
    modules = doc.get("modules", {})
    if not isinstance(modules, dict):
        raise UsageError(f"{path}: nightly results' 'modules' is not an object")
    for name, m in modules.items():
        if not isinstance(m, dict) or not isinstance(m.get("worst") or {}, dict):
            raise UsageError(f"{path}: nightly results of module {name[:40]!r} are not an object with a 'worst' object")
    extras.nightly = doc


def _read_walk(report_dir: Path, extras: Extras) -> None:
    """``decoder_walk.json`` beside the report: bounded and nested like a study, then checked."""
    with MapsFolder(report_dir, "report folder") as folder:
        doc = folder.read_json(WALK_FILE, MAX_STUDY_BYTES, "decoder walk")
    extras.walk = _checked_walk(doc, report_dir / WALK_FILE)


def _take_walk(doc: Any, path: Path, extras: Extras) -> None:
    """A decoder walk handed over in memory, held to the bounds of one read from ``path``: as it
    will be written (non-finite numbers as null), at most as large and as deeply nested."""
    try:
        text = json.dumps(json_safe(doc), indent=1, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise UsageError(f"{path}: decoder walk is not a JSON document: {str(exc)[:200]}") from None
    if len(text.encode("utf-8", "surrogatepass")) > MAX_STUDY_BYTES:
        raise UsageError(f"{path}: decoder walk has more than the {MAX_STUDY_BYTES} bytes allowed")
    extras.walk = _checked_walk(json.loads(text), path)


def _checked_walk(doc: Any, path: Path) -> dict[str, Any]:
    """A decoder walk read from ``path`` (or to be written there), nested at most as a study, and
    checked by :func:`~k3verify.harness.walk_page.check_walk`."""
    if _depth(doc) > MAX_STUDY_DEPTH:
        raise UsageError(f"{path}: decoder walk is nested deeper than {MAX_STUDY_DEPTH} levels")
    return check_walk(doc, path)


def _read_summary(folder: MapsFolder, name: str, extras: Extras, keep: set[str] | None = None) -> None:
    """The maps' agreement counts and commits, per module; the modules in ``keep`` (already
    shown from an earlier folder) are left as they are."""
    path = folder.path / name
    doc = folder.read_json(name, MAX_MAP_BYTES, "map summary")
    if not isinstance(doc, dict) or not all(isinstance(v, dict) for v in doc.values()):
        raise UsageError(f"{path}: map summary is not an object of one object per module")
    for module, v in doc.items():
        _check_provenance(v, path, f"map summary of {module[:40]!r}")
    doc = {k: v for k, v in doc.items() if keep is None or k not in keep}
    extras.map_agreement |= {k: v.get("agreement") or {} for k, v in doc.items()}
    extras.map_commits |= {k: (v.get("environment") or {}).get("git_commit") for k, v in doc.items()}


def _check_provenance(record: dict[str, Any], path: Path, what: str) -> None:
    """``UsageError`` unless ``record``'s ``agreement`` is an object of objects and its
    ``environment.git_commit`` is text (either may be missing)."""
    agreement, env = record.get("agreement") or {}, record.get("environment") or {}
    if not isinstance(agreement, dict) or not all(isinstance(v, dict) for v in agreement.values()):
        raise UsageError(f"{path}: {what}: 'agreement' is not an object of counts per subset")
    if not isinstance(env, dict) or not isinstance(env.get("git_commit") or "", str):
        raise UsageError(f"{path}: {what}: 'environment.git_commit' is not text")


def _read_map(folder: MapsFolder, name: str, extras: Extras) -> None:
    path = folder.path / name
    doc = check_map(folder.read_json(name, MAX_MAP_BYTES, "overflow map"), path)
    module = MAP_JSON.match(name)["module"]
    if doc["module"] != module:
        raise UsageError(f"{path}: overflow map of module {doc['module'][:40]!r} in a file named for {module!r}")
    meta = doc.get("meta") if isinstance(doc.get("meta"), dict) else {}
    _check_provenance({"agreement": meta.get("agreement"), "environment": doc.get("environment")}, path,
                      "overflow map")
    extras.map_agreement[module] = meta.get("agreement") or {}
    extras.map_commits[module] = (doc.get("environment") or {}).get("git_commit")
    if module not in extras.map_images and _FIGURES.get():
        extras.map_images[module] = _draw_map_doc(drawable_map(doc, path), path)


def _read_study(folder: MapsFolder, name: str, extras: Extras) -> None:
    doc = folder.read_json(name, MAX_STUDY_BYTES, "study file")
    if _depth(doc) > MAX_STUDY_DEPTH:
        raise UsageError(f"{folder.path / name}: study file is nested deeper than {MAX_STUDY_DEPTH} levels")
    extras.curves[name] = doc


def _depth(doc: Any) -> int:
    """How deeply lists and objects nest in a JSON document (a scalar: 0)."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack += [(c, depth + 1) for c in children]
    return deepest


def curve_title(name: str, doc: Any) -> str:
    """A study's title: its own ``title``, else its file name in words."""
    title = doc.get("title") if isinstance(doc, dict) else None
    return str(title) if title else name.removesuffix(".json").replace("_", " ")


def _draw_map_doc(result: Any, path: Path) -> list[tuple[str, bytes]]:
    """PNG heatmaps of a map JSON written without its PNGs (a checked :class:`MapResult`);
    ``UsageError`` naming ``path`` when a figure is larger than a page embeds."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            return [(p.name, _plots().compact_png(p.read_bytes())) for p in _plots().draw_map(result, Path(tmp))]
        except ValueError as exc:
            raise UsageError(f"{path}: overflow map drawn too large: {exc}") from None


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{html_text(alt)}" src="data:image/png;base64,{data}">'


def _figure(fig: Any, alt: str, caption: str, heading: str = "") -> str:
    """A figure with its caption (HTML, escaped by the caller) and an ``<h3>`` heading when
    given; nothing when ``fig`` is None."""
    if fig is None:
        return ""
    head = f"<h3>{html_text(heading)}</h3>" if heading else ""
    try:
        png = _plots().png_bytes(fig)
    except ValueError as exc:  # a figure larger than a page embeds (a report with thousands of rows in a case)
        return f"{head}<p class='muted'>{html_text(alt)}: not drawn: {html_text(exc)}</p>"
    return f"{head}<figure>{_img(png, alt)}<figcaption>{caption}</figcaption></figure>"


def _table(header: list[str], rows: list[list[Any]], classes: list[str] | None = None) -> str:
    """An HTML table; cells are escaped here, so callers pass plain text."""
    head = "".join(f"<th>{html_text(h)}</th>" for h in header)
    body = []
    for i, cells in enumerate(rows):
        cls = f' class="{html_text(classes[i])}"' if classes else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{html_text(c)}</td>" for c in cells) + "</tr>")
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
td.reason{font-size:12px;min-width:16em;max-width:32em} ul.failures li{color:#c62828}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap} td.nw{white-space:nowrap}
.bar{display:inline-block;height:9px;background:#4c9a2a;margin-right:6px;vertical-align:middle}
.bar.neg{background:#c62828}
.badge{display:inline-block;padding:2px 9px;border-radius:10px;margin-right:6px;font-size:13px;background:#eee}
.badge.pass{background:#dff5e1} .badge.fail{background:#fbd5d5} .badge.expected-nonfinite{background:#fff3c4}
figure{margin:10px 0} figure img{max-width:100%;border:1px solid #eee}
.wide{overflow-x:auto}
.maps{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:8px}
figcaption{font-size:12px;color:#555}
details{margin:6px 0} code,pre{font-size:12px}
.muted{color:#777;font-size:12px}
.warn{background:#fff3cd;border-left:4px solid #d39e00;padding:4px 8px;font-size:13px}
.ok{background:#eef7ee;border-left:4px solid #4c9a2a;padding:4px 8px;font-size:13px}
"""


def html_page(doc: dict[str, Any], extras: Extras) -> str:
    """The whole page as a string."""
    created, command = html_text(doc.get("created", "-")), html_text(_words(doc.get("command", [])))
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>k3verify report {created}</title><style>{CSS}</style></head><body>",
        "<h1>k3verify report</h1>",
        f"<p class='muted'>Created {created} by <code>{command}</code> · schema "
        f"{html_text(doc.get('schema_version'))}</p>",
        _summary(doc),
        _failures(doc["rows"]),
        _environment(doc),
        _not_shown(extras.not_shown),
        "" if _FIGURES.get() else f"<p class='muted'>{html_text(NO_FIGURES_NOTE)}</p>",
        "<h2>Verdicts</h2>",
        "<p>Rules: <b>fp64-agreement</b>: normwise relative max error ≤ 1e-10 against the fp64 oracle; "
        "<b>baseline</b>: rms_ratio ≤ 2 × (same-dtype naive baseline's rms_ratio) + noise floor; "
        "<b>frontier</b>: overflow predicted and observed. Margin = 1 − err/limit (bar: share of the allowance "
        "left; red when failing).</p>",
        _verdicts(doc["rows"]),
        _speed(doc["rows"]),
        _unavailable(doc["rows"]),
    ]
    # The modules that ran, each with its plots, map and studies; those of modules not run are left out.
    modules = list(dict.fromkeys(r["module"] for r in doc["rows"]))
    owners = study_owners()
    studies = {name: s for name, s in extras.curves.items() if owners.get(name) in (*modules, None)}
    skipped = [m for m in extras.map_images if m not in modules]
    if skipped:
        by_folder: dict[str, list[str]] = {}
        for m in skipped:
            by_folder.setdefault(str(extras.map_dirs.get(m, extras.maps_dir) or "-"), []).append(m)
        where = "; ".join(f"{', '.join(ms)} ({folder})" for folder, ms in by_folder.items())
        parts.append(f"<p class='muted'>Overflow maps of modules this run did not verify are left out: "
                     f"{html_text(where)}.</p>")
    if len(studies) < len(extras.curves):
        left = [n for n in extras.curves if n not in studies]
        parts.append(f"<p class='muted'>Studies of modules this run did not verify are left out: "
                     f"{html_text(', '.join(left))}.</p>")
    commit = (doc.get("environment") or {}).get("git_commit")
    for module in modules:
        module_rows = [r for r in doc["rows"] if r["module"] == module]
        parts.append(_module_section(module, module_rows, extras, commit if isinstance(commit, str) else None))
    if extras.walk is not None:
        shown = walk_shown(doc)
        parts.append(_walk_section(extras.walk) if shown else f"<p class='muted'>{html_text(WALK_LEFT_OUT)}</p>")
    for name, study in studies.items():
        parts.append(_curve_section(name, curve_title(name, study), study, extras.curve_dirs.get(name)))
    if extras.nightly:
        parts.append(_nightly_section(extras.nightly))
    parts.append(_notes(doc["rows"]))
    parts.append("</body></html>")
    return "\n".join(p for p in parts if p)


def _words(value: Any) -> str:
    """A list (a command line, module names) as its items joined by spaces; anything else as text."""
    return " ".join(str(v) for v in value) if isinstance(value, list) else str(value)


def _summary(doc: dict[str, Any]) -> str:
    summary = doc.get("summary") or {}
    # A status names its badge's colour; any other key of a report gets the plain badge.
    badges = "".join(
        f"<span class='badge{' ' + k if k in STATUSES else ''}'>{html_text(k)}: {html_text(v)}</span>"
        for k, v in summary.items()
    )
    cfg = doc.get("config") or {}
    modules = ", ".join(str(m) for m in cfg.get("modules", [])) if isinstance(cfg.get("modules"), list) else "-"
    # Numbers where a report is well-formed, but any value of a report may be text.
    return (f"<p>{badges}</p><p class='muted'>modules: {html_text(modules)} · seed {html_text(cfg.get('seed'))} · "
            f"wall {html_text(cfg.get('wall_s', '-'))} s</p>")


def _environment(doc: dict[str, Any]) -> str:
    rows = [[k, "-" if v is None else str(v)] for k, v in (doc.get("environment") or {}).items()]
    return f"<details><summary>Environment</summary>{_table(['key', 'value'], rows)}</details>"


def _not_shown(items: list[str]) -> str:
    """The files beside the report that the page leaves out, and why."""
    if not items:
        return ""
    lis = "".join(f"<li>{html_text(item)}</li>" for item in items)
    return f"<h2>Not shown</h2><div class='warn'><p>Files beside the report that this page leaves out:</p>" \
           f"<ul>{lis}</ul></div>"


def _verdict_cell(column: Column, row: dict[str, Any]) -> str:
    """One cell of the page's verdict table: the margin as a bar, numbers right-aligned, short
    names on one line, the reason in a wrapping column."""
    if column.header == "margin":
        return _margin_cell(row.get("margin"))
    css = ("status" if column.header == "status" else "num" if column.numeric else "reason"
           if column.header == "reason" else "nw" if column.nowrap else "")
    return f"<td{f' class={css!r}' if css else ''}>{html_text(column.cell(row))}</td>"


def _margin_cell(margin: Any) -> str:
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or (isinstance(margin, float)
                                                                             and math.isnan(margin)):
        return "<td class='num'>-</td>"
    if not -1e308 <= margin <= 1e308:  # infinite, or an integer beyond float range
        return f"<td class='num'><span class='bar neg' style='width:60px'></span>{fmt(margin, '.2f')}</td>"
    width = round(60 * min(max(abs(margin), 0.0), 1.0))
    neg = " neg" if margin < 0 else ""
    return f"<td class='num'><span class='bar{neg}' style='width:{width}px'></span>{float(margin):.3f}</td>"


def _failures(rows: list[dict[str, Any]]) -> str:
    """Every failed output first on the page, each linked to its row of the verdict table, with
    what the row's trace explains (overflowed or subnormal operands)."""
    items = []
    for i, r in enumerate(rows):
        if r.get("status") != FAIL:
            continue
        extra = [*(r.get("overflow") or []), *(r.get("explanation") or [])]
        sub = "".join(f"<li><code>{html_text(x)}</code></li>" for x in extra)
        for line in failure_lines([r]):
            items.append(f"<li><a href='#row-{i}'>{html_text(line)}</a>{f'<ul>{sub}</ul>' if sub else ''}</li>")
    if not items:
        return ""
    return f"<h2 id='failures'>Failures ({len(items)})</h2><ul class='failures'>{''.join(items)}</ul>"


def _speed(rows: list[dict[str, Any]]) -> str:
    """The timed kernel rows (``run --time``) with their verdicts, times and peers."""
    timed = speed_rows(rows)
    if not timed:
        return ""
    status = [r[1] if r[1] in STATUSES else "unknown" for r in timed]
    return (f"<h2 id='speed'>Speed</h2><p class='muted'>{html_text(speed_note(rows))}</p>"
            + _table(SPEED_HEADER, timed, status))


def _unavailable(rows: list[dict[str, Any]]) -> str:
    """Rows that could not run here, grouped by their reason (one entry per reason)."""
    groups = unavailable_groups(rows)
    if not groups:
        return ""
    n = sum(len(headings) for _, headings in groups)
    items = "".join(
        f"<li><details><summary>{html_text(reason)} ({len(headings)} rows)</summary><ul>"
        + "".join(f"<li>{html_text(h)}</li>" for h in headings) + "</ul></details></li>"
        for reason, headings in groups
    )
    return f"<h3 id='unavailable'>Unavailable here ({n} rows, {len(groups)} reasons)</h3><ul>{items}</ul>"


def _verdicts(rows: list[dict[str, Any]]) -> str:
    """The verdict table, failed rows first (each row keeps its anchor ``row-<i>`` from the
    report's order), with the verdict's reason (or why the row did not run) and its source."""
    body = []
    order = sorted(range(len(rows)), key=lambda i: rows[i].get("status") != FAIL)
    for i in order:
        r = rows[i]
        tds = "".join(_verdict_cell(c, r) for c in COLUMNS)
        body.append(f"<tr id='row-{i}' class='{r['status'] if r['status'] in STATUSES else 'unknown'}'>{tds}</tr>")
    head = "".join(f"<th>{html_text(c.header)}</th>" for c in COLUMNS)
    return f"<div class='wide'><table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>"


def _module_section(module: str, rows: list[dict[str, Any]], extras: Extras, report_commit: str | None) -> str:
    parts = [f"<h2 id='module-{html_text(module)}'>{html_text(module)}</h2>"]
    parts.append(_figure(
        _draw(_plots().position_figure, rows, f"{module}: error against token position"),
        f"{module} error against position",
        "RMS ratio of each position's output against the fp64 oracle; dashed, in colours of their own: the "
        "same-dtype naive baselines the baseline rule compares against. fp64 rows and single-token cases are left out.",
        "Error against token position",
    ))
    parts.append(_figure(
        _draw(_plots().ulp_figure, rows, f"{module}: ULP histograms"),
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
        parts.append("<p class='muted'>Colour: log10 rms_ratio against the fp64 oracle; red: overflow; black line: "
                     "the analytic frontier; white x: a missed prediction.</p><div class='maps'>")
        parts += [f"<figure>{_img(png, name)}<figcaption>{html_text(name)}</figcaption></figure>"
                  for name, png in images]
        parts.append("</div>")
    return "\n".join(p for p in parts if p)


def _committed_baseline(folder: Path | None) -> bool:
    """Whether maps or studies come from a committed baseline folder (``reports/baseline/...``)."""
    return folder is not None and "baseline" in folder.resolve().parts


def _map_provenance(module: str, extras: Extras, report_commit: str | None) -> str:
    """Where a module's maps come from, and whether they describe the code this report ran: a
    warning for committed baseline maps or maps made from another commit."""
    folder = extras.map_dirs.get(module, extras.maps_dir)
    where = html_text(folder)
    commit = extras.map_commits.get(module)
    redo = f"<code>k3verify overflow-map --module {html_text(module)}</code> maps the code under test"
    if _committed_baseline(folder):
        return (f"<p class='warn'>Committed baseline maps from {where}, not made by this run: they show the "
                f"code of commit {html_text(str(commit or 'unknown')[:10])}. {redo}.</p>")
    if commit and report_commit and commit != report_commit:
        return (f"<p class='warn'>Maps from {where}, made from commit {html_text(commit[:10])}; this report ran "
                f"commit {html_text(report_commit[:10])}. {redo}.</p>")
    made = f", made from this report's commit {html_text(commit[:10])}" if commit and commit == report_commit else ""
    return f"<p class='ok'>Maps from {where}{made}.</p>"


def _curve_section(name: str, title: str, doc: Any, maps_dir: Path | None) -> str:
    where = html_text((maps_dir or Path()) / name)
    parts = [f"<h2>{html_text(title)}</h2>" + (
        f"<p class='warn'>Committed baseline study {where}, not made by this run.</p>" if _committed_baseline(maps_dir)
        else f"<p class='muted'>{where}</p>")]
    fig = None
    if isinstance(doc, dict):
        try:
            # Curves against depth (a "layers" axis) are drawn as such; any other study as its series.
            fig = _draw(_plots().depth_figure if "layers" in doc else _plots().series_figure, doc, title)
        except ValueError as exc:  # a curve file of another shape still shows as data
            parts.append(f"<p class='muted'>not drawn: {html_text(exc)}</p>")
    parts.append(_figure(fig, title, html_text(name)))
    if isinstance(doc, dict):
        scalars = [[k, json.dumps(v)] for k, v in doc.items() if not isinstance(v, (list, dict))]
        if scalars:
            parts.append(_table(["key", "value"], scalars))
    parts.append(f"<details><summary>{html_text(name)}</summary><pre>{html_text(json.dumps(doc, indent=1))}"
                 "</pre></details>")
    return "\n".join(parts)


WALK_MODULE = "decoder"  # the module of k3verify walk's rows
WALK_LEFT_OUT = f"{WALK_FILE} beside the report is left out: this report is not one of k3verify walk."


def walk_shown(doc: dict[str, Any]) -> bool:
    """Whether a report is one of ``k3verify walk`` (its rows' module, or its config's when a
    walk of the study jobs alone has no rows), whose pages show ``decoder_walk.json``: another
    command writing into the folder keeps the file but does not show it as its own."""
    modules = (doc.get("config") or {}).get("modules")
    ran = isinstance(modules, list) and WALK_MODULE in modules
    return ran or any(r["module"] == WALK_MODULE for r in doc["rows"])


def _walk_curve(heading: str, curve: Any, draw: Callable[[dict[str, Any], str], Any], title: str, alt: str,
                caption: str) -> str:
    """A curve of the decoder walk under its heading: ``draw(curve, title)``, or why it is not
    drawn; nothing when ``curve`` is not an object."""
    if not isinstance(curve, dict):
        return ""
    try:
        figure = _figure(_draw(draw, curve, title), alt, caption)
    except ValueError as exc:
        figure = f"<p class='muted'>{html_text(alt)}: not drawn: {html_text(exc)}</p>"
    return f"<h3>{html_text(heading)}</h3>\n{figure}"


def _walk_section(walk: dict[str, Any]) -> str:
    """The decoder walk: the fp64 agreement, the depth-drift and decode-step curves with their
    tables, the attribution, the routing flips, the first divergence and the jobs' times."""
    parts = ["<section id='decoder-walk'><h2>Decoder walk</h2>",
             f"<p class='muted'>From {html_text(WALK_FILE)}: {html_text(describe(walk))}</p>"]
    fp64 = fp64_text(walk)
    if fp64:
        parts.append(f"<h3>fp64 agreement</h3><p>{html_text(fp64)}</p>")
    parts.append(_walk_curve(
        "Depth drift", walk.get("depth_drift"), _plots().walk_depth_figure,
        "Decoder walk: the residual stream's error against depth", "decoder walk depth drift",
        "RMS ratio of the residual stream against the fp64 walk after every sublayer call, one line per plan "
        "(markers: the sublayer's module); dotted lines: AttnRes block boundaries."))
    growth = growth_table(walk)
    if growth:
        header, rows, note = growth
        parts.append(f"<p class='muted'>{html_text(GROWTH_NOTE + note)}</p>" + _table(header, rows))
    parts.append(_walk_curve(
        "Decode steps", walk.get("decode_steps"), _plots().walk_decode_figure,
        "Decoder walk: error per token, prefill then decode", "decoder walk decode steps",
        "RMS ratio of each token's output against the fp64 definition (prefill of the whole sequence): the served "
        "low-precision path (prefill of the prompt, then one decode step per token, caches carried) and the naive "
        "same-dtype definition as baseline; shaded, diamonds: decode steps."))
    decode = decode_table(walk)
    if decode:
        parts.append(_table(DECODE_HEADER, decode))
    attribution = attribution_table(walk)
    if attribution:
        rows, note = attribution
        parts.append(f"<h3>Attribution</h3><p class='muted'>{html_text(ATTRIBUTION_NOTE + note)}</p>"
                     + _table(ATTRIBUTION_HEADER, rows))
    routing = routing_rows(walk)
    if routing:
        parts.append(f"<h3>Routing flips</h3><p class='muted'>{html_text(ROUTING_NOTE)}</p>"
                     + _table(ROUTING_HEADER, routing))
    divergence = divergence_rows(walk)
    if divergence:
        parts.append("<h3>First divergence</h3>" + _table(["search", "result"], divergence))
    jobs = job_rows(walk)
    if jobs:
        rows, note = jobs
        parts.append("<h3>Job times</h3>" + (f"<p class='muted'>{html_text(note.strip())}</p>" if note else "")
                     + _table(JOB_HEADER, rows))
    parts.append("</section>")
    return "\n".join(p for p in parts if p)


def markdown_page(doc: dict[str, Any], extras: Extras) -> str:
    """``report.md``: the report's Markdown with the nightly results, the decoder walk and the
    files left out of ``extras``."""
    walk: list[str] = []
    if extras.walk is not None:
        walk = walk_markdown(extras.walk) if walk_shown(doc) else [md_text(WALK_LEFT_OUT), ""]
    return markdown(doc, nightly=extras.nightly, not_shown=extras.not_shown, sections=walk)


def report_markdown(doc: dict[str, Any], extra_files: dict[str, Any] | None = None) -> str:
    """The Markdown a command prints for a report about to be written with ``extra_files``
    (``--format md``): that of ``report.md``, the decoder walk included, without the files
    beside an existing folder."""
    extras = Extras()
    if WALK_FILE in (extra_files or {}):
        _shown(extras, lambda: _take_walk(extra_files[WALK_FILE], Path(WALK_FILE), extras))
    return markdown_page(doc, extras)


def _nightly_section(nightly: dict[str, Any]) -> str:
    rows = []
    for module, m in (nightly.get("modules") or {}).items():
        w = m.get("worst") or {}
        rows.append([module, m.get("examples"), fmt(m.get("wall_s"), ".0f"), w.get("implementation", "-"),
                     fmt(w.get("ratio"), ".3f"), fmt(w.get("err")), fmt(w.get("limit")), w.get("replay", "-")])
    head = (f"<h2>Nightly worst-case search</h2><p class='muted'>profile {html_text(nightly.get('profile'))}, "
            f"budget {html_text(nightly.get('budget_s'))} s, created {html_text(nightly.get('created'))}; "
            "ratio = err / limit of the row's rule (1 = at the limit).</p>")
    return head + _table(["module", "examples", "wall s", "worst implementation", "err/limit", "err", "limit",
                          "replay"], rows)


def _notes(rows: list[dict[str, Any]]) -> str:
    """Overflows and crash reasons of rows that ran (unavailable rows are grouped above)."""
    items = notes([r for r in rows if r.get("status") != UNAVAILABLE])
    if not items:
        return ""
    lis = []
    for head, detail, lines in items:
        sub = "".join(f"<li><code>{html_text(x)}</code></li>" for x in lines)
        lis.append(f"<li><b>{html_text(head)}</b>: {html_text(detail)}{f'<ul>{sub}</ul>' if sub else ''}</li>")
    return f"<h2>Notes</h2><ul>{''.join(lis)}</ul>"


# --- the report set: report.json, report.md, report.html --------------------------------


def write_report(doc: dict[str, Any], out_dir: Path, *, maps_dir: Path | None = None,
                 not_shown: NotShown | None = None, map_fallbacks: Sequence[Path] = (),
                 extra_files: dict[str, Any] | None = None, figures: bool = True) -> list[Path]:
    """Write ``report.json``, ``report.md`` and ``report.html`` into ``out_dir`` as one set (the
    folder is swapped in whole: an interrupt leaves the previous three); return the paths.
    ``extra_files`` (name → JSON document, e.g. ``decoder_walk.json``) join the same set.

    ``maps_dir`` is where overflow maps and curve files are looked for (see :func:`render_report`),
    then ``map_fallbacks`` for the modules and studies it lacks; ``not_shown`` is called with one
    line per file the pages leave out. ``figures=False`` writes the pages without figures or map
    images (they say so); ``report render`` draws them later from the same files.
    """
    token = _FIGURES.set(figures)
    try:
        return _write_set(out_dir, doc, maps_dir, with_json=True, not_shown=not_shown, fallbacks=map_fallbacks,
                          extra_files=extra_files)
    finally:
        _FIGURES.reset(token)


def render_report(out_dir: Path, *, maps_dir: Path | None = None, not_shown: NotShown | None = None,
                  map_fallbacks: Sequence[Path] = ()) -> list[Path]:
    """(Re)write ``report.md`` and ``report.html`` in ``out_dir`` from its ``report.json``.

    The pages also show what sits beside the report: ``nightly.json`` and ``decoder_walk.json``
    (``k3verify walk``'s study document) in ``out_dir``, and the
    overflow maps and curve files (``attnres_depth_drift.json``, ``moe_routing_flips.json``) in
    ``maps_dir``; ``not_shown`` is called with one line per file they leave out.
    """
    return _write_set(out_dir, load(out_dir), maps_dir, with_json=False, not_shown=not_shown,
                      fallbacks=map_fallbacks)


def _write_set(out_dir: Path, doc: dict[str, Any], maps_dir: Path | None, *, with_json: bool,
               not_shown: NotShown | None, fallbacks: Sequence[Path] = (),
               extra_files: dict[str, Any] | None = None) -> list[Path]:
    extras = collect_extras(out_dir, maps_dir, fallbacks, walk=(extra_files or {}).get(WALK_FILE))
    pages = {REPORT_MD: markdown_page(doc, extras), REPORT_HTML: html_page(doc, extras)}
    if with_json:
        pages[REPORT_JSON] = json.dumps(json_safe(doc), indent=1, allow_nan=False) + "\n"
    for name, extra in (extra_files or {}).items():
        pages[name] = json.dumps(json_safe(extra), indent=1, allow_nan=False) + "\n"
    with staged_folder(out_dir, carry=lambda name: name not in pages) as stage:
        for name, text in pages.items():
            (stage / name).write_text(text, encoding="utf-8")
    for item in extras.not_shown if not_shown else ():
        not_shown(item)
    return [out_dir / name for name in REPORT_FILES if name in pages]
