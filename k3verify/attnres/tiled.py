"""Block AttnRes tiled form — online softmax over source tiles, as a fused kernel runs it (docs/model.md §3).

Sources are read in the stream dtype (BF16 in production) ``tile`` at a time; keys and logits
are formed in the compute dtype (fp32) from them, logits are stored in ``logit_dtype``, and the
statistics run online in the compute dtype. Per tile ``I`` of sources::

    ℓ_i = round_L(wᵀ RMSNorm_γ(v_i))                 i ∈ I, stored in the logit dtype L
    m' = max(m, max_I ℓ),   c = e^{m − m'}
    P_i = round_L(e^{ℓ_i − m'})                      the exponentials, stored in L as well
    Z ← c Z + Σ_I P_i,   N ← c N + Σ_I P_i v_i
    h = N / Z                                        (rounded to the stream dtype for output)

A row that has seen nothing has ``m = −∞`` and ``c = e^{−∞} = 0``. The result does not depend
on the tile size in exact arithmetic; in fp64 any two tile sizes agree to ≤ 1e-10.

Known-bad variants, both selectable:

- ``logit_dtype="bf16"``: a logit rounded to BF16 moves by up to half a spacing, an absolute
  error that grows with the logit magnitude (0.25 for ``|ℓ|`` in [64, 128): a 28 % change of a
  weight), while a plain implementation that keeps the fp32 softmax of docs/model.md §3 loses only the rounding
  of the sources and keys.
- ``subtract_max=False``: ``P_i = e^{ℓ_i}`` with no running maximum. ``|ℓ| ≤ ‖w⊙γ‖·sqrt(d)``
  makes it look safe, but it overflows once ``ℓ`` passes ``ln(max)`` of the dtype ``P`` is stored
  in (88.72 for fp32/BF16, 11.09 for FP16) or the row sum passes ``ln(max fp32)``, and gives
  ``0/0`` when every ``P`` of a token underflows (the largest logit below ``ln`` of half the
  smallest subnormal of that dtype: −103.97 fp32, −92.9 BF16, −17.3 FP16).

:func:`overflow_quantities` and :func:`predict` turn these statements into a per-input
prediction of finiteness.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..numerics import exp_fits, facts, ln_max, resolve_dtype, spacing
from ..numerics.frontier import Magnitudes, as_checks, prediction_from, underflow_threshold
from ..numerics.frontier import OverflowPrediction as _Prediction
from ..numerics.frontier import ln_abs_max as _ln_abs_max
from ..numerics.ops import RMS_NORM_EPS
from ..numerics.trace import OverflowEvent
from .chunkwise import two_phase_backward
from .inputs import Options, Precision, Sublayers, check_sources, prepare_sources
from .layer import AttnResWeights, DepthStream, Walk, check_walk, walk
from .recurrent import logits, mix
from .schedule import Call, Schedule, Source

NEG_INF = float("-inf")


def online_mix(
    ell: torch.Tensor, v: torch.Tensor, *, tile: int = 4, subtract_max: bool = True, prec: Precision | None = None
) -> torch.Tensor:
    """Online softmax mixing of ``ℓ:[N, T]`` over ``v:[N, T, d]`` in tiles of ``tile`` sources.

    Works in ``ℓ``'s dtype; with ``prec`` the exponentials are stored in its logit dtype.
    """
    N, T = ell.shape
    m = ell.new_full((T,), NEG_INF if subtract_max else 0.0)
    Z = ell.new_zeros(T)
    acc = torch.zeros_like(v[0])
    for i0 in range(0, N, tile):
        ell_t, v_t = ell[i0:i0 + tile], v[i0:i0 + tile]
        if subtract_max:
            m_new = torch.maximum(m, ell_t.amax(0))
            c = torch.exp(m - m_new)  # 0 on the first tile (m = −inf)
            m = m_new
        else:
            c = torch.ones_like(m)
        p = torch.exp(ell_t - m)
        if prec is not None:
            p = prec.logit("exponentials P", p)
        Z = c * Z + p.sum(0)
        acc = c[:, None] * acc + torch.einsum("nt,ntd->td", p, v_t)
    return acc / Z[:, None]


def _online(v: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor, prec: Precision, opts: Options) -> torch.Tensor:
    # Logits of different sources are independent, so forming them all before the tile loop
    # is the same arithmetic as forming them tile by tile.
    ell = prec.logit("logits ℓ", logits(v, w, gamma, opts.eps))
    return online_mix(ell, v, tile=opts.tile, subtract_max=opts.subtract_max, prec=prec)


def aggregate_tiled(
    sources: torch.Tensor | Sequence[torch.Tensor],
    w: torch.Tensor,
    gamma: torch.Tensor,
    *,
    stream_dtype: torch.dtype | str | None = None,
    logit_dtype: torch.dtype | str | None = None,
    tile: int = 4,
    subtract_max: bool = True,
    eps: float = RMS_NORM_EPS,
) -> torch.Tensor:
    """One AttnRes call by online softmax over tiles. Arguments as in :mod:`k3verify.attnres.inputs`.

    Returns ``h:[T, d]`` in the stream dtype; overflowing tensors become inf/NaN so they show
    in the output (:func:`explain_overflow` says which).
    """
    return aggregate_tiled_traced(sources, w, gamma, stream_dtype=stream_dtype, logit_dtype=logit_dtype, tile=tile,
                                  subtract_max=subtract_max, eps=eps, trace=False)[0]


def aggregate_tiled_traced(
    sources: torch.Tensor | Sequence[torch.Tensor],
    w: torch.Tensor,
    gamma: torch.Tensor,
    *,
    trace: bool = True,
    **options: object,
) -> tuple[torch.Tensor, list[OverflowEvent]]:
    """:func:`aggregate_tiled`'s output and the stored tensors that overflowed, from one run."""
    opts = Options(**options)  # type: ignore[arg-type]
    v, w, gamma, prec = prepare_sources(sources, w, gamma, opts, trace=trace)
    return prec.output(_online(v, w, gamma, prec, opts)), prec.rounder.events


