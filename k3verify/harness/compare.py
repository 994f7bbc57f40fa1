"""Regression compare: what got worse between a base and a new report (and their overflow maps).

Rows are matched by (module, implementation, form, dtype, params, case); every module the base
has rows of is compared unless the caller narrows them explicitly (``--modules``). A finding is
a **regression** (``k3verify report compare`` exits 1) when, from base to new:

- a verdict flipped to ``fail`` (from ``pass``, ``expected-nonfinite`` or ``unavailable``), or a
  new row fails;
- a finite output became non-finite (``pass`` -> ``expected-nonfinite``, or ``metrics.nonfinite``
  0 -> > 0);
- a row that had a verdict became ``unavailable`` (coverage lost); a row disappeared; a base
  module has no row in the new report at all. A row whose optional package is not installed in
  the new run (``fla-core 0.6.0`` -> ``fla-core (missing)``) is ``now unavailable`` with the
  reason, information unless ``--strict-coverage``;
- the rule's error grew beyond the thresholds (:class:`Thresholds`): by more than 25 % while the
  margin fell by more than 0.05, or by more than 4x (two bits) while at or above 1 % of the limit;
- an overflow-map cell became non-finite, or its analytic prediction, which agreed, now
  disagrees away from the frontier; a base cell, or all of one implementation's, has no
  counterpart; the map's layout (module, axis names) changed; a base map is missing.

Two rows (or map cells) with one identity in either document are refused (``UsageError``):
whichever the matching kept, the other would go unjudged. Everything else that changed is
information (improvements, new rows and cells; errors that moved within the thresholds).

What is invariant decides which thresholds apply. On the same math platform (equal
``environment.math_platform`` records: torch build, CPU, ATen capability, MKL/oneDNN code
paths, threads) runs are bitwise reproducible, so any change comes from the code and every row
is held to the thresholds above. Across platforms the fp32 accumulations run in another order:
- a row whose every operation rounds to its own dtype (fp32 rows, fp64 rows: ``compute_dtype``
  of the dtype is the dtype) has an error that *is* that rounding noise, and a reordered
  accumulation draws a new sample of it: measured across MKL's AVX-512, AVX2 and generic paths
  and ATen's capabilities on the CPU baseline, fp32 errors moved by up to x1.96 and margins by up
  to 0.38 with no code change. Such rows keep every rule except the 25 %/0.05 one: a flipped
  verdict, non-finite output, lost coverage and growth beyond 4x (two bits) still regress.
- a row with narrower operands (bf16, fp16, fp8) has an error set by rounding its operands,
  which depends on the inputs only (equal to fp64 rounding on every host); the fp32
  accumulation moves it by about u(fp32)/u(dtype) per rounding, or a little more where a long
  dependent chain turns a flipped rounding into a new path (the 93-layer AttnRes walk: up to
  8 %, margin 0.07). These rows keep all thresholds, so +25 % with a margin drop still fails.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..numerics import EXPECTED_NONFINITE, FAIL, PASS, UNAVAILABLE, compute_dtype, resolve_dtype
from .environment import platform_differences
from .files import UsageError
from .map_files import load_map
from .report import load
from .rows import JudgedOutput, Row, RowError, VerdictRecord
from .text import md_text

MAP_SUFFIX = "_overflow_map.json"
MAP_GLOB = f"*{MAP_SUFFIX}"


@dataclass(frozen=True)
class Thresholds:
    """When a change in a row's error counts as a regression (see the module docstring)."""

    error_growth: float = 0.25  # relative growth of err that matters ...
    margin_drop: float = 0.05  # ... once the margin has also fallen by this much (absolute)
    error_factor: float = 4.0  # growth that matters on its own ...
    significant: float = 0.01  # ... when err is at least this share of the limit


IMPROVED = "error shrank"
WITHIN = "moved within thresholds"


@dataclass(frozen=True)
class Finding:
    """One difference between base and new."""

    kind: str
    subject: str
    detail: str
    regression: bool


