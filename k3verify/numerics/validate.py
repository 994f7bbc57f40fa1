"""Input checks shared by every form: errors that name the argument and the problem.

A verification harness must never turn bad input into a plausible number, so every public
form calls these before computing anything.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def require_tensor(name: str, t: object) -> torch.Tensor:
    """``t`` itself if it is a tensor, else ``TypeError`` naming ``name``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def require_shape(name: str, t: torch.Tensor, shape: Sequence[int | None], dims: str) -> None:
    """Check ``t.shape`` against ``shape`` (``None`` = any); ``dims`` names the axes, e.g. ``"B,T,H,K"``."""
    expected = "[" + ", ".join(f"{d}={s}" if s is not None else d for d, s in zip(dims.split(","), shape)) + "]"
    if t.dim() != len(shape) or any(s is not None and s != a for s, a in zip(shape, t.shape)):
        raise ValueError(f"{name} has shape {list(t.shape)}; expected {expected}")


def require_float(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype] = FLOAT_DTYPES) -> None:
    """``t`` must have one of the ``allowed`` floating dtypes."""
    if t.dtype not in allowed:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {', '.join(map(str, allowed))}")


def require_same(names: Sequence[str], tensors: Sequence[torch.Tensor], what: str = "dtype") -> None:
    """All ``tensors`` share ``dtype`` (or ``device``); the error lists each one's value."""
    values = [getattr(t, what) for t in tensors]
    if len(set(values)) > 1:
        listing = ", ".join(f"{n}={v}" for n, v in zip(names, values))
        raise TypeError(f"inputs must share one {what}; got {listing}")


def require_finite(name: str, t: torch.Tensor) -> None:
    """No NaN or inf in ``t``; the error counts them and gives the first index."""
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        count = int(bad.sum())
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name} has {count} non-finite value(s) (first at index {first})")


def require_positive_int(name: str, value: object) -> int:
    """``value`` as an int if it is a positive integer, else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value
