"""Argument checking shared by the Block AttnRes forms, their options and their precision model
(the walk's own arguments are checked by :mod:`k3verify.attnres.layer`, which owns their types).

Every form exists at two levels, each with one signature for all forms:

aggregation — one AttnRes call::

    form(sources, w, gamma, *, stream_dtype=None, logit_dtype=None, tile=4, subtract_max=True,
         eps=1e-5) -> h

- ``sources:[N, T, d]`` (or a sequence of ``N`` tensors ``[T, d]``), in depth order with the
  current partial sum last; ``w:[d]`` the pseudo-query, ``gamma:[d]`` the key-norm gain.
- ``h:[T, d] = Σ_i softmax_i(ℓ) v_i`` with ``ℓ_i = wᵀ RMSNorm_γ(v_i)``, in the stream dtype.

walk — the whole depth recurrence (:mod:`k3verify.attnres.layer`)::

    form(embedding, weights, sublayers, *, schedule=Schedule(), <the same options>) -> Walk

Precision model (the same in every form):

- ``stream_dtype``: the dtype sources, parameters, the prefix and every sublayer input and
  output are stored in (default: the inputs' dtype). Values are rounded to it and held in the
  compute dtype (:func:`k3verify.numerics.rounder`), so a bf16 stream is emulated exactly.
- compute dtype: fp64 for an fp64 stream, fp32 otherwise — keys, logits, softmax statistics
  and accumulators (docs/model.md §3: softmax in fp32). fp64 input stays fp64 in every form.
- ``logit_dtype``: the dtype the logits ``ℓ`` (and, in ``tiled``, the exponentials ``P``) are
  stored in; default the compute dtype. ``"bf16"`` is the known-bad variant.
- ``tile`` (sources per tile) and ``subtract_max`` (online softmax with a running maximum; the
  known-bad ``False`` exponentiates raw logits) are used by ``tiled``; the other forms validate
  and ignore them, so one call site can switch forms.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..numerics import compute_dtype, resolve_dtype
from ..numerics.ops import RMS_NORM_EPS
from ..numerics.trace import TracingRounder
from ..numerics.validate import (
    FLOAT_DTYPES,
    require_block,
    require_finite,
    require_float,
    require_on_device,
    require_same,
    require_shape,
    require_tensor,
)


@dataclass(frozen=True)
class Dims:
    """Sizes of one aggregation: ``N`` sources of ``T`` tokens, width ``d``."""

    N: int
    T: int
    d: int


def _optional_dtype(name: str, value: torch.dtype | str | None) -> torch.dtype | None:
    if value is None:
        return None
    dtype = resolve_dtype(value)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be one of fp64, fp32, bf16, fp16, got {value!r}")
    return dtype


@dataclass(frozen=True)
class Options:
    """The keyword options of the common signature, validated on construction."""

    stream_dtype: torch.dtype | str | None = None
    logit_dtype: torch.dtype | str | None = None
    tile: int = 4
    subtract_max: bool = True
    eps: float = RMS_NORM_EPS

    def __post_init__(self) -> None:
        object.__setattr__(self, "stream_dtype", _optional_dtype("stream_dtype", self.stream_dtype))
        object.__setattr__(self, "logit_dtype", _optional_dtype("logit_dtype", self.logit_dtype))
        require_block("tile", self.tile)
        if not isinstance(self.subtract_max, bool):
            raise TypeError(f"subtract_max must be a bool, got {type(self.subtract_max).__name__}")
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)):
            raise TypeError(f"eps must be a number, got {type(self.eps).__name__}")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"eps must be a positive finite number, got {self.eps!r}")

    def precision(self, inputs_dtype: torch.dtype, *, trace: bool = False) -> Precision:
        """The resolved precision for inputs of ``inputs_dtype``."""
        stream = self.stream_dtype or inputs_dtype
        compute = compute_dtype(stream)
        return Precision(stream, compute, self.logit_dtype or compute, TracingRounder(stream, trace=trace))


@dataclass(frozen=True)
class Precision:
    """Where each tensor lives: stream storage, compute (statistics), logit storage.

    ``rounder`` records the first overflows when tracing is on (``rounder.events``).
    """

    stream: torch.dtype
    compute: torch.dtype
    logits: torch.dtype
    rounder: TracingRounder = field(repr=False)

    def store(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` rounded once (from its own precision) to the stream dtype, held in the compute dtype."""
        return self.rounder(name, x).to(self.compute)

    def logit(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` rounded to the logit dtype, held in the compute dtype."""
        return self.rounder(name, x, self.logits).to(self.compute)

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The final result as a tensor of the stream dtype."""
        return self.rounder("output h", x).to(self.stream)


def floats_together(names: Sequence[str], values: Sequence[object]) -> list[torch.Tensor]:
    """Each value a floating tensor, all of one dtype and device; errors name the argument."""
    tensors = [require_tensor(n, t) for n, t in zip(names, values)]
    for n, t in zip(names, tensors):
        require_float(n, t)
        require_on_device(n, t)
    require_same(names, tensors, "dtype")
    require_same(names, tensors, "device")
    return tensors


def check_sources(
    sources: torch.Tensor | Sequence[torch.Tensor], w: torch.Tensor, gamma: torch.Tensor
) -> tuple[torch.Tensor, Dims]:
    """Validate one aggregation; return the sources stacked to ``[N, T, d]`` and the sizes.

    Raises ``TypeError``/``ValueError`` naming the argument for wrong types, shapes, mixed dtypes
    or devices, an empty source list and non-finite values.
    """
    if isinstance(sources, (list, tuple)):
        if not sources:
            raise ValueError("sources is empty; AttnRes needs at least one source")
        names = [f"sources[{i}]" for i in range(len(sources))]
        items = floats_together(names, sources)
        for n, s in zip(names, items):
            if s.dim() != 2:
                raise ValueError(f"{n} has shape {list(s.shape)}; expected [T, d]")
            require_shape(n, s, tuple(items[0].shape), "T,d")
        sources = torch.stack(items)
    names = ["sources", "w", "gamma"]
    tensors = floats_together(names, [sources, w, gamma])
    if sources.dim() != 3:
        raise ValueError(f"sources has shape {list(sources.shape)}; expected [N, T, d]")
    N, T, d = sources.shape
    if N == 0:
        raise ValueError("sources has N = 0 sources; AttnRes needs at least one")
    if d == 0:
        raise ValueError("sources has width d = 0")
    require_shape("w", w, (d,), "d")
    require_shape("gamma", gamma, (d,), "d")
    for n, t in zip(names, tensors):
        require_finite(n, t)
    return sources, Dims(N, T, d)


Sublayers = Callable[[int, torch.Tensor], torch.Tensor]


def prepare_sources(
    sources: torch.Tensor | Sequence[torch.Tensor],
    w: torch.Tensor,
    gamma: torch.Tensor,
    opts: Options,
    *,
    trace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Precision]:
    """Validate an aggregation and bring its inputs into the stream: ``(v, w, gamma, precision)``.

    Sources and parameters arrive in the stream dtype (rounded once from their own precision)
    and are held in the compute dtype.
    """
    v, _ = check_sources(sources, w, gamma)
    prec = opts.precision(v.dtype, trace=trace)
    return prec.store("sources v", v), prec.store("pseudo-query w", w), prec.store("key gain gamma", gamma), prec