@dataclass
class Comparison:
    """All findings, plus notes on what could not be compared."""

    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    rows_compared: int = 0
    cells_compared: int = 0

    @property
    def regressions(self) -> list[Finding]:
        return [f for f in self.findings if f.regression]

    def groups(self) -> dict[str, list[Finding]]:
        """Findings by what a reviewer does with them: ``regressions``, ``improvements``,
        ``changes`` (new rows and outputs, ...) and ``within_thresholds`` (err moved, no rule hit)."""
        out: dict[str, list[Finding]] = {"regressions": [], "improvements": [], "changes": [], "within_thresholds": []}
        for f in self.findings:
            key = ("regressions" if f.regression else "improvements" if f.kind == IMPROVED
                   else "within_thresholds" if f.kind == WITHIN else "changes")  # fmt: skip
            out[key].append(f)
        return out


def row_key(row: Row) -> tuple[str, ...]:
    """What identifies a row across runs."""
    params = json.dumps(row.params, sort_keys=True)
    return (row.module, row.implementation, row.form, row.dtype, params, row.case)


def row_subject(row: Row) -> str:
    """How findings name a row: ``module implementation form dtype params (case)``."""
    params = " ".join(f"{k}={v}" for k, v in row.params.items())
    parts = [row.module, row.implementation, row.form, row.dtype, params, f"({row.case})"]
    return " ".join(str(p) for p in parts if p)


def typed_rows(doc: dict[str, Any], where: str) -> list[Row]:
    """A report document's rows as :class:`Row` (``UsageError`` naming ``where`` and the row for
    one that is not: ``report.load`` has refused those already)."""
    try:
        return [Row.from_json(r, where=f"row {i}") for i, r in enumerate(doc["rows"])]
    except RowError as exc:
        raise UsageError(f"{where}: {exc}") from None


def _reason(row: Row) -> str | None:
    """Why a row is what it is: its own reason (a crash, an unavailable package), else its verdict's."""
    return row.reason or (row.verdict.reason if row.verdict else None)


def rounding_noise_row(dtype: str) -> bool:
    """True for a row whose every operation rounds to its own dtype (fp32, fp64): its error is
    accumulation rounding noise, which another summation order draws anew."""
    try:
        t = resolve_dtype(dtype)
    except (ValueError, KeyError, TypeError):
        return False
    return compute_dtype(t) == t


MISSING = " (missing)"


def _package_key(row: Row) -> tuple[str, ...]:
    """A row's identity with its implementation's version left out (``fla-core 0.6.0`` and
    ``fla-core (missing)`` are one package's row)."""
    implementation = row.implementation
    if implementation.endswith(MISSING):
        package = implementation[: -len(MISSING)]
    else:
        package = implementation.rsplit(" ", 1)[0] if " " in implementation else implementation
    return (row.module, package, *row_key(row)[2:])


def _now_unavailable(base_rows: dict[tuple[str, ...], Row], new_rows: dict[tuple[str, ...], Row]
                     ) -> dict[tuple[str, ...], Row]:
    """Base rows whose optional package is missing from the new run: base key -> the new row,
    ``unavailable`` and named ``<package> (missing)``, that stands for it."""
    missing = {_package_key(n): n for k, n in new_rows.items()
               if k not in base_rows and n.status == UNAVAILABLE and n.implementation.endswith(MISSING)}
    return {k: missing[_package_key(b)] for k, b in base_rows.items()
            if k not in new_rows and _package_key(b) in missing}


