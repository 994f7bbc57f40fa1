"""Rounding with an audit trail: which named tensor overflowed its dtype (or fell into its
subnormal range), where, and by how much.

A tiled form passes every operand through a :class:`TracingRounder`; with tracing on, the
first tensors whose rounding produced inf/NaN are kept as :class:`OverflowEvent` records, so
a report can say "the diagonal key operand overflowed bf16 at batch 0, head 1, chunk 3,
tile 2: ln|value| reached 90.1 > 88.7" instead of just "NaN".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from .dtypes import facts, resolve_dtype
from .frontier import ln_max
from .rounding import Overflow, round_to, stored

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
class UnderflowEvent:
    """A named tensor some of whose non-zero values fell below its dtype's smallest normal when
    rounded: they keep fewer significant bits (or become 0), a precision loss no overflow check
    sees. Counts add up over every rounding of that tensor; the place is that of the smallest."""

    operand: str
    count: int
    nonzero: int
    index: tuple[int, ...]
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    min_log_magnitude: float  # ln of the smallest non-zero pre-rounding magnitude
    dtype: str
    ln_tiny: float  # ln of the dtype's smallest normal

    @property
    def fraction(self) -> float:
        return self.count / self.nonzero if self.nonzero else 0.0

    def describe(self) -> str:
        """One line naming the tensor, how much of it fell into the subnormal range, and where."""
        where = OverflowEvent.where(self)  # type: ignore[arg-type]
        return (f"{self.operand} fell below {self.dtype}'s smallest normal in {self.count} of {self.nonzero} "
                f"non-zero values ({100 * self.fraction:.1f} %): ln|value| down to {self.min_log_magnitude:.2f} "
                f"< {self.ln_tiny:.2f} at {where}, with fewer significant bits")


@dataclass
class TracingRounder:
    """``rounder(name, t, dtype=None)`` rounds ``t`` to ``dtype`` (default: the rounder's own).

    The result keeps ``t``'s storage (fp32 or fp64; narrower tensors are widened to fp32 first,
    so the rounding happens once). With ``trace=True`` the first :data:`MAX_EVENTS` overflows
    are recorded in ``events`` (and, unless ``underflow=False``, the operands that fell into the
    subnormal range in ``underflows``), and every name rounded below fp32 in ``narrowed``;
    ``axes(name)`` names the leading index axes of a tensor. The names in ``keep`` pass unrounded,
    to measure what rounding them costs.
    """

    dtype: torch.dtype | str
    overflow: Overflow = "nonfinite"
    trace: bool = False
    axes: Callable[[str], tuple[str, ...]] = lambda name: ()
    underflow: bool = True
    keep: frozenset[str] = frozenset()
    events: list[OverflowEvent] = field(default_factory=list)
    underflows: dict[str, UnderflowEvent] = field(default_factory=dict)
    narrowed: dict[str, torch.dtype] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.dtype = resolve_dtype(self.dtype)

    def __call__(self, name: str, t: torch.Tensor, dtype: torch.dtype | str | None = None) -> torch.Tensor:
        target = self.dtype if dtype is None else resolve_dtype(dtype)
        wide = t if t.dtype in (torch.float32, torch.float64) else t.to(torch.float32)
        if self.trace and target not in (torch.float32, torch.float64):
            self.narrowed.setdefault(name, target)
        if name in self.keep:
            # Attribution (kda.tiled.attribute_backward_error): this operand is not rounded.
            return wide
        # Under autograd the gradient through a stored tensor is stored in its dtype as well.
        y = stored(wide, partial(round_to, dtype=target, overflow=self.overflow))
        if self.trace and len(self.events) < MAX_EVENTS:
            self._record(name, wide, y, target)
        if self.trace and self.underflow:
            self._record_underflow(name, wide, target)
        return y

    def _record_underflow(self, name: str, before: torch.Tensor, dtype: torch.dtype) -> None:
        magnitude = before.detach().abs()
        nonzero = torch.isfinite(magnitude) & (magnitude > 0)
        tiny = facts(dtype).smallest_normal
        low = nonzero & (magnitude < tiny)
        count = int(low.sum())
        if not count:
            return
        smallest = torch.where(low, magnitude, torch.full_like(magnitude, math.inf))
        at = int(smallest.reshape(-1).argmin())
        least = float(smallest.reshape(-1)[at])
        seen = self.underflows.get(name)
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(at), tuple(before.shape)))
        if seen is not None and seen.min_log_magnitude <= math.log(least):
            index, least = seen.index, math.exp(seen.min_log_magnitude)
        self.underflows[name] = UnderflowEvent(
            operand=name,
            count=count + (seen.count if seen else 0),
            nonzero=int(nonzero.sum()) + (seen.nonzero if seen else 0),
            index=index,
            shape=tuple(before.shape),
            axes=self.axes(name),
            min_log_magnitude=math.log(least),
            dtype=facts(dtype).name,
            ln_tiny=math.log(tiny),
        )

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
