"""Input checks shared by every form: errors that name the argument and the problem.

A verification harness must never turn bad input into a plausible number, so every public
form calls these before computing anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from .tensors import Stamp

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


# Elements scanned at once by require_finite: the masks of a large tensor stay at 128 MB (a
# K3 expert matrix has 9.9e9 elements; one mask of it took 9.2 GiB and failed on an 80 GB device).
FINITE_SCAN = 1 << 27


def _parts(t: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """``t`` as slices along its first axis of at most about :data:`FINITE_SCAN` elements, each
    with its first index (``t`` whole when it is small or has no axis)."""
    if t.dim() == 0 or t.numel() <= FINITE_SCAN or t.shape[0] == 0:
        return [(0, t)]
    step = max(1, FINITE_SCAN // (t.numel() // t.shape[0]))
    return [(i, t[i : i + step]) for i in range(0, t.shape[0], step)]


def require_finite(name: str, t: torch.Tensor) -> None:
    """No NaN or inf in ``t``; the error counts them and gives the first index."""
    if bool(finite(t)):
        return
    count, first = 0, None
    for start, part in _parts(t):
        bad = ~torch.isfinite(part)
        count += int(bad.sum())
        if first is None and bool(bad.any()):
            at = [int(i) for i in bad.reshape(part.shape).nonzero()[0]]
            first = tuple([at[0] + start, *at[1:]]) if at else ()
    raise ValueError(f"{name} has {count} non-finite value(s) (first at index {first})")


def finite(t: torch.Tensor) -> torch.Tensor:
    """Whether ``t`` is all finite, as a 0-d bool tensor on ``t``'s device (no host wait; scanned
    in the parts :func:`require_finite` uses)."""
    return torch.stack([torch.isfinite(part).all() for _, part in _parts(t)]).all()


Check = tuple[torch.Tensor, Callable[[], object]]


def all_hold(checks: Sequence[Check]) -> None:
    """Each check is a 0-d bool tensor (true: it holds) and the full check that names the
    problem. The flags reach the host together, one wait on the device for all of them (each
    ``bool()`` of a device tensor waits; a MoE layer call made about ten), then the full check of
    the first that does not hold, in order, raises its error."""
    if not checks:
        return
    held = torch.stack([flag.reshape(()) for flag, _ in checks]).tolist()
    for ok, (_, full) in zip(held, checks):
        if not ok:
            full()
    if not all(held):
        raise RuntimeError("a check's flag and its full check disagree")  # a defect of the check itself


# Parameters checked finite, by ``id``: each one's :class:`~k3verify.numerics.tensors.Stamp` at
# the check. A weight tensor that a stack reuses in every call is scanned once, and again after
# any in-place write; the entry goes when the tensor dies.
_FINITE_PARAMETERS: dict[int, Stamp] = {}


def require_finite_parameter(name: str, t: torch.Tensor) -> None:
    """:func:`require_finite` for a parameter that many calls share: skipped when ``t`` was
    found finite before and has not been written since (same object, same ``_version``)."""
    key = id(t)
    seen = _FINITE_PARAMETERS.get(key)
    if seen is not None and seen.holds(t):
        return
    require_finite(name, t)
    stamp = Stamp.of(t, lambda _: _FINITE_PARAMETERS.pop(key, None))
    if stamp is not None:
        _FINITE_PARAMETERS[key] = stamp


# The largest chunk, tile or split count a form accepts. Beyond it the zero padding of a chunk
# or tile, or the loop over splits, would allocate or run for minutes before computing anything
# a smaller block does not already show; the check comes before any allocation.
MAX_BLOCK = 4096


def require_positive_int(name: str, value: object, maximum: int | None = None) -> int:
    """``value`` as an int if it is a positive integer (at most ``maximum``), else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={value} is larger than {maximum}, the largest k3verify accepts")
    return value


def require_block(name: str, value: object) -> int:
    """A chunk size, tile size or split count: a positive integer up to :data:`MAX_BLOCK`."""
    return require_positive_int(name, value, MAX_BLOCK)


def require_scale(value: object) -> float:
    """A softmax or attention scale: a finite positive real number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"scale must be a finite positive number, got {value!r}")
    return float(value)


def require_on_device(name: str, t: torch.Tensor) -> None:
    """``t`` holds data on a real device (CPU or CUDA), not on ``meta``."""
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on device {t.device}; k3verify computes on cpu or cuda tensors with data")