def compare_reports(base: dict[str, Any], new: dict[str, Any], thresholds: Thresholds | None = None, *,
                    modules: Sequence[str] | None = None, names: tuple[str, str] = ("base report", "new report"),
                    strict_coverage: bool = False) -> Comparison:
    """Findings between two report documents, over every module the base has rows of, or only
    ``modules`` (an explicit narrowing; each must be one of the base's). What the new report says
    it covers (``config.modules``) decides nothing: a base row with no counterpart is a regression.
    A base row whose optional package is not installed in the new run (its new row is the same
    row of ``<package> (missing)``, unavailable) is ``now unavailable`` with the reason:
    information, or a regression with ``strict_coverage``. ``UsageError`` (naming ``names``) for
    two rows of one identity in either report, or a module the base has no rows of."""
    th = thresholds or Thresholds()
    out = Comparison()
    base_list, new_list = typed_rows(base, names[0]), typed_rows(new, names[1])
    base_rows, new_rows = rows_by_key(base_list, names[0]), rows_by_key(new_list, names[1])
    scope = modules_in_scope({r.module for r in base_list}, modules, names[0])
    differences = platform_differences(
        base.get("environment", {}).get("math_platform"), new.get("environment", {}).get("math_platform")
    )
    same_platform = not differences
    if same_platform:
        out.notes.append("same math platform: runs are bitwise reproducible, every row held to the thresholds")
    else:
        out.notes.append(
            "math platform differs (" + "; ".join(differences) + "): fp32/fp64 rows, whose error is accumulation "
            "rounding noise, are held to the two-bit rule only; narrower dtypes to every threshold"
        )
    if modules is not None:
        left_out = sorted({r.module for r in (*base_list, *new_list)} - scope)
        out.notes.append(f"compared modules {', '.join(sorted(scope))} only (--modules)"
                         + (f"; not compared: {', '.join(left_out)}" if left_out else ""))
    for key in ("torch", "device", "fla-core"):
        b, n = base.get("environment", {}).get(key), new.get("environment", {}).get(key)
        if b != n:
            out.notes.append(f"environment differs: {key} {b} -> {n}")
    present = {r.module for r in new_list}
    gone = _now_unavailable(base_rows, new_rows)
    for module in sorted(scope - present):
        lost = [b for b in base_rows.values() if b.module == module]
        out.findings.append(Finding("module missing", module, f"none of its {len(lost)} base rows "
                                    f"({_status_counts(lost)}) is in the new report", True))
    for key, b in base_rows.items():
        if b.module not in scope or b.module not in present:
            continue
        n = new_rows.get(key)
        if n is None and key in gone:
            reason = gone[key].reason or "no reason given"
            out.findings.append(Finding("now unavailable", row_subject(b), f"was {b.status}, now: {reason}",
                                        strict_coverage and b.status != UNAVAILABLE))
            continue
        if n is None:
            out.findings.append(Finding("row removed", row_subject(b), f"was {b.status}", True))
            continue
        out.rows_compared += 1
        out.findings += _compare_row(b, n, th, noise_only=not same_platform and rounding_noise_row(n.dtype))
    standing_in = {id(n) for n in gone.values()}
    for key, n in new_rows.items():
        if key not in base_rows and id(n) not in standing_in and (modules is None or n.module in scope):
            regression = n.status == FAIL
            reason = _reason(n)
            detail = f"{n.status}: {reason}" if reason and n.status != PASS else n.status
            out.findings.append(Finding("new row", row_subject(n), detail, regression))
    return out


def rows_by_key(rows: list[Row], where: str) -> dict[tuple[str, ...], Row]:
    """``rows`` by :func:`row_key`; ``UsageError`` naming ``where`` and the identity when two rows
    share one (a passing twin would otherwise hide a failing row, in whichever order)."""
    out: dict[tuple[str, ...], Row] = {}
    first: dict[tuple[str, ...], int] = {}
    for i, row in enumerate(rows):
        key = row_key(row)
        if key in out:
            raise UsageError(f"{where}: rows {first[key]} and {i} are both {row_subject(row)[:200]!r}; "
                             "a row's identity (module, implementation, form, dtype, params, case) must be unique")
        out[key], first[key] = row, i
    return out


def modules_in_scope(present: set[str], modules: Sequence[str] | None, where: str) -> set[str]:
    """The modules to compare: ``present`` (the base's), or ``modules`` when given, each of which
    must be present (narrowing to a module the base lacks would compare nothing)."""
    if modules is None:
        return set(present)
    wanted = {m.strip() for m in modules if m.strip()}
    if not wanted:
        raise UsageError("--modules names no module")
    unknown = sorted(wanted - present)
    if unknown:
        shown = ", ".join(repr(m[:40]) for m in unknown[:5])
        raise UsageError(f"--modules names {shown}, which {where} holds nothing of "
                         f"(it has: {', '.join(repr(m[:40]) for m in sorted(present)) or 'none'})")
    return wanted