class _TiledMixer(DepthStream):
    def __init__(self, e: torch.Tensor, params: AttnResWeights, schedule: Schedule, prec: Precision, opts: Options):
        super().__init__(e, schedule, prec)
        self.params, self.opts = params, opts

    def mix(self, call: Call) -> tuple[torch.Tensor, tuple[Source, ...]]:
        values, refs = self.sources()
        s = call.index
        return _online(torch.stack(values), self.params.w[s], self.params.gamma[s], self.prec, self.opts), refs


def tiled(
    embedding: torch.Tensor,
    weights: AttnResWeights,
    sublayers: Sublayers,
    *,
    schedule: Schedule | None = None,
    stream_dtype: torch.dtype | str | None = None,
    logit_dtype: torch.dtype | str | None = None,
    tile: int = 4,
    subtract_max: bool = True,
    eps: float = RMS_NORM_EPS,
    trace: bool = False,
) -> Walk:
    """The depth walk with the tiled online softmax for every call, over the stored-block buffer
    and the partial sum. Arguments as in :func:`k3verify.attnres.recurrent`; with ``trace`` the
    walk's ``events`` name the first stored tensors that overflowed."""
    opts = Options(stream_dtype, logit_dtype, tile, subtract_max, eps)
    return walk(embedding, weights, sublayers, schedule or Schedule(), opts, _TiledMixer, trace=trace)


# ----------------------------------------------------------------------------------------------
# Analytic overflow prediction (the same three names in every module package). Each takes the
# positional arguments of either level's forms: ``(sources, w, gamma)`` for one aggregation,
# ``(embedding, weights, sublayers)`` for a walk.


