"""The verification run: case -> implementations -> metrics vs oracle -> verdict -> rows.

Each row is a plain dict (JSON-ready after ``files.json_safe``) describing one
(module, implementation, form, dtype, parameters, case) with its metrics, verdict and margin,
plus two profiles of the error that the HTML report draws: ``ulp_histogram`` (how many
outputs lie in each ULP band) and, for modules with a position axis, ``error_by_position``
(the RMS ratio at every token position; ``baseline_error_by_position`` for the baseline).
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable, Collection, Iterator
from dataclasses import replace
from typing import Any

import torch

from ..numerics import (
    ACCUMULATOR_ROUNDOFF,
    BASELINE_K,
    EXPECTED_NONFINITE,
    FAIL,
    FRONTIER_RULE,
    POLICY,
    UNAVAILABLE,
    Metrics,
    Verdict,
    compare,
    effective_errors,
    effective_products,
    effective_slices,
    expected_nonfinite,
    spacing,
    worst_element,
)
from . import timing, tp_rows
from .guard import run_isolated
from .registry import (
    Case,
    Implementation,
    ModuleEntry,
    Outputs,
    as_outputs,
    orphan_implementations,
)
from .tp_rows import TPOptions

Progress = Callable[[str], None]


def plan(entries: list[ModuleEntry], tp: TPOptions | None = None, orphans: bool = False,
         names: Collection[str] | None = None) -> list[tuple[ModuleEntry, Implementation, str]]:
    """Every (entry, implementation, case name) a run will verify, in order; with ``tp``, the
    tensor-parallel rows instead (:mod:`k3verify.harness.tp_rows`). ``orphans`` adds the rows of
    plugins that name no registered module (a full run shows them); ``names`` keeps only the
    implementations of those names (``KeyError`` listing the known ones for a name none has)."""
    if tp is not None:
        return tp_rows.plan(entries, tp)
    planned = [(e, impl, c) for e in entries for impl in e.implementations() for c in impl.cases]
    if orphans and entries:
        planned += [(entries[0], impl, c) for impl in orphan_implementations() for c in impl.cases]
    if names is not None:
        known = {impl.implementation for _, impl, _ in planned}
        unknown = sorted(set(names) - known)
        if unknown:
            raise KeyError(f"no implementation named {', '.join(map(repr, unknown))} in the selected modules; "
                           f"known: {', '.join(sorted(known))}")
        planned = [row for row in planned if row[1].implementation in names]
    return planned


def run(entries: list[ModuleEntry], *, seed: int = 0, progress: Progress | None = None,
        orphans: bool = False, tp: TPOptions | None = None,
        names: Collection[str] | None = None, time_kernels: bool = False) -> Iterator[dict[str, Any]]:
    """Verify every planned row; yields rows as they finish (``progress`` gets each label first).

    An implementation that cannot run here yields its ``unavailable`` row without building its
    case (a broken plugin may ask for a case its module does not make); one that asks for a
    case its module does not make yields a failed row. ``orphans``, ``tp`` and ``names`` as in
    :func:`plan`; exactly one row is yielded per planned row. ``time_kernels``: every kernel row
    that ran, and every row a kernel names as its peer, also gets its ``time``
    (:mod:`k3verify.harness.timing`; ratios are set once all rows are in, by
    :func:`~k3verify.harness.timing.with_peer_ratios`)."""
    cases: dict[int, dict[str, Case]] = {}
    planned = plan(entries, tp, orphans, names)
    peers = timing.named_peers([impl for _, impl, _ in planned]) if time_kernels else []
    for entry, impl, case_name in planned:
        if progress:
            progress(f"{impl.label} on {case_name}")

        def made(e: ModuleEntry = entry) -> dict[str, Case]:
            if id(e) not in cases:  # by identity: a --tp run's entries share their module's name
                cases[id(e)] = e.make_cases(seed)
            return cases[id(e)]

        row, case = planned_row(entry, impl, case_name, made)
        if case is not None and time_kernels and "verdict" in row and (timing.timed(impl)
                                                                      or timing.is_peer(row, peers)):
            row["time"] = _timed(impl, case)
        yield row


def planned_row(entry: ModuleEntry, impl: Implementation, case_name: str,
                cases: Callable[[], dict[str, Case]]) -> tuple[dict[str, Any], Case | None]:
    """The row of one planned (entry, implementation, case name) and the case it was verified on
    (``None`` when it was not: an implementation that cannot run here, whose case is never built,
    or a case ``entry`` does not make, a failed row). ``cases()`` gives the entry's cases by name,
    built once by the caller."""
    reason = impl.unavailable()
    if reason:
        return reason_row(entry, impl, case_name, UNAVAILABLE, reason), None
    made = cases()
    if case_name not in made:
        why = (f"{impl.label} asks for case {case_name!r}, which {entry.name} does not make "
               f"(its cases: {', '.join(made)})")
        return reason_row(entry, impl, case_name, FAIL, why), None
    return verify(entry, impl, made[case_name]), made[case_name]


def reason_row(entry: ModuleEntry, impl: Implementation, case_name: str, status: str, reason: str) -> dict[str, Any]:
    """A row that holds no verdict: its header, ``status`` and ``reason``."""
    return row_header(impl, Case(case_name, {}), entry.direction) | {"status": status, "reason": reason}


def _timed(impl: Implementation, case: Case) -> dict[str, Any]:
    """The row's ``time``, or ``{"error": why}`` when timing it raised (the verdict stands)."""
    try:
        return timing.time_row(impl, case)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        return {"error": timing.first_line(f"{type(exc).__name__}: {exc}", 300)}


