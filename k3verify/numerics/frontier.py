"""Overflow frontiers: does ``exp(L)`` times a unit-magnitude operand fit a format?

Tensor-core kernels split ``exp(a - b)`` into two factors that are rounded to the operand
dtype separately, so each factor must stay below the format's maximum. A module supplies the
largest log-magnitude its factors can reach (from its tiling and anchor); this module says
whether that fits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from .dtypes import facts


def ln_max(dtype: torch.dtype | str) -> float:
    """``ln`` of the largest finite value of ``dtype`` (88.72 for bf16, 11.09 for fp16 ...)."""
    return facts(dtype).ln_max


def exp_fits(
    log_magnitude: float, dtype: torch.dtype | str, *, compute_dtype: torch.dtype | str = torch.float32
) -> bool:
    """True if ``exp(log_magnitude)`` is finite both where it is computed and once rounded.

    The exponential is evaluated in ``compute_dtype`` (fp32 in every kernel we model) before
    the cast to the operand dtype, so the tighter of the two ranges decides.
    """
    if math.isnan(log_magnitude):
        return False
    return log_magnitude < min(ln_max(dtype), ln_max(compute_dtype))


def headroom(
    log_magnitude: float, dtype: torch.dtype | str, *, compute_dtype: torch.dtype | str = torch.float32
) -> float:
    """How far below the frontier ``log_magnitude`` sits, in natural-log units (negative past it)."""
    return min(ln_max(dtype), ln_max(compute_dtype)) - log_magnitude


def underflow_threshold(dtype: torch.dtype | str) -> float:
    """``ln`` below which ``exp`` in ``dtype`` rounds to exactly 0: half the smallest subnormal."""
    return math.log(facts(dtype).smallest_subnormal / 2)


def ln_abs_max(x: torch.Tensor) -> float:
    """``ln max|x|`` computed in ``x``'s dtype (``-inf`` for an empty or all-zero tensor)."""
    m = float(x.abs().max()) if x.numel() else 0.0
    return math.log(m) if m > 0 else -math.inf


@dataclass(frozen=True)
class OverflowPrediction:
    """An analytic prediction from range checks: finite or not, every check that fails, and
    the tightest one. Modules fill it from their own quantities and subclass it to add more."""

    finite: bool
    reasons: tuple[str, ...]
    binding: str  # the check with the least headroom
    headroom: float  # ln units left before that check fails (negative: past it)

    def explanation(self) -> str:
        """One line: the failing checks, or the binding one and its headroom."""
        if self.reasons:
            return "; ".join(self.reasons)
        return f"all ranges fit; tightest: {self.binding} ({self.headroom:.2f} ln units of headroom)"


# A range check: what is checked, whether it fits, and its headroom in ln units.
Check = tuple[str, bool, float]


def as_checks(prediction: OverflowPrediction, label: str = "forward") -> list[Check]:
    """Another prediction's verdict as range checks: its failing ones, or its binding one."""
    return [(reason, False, -math.inf) for reason in prediction.reasons] or [
        (f"{label}: {prediction.binding}", True, prediction.headroom)]


def prediction_from(checks: Iterable[Check]) -> OverflowPrediction:
    """The prediction of a list of range checks: finite iff every one fits (each failing one
    named once), bound by the one with the least headroom."""
    checks = list(checks)
    failing = tuple(dict.fromkeys(what for what, ok, _ in checks if not ok))
    what, _, room = min(checks, key=lambda c: c[2] if not math.isnan(c[2]) else -math.inf)
    return OverflowPrediction(finite=not failing, reasons=failing, binding=what, headroom=room)


@dataclass
class Magnitudes:
    """What a form stores, measured instead of rounded: a stand-in for its rounding hooks that
    hands every tensor back unchanged (the form runs in fp64) and records by name the natural log
    of the largest magnitude it reaches and how it is stored (``kind``, which names the dtype it
    is checked against: ``operand``, ``output`` or ``accumulator``)."""

    stored: dict[str, tuple[str, float]] = field(default_factory=dict)

    def __call__(self, name: str, t: torch.Tensor, kind: str = "operand") -> torch.Tensor:
        value = ln_abs_max(t.detach())
        seen = self.stored.get(name)
        if seen is None or value > seen[1]:
            self.stored[name] = (kind, value)
        return t

    def hook(self, kind: str) -> Callable[[str, torch.Tensor], torch.Tensor]:
        """A ``cast(name, t)`` hook recording under ``kind``."""
        return lambda name, t: self(name, t, kind)

    def checks(self, dtypes: Mapping[str, torch.dtype | str], accumulator: torch.dtype | str) -> list[Check]:
        """One range check per recorded tensor: its ln max against its kind's dtype in ``dtypes``
        (and the accumulator it is computed in first)."""
        out = []
        for name, (kind, value) in self.stored.items():
            dtype = dtypes[kind]
            limit = min(ln_max(dtype), ln_max(accumulator))
            out.append((f"{name} (ln {value:.2f} vs {limit:.2f}: {facts(dtype).name})",
                        exp_fits(value, dtype, compute_dtype=accumulator), limit - value))
        return out
