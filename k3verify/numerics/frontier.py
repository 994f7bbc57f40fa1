"""Overflow frontiers: does ``exp(L)`` times a unit-magnitude operand fit a format?

Tensor-core kernels split ``exp(a - b)`` into two factors that are rounded to the operand
dtype separately, so each factor must stay below the format's maximum. A module supplies the
largest log-magnitude its factors can reach (from its tiling and anchor); this module says
whether that fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