def row_header(impl: Implementation, case: Case, direction: str = "forward") -> dict[str, Any]:
    """What identifies a row: the implementation's module, name, form, dtype, params, rule and
    source, and the case; ``direction`` for a row of gradients (a forward row has none, as
    before there were backward rows)."""
    header = {
        "module": impl.module,
        "implementation": impl.implementation,
        "form": impl.form,
        "dtype": impl.dtype,
        "params": {str(k): _param_value(v) for k, v in impl.params.items()},
        "case": case.name,
        "case_params": dict(case.params),
        "rule": impl.rule,
        "source": impl.source,
    }
    return header if direction == "forward" else header | {"direction": direction}


def _param_value(value: Any) -> Any:
    """A parameter as a report stores it: JSON's own types as they are, anything else (a dtype,
    a tensor, an object a plugin passed) as its ``repr``."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [_param_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _param_value(v) for k, v in value.items()}
    return repr(value)


class HookFailed(RuntimeError):
    """An implementation's ``predict`` or ``explain`` raised: its row fails with that reason."""


def _hook(impl: Implementation, name: str, case: Case) -> Any:
    try:
        return getattr(impl, name)(case)
    except Exception as exc:
        raise HookFailed(f"its {name}() raised {type(exc).__name__}: {exc}") from exc


def verify(entry: ModuleEntry, impl: Implementation, case: Case, *, oracle: Outputs | None = None) -> dict[str, Any]:
    """One row: run ``impl`` on ``case`` and judge each named output under its rule.

    ``oracle`` replaces ``entry.oracle(case)`` (golden verification passes the stored fp64
    outputs, so the row is judged against what was committed, not against today's oracle).
    The row's ``outputs`` holds every output's verdict; its top-level ``verdict``, ``metrics``
    and ``margin`` are those of the binding output (``output``): a failing one, else the one
    with the least margin. Overflow predictions, positions and ULP histograms are the primary
    output's.
    """
    row = row_header(impl, case, entry.direction)
    reason = impl.unavailable()
    if reason:
        return row | {"status": UNAVAILABLE, "reason": reason}
    # The oracle is computed before the implementation runs, and the implementation gets its own
    # copy of the case (guard.run_isolated): nothing it does can reach or redo the oracle, or
    # change the inputs of a later row.
    ref = as_outputs(entry.oracle(case) if oracle is None else oracle, entry.outputs, f"the {entry.name} oracle")
    terms = {name: _term_sizes(entry, case, name, ref) for name in ref}  # from the inputs, as the oracle
    start = time.perf_counter()
    try:
        out = as_outputs(run_isolated(impl, case), entry.outputs, impl.label)
        missing = [n for n in ref if n not in out]
        if missing:
            raise ValueError(f"{impl.label} returned no {', '.join(missing)} (this module's outputs: "
                             f"{', '.join(entry.outputs)})")
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a crash, even sys.exit, is a failed verdict, not a crashed run
        return _crashed(row, exc)
    row["wall_s"] = time.perf_counter() - start
    try:
        return _judged(entry, impl, case, row, out, ref, terms)
    except HookFailed as exc:
        return _crashed(row, exc)
    except Exception as exc:  # outputs the policy cannot judge (a wrong shape, a wrong dtype) fail the row
        return _crashed(row, exc, "its outputs could not be judged: ")


