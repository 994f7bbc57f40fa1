"""The verification run: case -> implementations -> metrics vs oracle -> verdict -> rows.

Each row is a plain dict (JSON-ready after ``report.json_safe``) describing one
(module, implementation, form, dtype, parameters, case) with its metrics, verdict and margin,
plus two profiles of the error that the HTML report draws: ``ulp_histogram`` (how many
outputs lie in each ULP band) and, for modules with a position axis, ``error_by_position``
(the RMS ratio at every token position; ``baseline_error_by_position`` for the baseline).
"""

from __future__ import annotations

import contextlib
import math
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..numerics import (
    FAIL,
    baseline_rule,
    compare,
    expected_nonfinite,
    fp64_agreement,
    noise_floor,
    spacing,
)
from .registry import FP64_RULE, Case, Implementation, ModuleEntry

UNAVAILABLE = "unavailable"

Progress = Callable[[str], None]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block with one torch intra-op thread, then restore the previous setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def plan(entries: list[ModuleEntry]) -> list[tuple[ModuleEntry, Implementation, str]]:
    """Every (entry, implementation, case name) a run will verify, in order."""
    return [(e, impl, c) for e in entries for impl in e.implementations() for c in impl.cases]


def run(entries: list[ModuleEntry], *, seed: int = 0, progress: Progress | None = None) -> Iterator[dict[str, Any]]:
    """Verify every planned row; yields rows as they finish (``progress`` gets each label first)."""
    cases: dict[str, dict[str, Case]] = {}
    for entry, impl, case_name in plan(entries):
        if entry.name not in cases:
            cases[entry.name] = entry.make_cases(seed)
        if case_name not in cases[entry.name]:
            raise KeyError(f"{impl.label} asks for case {case_name!r}, which {entry.name} does not make")
        if progress:
            progress(f"{impl.label} on {case_name}")
        yield verify(entry, impl, cases[entry.name][case_name])


def verify(
    entry: ModuleEntry, impl: Implementation, case: Case, *, oracle: torch.Tensor | None = None
) -> dict[str, Any]:
    """One row: run ``impl`` on ``case`` and judge it under its rule.

    ``oracle`` replaces ``entry.oracle(case)`` (golden verification passes the stored fp64
    output, so the row is judged against what was committed, not against today's oracle).
    """
    row: dict[str, Any] = {
        "module": impl.module,
        "implementation": impl.implementation,
        "form": impl.form,
        "dtype": impl.dtype,
        "params": dict(impl.params),
        "case": case.name,
        "case_params": dict(case.params),
        "rule": impl.rule,
    }
    reason = impl.unavailable()
    if reason:
        return row | {"status": UNAVAILABLE, "reason": reason}
    ref = entry.oracle(case) if oracle is None else oracle
    start = time.perf_counter()
    try:
        out = impl.run(case)
    except Exception as exc:  # a crashing implementation is a failed verdict, not a crashed run
        return row | {
            "status": FAIL,
            "reason": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(limit=4),
        }
    row["wall_s"] = time.perf_counter() - start
    metrics = compare(out, ref, ulp_dtype=impl.dtype)
    row["metrics"] = metrics.as_dict()
    if not metrics.nonfinite:
        row["ulp_histogram"] = ulp_histogram(out, ref, impl.dtype)
        if entry.position_axis is not None:
            row["error_by_position"] = error_by_position(out, ref, entry.position_axis)
    verdict = None
    if impl.predict is not None:
        prediction = impl.predict(case)
        row["prediction"] = {"finite": prediction.finite, "explanation": prediction.explanation}
        verdict = expected_nonfinite(metrics, predicted_finite=prediction.finite, explanation=prediction.explanation)
    if verdict is None:
        if impl.rule == FP64_RULE:
            verdict = fp64_agreement(_as_fp64(out, impl), ref)
        else:
            base_out = entry.baseline(case, impl.dtype, impl.baseline)
            base = compare(base_out, ref, ulp_dtype=impl.dtype)
            row["baseline_form"] = impl.baseline
            row["baseline_metrics"] = base.as_dict()
            if entry.position_axis is not None and not base.nonfinite:
                row["baseline_error_by_position"] = error_by_position(base_out, ref, entry.position_axis)
            # The floor is what storing the oracle in the output's own dtype costs (an fp8 run
            # that writes bf16 is floored at bf16, not fp8).
            verdict = baseline_rule(metrics, base, noise_floor(ref, out.dtype))
    if metrics.nonfinite and impl.explain is not None:
        row["overflow"] = impl.explain(case)
    row.update(status=verdict.status, verdict=verdict.as_dict(), margin=verdict.margin)
    return row


def _as_fp64(out: torch.Tensor, impl: Implementation) -> torch.Tensor:
    if out.dtype != torch.float64:
        raise TypeError(f"{impl.label} is judged by fp64-agreement but returned {out.dtype}; fp64 must stay fp64")
    return out


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