def _status_counts(rows: list[Row]) -> str:
    counts = Counter(r.status for r in rows)
    return ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))


def _compare_row(b: Row, n: Row, th: Thresholds, *, noise_only: bool = False) -> list[Finding]:
    """Findings for one matched row; ``noise_only``: the error is rounding noise redrawn on another
    platform, so only growth beyond ``error_factor`` counts (see the module docstring)."""
    subject = row_subject(n)
    bs, ns = b.status, n.status
    if bs != ns:
        flipped_to_fail = ns == FAIL
        became_nonfinite = bs == PASS and ns == EXPECTED_NONFINITE
        lost = ns == UNAVAILABLE
        detail = f"{bs} -> {ns}"
        reason = _reason(n)
        if reason and ns != PASS:
            detail += f": {reason}"
        kind = "verdict flipped" if flipped_to_fail else "became non-finite" if became_nonfinite else (
            "coverage lost" if lost else "verdict changed")
        return [Finding(kind, subject, detail, flipped_to_fail or became_nonfinite or lost)]
    findings = []
    base_outputs, new_outputs = outputs_of(b, n), outputs_of(n, n)
    for name in base_outputs.keys() - new_outputs.keys():
        findings.append(Finding("output removed", f"{subject} [{name}]", "no longer judged", True))
    for name, nout in new_outputs.items():
        if name not in base_outputs:
            findings.append(Finding("new output", f"{subject} [{name}]", str(nout.status), False))
            continue
        findings += _compare_output(base_outputs[name], nout, f"{subject} [{name}]", th, noise_only)
    return findings


def outputs_of(row: Row, like: Row) -> dict[str, JudgedOutput]:
    """A row's judged outputs: ``outputs`` (report schema 2), or for a schema-1 row its top-level
    verdict under the row's status, named after ``like``'s primary (first) output."""
    if row.outputs is not None:
        return dict(row.outputs)
    names = list(like.outputs or {}) or ["-"]
    return {names[0]: JudgedOutput(status=row.status, verdict=row.verdict, margin=row.margin, metrics=row.metrics)}


def _compare_output(b: JudgedOutput, n: JudgedOutput, subject: str, th: Thresholds,
                    noise_only: bool) -> list[Finding]:
    findings = []
    b_nf = (b.metrics.nonfinite if b.metrics else None) or 0
    n_nf = (n.metrics.nonfinite if n.metrics else None) or 0
    if b_nf == 0 and n_nf > 0:
        findings.append(Finding("became non-finite", subject, f"{n_nf} non-finite outputs", True))
    bv, nv = b.verdict or VerdictRecord(), n.verdict or VerdictRecord()
    if b.status != FAIL and n.status == FAIL:
        findings.append(Finding("verdict flipped", subject, f"{b.status} -> fail: {nv.reason or ''}", True))
    e_b, e_n, lim = bv.err, nv.err, nv.limit
    m_b, m_n = b.margin, n.margin
    if not all(isinstance(x, (int, float)) for x in (e_b, e_n, lim, m_b, m_n)) or n_nf:
        return findings
    metric = nv.metric or "err"
    detail = f"{metric} {e_b:.3e} -> {e_n:.3e} (x{_ratio(e_n, e_b):.3g}), margin {m_b:.3f} -> {m_n:.3f}"
    if _worse(e_b, e_n, m_b, m_n, lim, th, noise_only=noise_only):
        findings.append(Finding("error grew", subject, detail, True))
    elif _worse(e_n, e_b, m_n, m_b, bv.limit or lim, th, noise_only=noise_only):
        findings.append(Finding(IMPROVED, subject, detail, False))
    elif e_n != e_b:
        findings.append(Finding(WITHIN, subject, detail, False))
    return findings


def _ratio(new: float, base: float) -> float:
    if base == 0:
        return 1.0 if new == 0 else math.inf
    return new / base


