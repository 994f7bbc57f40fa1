"""The verification run: case -> implementations -> metrics vs oracle -> verdict -> rows.

Each row is a plain dict (JSON-ready after ``report.json_safe``) describing one
(module, implementation, form, dtype, parameters, case) with its metrics, verdict and margin.
"""

from __future__ import annotations

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
)
from .registry import FP64_RULE, Case, Implementation, ModuleEntry

UNAVAILABLE = "unavailable"

Progress = Callable[[str], None]


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


def verify(entry: ModuleEntry, impl: Implementation, case: Case) -> dict[str, Any]:
    """One row: run ``impl`` on ``case`` and judge it under its rule."""
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
    ref = entry.oracle(case)
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
    verdict = None
    if impl.predict is not None:
        prediction = impl.predict(case)
        row["prediction"] = {"finite": prediction.finite, "explanation": prediction.explanation}
        verdict = expected_nonfinite(metrics, predicted_finite=prediction.finite, explanation=prediction.explanation)
    if verdict is None:
        if impl.rule == FP64_RULE:
            verdict = fp64_agreement(_as_fp64(out, impl), ref)
        else:
            base = compare(entry.baseline(case, impl.dtype, impl.baseline), ref, ulp_dtype=impl.dtype)
            row["baseline_form"] = impl.baseline
            row["baseline_metrics"] = base.as_dict()
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