def _crashed(row: dict[str, Any], exc: BaseException, prefix: str = "") -> dict[str, Any]:
    """``row`` failed by ``exc``, with its reason and a short traceback."""
    if isinstance(exc, SystemExit):
        what = f"called sys.exit({exc.code!r})"
    else:
        what = str(exc) if isinstance(exc, HookFailed) else f"{type(exc).__name__}: {exc}"
    return row | {"status": FAIL, "reason": prefix + what, "traceback": "".join(traceback.format_exception(
        type(exc), exc, exc.__traceback__, limit=4))}


def _judged(entry: ModuleEntry, impl: Implementation, case: Case, row: dict[str, Any], out: Outputs,
            ref: Outputs, terms: dict[str, torch.Tensor | None]) -> dict[str, Any]:
    """``row`` with every output of ``out`` judged against ``ref`` (see :func:`verify`), an output
    formed as a sum given its ``terms``' sizes."""
    primary = next(n for n in entry.outputs if n in ref)
    prediction = _hook(impl, "predict", case) if impl.predict is not None else None
    if prediction is not None:
        row["prediction"] = {"finite": prediction.finite, "explanation": prediction.explanation}
    judged = {name: _judge_output(entry, impl, case, name, out[name], ref[name], prediction, name == primary,
                                  _zero_floor(entry, case, name, ref), terms[name], ref)
              for name in ref}
    main = judged[primary]
    if main["metrics"].get("nonfinite") == 0 and out[primary].is_floating_point():
        row["ulp_histogram"] = ulp_histogram(out[primary], ref[primary], impl.dtype)
        if entry.position_axis is not None:
            row["error_by_position"] = error_by_position(out[primary], ref[primary], entry.position_axis)
            if "baseline_out" in main and not main["baseline_metrics"]["nonfinite"]:
                row["baseline_error_by_position"] = error_by_position(main["baseline_out"], ref[primary],
                                                                      entry.position_axis)
    if (main["metrics"].get("nonfinite") or 0) and impl.explain is not None:
        row["overflow"] = _hook(impl, "explain", case)
    elif impl.explain is not None and any(j["status"] == FAIL for j in judged.values()):
        # A finite output that fails: what the form's trace says of its operands (an underflow
        # into the subnormal range, say), if anything.
        row["explanation"] = _hook(impl, "explain", case)
    for j in judged.values():
        j.pop("baseline_out", None)
    binding = _binding(judged, primary)
    status = FAIL if any(j["status"] == FAIL for j in judged.values()) else judged[binding]["status"]
    if status != FAIL and main["status"] == EXPECTED_NONFINITE:
        status, binding = EXPECTED_NONFINITE, primary
    if "baseline_metrics" in judged[binding]:
        row["baseline_form"] = entry.baseline_family(impl)
        row["baseline_metrics"] = judged[binding]["baseline_metrics"]
    row.update(outputs=judged, output=binding, status=status, verdict=judged[binding]["verdict"],
               margin=judged[binding]["margin"], metrics=judged[binding]["metrics"])
    return row


def _binding(judged: dict[str, dict[str, Any]], primary: str) -> str:
    """The output that decides the row: the failing one with the least margin, else the least margin."""
    def key(name: str) -> tuple[bool, float]:
        m = judged[name]["margin"]
        return judged[name]["status"] != FAIL, m if isinstance(m, float) and not math.isnan(m) else math.inf

    names = [primary, *(n for n in judged if n != primary)]
    return min(names, key=key)


