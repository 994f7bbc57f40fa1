"""Overflow frontiers: does ``exp(L)`` times a unit-magnitude operand fit a format?

Tensor-core kernels split ``exp(a - b)`` into two factors that are rounded to the operand
dtype separately, so each factor must stay below the format's maximum. A module supplies the
largest log-magnitude its factors can reach (from its tiling and anchor); this module says
whether that fits.
"""

from __future__ import annotations

import math

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
