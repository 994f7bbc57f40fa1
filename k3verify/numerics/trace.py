"""Rounding with an audit trail: which named tensor overflowed its dtype, where, and by how much.

A tiled form passes every operand through a :class:`TracingRounder`; with tracing on, the
first tensors whose rounding produced inf/NaN are kept as :class:`OverflowEvent` records, so
a report can say "the diagonal key operand overflowed bf16 at batch 0, head 1, chunk 3,
tile 2: ln|value| reached 90.1 > 88.7" instead of just "NaN".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .dtypes import facts, resolve_dtype
from .frontier import ln_max
from .rounding import Overflow, round_to

# Past the first few events everything downstream is propagation; stop paying for checks.
MAX_EVENTS = 4


@dataclass(frozen=True)
class OverflowEvent:
    """A named tensor that left its dtype's range when it was rounded."""

    operand: str
    count: int
    index: tuple[int, ...]  # first offending element
    shape: tuple[int, ...]
    axes: tuple[str, ...]  # names of the leading index axes ("batch", "head", ...); may be empty
    arrived_nonfinite: bool  # already inf/NaN before rounding (accumulator overflow or propagation)
    max_log_magnitude: float  # ln of the largest finite pre-rounding magnitude
    dtype: str
    ln_max: float

    def where(self) -> str:
        """``"batch 0, head 1, chunk 3"`` from the named axes, else the raw index and shape."""
        if self.axes:
            return ", ".join(f"{a} {i}" for a, i in zip(self.axes, self.index))
        return f"index {list(self.index)} of shape {list(self.shape)}"

    def describe(self) -> str:
        """One line naming the tensor, where it overflowed and by how much."""
        if self.arrived_nonfinite:
            cause = "already non-finite before rounding (an fp32 overflow upstream, or propagation)"
        else:
            cause = f"ln|value| reached {self.max_log_magnitude:.2f} > ln(max {self.dtype}) = {self.ln_max:.2f}"
        return f"{self.operand} overflowed {self.dtype} at {self.where()} ({self.count} values): {cause}"


@dataclass
class TracingRounder:
    """``rounder(name, t, dtype=None)`` rounds ``t`` to ``dtype`` (default: the rounder's own).

    The result keeps ``t``'s storage (fp32 or fp64; narrower tensors are widened to fp32 first,
    so the rounding happens once). With ``trace=True`` the first :data:`MAX_EVENTS` overflows
    are recorded in ``events``; ``axes(name)`` names the leading index axes of a tensor.
    """

    dtype: torch.dtype | str
    overflow: Overflow = "nonfinite"
    trace: bool = False
    axes: Callable[[str], tuple[str, ...]] = lambda name: ()
    events: list[OverflowEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.dtype = resolve_dtype(self.dtype)

    def __call__(self, name: str, t: torch.Tensor, dtype: torch.dtype | str | None = None) -> torch.Tensor:
        target = self.dtype if dtype is None else resolve_dtype(dtype)
        wide = t if t.dtype in (torch.float32, torch.float64) else t.to(torch.float32)
        y = round_to(wide, target, overflow=self.overflow)
        if self.trace and len(self.events) < MAX_EVENTS:
            self._record(name, wide, y, target)
        return y

    def _record(self, name: str, before: torch.Tensor, after: torch.Tensor, dtype: torch.dtype) -> None:
        bad = ~torch.isfinite(after)
        if not bool(bad.any()):
            return
        finite = before[torch.isfinite(before)].abs()
        biggest = float(finite.max()) if finite.numel() else 0.0
        self.events.append(
            OverflowEvent(
                operand=name,
                count=int(bad.sum()),
                index=tuple(int(i) for i in bad.nonzero()[0]),
                shape=tuple(before.shape),
                axes=self.axes(name),
                arrived_nonfinite=bool((~torch.isfinite(before[bad])).any()),
                max_log_magnitude=math.log(biggest) if biggest > 0 else -math.inf,
                dtype=facts(dtype).name,
                ln_max=ln_max(dtype),
            )
        )