def _zero_floor(entry: ModuleEntry, case: Case, name: str, ref: Outputs) -> float:
    """The absolute error the baseline rule allows output ``name`` where its oracle is all zero:
    ``k`` roundings in the fp32 accumulator of the terms it is a difference of (the module's
    ``term_scale``); 0 for any other output."""
    r = ref[name]
    if entry.term_scale is None or not r.is_floating_point() or r.numel() == 0 or bool(r.detach().any()):
        return 0.0
    scale = entry.term_scale(name, case, ref)
    return 0.0 if scale is None else BASELINE_K * ACCUMULATOR_ROUNDOFF * scale


def _term_sizes(entry: ModuleEntry, case: Case, name: str, ref: Outputs) -> torch.Tensor | None:
    """Output ``name``'s terms' sizes (the module's ``term_sizes``), or None."""
    if entry.term_sizes is None or not ref[name].is_floating_point():
        return None
    return entry.term_sizes(name, case, ref)


def _judge_output(entry: ModuleEntry, impl: Implementation, case: Case, name: str, out: torch.Tensor,
                  ref: torch.Tensor, prediction: Any, primary: bool, zero_floor: float = 0.0,
                  term_sizes: torch.Tensor | None = None, oracle: Outputs | None = None) -> dict[str, Any]:
    """:func:`_judge`, with an output the policy cannot read (a meta tensor, a wrong shape or
    dtype) named in the error."""
    try:
        if out.is_meta:
            raise ValueError("a meta tensor, which holds no values")
        return _judge(entry, impl, case, name, out, ref, prediction, primary, zero_floor, term_sizes, oracle)
    except Exception as exc:
        raise ValueError(f"output {name!r}: {exc}") from exc


def _judge(entry: ModuleEntry, impl: Implementation, case: Case, name: str, out: torch.Tensor, ref: torch.Tensor,
           prediction: Any, primary: bool, zero_floor: float = 0.0,
           term_sizes: torch.Tensor | None = None, oracle: Outputs | None = None) -> dict[str, Any]:
    """One output's verdict: the frontier where overflow is predicted, else the row's rule
    (``POLICY[impl.rule]``), given the same-dtype baseline's output where the rule uses one;
    ``oracle`` holds every output's oracle, for an error count read from another output."""
    out = out.detach().cpu()
    rule = POLICY[impl.rule]
    judged: dict[str, Any] = {}
    metrics = None
    if ref.is_floating_point():
        metrics = compare(out, ref, ulp_dtype=impl.dtype)
        judged["worst"] = worst_element(out, ref, tuple(entry.output_axes.get(name, ())))
        verdict = None if prediction is None else expected_nonfinite(
            metrics, predicted_finite=prediction.finite, explanation=prediction.explanation)
        if verdict is not None and verdict.status == EXPECTED_NONFINITE and prediction.by_plugin:
            verdict = _plugin_overflow(verdict, metrics, _baseline(entry, case, impl)[name], prediction.explanation)
        # The frontier speaks of the primary output; another output that stays finite where the
        # primary is predicted to overflow is held to the precision rule instead.
        if verdict is not None and (primary or metrics.nonfinite):
            return judged | {"metrics": metrics.as_dict(), "status": verdict.status, "verdict": verdict.as_dict(),
                             "margin": verdict.margin}
    base_out = _baseline(entry, case, impl)[name].detach().cpu() if rule.uses_baseline else None
    samples = entry.samples_of(name, ref.shape, case.params)
    rms_n, bias_n = samples.rms, samples.bias
    if samples.spread and base_out is not None:
        # Errors of unequal scales count as many as they are worth (Kish's number, both forms'
        # pooled), for the RMS term and the bias's noise alike.
        worth = effective_errors(ref, out, base_out)
        if samples.products:
            worth = min(worth, effective_products(ref, out, base_out))
        rms_n, bias_n = min(rms_n, worth), min(bias_n, worth)
    if samples.spread_over is not None and base_out is not None and oracle is not None:
        # Errors that come in slices of very different sizes (a walk's tokens): as many as the
        # baseline's slices are worth, read where they show apart, for every output of the row.
        # The baseline's alone: a form whose error sits on one slice must not lower its own count.
        source, axis = samples.spread_over
        worth = effective_slices(oracle[source], _baseline(entry, case, impl)[source].detach().cpu(), axis=axis)
        rms_n, bias_n = min(rms_n, worth * samples.slice_errors), min(bias_n, worth)
    j = rule.judge(out, ref, dtype=impl.dtype, baseline=base_out, metrics=metrics, rms_n=rms_n,
                   bias_n=bias_n, zero_floor=zero_floor, term_sizes=term_sizes)
    judged["metrics"] = j.metrics
    if j.baseline_metrics is not None:
        judged.update(baseline_metrics=j.baseline_metrics, baseline_out=base_out)
    return judged | {"status": j.verdict.status, "verdict": j.verdict.as_dict(), "margin": j.verdict.margin}