def _worse(
    e_b: float, e_n: float, m_b: float, m_n: float, limit: float, th: Thresholds, *, noise_only: bool = False
) -> bool:
    """``e_n`` is worse than ``e_b`` beyond the thresholds (only the two-bit one if ``noise_only``)."""
    growth = _ratio(e_n, e_b)
    by_margin = not noise_only and growth > 1 + th.error_growth and (m_b - m_n) > th.margin_drop
    significant = limit > 0 and math.isfinite(limit) and e_n >= th.significant * limit
    return by_margin or (growth > th.error_factor and significant)


# --- overflow maps ----------------------------------------------------------------------------

MAP_AXES = ("figure", "panel_row", "panel_col", "x", "y")


def _cell_key(cell: dict[str, Any], spec: dict[str, Any]) -> str:
    """Where a cell lies (its value on each axis of ``spec``) and whose it is, as one hashable
    text (values may be any JSON)."""
    return json.dumps([*(cell.get(spec[a]) for a in MAP_AXES), cell.get("implementation")], sort_keys=True,
                      default=str)


def _cell_subject(module: str, cell: dict[str, Any], spec: dict[str, Any]) -> str:
    where = " ".join(f"{spec[a]}={cell.get(spec[a])}" for a in MAP_AXES)
    return f"{module} map cell {where} [{cell.get('implementation')}]"


