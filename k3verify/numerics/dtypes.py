"""Facts about floating-point formats, derived from ``torch.finfo`` rather than typed in.

Every other part of k3verify asks this module for a format's maximum, unit roundoff or
``ln(max)``; nothing else hard-codes them, so adding a format means adding a name here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch

# Short names used on the command line, in reports and in test ids.
_NAMES: dict[str, torch.dtype] = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
_ALIASES: dict[str, str] = {
    "float64": "fp64",
    "double": "fp64",
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "fp8": "fp8_e4m3",
    "e4m3": "fp8_e4m3",
    "fp8_e4m3fn": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "e5m2": "fp8_e5m2",
    "float8_e5m2": "fp8_e5m2",
}


@dataclass(frozen=True)
class DTypeFacts:
    """Properties of one floating-point format.

    ``digits`` counts the significand bits including the implicit one, so the spacing of
    numbers in ``[2**e, 2**(e+1))`` is ``2**(e - digits + 1)``.
    """

    dtype: torch.dtype
    name: str
    bits: int
    digits: int
    emin: int
    emax: int
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float
    has_inf: bool

    @property
    def unit_roundoff(self) -> float:
        """Half the spacing at 1: the relative error bound of round-to-nearest."""
        return self.eps / 2

    @property
    def ln_max(self) -> float:
        """Natural log of the largest finite value: the exponent budget for ``exp``."""
        return math.log(self.max)

    @property
    def overflow_threshold(self) -> float:
        """Magnitude from which round-to-nearest leaves the finite range.

        That is ``max`` plus half a spacing at ``max``; whether the tie itself overflows
        depends on the parity of ``max``'s significand (see ``rounding.round_to``).
        """
        return self.max + 2.0 ** (self.emax - self.digits + 1) / 2


def resolve_dtype(spec: str | torch.dtype) -> torch.dtype:
    """Map a name such as ``"bf16"``/``"bfloat16"`` or a ``torch.dtype`` to a ``torch.dtype``.

    Raises ``ValueError`` naming the accepted spellings for anything else.
    """
    if isinstance(spec, torch.dtype):
        if spec not in _NAMES.values():
            raise ValueError(f"unsupported dtype {spec}; supported: {', '.join(_NAMES)}")
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"dtype must be a name or torch.dtype, got {type(spec).__name__}")
    key = spec.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _NAMES:
        raise ValueError(f"unknown dtype {spec!r}; supported: {', '.join(_NAMES)}")
    return _NAMES[key]


def dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical short name (``"bf16"``, ``"fp8_e4m3"`` ...) of a dtype."""
    dtype = resolve_dtype(dtype)
    for name, dt in _NAMES.items():
        if dt == dtype:
            return name
    raise AssertionError("unreachable: resolve_dtype accepted an unnamed dtype")


def supported_dtypes() -> tuple[str, ...]:
    """Short names of every format k3verify can emulate."""
    return tuple(_NAMES)


@cache
def facts(dtype: torch.dtype | str) -> DTypeFacts:
    """The :class:`DTypeFacts` of ``dtype``, computed from ``torch.finfo``."""
    dtype = resolve_dtype(dtype)
    fi = torch.finfo(dtype)
    digits = round(-math.log2(fi.eps)) + 1
    emin = round(math.log2(fi.smallest_normal))
    emax = math.frexp(fi.max)[1] - 1  # exact, unlike floor(log2(max)) for fp64
    # A format has infinities iff casting inf to it stays infinite (e4m3fn has none).
    has_inf = bool(torch.isinf(torch.tensor(float("inf")).to(dtype).float()).item())
    return DTypeFacts(
        dtype=dtype,
        name=dtype_name(dtype),
        bits=fi.bits,
        digits=digits,
        emin=emin,
        emax=emax,
        max=float(fi.max),
        smallest_normal=float(fi.smallest_normal),
        smallest_subnormal=2.0 ** (emin - digits + 1),
        eps=float(fi.eps),
        has_inf=has_inf,
    )


def finer(a: torch.dtype | str, b: torch.dtype | str) -> torch.dtype:
    """The one of ``a`` and ``b`` with more significand digits (``a`` on a tie): the precision a
    result can be held to when it is declared in one and stored in the other."""
    fa, fb = facts(a), facts(b)
    return fa.dtype if fa.digits >= fb.digits else fb.dtype


def is_float8(dtype: torch.dtype | str) -> bool:
    """True for the 8-bit formats, which torch cannot do arithmetic in."""
    return facts(dtype).bits == 8


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic dtype a reference path uses for inputs of ``dtype``.

    fp64 stays fp64 (reference paths never downcast); everything narrower is computed in
    fp32, the accumulator of every tensor-core kernel we model.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32