@dataclass(frozen=True)
class OverflowQuantities:
    """Magnitudes an aggregation drives through the tiled form, computed exactly (fp64) from the
    inputs as stored in ``stream_dtype``. ``ln_*`` are natural logs of largest magnitudes.

    ``logit_bound = max ‖w⊙γ‖·sqrt(d)`` bounds every ``|ℓ|`` a priori; the prediction uses the
    realised logits, which reach it only for a source aligned with ``w⊙γ``.
    """

    ln_inputs: dict[str, float]
    ln_sum_squares: float  # ln of the largest Σ_d v² (the RMSNorm's sum, in the compute dtype)
    logit_bound: float
    max_logit: float
    min_logit: float
    min_row_max: float  # smallest over tokens of the largest logit: underflow of the no-max row sum
    max_lse: float  # largest log Σ_i e^{ℓ_i}: the no-max row sum
    ln_weighted: float  # largest ln Σ_i e^{ℓ_i} |v_i|: bounds every no-max accumulator
    ln_output: float
    logits: torch.Tensor  # [N, T] fp64
    output: torch.Tensor  # h [T, d] fp64: the oracle for these stored inputs
    stream_dtype: torch.dtype  # the dtype the inputs were stored in

    def as_dict(self) -> dict[str, object]:
        """The scalar fields (for map cells and reports)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("logits", "output", "stream_dtype")}


@dataclass(frozen=True)
class WalkOverflowQuantities:
    """What bounds a depth walk's softmax before it runs: ``logit_bound = max_s ‖w_s⊙γ_s‖·sqrt(d)``
    over every call's weights as stored in ``stream_dtype`` (every ``|ℓ|`` of the walk is below
    it), and the most sources any call of the schedule mixes."""

    logit_bound: float
    max_sources: int
    stream_dtype: torch.dtype


@dataclass(frozen=True)
class OverflowPrediction(_Prediction):
    """Finite or not, the failing checks and the tightest one (as for Gated MLA), and whether
    rounding may decide: ``near_frontier`` is true when some check is within its rounding band of
    its limit — the logits (and the inputs) are rounded before they are used, by up to half a
    spacing of their dtype, and a value within half a spacing above a format's maximum still
    rounds to it. ``max_logit`` and ``max_lse`` are the aggregation's largest logit and largest
    ``log Σ e^ℓ`` (NaN for a walk, whose prediction uses the a-priori bound).
    """

    near_frontier: bool = False
    max_logit: float = math.nan
    max_lse: float = math.nan


def overflow_quantities(
    first: torch.Tensor | Sequence[torch.Tensor],
    second: torch.Tensor | AttnResWeights,
    third: torch.Tensor | Sublayers,
    *,
    schedule: Schedule | None = None,
    stream_dtype: torch.dtype | str | None = None,
    eps: float = RMS_NORM_EPS,
    **_: object,
) -> OverflowQuantities | WalkOverflowQuantities:
    """What the prediction reads from a call's inputs stored in ``stream_dtype`` (default: their
    own): :class:`OverflowQuantities` of an aggregation ``(sources, w, gamma)``, or
    :class:`WalkOverflowQuantities` of a walk ``(embedding, weights, sublayers)`` on ``schedule``
    (default K3's). The forms' other options do not move it."""
    if isinstance(second, AttnResWeights):
        return _walk_quantities(first, second, third, schedule or Schedule(), stream_dtype)
    v, dims = check_sources(first, second, third)
    stream = resolve_dtype(stream_dtype) if stream_dtype is not None else v.dtype
    prec = Options(stream_dtype=stream, eps=eps).precision(stream)
    # Inputs as the kernel reads them (rounded to the stream), then exact arithmetic.
    v, w, gamma = (prec.rounder("input", t).to(torch.float64) for t in (v, second, third))
    ell = logits(v, w, gamma, eps)
    lse = torch.logsumexp(ell, 0)
    weighted = torch.logsumexp(ell[..., None] + torch.log(v.abs()), 0)  # log(0) = −inf is fine here
    h = mix(ell, v)
    return OverflowQuantities(
        ln_inputs={"sources v": _ln_abs_max(v), "pseudo-query w": _ln_abs_max(w), "key gain gamma": _ln_abs_max(gamma)},
        ln_sum_squares=_ln_abs_max((v * v).sum(-1)),
        logit_bound=float((w * gamma).norm()) * dims.d**0.5,
        max_logit=float(ell.max()) if ell.numel() else -math.inf,
        min_logit=float(ell.min()) if ell.numel() else math.inf,
        min_row_max=float(ell.amax(0).min()) if ell.numel() else math.inf,
        max_lse=float(lse.max()) if lse.numel() else -math.inf,
        ln_weighted=float(weighted.max()) if weighted.numel() else -math.inf,
        ln_output=_ln_abs_max(h),
        logits=ell,
        output=h,
        stream_dtype=stream,
    )


def _walk_quantities(embedding: torch.Tensor, weights: AttnResWeights, sublayers: Sublayers, schedule: Schedule,
                     stream_dtype: torch.dtype | str | None) -> WalkOverflowQuantities:
    check_walk(embedding, weights, sublayers, schedule)
    stream = resolve_dtype(stream_dtype) if stream_dtype is not None else embedding.dtype
    prec = Options(stream_dtype=stream).precision(stream)
    w, gamma = (prec.rounder("input", t).to(torch.float64) for t in (weights.w, weights.gamma))
    bound = float(((w * gamma).norm(dim=-1) * w.shape[-1] ** 0.5).max())
    return WalkOverflowQuantities(bound, schedule.max_sources, stream)


def predict(
    quantities: OverflowQuantities | WalkOverflowQuantities,
    *,
    stream_dtype: torch.dtype | str | None = None,
    logit_dtype: torch.dtype | str | None = None,
    subtract_max: bool = True,
    **_: object,
) -> OverflowPrediction:
    """Will the tiled form with these settings return finite values for these inputs?

    ``stream_dtype`` defaults to the one the quantities were taken in; other options (``tile``,
    ``eps``, ``schedule``) do not move the prediction. For an aggregation:

    Every stored tensor must fit the dtype it is stored in, which also needs the compute dtype
    (fp32) that forms it to hold it (``exp_fits``): the inputs in the stream dtype, the sum of
    squares of the RMSNorm in the compute dtype, the logits in the logit dtype. With max
    subtraction nothing else can overflow (``P ≤ 1``, ``1 ≤ Z ≤ N``, ``|N| ≤ N max|v|``).
    Without it also ``P = e^ℓ`` in the logit dtype (``max ℓ``), the row sum ``Z`` (largest
    log-sum-exp) and the accumulator (``ln Σ e^ℓ |v|``) in the compute dtype, and no token may
    have every ``P`` underflow (its largest logit above ``ln`` of half the smallest subnormal of
    the logit and the compute dtype), else ``Z = 0`` and ``h = 0/0``.

    A check within its rounding band (see :class:`OverflowPrediction`) sets ``near_frontier``.

    For a walk (stand-in sublayers keep the stream at O(1), so only the exponentials can
    overflow): finite with max subtraction; without it, finite iff the a-priori row-sum bound
    ``logit_bound + ln(max sources)`` stays below ``ln max`` of the logit and compute dtypes.
    """
    stream = resolve_dtype(stream_dtype) if stream_dtype is not None else quantities.stream_dtype
    acc = Options(stream_dtype=stream).precision(stream).compute
    logit = resolve_dtype(logit_dtype) if logit_dtype is not None else acc
    if isinstance(quantities, WalkOverflowQuantities):
        return _predict_walk(quantities, logit, acc, subtract_max)
    checks: list[tuple[str, bool, float, float]] = []  # (what, passes, headroom, band), in ln units

    def fits(what: str, ln_value: float, dtype: torch.dtype, band: float) -> None:
        limit = min(ln_max(dtype), ln_max(acc))
        ok = exp_fits(ln_value, dtype, compute_dtype=acc)
        room = limit - ln_value if not math.isnan(ln_value) else -math.inf
        checks.append((f"{what} (ln {ln_value:.2f} vs ln max {facts(dtype).name} {limit:.2f})", ok, room, band))

    def relative(dtype: torch.dtype) -> float:  # a stored magnitude: its own rounding, plus fp32 noise
        return 2 * facts(dtype).unit_roundoff + 2.0**-20

    def exponent(value: float) -> float:  # an exponent that is a rounded logit: half its spacing
        top = torch.tensor([abs(value) if math.isfinite(value) else 0.0], dtype=torch.float64)
        return float(spacing(top, logit)[0]) / 2 + 1e-5 * max(1.0, abs(value))

    q = quantities
    for name, value in q.ln_inputs.items():
        fits(f"input {name}", value, stream, relative(stream))
    fits("sum of squares Σ v² of the key norm", q.ln_sum_squares, acc, relative(acc))
    biggest = max(abs(q.max_logit), abs(q.min_logit))
    fits("logits |ℓ|", math.log(biggest) if biggest > 0 else -math.inf, logit, relative(logit))
    if not subtract_max:
        fits("P = exp(ℓ) without max subtraction", q.max_logit, logit, exponent(q.max_logit))
        fits("row sum Z = Σ exp(ℓ)", q.max_lse, acc, exponent(q.max_logit))
        fits("accumulator Σ exp(ℓ) v", q.ln_weighted, acc, exponent(q.max_logit))
        floor = max(underflow_threshold(logit), underflow_threshold(acc))
        checks.append((f"row sum underflow (smallest row max {q.min_row_max:.2f} vs ln(min subnormal/2) "
                       f"{floor:.2f}; Z = 0 gives 0/0)", q.min_row_max > floor, q.min_row_max - floor,
                       exponent(q.min_row_max)))
    fits("output h", q.ln_output, stream, relative(stream))
    failing = tuple(what for what, ok, _, _ in checks if not ok)
    what, _, room, _ = min(checks, key=lambda c: c[2])
    near = any(abs(room_i) <= band for _, _, room_i, band in checks)
    return OverflowPrediction(finite=not failing, reasons=failing, binding=what, headroom=room, near_frontier=near,
                              max_logit=q.max_logit, max_lse=q.max_lse)


def _predict_walk(q: WalkOverflowQuantities, logit: torch.dtype, acc: torch.dtype,
                  subtract_max: bool) -> OverflowPrediction:
    if subtract_max:
        return OverflowPrediction(True, (), f"max subtraction keeps every P <= 1 (logit bound {q.logit_bound:.2f})",
                                  math.inf)
    limit = min(ln_max(logit), ln_max(acc))
    value = q.logit_bound + math.log(q.max_sources)
    what = (f"no-max row sum: logit bound max ‖w⊙γ‖·sqrt(d) {q.logit_bound:.2f} + ln({q.max_sources} sources) "
            f"= {value:.2f} vs ln max {limit:.2f}")
    finite = value < limit
    return OverflowPrediction(finite, () if finite else (what,), what, limit - value)


def explain_logit_rounding(q: OverflowQuantities, logit_dtype: torch.dtype | str) -> list[str]:
    """For the known-bad ``logit_dtype`` variant: how far its largest logit moves when stored in
    ``logit_dtype`` (half a spacing at ``|ℓ|``, an absolute error in the exponent of a weight)."""
    peak = max(abs(q.max_logit), abs(q.min_logit))

    def half_spacing(dtype: torch.dtype | str) -> float:
        return float(spacing(torch.tensor([peak], dtype=torch.float64), dtype)[0]) / 2

    half, name = half_spacing(logit_dtype), facts(resolve_dtype(logit_dtype)).name
    return [f"logits stored in {name}: |logit| reaches {peak:.3g}, where a rounding moves it by up to {half:.3g}, "
            f"so a mixing weight e^logit by up to {100 * math.expm1(half):.2f} % (with fp32 logits: "
            f"{100 * math.expm1(half_spacing(torch.float32)):.1e} %)"]


def explain_overflow(
    first: torch.Tensor | Sequence[torch.Tensor],
    second: torch.Tensor | AttnResWeights,
    third: torch.Tensor | Sublayers,
    **options: object,
) -> list[str]:
    """One line per stored tensor that overflowed in the tiled form, in the order computed: of
    :func:`aggregate_tiled` for ``(sources, w, gamma)``, of :func:`tiled` (the first overflows of
    the walk) for ``(embedding, weights, sublayers)``."""
    if isinstance(second, AttnResWeights):
        events = tiled(first, second, third, trace=True, **options).events  # type: ignore[arg-type]
    else:
        events = aggregate_tiled_traced(first, second, third, **options)[1]
    return [e.describe() for e in events]


# --- the backward's overflow model (one call) ---------------------------------------------------


def aggregate_backward_traced(sources: torch.Tensor | Sequence[torch.Tensor], w: torch.Tensor, gamma: torch.Tensor,
                              *, dh: torch.Tensor, delta: str = "weights",
                              **options: object) -> tuple[dict[str, torch.Tensor], list[OverflowEvent]]:
    """:func:`~k3verify.attnres.chunkwise.aggregate_backward`'s gradients and the stored tensors
    that overflowed, from one run."""
    opts = Options(**options)  # type: ignore[arg-type]
    v, w, gamma, prec = prepare_sources(sources, w, gamma, opts, trace=True)
    grads = two_phase_backward(v, w, gamma, dh.to(v.dtype), opts.eps, cast=prec.store, delta=delta)
    return grads, prec.rounder.events


@dataclass(frozen=True)
class BackwardOverflowQuantities:
    """What the two-phase backward stores, measured exactly (fp64) on the inputs as a kernel reads
    them in ``stream_dtype`` (``stored``: the inputs, ``h``, ``dh`` and ``dsources`` in the stream,
    the parameters' gradients in fp32), the gradients of that pass and the forward's quantities."""

    stored: Magnitudes
    gradients: dict[str, torch.Tensor]
    forward: OverflowQuantities


def backward_overflow_quantities(sources: torch.Tensor | Sequence[torch.Tensor], w: torch.Tensor, gamma: torch.Tensor,
                                 *, dh: torch.Tensor, stream_dtype: torch.dtype | str | None = None,
                                 eps: float = RMS_NORM_EPS, **_: object) -> BackwardOverflowQuantities:
    """:class:`BackwardOverflowQuantities` of a call whose stream is ``stream_dtype`` (default: the
    sources' dtype); the forms' other options do not move it."""
    forward = overflow_quantities(sources, w, gamma, stream_dtype=stream_dtype, eps=eps)
    v, _ = check_sources(sources, w, gamma)
    prec = Options(stream_dtype=forward.stream_dtype, eps=eps).precision(forward.stream_dtype)
    seen = Magnitudes()
    v, w, gamma, dh = (seen(name, prec.rounder("input", t).to(torch.float64), "stream")
                       for name, t in (("sources v", v), ("pseudo-query w", w), ("key gain gamma", gamma),
                                       ("input dh", dh)))
    grads = two_phase_backward(v, w, gamma, dh, eps, cast=seen.hook("stream"))
    for name in ("dw", "dgamma"):
        seen(f"gradient {name}", grads[name], "accumulator")
    return BackwardOverflowQuantities(seen, grads, forward)


def predict_backward(q: BackwardOverflowQuantities, *, stream_dtype: torch.dtype | str | None = None,
                     logit_dtype: torch.dtype | str | None = None, **_: object) -> _Prediction:
    """Will the two-phase backward return finite gradients for these inputs? The forward's checks
    with max subtraction (the backward's weights are ``e^{ℓ − M} / Z'``) and every stored tensor
    against its dtype: the stream dtype for ``h``, ``dh``, ``dsources`` and the inputs, fp32 for
    the parameters' gradients."""
    stream = resolve_dtype(stream_dtype) if stream_dtype is not None else q.forward.stream_dtype
    acc = Options(stream_dtype=stream).precision(stream).compute
    forward = predict(q.forward, stream_dtype=stream, logit_dtype=logit_dtype, subtract_max=True)
    return prediction_from([*as_checks(forward), *q.stored.checks({"stream": stream, "accumulator": acc}, acc)])