def cells_by_key(doc: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """A map's cells by :func:`_cell_key`; ``UsageError`` naming ``where`` and the cell when two
    cells share a place (one could hide the other)."""
    out: dict[str, dict[str, Any]] = {}
    first: dict[str, int] = {}
    for i, cell in enumerate(doc["cells"]):
        key = _cell_key(cell, doc["spec"])
        if key in out:
            subject = _cell_subject(str(doc["module"]), cell, doc["spec"])
            raise UsageError(f"{where}: cells {first[key]} and {i} are both {subject[:200]!r}; a cell's place "
                             "(its figure, panel and x/y values and implementation) must be unique")
        out[key], first[key] = cell, i
    return out


def _map_layout(doc: dict[str, Any]) -> dict[str, Any]:
    """What decides where cells lie: the module and the spec's axis names."""
    return {"module": doc["module"], **{a: doc["spec"].get(a) for a in MAP_AXES}}


def compare_maps(base: dict[str, Any], new: dict[str, Any], *,
                 names: tuple[str, str] = ("base map", "new map")) -> Comparison:
    """Findings between two overflow-map documents of one module (``<module>_overflow_map.json``).

    Regressions: a cell that became non-finite, a prediction that agreed and now disagrees away
    from the frontier, a base cell with no counterpart (one finding per cell, or one per
    implementation whose cells all vanished), and a changed layout (module or axis names), under
    which no cell can be matched. New cells are information, one finding per implementation.
    ``UsageError`` (naming ``names``) for two cells in one place."""
    out = Comparison()
    module = str(base["module"])
    layout_b, layout_n = _map_layout(base), _map_layout(new)
    if layout_b != layout_n:
        changed = "; ".join(f"{k} {layout_b[k]!r} -> {layout_n[k]!r}" for k in layout_b if layout_b[k] != layout_n[k])
        out.findings.append(Finding("map layout changed", f"{module} map", f"{changed}: none of the "
                                    f"{len(base['cells'])} base cells can be matched", True))
        return out
    base_cells, new_cells = cells_by_key(base, names[0]), cells_by_key(new, names[1])
    spec = new["spec"]
    for key, cell in new_cells.items():
        b = base_cells.get(key)
        if b is None:
            continue
        out.cells_compared += 1
        subject = _cell_subject(module, cell, spec)
        if b["finite"] and not cell["finite"]:
            out.findings.append(Finding("map cell became non-finite", subject, str(cell.get("overflow", "")), True))
        agreed = bool(b["finite"]) == bool(b["predicted_finite"])
        agrees = bool(cell["finite"]) == bool(cell["predicted_finite"])
        if agreed and not agrees and not cell.get("frontier_adjacent", False):
            detail = f"predicted finite={cell['predicted_finite']}, observed finite={cell['finite']}"
            out.findings.append(Finding("map prediction now wrong", subject, detail, True))
    out.findings += _unmatched_cells(module, base_cells, new_cells, spec)
    return out


def _unmatched_cells(module: str, base_cells: dict[str, dict[str, Any]], new_cells: dict[str, dict[str, Any]],
                     spec: dict[str, Any]) -> list[Finding]:
    """Base cells the new map lacks (regressions: per implementation when all of its cells went,
    else per cell), then new cells (information, per implementation)."""
    findings = []
    by_impl: dict[str, list[str]] = {}
    for key, cell in base_cells.items():
        by_impl.setdefault(str(cell.get("implementation")), []).append(key)
    for impl, keys in by_impl.items():
        gone = [k for k in keys if k not in new_cells]
        if gone and len(gone) == len(keys):
            findings.append(Finding("map implementation missing", f"{module} map [{impl}]",
                                    f"all {len(keys)} of its base cells are gone", True))
            continue
        findings += [Finding("map cell removed", _cell_subject(module, base_cells[k], spec), "no counterpart in "
                             "the new map", True) for k in gone]
    added: Counter[str] = Counter(str(c.get("implementation")) for k, c in new_cells.items() if k not in base_cells)
    findings += [Finding("new map cells", f"{module} map [{impl}]", f"{n} cells the base map does not have", False)
                 for impl, n in added.items()]
    return findings


def _map_files(path: Path) -> dict[str, Path]:
    """The overflow maps in ``path`` (or beside the file ``path``), by module."""
    folder = path if path.is_dir() else path.parent
    return {p.name.removesuffix(MAP_SUFFIX): p for p in sorted(folder.glob(f"*{MAP_SUFFIX}"))}


def check_thresholds(th: Thresholds) -> None:
    """``UsageError`` unless every threshold is a finite number in its range (a NaN threshold
    would silently disable its check)."""
    for name, value, low in (("error_growth", th.error_growth, 0.0), ("margin_drop", th.margin_drop, 0.0),
                             ("error_factor", th.error_factor, 1.0), ("significant", th.significant, 0.0)):
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < low:
            raise UsageError(f"threshold {name} = {value!r} must be a finite number >= {low:g}")


def _judgeable(doc: dict[str, Any], path: Path) -> None:
    """``UsageError`` for a report compare cannot judge: one without rows. (A row whose verdicts
    contradict each other, or a pass without numeric err and limit, is refused by ``load``.)"""
    if not doc["rows"]:
        raise UsageError(f"{path}: report has no rows; nothing to compare")


def compare_paths(base: Path, new: Path, thresholds: Thresholds | None = None, *,
                  modules: Sequence[str] | None = None, strict_coverage: bool = False) -> Comparison:
    """Compare two reports (``report.json`` or folders holding one) and the overflow maps in the
    base folder with the new folder's, over the base's modules or only ``modules``. A base map
    the new folder lacks is a regression. ``UsageError`` for anything that cannot be judged: a
    missing, malformed or self-contradicting report, an empty one, duplicate rows or cells, a map
    without cells, a NaN threshold, a ``--modules`` the base does not have, nothing to compare."""
    th = thresholds or Thresholds()
    check_thresholds(th)
    base_has = (base / "report.json").exists() if base.is_dir() else base.exists()
    new_has = (new / "report.json").exists() if new.is_dir() else new.exists()
    if base_has != new_has:
        raise UsageError(f"{new if base_has else base}: no report.json to compare against")
    base_maps, new_maps = _map_files(base), _map_files(new)
    if not base_has and not base_maps:
        raise UsageError(f"nothing to compare: no report.json or {MAP_GLOB} in {base}")
    docs = (load(base), load(new)) if base_has else None
    for doc, path in zip(docs or (), (base, new)):
        _judgeable(doc, path)
    row_modules = {r.module for r in typed_rows(docs[0], str(base))} if docs else set()
    wanted = None if modules is None else modules_in_scope(row_modules | set(base_maps), modules, str(base))
    out = Comparison()
    if docs and (wanted is None or wanted & row_modules):
        narrowed = None if wanted is None else sorted(wanted & row_modules)
        out = compare_reports(*docs, th, modules=narrowed, names=(str(base), str(new)),
                              strict_coverage=strict_coverage)
    for module, path in base_maps.items():
        if wanted is not None and module not in wanted:
            continue
        if module not in new_maps:
            out.findings.append(Finding("map missing", f"{module} map", f"{path.name} is in {base} but not in "
                                        f"{new}", True))  # fmt: skip
            continue
        m = compare_maps(load_map(path), load_map(new_maps[module]), names=(str(path), str(new_maps[module])))
        out.findings += m.findings
        out.notes += m.notes
        out.cells_compared += m.cells_compared
    out.findings += [Finding("new map", f"{module} map", f"{path.name} is in {new} only", False)
                     for module, path in new_maps.items()
                     if module not in base_maps and (wanted is None or module in wanted)]
    return out


# --- as a pull-request comment -------------------------------------------------------------


def markdown(result: Comparison, base: str, new: str) -> str:
    """The comparison as a pull-request comment: regressions and improvements as tables, the
    rest collapsed under ``<details>``. Every finding, note and path is escaped (``md_text``):
    they come from the reports, which a pull request may have written."""
    groups = result.groups()
    n = len(groups["regressions"])
    lines = [f"### k3verify: {n} regression(s)" if n else "### k3verify: no regressions", "",
             f"Compared {_md(base)} → {_md(new)}: {result.rows_compared} rows and {result.cells_compared} map "
             "cells.", ""]
    if result.notes:
        lines += [f"<details><summary>Notes ({len(result.notes)}): platforms and environment</summary>", "",
                  *(f"- {_md(note)}" for note in result.notes), "", "</details>", ""]
    titles = {"regressions": "Regressions", "improvements": "Improvements", "changes": "Other changes",
              "within_thresholds": "Moved within the thresholds"}
    for key, title in titles.items():
        found = groups[key]
        if not found:
            continue
        if key == "within_thresholds" and len(found) > WITHIN_SHOWN:
            lines += _within_summary(found)
            continue
        table = ["| kind | what | detail |", "|---|---|---|"] + [
            f"| {_md(f.kind)} | {_md(f.subject)} | {_md(f.detail)} |" for f in found]  # fmt: skip
        if key in ("regressions", "improvements"):
            lines += [f"**{title}** ({len(found)})", "", *table, ""]
        else:
            lines += [f"<details><summary>{title} ({len(found)})</summary>", "", *table, "", "</details>", ""]
    return "\n".join(lines)


# A comment lists this many of the outputs that moved within the thresholds, the largest moves.
WITHIN_SHOWN = 5
_FACTOR = re.compile(r"\(x([0-9.eE+-]+)\)")


def _factor(f: Finding) -> float:
    """How far a within-thresholds move went, as ``max(r, 1/r)`` of its error ratio (1 if unread)."""
    m = _FACTOR.search(f.detail)
    try:
        r = float(m.group(1)) if m else 1.0
    except ValueError:
        return 1.0
    return max(r, 1 / r) if r > 0 else math.inf


def _within_summary(found: list[Finding]) -> list[str]:
    """Many small moves, summarised: their count, the range of their factors and the largest few."""
    ranked = sorted(found, key=_factor, reverse=True)
    largest = ranked[:WITHIN_SHOWN]
    table = ["| kind | what | detail |", "|---|---|---|"] + [
        f"| {_md(f.kind)} | {_md(f.subject)} | {_md(f.detail)} |" for f in largest]  # fmt: skip
    return [f"<details><summary>Moved within the thresholds ({len(found)}; the largest "
            f"{len(largest)} below, every one within x{_factor(ranked[0]):.3g})</summary>", "", *table, "",
            "</details>", ""]


def _md(text: Any) -> str:
    """Inline Markdown (a table cell, a note) that reads as ``text`` itself: see ``md_text``."""
    return md_text(text)
