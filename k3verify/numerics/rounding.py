"""Rounding emulation: values of a wide tensor rounded to a narrower format.

``round_to(x, bf16)`` returns a tensor of ``x``'s dtype (fp32 or fp64) whose values are
exactly representable in bf16 — what a kernel's operand holds after a cast. Keeping the
wide storage lets fp8 values take part in ordinary fp32 matmuls, which is how tensor cores
accumulate them.

The reference path works from ``torch.finfo`` facts alone (round to nearest, ties to even,
gradual underflow), so its behaviour is defined here and not by torch's casts. For speed,
torch's own cast is used where tests show it is bit-identical to the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Literal

import torch

from .dtypes import DTypeFacts, facts, resolve_dtype

Overflow = Literal["nonfinite", "saturate"]
OVERFLOW_MODES: tuple[str, ...] = ("nonfinite", "saturate")


def round_to(
    x: torch.Tensor,
    dtype: torch.dtype | str,
    *,
    overflow: Overflow = "nonfinite",
) -> torch.Tensor:
    """Round ``x`` (fp32 or fp64) to the values of ``dtype``; keep ``x``'s dtype.

    ``overflow="nonfinite"`` turns out-of-range magnitudes into ``inf`` (``nan`` for a
    format without infinities, such as fp8 e4m3fn) so that an overflow cannot pass
    unnoticed; ``"saturate"`` clamps to ``±max`` like ``cvt.satfinite``. NaN stays NaN.
    A ``dtype`` at least as wide as ``x`` returns ``x`` unchanged.
    """
    target = resolve_dtype(dtype)
    if overflow not in OVERFLOW_MODES:
        raise ValueError(f"overflow must be one of {OVERFLOW_MODES}, got {overflow!r}")
    if x.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"round_to takes fp32 or fp64 storage, got {x.dtype}")
    if torch.finfo(target).bits >= torch.finfo(x.dtype).bits:
        return x
    if x.dtype == torch.float32:
        # torch's fp32 casts round to nearest-even; properties/test_numerics.py checks that
        # this fast path is bit-identical to the reference on every binade boundary.
        return _round_native(x, target, overflow)
    return _round_fp64(x, target, overflow)


def storage_for(dtype: torch.dtype | str) -> torch.dtype:
    """Wide dtype that holds emulated ``dtype`` values: fp64 for fp64, fp32 for the rest."""
    return torch.float64 if resolve_dtype(dtype) == torch.float64 else torch.float32


def rounder(dtype: torch.dtype | str, *, overflow: Overflow = "nonfinite") -> Callable[[torch.Tensor], torch.Tensor]:
    """How a naive baseline stores a tensor: rounded once to ``dtype``, held in ``storage_for(dtype)``.

    The rounding starts from ``x``'s own precision (fp64 stays fp64 until the single rounding),
    so an fp64 input is not rounded to fp32 first.
    """
    target, storage = resolve_dtype(dtype), storage_for(dtype)

    def plain(x: torch.Tensor) -> torch.Tensor:
        wide = x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float64)
        return round_to(wide, target, overflow=overflow).to(storage)

    return lambda x: stored(x, plain)


def stored(x: torch.Tensor, plain: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``plain(x)``, the rounding of a stored tensor; under autograd the gradient that flows back
    through it is rounded by ``plain`` too (:class:`_StoredInDtype`)."""
    if x.requires_grad and torch.is_grad_enabled():
        return _StoredInDtype.apply(x, plain)
    return plain(x)