def _plugin_overflow(verdict: Verdict, metrics: Metrics, baseline: torch.Tensor, claim: str) -> Verdict:
    """A plugin's non-finite output that its own ``predict`` expected (``claim``, its
    explanation): excused only where the same-dtype baseline, the harness's own computation at
    the row's dtype, overflows too; else failed, the claim quoted. A plugin cannot turn its own
    overflow into a prediction."""
    spilled = int((~torch.isfinite(baseline.detach())).sum()) if baseline.is_floating_point() else 0
    if spilled:
        return replace(verdict, reason=f"{verdict.reason} (the same-dtype baseline overflows too: {spilled} "
                                       "non-finite outputs)")
    return Verdict(FAIL, FRONTIER_RULE, "nonfinite", float(metrics.nonfinite), math.nan, -math.inf,
                   f"{metrics.nonfinite} non-finite outputs where the same-dtype baseline is finite; the plugin's "
                   f"own prediction of overflow does not excuse them: {claim}")


def _baseline(entry: ModuleEntry, case: Case, impl: Implementation) -> Outputs:
    family = entry.baseline_family(impl)
    return as_outputs(entry.baseline(case, impl.dtype, family), entry.outputs, f"the {entry.name} baseline")


# ULP bands of the histogram: [0, 1/8), [1/8, 1/4), ..., [2^19, 2^20), [2^20, inf).
# Powers of two because a band then means "this many bits of the dtype's mantissa were lost".
ULP_EDGES = [0.0, *(2.0**e for e in range(-3, 21)), math.inf]


def ulp_histogram(out: torch.Tensor, ref: torch.Tensor, dtype: str) -> dict[str, Any]:
    """Counts of ``|out - ref|`` in ULPs of ``dtype`` at ``ref``, per band of :data:`ULP_EDGES`.

    ``out`` and ``ref`` have the same shape (any dtype; counted in fp64). Returns
    ``{"dtype", "edges": [...], "counts": [...]}`` with ``len(counts) == len(edges) - 1``.
    """
    x = out.detach().to("cpu", torch.float64).reshape(-1)
    r = ref.detach().to("cpu", torch.float64).reshape(-1)
    ulps = (x - r).abs() / spacing(r, dtype)
    inner = torch.tensor(ULP_EDGES[1:-1], dtype=torch.float64)
    band = torch.bucketize(ulps, inner, right=True)  # 0 for [0, 1/8), len(inner) for [2^20, inf)
    counts = torch.bincount(band, minlength=len(ULP_EDGES) - 1)
    return {"dtype": dtype, "edges": ULP_EDGES, "counts": [int(c) for c in counts]}


def error_by_position(out: torch.Tensor, ref: torch.Tensor, axis: int) -> list[float]:
    """``rms(out_t - ref_t) / rms(ref_t)`` at every index ``t`` of ``axis`` (4 significant digits).

    Positions where the oracle is exactly zero are normalised by the RMS of the whole oracle
    instead, so a silent position does not become a division by zero.
    """
    x = out.detach().to("cpu", torch.float64).movedim(axis, 0)
    r = ref.detach().to("cpu", torch.float64).movedim(axis, 0)
    x, r = x.reshape(x.shape[0], -1), r.reshape(r.shape[0], -1)
    err = (x - r).pow(2).mean(dim=1).sqrt()
    scale = r.pow(2).mean(dim=1).sqrt()
    scale = torch.where(scale > 0, scale, r.pow(2).mean().sqrt())
    ratio = torch.where(scale > 0, err / scale, torch.where(err > 0, math.inf, 0.0))
    return [float(f"{v:.4g}") for v in ratio.tolist()]