class _StoredInDtype(torch.autograd.Function):
    """A rounding under autograd as a plain implementation in the narrow dtype differentiates it:
    the value is stored rounded, and so is the gradient that flows back through it (a bf16
    tensor's gradient is a bf16 tensor). Rounding's own derivative, zero almost everywhere, is
    not what such an implementation computes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, plain: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        ctx.plain, ctx.dtype = plain, x.dtype
        return plain(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.plain(grad).to(ctx.dtype), None


def round_to_reference(
    x: torch.Tensor,
    dtype: torch.dtype | str,
    *,
    overflow: Overflow = "nonfinite",
) -> torch.Tensor:
    """Round to nearest, ties to even, from the format's digits and exponent range only.

    Works in fp64, where scaling by a power of two is exact, so the single rounding step is
    ``torch.round`` (which breaks ties to even) on the scaled value.
    """
    f = facts(dtype)
    xd = x.to(torch.float64)
    quantum = spacing(xd, dtype)
    r = torch.round(xd / quantum) * quantum
    r = torch.where(torch.isfinite(xd), r, xd)
    too_big = r.abs() > f.max
    if overflow == "saturate":
        r = torch.where(too_big & ~torch.isnan(xd), torch.sign(xd) * f.max, r)
    else:
        r = torch.where(too_big, _nonfinite(f, xd), r)
    return r.to(x.dtype)


def _round_fp64(x: torch.Tensor, dtype: torch.dtype, overflow: Overflow) -> torch.Tensor:
    """fp64 ``x`` rounded to ``dtype``'s values, kept fp64: the reference where the result may be
    subnormal, overflow or is not finite; elsewhere one integer rounding of the bit pattern.

    Why not torch's cast: fp64 to bf16 goes through fp32, a double rounding (see
    ``test_reference_rounds_fp64_once``). Why not the reference everywhere: its divide and
    ``torch.round`` cost ten times as much, and drawing the wide decoder's weights (10^9
    values, each rounded to bf16) spent most of its time there. For a normal result the
    dropped fraction bits round to nearest, ties to even, by adding ``half - 1`` plus the kept
    last bit, a carry running into the exponent where the binade ends; the sign bit is never
    reached for finite values. properties/test_numerics.py checks the two paths bit for bit.
    """
    f = facts(dtype)
    a = x.abs()
    fast = ((a >= f.smallest_normal) & (a <= f.max)) | (a == 0)
    drop = 53 - f.digits  # fp64 keeps 53 significant bits, the format ``digits``
    bits = x.view(torch.int64)  # same element size: any strides, which the result keeps
    kept_last = (bits >> drop) & 1
    rounded = ((bits + ((1 << (drop - 1)) - 1) + kept_last) & ~((1 << drop) - 1)).view(torch.float64)
    if bool(fast.all()):
        return rounded
    out = rounded.clone()
    slow = ~fast
    out[slow] = round_to_reference(x[slow], dtype, overflow=overflow)
    return out


def _nonfinite(f: DTypeFacts, like: torch.Tensor) -> torch.Tensor:
    """Signed infinity where the format has one, NaN otherwise."""
    if f.has_inf:
        return torch.sign(like) * float("inf")
    return torch.full_like(like, float("nan"))


def _round_native(x: torch.Tensor, dtype: torch.dtype, overflow: str) -> torch.Tensor:
    f = facts(dtype)
    y = x.to(dtype).to(x.dtype)
    if f.has_inf:
        if overflow == "saturate":
            y = torch.where(torch.isinf(y), torch.sign(y) * f.max, y)
        return y
    # Formats without inf: torch saturates, so mark the overflowing magnitudes ourselves.
    if overflow == "nonfinite":
        over = _overflows(x.abs(), f) | torch.isinf(x)
        y = torch.where(over, torch.full_like(y, float("nan")), y)
    return y


def _overflows(mag: torch.Tensor, f: DTypeFacts) -> torch.Tensor:
    """Magnitudes that round past ``max``; the exact tie goes by the reference rounding."""
    t = f.overflow_threshold
    if _tie_overflows(f.dtype):
        return mag >= t
    return mag > t


@cache
def _tie_overflows(dtype: torch.dtype) -> bool:
    tie = torch.tensor([facts(dtype).overflow_threshold], dtype=torch.float64)
    return not bool(torch.isfinite(round_to_reference(tie, dtype)).item())


def spacing(x: torch.Tensor, dtype: torch.dtype | str) -> torch.Tensor:
    """Distance between adjacent ``dtype`` values at ``|x|`` (one ULP), in fp64.

    Zero and subnormal magnitudes get the subnormal spacing.
    """
    f = facts(dtype)
    xd = x.to(torch.float64).abs()
    _, exponent = torch.frexp(xd)  # xd = m * 2**exponent, 0.5 <= m < 1, so floor(log2 xd) = exponent - 1
    # Held at emin below the normal range (subnormals); frexp(0) reports 0, also subnormal here.
    e = torch.where(xd == 0, f.emin, torch.clamp(exponent - 1, min=f.emin))
    return torch.ldexp(torch.ones_like(xd), (e - (f.digits - 1)).to(torch.int32))
