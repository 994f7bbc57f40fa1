"""KDA tiled low-precision form — what a tensor-core kernel computes (docs/model.md §1.6).

The chunkwise algebra of :mod:`k3verify.kda.chunkwise`, with each chunk of ``C`` tokens
split into sub-tiles of ``BC`` rows and every matrix-product operand rounded to
``operand_dtype`` (bf16, fp16, fp8 e4m3/e5m2, fp32, or fp64 for an exact run) while products
accumulate in fp32 (fp64 for fp64 operands). Exponentials are evaluated in the accumulator
dtype, as kernels do, before the product with ``q`` or ``k`` is rounded.

Off-diagonal tiles use the prefix at the query tile's start, so both factors are ``<= 1``.
A diagonal tile splits ``exp(G_i - G_j) = exp(G_i - a) * exp(a - G_j)`` at an anchor ``a``:

``tile_start``
    the prefix at the tile's start boundary (K3 paper). Key factors reach
    ``exp(BC * |g_min|)``: 80 natural-log units at ``BC = 16, g_min = -5``.
``tile_middle``
    the inclusive prefix of row ``BC // 2`` (FLA up to mid-2026). Rows before it read a
    *future* token's gate, so rounding leaks the future into the past (FLA issue #1240).
    Rows past the end of the sequence read the zero-padded gates.
``row0_shift``
    the inclusive prefix of row 0 minus ``anchor_shift * (BC - 1) / 2`` (fla-core 0.6.0,
    ``fla/ops/kda/chunk_intra.py``: shift 2 unless a lower bound is passed to the intra kernel).

``diagonal="fp32"`` instead forms diagonal tiles element by element in fp32 with no split
(Kimi Linear's CUDA-core path), which cannot overflow.

``prefix`` says how the chunk-local prefix ``G`` is summed in the accumulator dtype
(:func:`k3verify.numerics.ops.prefix_sum`): ``rounded`` (each prefix correctly rounded, the
default), ``sequential`` (row after row) or ``parallel`` (the shape of a GPU scan such as
Triton's ``tl.cumsum``, whose fp32 rounding roughly doubles an fp32 kernel's error).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial

import torch

from ..numerics import compare, dtype_name, exp_fits, is_float8, ln_max, resolve_dtype
from ..numerics.frontier import OverflowPrediction as _Prediction
from ..numerics.frontier import ln_abs_max
from ..numerics.ops import prefix_sum, require_prefix_order
from ..numerics.rounding import OVERFLOW_MODES
from ..numerics.trace import OverflowEvent, TracingRounder
from ..numerics.validate import require_block
from .chunkwise import Emulation, backward, decayed_products, tile_start_prefix, wy_pipeline
from .gate import InKernelGate
from .inputs import Dims, check_inputs, from_chunks, initial, sequence_bounds, to_chunks

ANCHORS = ("tile_start", "tile_middle", "row0_shift")
DIAGONALS = ("matmul", "fp32")
# How the backward's split diagonal products round their operands: "bf16x3" to fp32's precision
# (three bf16 products; fla-core 0.6.0, chunk_kda_bwd_kernel_intra with safe_gate, passes
# input_precision="bf16x3" there), "operand" to the operand dtype like the forward's diagonal.
BACKWARD_DIAGONALS = ("bf16x3", "operand")
# fla-core 0.6.0 chunk_kda does not pass lower_bound to its intra kernel, which then shifts
# by 2 natural-log units per row (fla/ops/kda/chunk_intra.py, chunk_kda_fwd_intra).
DEFAULT_ROW0_SHIFT = 2.0


@dataclass(frozen=True)
class TileConfig:
    """Tiling and precision of one tiled run; validated on construction."""

    chunk_size: int = 64
    tile: int = 16
    operand_dtype: torch.dtype = torch.bfloat16
    anchor: str = "tile_start"
    anchor_shift: float = DEFAULT_ROW0_SHIFT
    diagonal: str = "matmul"
    overflow: str = "nonfinite"
    prefix: str = "rounded"
    backward_diagonal: str = "bf16x3"

    def __post_init__(self) -> None:
        require_block("chunk_size", self.chunk_size)
        require_block("tile", self.tile)
        if self.chunk_size % self.tile:
            raise ValueError(f"tile {self.tile} must divide chunk_size {self.chunk_size}")
        object.__setattr__(self, "operand_dtype", resolve_dtype(self.operand_dtype))
        if self.anchor not in ANCHORS:
            raise ValueError(f"unknown anchor {self.anchor!r}; choose one of {', '.join(ANCHORS)}")
        if self.diagonal not in DIAGONALS:
            raise ValueError(f"unknown diagonal path {self.diagonal!r}; choose one of {', '.join(DIAGONALS)}")
        if self.overflow not in OVERFLOW_MODES:
            raise ValueError(f"overflow must be one of {OVERFLOW_MODES}, got {self.overflow!r}")
        require_prefix_order(self.prefix)
        if self.backward_diagonal not in BACKWARD_DIAGONALS:
            raise ValueError(f"unknown backward_diagonal {self.backward_diagonal!r}; "
                             f"choose one of {', '.join(BACKWARD_DIAGONALS)}")
        if not math.isfinite(self.anchor_shift) or self.anchor_shift < 0:
            raise ValueError(f"anchor_shift must be finite and >= 0, got {self.anchor_shift}")

    @classmethod
    def of(cls, tiling: Mapping[str, object]) -> TileConfig:
        """The config named by ``tiling``'s own fields; other keys (a row's ``chunk_size`` beside
        its label, say) are ignored, as the predictions take a row's whole tiling."""
        return cls(**{k: v for k, v in tiling.items() if k in cls.__dataclass_fields__})  # type: ignore[arg-type]

    @property
    def accumulator(self) -> torch.dtype:
        """fp64 for an exact fp64 run, fp32 (the tensor-core accumulator) otherwise."""
        return torch.float64 if self.operand_dtype == torch.float64 else torch.float32

    @property
    def output_dtype(self) -> torch.dtype:
        """Kernels write fp8 runs' outputs in bf16, all others in the operand dtype."""
        return torch.bfloat16 if is_float8(self.operand_dtype) else self.operand_dtype


def _axes(name: str) -> tuple[str, ...]:
    """Index axes of each traced operand (see where they are cast in this module and chunkwise)."""
    if "diagonal" in name:
        return ("batch", "head", "chunk", "tile")
    if name.startswith(("input", "output")):
        return ("batch", "token", "head")
    if name in ("state", "pseudo-values V~", "state gradient", "pseudo-value gradient"):
        return ("batch", "head")  # cast per chunk inside the state pass
    return ("batch", "head", "chunk", "row")


def _caster(cfg: TileConfig, *, trace: bool = False, underflow: bool = True,
            keep: frozenset[str] = frozenset()) -> TracingRounder:
    return TracingRounder(cfg.operand_dtype, overflow=cfg.overflow, trace=trace, axes=_axes, underflow=underflow,
                          keep=keep)


def tiled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    tile: int = 16,
    operand_dtype: torch.dtype | str = torch.bfloat16,
    anchor: str = "tile_start",
    anchor_shift: float = DEFAULT_ROW0_SHIFT,
    diagonal: str = "matmul",
    overflow: str = "nonfinite",
    prefix: str = "rounded",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tiled low-precision KDA. Shapes as in :mod:`k3verify.kda.inputs`.

    Returns ``o:[B,T,H,V]`` in :attr:`TileConfig.output_dtype` and the final state in the
    accumulator dtype. Overflowing operands become inf/NaN (``overflow="nonfinite"``) so they
    show in the output; :func:`explain_overflow` says which operand and where.
    """
    cfg = TileConfig(chunk_size, tile, operand_dtype, anchor, anchor_shift, diagonal, overflow, prefix)
    dims, scale = check_inputs(q, k, v, g, beta, initial_state, scale)
    o, S = _tiled(q, k, v, g, beta, scale, initial_state, dims, cfg, _caster(cfg))
    return o, (S if output_final_state else None)


def tiled_traced(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    **tiling: object,
) -> tuple[torch.Tensor, list[OverflowEvent]]:
    """:func:`tiled`'s output together with every operand that overflowed, in computing order.

    ``tiling`` takes the keyword arguments of :class:`TileConfig`.
    """
    o, caster = _run_traced(q, k, v, g, beta, scale, initial_state, tiling)
    return o, caster.events


def _run_traced(q, k, v, g, beta, scale: float | None, initial_state: torch.Tensor | None,
                tiling: dict[str, object]) -> tuple[torch.Tensor, TracingRounder]:
    """:func:`tiled` with a tracing rounder, which comes back with the output."""
    cfg = TileConfig(**tiling)  # type: ignore[arg-type]
    dims, scale = check_inputs(q, k, v, g, beta, initial_state, scale)
    caster = _caster(cfg, trace=True)
    o, _ = _tiled(q, k, v, g, beta, scale, initial_state, dims, cfg, caster)
    return o, caster


def overflow_events(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, **kwargs: object
) -> list[OverflowEvent]:
    """The overflow events of :func:`tiled_traced` alone (same arguments)."""
    return tiled_traced(q, k, v, g, beta, **kwargs)[1]  # type: ignore[arg-type]


def _fp32_arguments(q, k, v, g, beta, kwargs: dict[str, object]) -> tuple[list, dict[str, object]]:
    """The inputs and keyword arguments of an explanation, in fp32 (``output_final_state`` dropped)."""
    f32 = [t.float() if isinstance(t, torch.Tensor) else t for t in (q, k, v, g, beta)]
    kwargs = dict(kwargs)
    kwargs.pop("output_final_state", None)
    state = kwargs.get("initial_state")
    if isinstance(state, torch.Tensor):
        kwargs["initial_state"] = state.float()
    return f32, kwargs


def explain_overflow(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, **kwargs: object
) -> list[str]:
    """Each operand that overflowed in :func:`tiled` (same arguments, computed in fp32): which,
    where (batch, head, chunk, tile) and by how much, one line each, in computing order."""
    f32, kwargs = _fp32_arguments(q, k, v, g, beta, kwargs)
    return [e.describe() for e in overflow_events(*f32, **kwargs)]


def explain_underflow(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, **kwargs: object
) -> list[str]:
    """Each operand of :func:`tiled` (same arguments, computed in fp32) some of whose non-zero
    values fell into the operand dtype's subnormal range: the diagonal tile's split operands
    first, then the others, each group by the largest share. The split is where an underflow
    costs: with a tile-start anchor the queries are scaled by ``e^(G_t - G_0)``, which strong
    decay takes below the smallest normal of fp8 or fp16 (or of bf16 on a long tile), and their
    partner, the key scaled by ``e^(G_0 - G_s)``, is large, so the lost bits reach the output.
    Elsewhere an underflowed value is mostly a contribution already negligible."""
    f32, kwargs = _fp32_arguments(q, k, v, g, beta, kwargs)
    scale, state = kwargs.pop("scale", None), kwargs.pop("initial_state", None)
    _, caster = _run_traced(*f32, scale, state, kwargs)
    ranked = sorted(caster.underflows.values(), key=lambda e: (not e.operand.startswith("diagonal"), -e.fraction))
    return [e.describe() for e in ranked]


def _tiled(q, k, v, g, beta, scale: float, initial_state, dims: Dims, cfg: TileConfig, cast: TracingRounder):
    acc = cfg.accumulator
    S = initial(initial_state, dims, acc, q.device)
    if dims.T == 0:
        return v.new_zeros(dims.B, 0, dims.H, dims.V).to(cfg.output_dtype), S
    # Kernel inputs arrive in the operand dtype; gates arrive in the accumulator dtype.
    qc, kc, vc = (to_chunks(cast("input " + n, t.to(acc)), cfg.chunk_size) for n, t in (("q", q), ("k", k), ("v", v)))
    bc = to_chunks(cast("input beta", beta.to(acc))[..., None], cfg.chunk_size)[..., 0]
    G = prefix_sum(to_chunks(g.to(acc), cfg.chunk_size), -2, cfg.prefix)  # [B,H,N,C,K]
    O, S = wy_pipeline(qc, kc, vc, bc, G, _intra_chunk(qc, kc, G, cfg, cast), S, scale, cast=cast)
    return from_chunks(O, dims.T).to(cfg.output_dtype), S


def _intra_chunk(qc, kc, G, cfg: TileConfig, cast: TracingRounder) -> dict[str, torch.Tensor]:
    """``A_qk`` (unscaled, diagonal kept) and ``A_kk`` (unmasked) for every chunk."""
    if cfg.diagonal == "fp32":
        # Operands are already rounded inputs; the decays stay in the accumulator.
        return decayed_products({"q": qc, "k": kc}, kc, G, tile=cfg.tile, cast=cast)
    lead = G.shape[:-2]
    Gt = G.reshape(*lead, cfg.chunk_size // cfg.tile, cfg.tile, G.shape[-1])
    anchor = diagonal_anchor(Gt, cfg.anchor, cfg.anchor_shift)
    return decayed_products({"q": qc, "k": kc}, kc, G, tile=cfg.tile, cast=cast, diagonal_anchor=anchor)


def diagonal_anchor(Gt: torch.Tensor, anchor: str, shift: float = DEFAULT_ROW0_SHIFT) -> torch.Tensor:
    """Anchor prefix of each diagonal tile: ``Gt:[..., nT, BC, D] -> [..., nT, D]``.

    ``Gt`` holds the inclusive chunk-local prefixes of each tile's rows.
    """
    BC = Gt.shape[-2]
    if anchor == "tile_start":
        return tile_start_prefix(Gt)
    if anchor == "tile_middle":
        return Gt[..., BC // 2, :]
    if anchor == "row0_shift":
        return Gt[..., 0, :] - shift * (BC - 1) / 2
    raise ValueError(f"unknown anchor {anchor!r}; choose one of {', '.join(ANCHORS)}")


def max_log_factor(g_min: float, *, tile: int, anchor: str, anchor_shift: float = DEFAULT_ROW0_SHIFT) -> float:
    """Largest ``ln`` of a diagonal-tile factor when every gate equals ``g_min`` (docs/model.md §1.6).

    ``tile_start``: ``BC |g_min|``; ``tile_middle``: ``max(m, BC - 1 - m) |g_min|`` with
    ``m = BC // 2``; ``row0_shift``: ``max(d, (BC - 1) |g_min| - d)``, ``d = shift (BC - 1) / 2``.
    Off-diagonal and inter-chunk factors never exceed 1.
    """
    span = abs(g_min)
    if anchor == "tile_start":
        return tile * span
    if anchor == "tile_middle":
        m = tile // 2
        return max(m, tile - 1 - m) * span
    if anchor == "row0_shift":
        d = anchor_shift * (tile - 1) / 2
        return max(d, (tile - 1) * span - d)
    raise ValueError(f"unknown anchor {anchor!r}; choose one of {', '.join(ANCHORS)}")


def predicted_finite(
    g_min: float,
    *,
    tile: int,
    operand_dtype: torch.dtype | str,
    anchor: str,
    anchor_shift: float = DEFAULT_ROW0_SHIFT,
    diagonal: str = "matmul",
) -> bool:
    """docs/model.md §1.6's frontier for unit-magnitude ``q``/``k`` entries and gates at ``g_min``.

    True when no diagonal factor can overflow the fp32 exponential or the operand dtype.
    The ``fp32`` diagonal path never splits, so it is always finite.
    """
    if diagonal == "fp32":
        return True
    return exp_fits(max_log_factor(g_min, tile=tile, anchor=anchor, anchor_shift=anchor_shift), operand_dtype)


def realized_log_magnitudes(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    *,
    chunk_size: int = 64,
    tile: int = 16,
    anchor: str = "tile_start",
    anchor_shift: float = DEFAULT_ROW0_SHIFT,
) -> tuple[float, float]:
    """``(max exponent, max ln|operand|)`` over the diagonal-tile operands of these inputs.

    The same frontier as :func:`max_log_factor`, evaluated on the actual gates and the actual
    ``q``/``k`` magnitudes in fp64: the exponent decides the fp32 ``exp``, the operand
    magnitude decides the cast to the operand dtype.
    """
    cfg = TileConfig(chunk_size, tile, torch.float64, anchor, anchor_shift)
    G = to_chunks(g.to(torch.float64), chunk_size).cumsum(-2)
    lead = G.shape[:-2]
    Gt = G.reshape(*lead, chunk_size // tile, tile, G.shape[-1])
    a = diagonal_anchor(Gt, cfg.anchor, cfg.anchor_shift)[..., None, :]
    exponents, logs = [], []
    for x, e in ((q, Gt - a), (k, a - Gt)):
        xt = to_chunks(x.to(torch.float64), chunk_size).reshape(Gt.shape)
        exponents.append(float(e.max()))
        logs.append(float((torch.log(xt.abs()) + e).max()))
    return max(exponents), max(logs)


def predicted_finite_for(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, **tiling: object) -> bool:
    """:func:`realized_log_magnitudes` against the fp32 exponential and the operand dtype."""
    cfg = TileConfig(**tiling)  # type: ignore[arg-type]
    if cfg.diagonal == "fp32":
        return True
    exponent, log_operand = realized_log_magnitudes(
        q, k, g, chunk_size=cfg.chunk_size, tile=cfg.tile, anchor=cfg.anchor, anchor_shift=cfg.anchor_shift
    )
    return exp_fits(exponent, torch.float32) and exp_fits(log_operand, cfg.operand_dtype)


# --- the backward (docs/model.md §1.9) -------------------------------------------------------


def tiled_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    do: torch.Tensor,
    dht: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    gate: InKernelGate | None = None,
    **tiling: object,
) -> dict[str, torch.Tensor]:
    """The chunkwise backward as a tensor-core kernel computes it: :func:`chunkwise_backward`'s
    algebra with every matrix-product operand (and the inputs and cotangents) rounded to the
    operand dtype, fp32 accumulation, and the diagonal tiles split at the forward's anchor.

    Arguments as :func:`chunkwise_backward`; ``tiling`` takes :class:`TileConfig`'s. Returns the
    gradients by name: ``dq, dk, dv, dbeta`` stored in :attr:`TileConfig.output_dtype`, ``dg,
    dh0`` (and the gate's ``dA_log, ddt_bias``) in the accumulator dtype, as kernels write them.
    """
    return _backward_run(q, k, v, g, beta, do, dht, scale, initial_state, cu_seqlens, gate, tiling, trace=False)[0]


def tiled_backward_traced(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, **kwargs: object
) -> tuple[dict[str, torch.Tensor], list[OverflowEvent]]:
    """:func:`tiled_backward`'s gradients with every operand or split product that overflowed,
    in computing order (the forward's recomputed operands first)."""
    known = ("do", "dht", "scale", "initial_state", "cu_seqlens", "gate")
    a = {n: kwargs.pop(n, None) for n in known}
    grads, caster = _backward_run(q, k, v, g, beta, *a.values(), kwargs, trace=True)
    return grads, caster.events


def explain_backward_underflow(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, **kwargs: object
) -> list[str]:
    """Each operand of :func:`tiled_backward` (same arguments) some of whose non-zero values fell
    into the operand dtype's subnormal range, by the largest share: where a finite gradient lost
    bits it had (fp16's smallest normal is 6.1e-5, and strong decay takes the decayed keys,
    queries and state cotangents below it)."""
    known = ("do", "dht", "scale", "initial_state", "cu_seqlens", "gate")
    a = {n: kwargs.pop(n, None) for n in known}
    _, caster = _backward_run(q, k, v, g, beta, *a.values(), kwargs, trace=True, underflow=True)
    return [e.describe() for e in sorted(caster.underflows.values(), key=lambda e: -e.fraction)]


def attribute_backward_error(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    reference: Mapping[str, torch.Tensor], gradients: tuple[str, ...] | None = None, share: float = 0.5,
    **kwargs: object,
) -> list[str]:
    """Which rounding costs a finite gradient its precision: :func:`tiled_backward` (same
    arguments) run once per operand it rounds below fp32, with that operand alone left unrounded;
    a line for each operand whose rounding holds at least ``share`` of a gradient's RMS error
    against ``reference`` (gradients by name, fp64: the exact backward), largest first. An
    operand can cost far more than its own rounding where a gradient is a small difference of
    large terms: ``dg`` is the reverse prefix sum of ``q * dq - k * dk``."""
    known = ("do", "dht", "scale", "initial_state", "cu_seqlens", "gate")
    a = {n: kwargs.pop(n, None) for n in known}
    grads, caster = _backward_run(q, k, v, g, beta, *a.values(), dict(kwargs), trace=True)
    names = tuple(reference if gradients is None else gradients)

    def errors(out: Mapping[str, torch.Tensor]) -> dict[str, float]:
        return {n: compare(out[n].to(torch.float64), reference[n], ulp_dtype="fp32").rms_ratio
                for n in names if n in out}

    full = errors(grads)
    found = []
    for operand, dtype in caster.narrowed.items():
        kept = errors(_backward_run(q, k, v, g, beta, *a.values(), dict(kwargs), trace=False,
                                    keep=frozenset({operand}))[0])
        for n, err in full.items():
            if math.isfinite(err) and err > 0 and (err - kept[n]) >= share * err:
                found.append((1 - kept[n] / err, f"{n}: rms error {err:.3e}, {kept[n]:.3e} with {operand} left "
                                                 f"unrounded ({dtype_name(dtype)}): its rounding holds "
                                                 f"{1 - kept[n] / err:.0%} of the error"))
    return [line for _, line in sorted(found, key=lambda f: -f[0])]


def _backward_run(q, k, v, g, beta, do, dht, scale, initial_state, cu_seqlens, gate, tiling: dict[str, object],
                  *, trace: bool, underflow: bool = False,
                  keep: frozenset[str] = frozenset()) -> tuple[dict[str, torch.Tensor], TracingRounder]:
    cfg = TileConfig(**tiling)  # type: ignore[arg-type]
    if do is None:
        raise TypeError("tiled_backward needs the output's cotangent do")
    cast = _caster(cfg, trace=trace, underflow=underflow, keep=keep)
    grads = backward(q, k, v, g, beta, do=do, dht=dht, scale=scale, initial_state=initial_state,
                     chunk_size=cfg.chunk_size, cu_seqlens=cu_seqlens, gate=gate, dtype=cfg.accumulator,
                     emulation=backward_emulation(cfg, cast))
    return grads, cast


def backward_emulation(cfg: TileConfig, cast: TracingRounder) -> Emulation:
    """The rounding of :func:`tiled_backward` under ``cfg``: operands through ``cast``, the split
    diagonal products' operands at ``cfg.backward_diagonal``'s precision and their results checked
    in the accumulator, the prefixes summed in ``cfg.prefix`` order."""
    acc = cfg.accumulator
    stored = set(STORED_IN_OUTPUT_DTYPE)
    split_dtype = cfg.operand_dtype if cfg.backward_diagonal == "operand" else acc
    return Emulation(
        cast=cast,
        split=lambda name, t: cast(name, t, split_dtype),
        accumulate=lambda name, t: cast(name, t, acc),
        tile=cfg.tile,
        anchor=None if cfg.diagonal == "fp32" else partial(diagonal_anchor, anchor=cfg.anchor,
                                                              shift=cfg.anchor_shift),
        prefix=partial(prefix_sum, dim=-2, order=cfg.prefix),
        outputs=lambda name, t: cast(f"output {name}", t, cfg.output_dtype) if name in stored else t,
    )


# Gradients a kernel writes in its input dtype; dg and dh0 stay in the accumulator dtype.
STORED_IN_OUTPUT_DTYPE = ("dq", "dk", "dv", "dbeta")


# --- the overflow model (the same three names in every module package) -----------------------


@dataclass(frozen=True)
class OverflowQuantities:
    """What KDA's frontier reads from a call's inputs: ``q``, ``k`` and the log-decays ``g`` in fp64."""

    q: torch.Tensor
    k: torch.Tensor
    g: torch.Tensor


@dataclass(frozen=True)
class OverflowPrediction(_Prediction):
    """The frontier on the realized gates, with the largest diagonal exponent and ln|operand| it
    met, and docs/model.md §1.6's bound evaluated at the smallest gate (``bound_finite``)."""

    max_exponent: float = 0.0
    max_log_operand: float = 0.0
    bound_finite: bool = True


def overflow_quantities(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        **_: object) -> OverflowQuantities:
    """The inputs the frontier reads (the call's other arguments do not move it)."""
    return OverflowQuantities(q.to(torch.float64), k.to(torch.float64), g.to(torch.float64))


def predict(quantities: OverflowQuantities, **tiling: object) -> OverflowPrediction:
    """Finite iff every diagonal-tile exponent fits the fp32 exponential and every ln|operand|
    fits the operand dtype, on these inputs (``tiling``: the arguments of :class:`TileConfig`;
    others are ignored). The fp32 diagonal path never splits and is always finite."""
    cfg = TileConfig.of(tiling)
    q, k, g = quantities.q, quantities.k, quantities.g
    g_min = float(g.min()) if g.numel() else 0.0
    bound = predicted_finite(g_min, tile=cfg.tile, operand_dtype=cfg.operand_dtype, anchor=cfg.anchor,
                             anchor_shift=cfg.anchor_shift, diagonal=cfg.diagonal)
    if cfg.diagonal == "fp32":
        return OverflowPrediction(True, (), "fp32 diagonal path: no split exponentials", math.inf, bound_finite=bound)
    exponent, log_operand = realized_log_magnitudes(q, k, g, chunk_size=cfg.chunk_size, tile=cfg.tile,
                                                    anchor=cfg.anchor, anchor_shift=cfg.anchor_shift)
    dt = dtype_name(cfg.operand_dtype)
    checks = (("largest diagonal exponent vs ln(max fp32)", exponent, ln_max("fp32")),
              (f"largest ln|operand| vs ln(max {dt})", log_operand, ln_max(cfg.operand_dtype)))
    failing = tuple(f"{what}: {value:.2f} >= {limit:.2f}" for what, value, limit in checks if value >= limit)
    what, value, limit = min(checks, key=lambda c: c[2] - c[1])
    return OverflowPrediction(not failing, failing, what, limit - value, max_exponent=exponent,
                              max_log_operand=log_operand, bound_finite=bound)


# --- the backward's overflow model (docs/model.md §1.9) ------------------------------------------


@dataclass(frozen=True)
class BackwardOverflowQuantities:
    """What the backward's frontier reads, per sequence, in fp64: ``q, k`` and the log-decays
    ``g`` (``[B, T, H, K]``), the cotangents ``D_q = scale dA_qk`` and ``D_k = Diag(beta) dA_kk``
    of the decayed products (``[B, H, N, C, C]`` at ``chunk_size``), and the largest ln|do|, ln|dht|;
    ``gradients``, the exact fp64 backward's they were read from (a map's reference, made once)."""

    sequences: tuple[tuple[torch.Tensor, ...], ...]
    chunk_size: int
    ln_upstream: float
    gradients: Mapping[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class BackwardOverflowPrediction(_Prediction):
    """The backward's checks on the realized inputs: the forward's (its operands are recomputed),
    the upstream gradients and the products' cotangents in the operand dtype, and the diagonal
    tiles' split products in the fp32 accumulator (``max_log_product``)."""

    max_exponent: float = 0.0
    max_log_operand: float = 0.0
    max_log_product: float = 0.0


def backward_overflow_quantities(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, *, do: torch.Tensor, dht: torch.Tensor | None = None,
                                 scale: float | None = None, initial_state: torch.Tensor | None = None,
                                 cu_seqlens: torch.Tensor | None = None, gate: InKernelGate | None = None,
                                 chunk_size: int = 64, **_: object) -> BackwardOverflowQuantities:
    """The quantities of :class:`BackwardOverflowQuantities`, from the exact fp64 backward."""
    f64 = [t.to(torch.float64) for t in (q, k, v, g, beta)]
    record: dict[str, list[torch.Tensor]] = {}
    grads = backward(*f64, do=do.to(torch.float64), dht=None if dht is None else dht.to(torch.float64), scale=scale,
             initial_state=None if initial_state is None else initial_state.to(torch.float64),
             chunk_size=chunk_size, cu_seqlens=cu_seqlens, gate=gate, dtype=torch.float64, record=record)
    gates = gate(f64[3]) if gate is not None else f64[3]
    bounds = sequence_bounds(cu_seqlens, q.shape[0], q.shape[1])
    kept = [b for b in bounds if b[1] > b[0]]  # an empty sequence records nothing
    sequences = tuple((f64[0][:, a:b], f64[1][:, a:b], gates[:, a:b], D_q, D_k)
                      for (a, b), D_q, D_k in zip(kept, record.get("D_q", []), record.get("D_k", [])))
    upstream = max(ln_abs_max(do.to(torch.float64)), -math.inf if dht is None else ln_abs_max(dht.to(torch.float64)))
    return BackwardOverflowQuantities(sequences, chunk_size, upstream, grads)


def predict_backward(quantities: BackwardOverflowQuantities, **tiling: object) -> BackwardOverflowPrediction:
    """Finite iff, on these inputs:

    1. the forward's checks hold (:func:`predict`; the backward recomputes its operands);
    2. the upstream gradients fit the operand dtype, and the products' cotangents (kept in fp32) fp32;
    3. each split diagonal-tile product of the backward, ``sum_c |D[r,c]| |k_c| e^(a-G_c)`` and
       ``sum_r |D[r,c]| |x_r| e^(G_r-a)``, fits the fp32 accumulator. A large upstream gradient
       overflows there before any operand does (fla-core's ``test_gdn2_overflow.py`` class).

    The fp32 diagonal path forms the tiles pair by pair: only 2 applies.
    """
    cfg = TileConfig.of(tiling)
    if cfg.chunk_size != quantities.chunk_size:
        raise ValueError(f"the quantities were made at chunk {quantities.chunk_size}, the tiling has {cfg.chunk_size}")
    dt = dtype_name(cfg.operand_dtype)
    exponent = log_operand = log_product = log_cotangent = -math.inf
    for q, k, g, D_q, D_k in quantities.sequences:
        log_cotangent = max(log_cotangent, ln_abs_max(D_q), ln_abs_max(D_k))
        if cfg.diagonal == "fp32":
            continue
        e, o = realized_log_magnitudes(q, k, g, chunk_size=cfg.chunk_size, tile=cfg.tile, anchor=cfg.anchor,
                                       anchor_shift=cfg.anchor_shift)
        exponent, log_operand = max(exponent, e), max(log_operand, o)
        log_product = max(log_product, _log_split_products(q, k, g, D_q, D_k, cfg))
    checks = [(f"largest ln|upstream gradient| vs ln(max {dt})", quantities.ln_upstream, ln_max(cfg.operand_dtype)),
              ("largest ln|A gradient| vs ln(max fp32)", log_cotangent, ln_max("fp32"))]
    if cfg.diagonal != "fp32":
        checks += [("largest diagonal exponent vs ln(max fp32)", exponent, ln_max("fp32")),
                   (f"largest ln|operand| vs ln(max {dt})", log_operand, ln_max(cfg.operand_dtype)),
                   ("largest ln|split diagonal product| vs ln(max fp32)", log_product, ln_max("fp32"))]
    failing = tuple(f"{what}: {value:.2f} >= {limit:.2f}" for what, value, limit in checks if value >= limit)
    what, value, limit = min(checks, key=lambda c: c[2] - c[1])
    return BackwardOverflowPrediction(not failing, failing, what, limit - value, max_exponent=exponent,
                                      max_log_operand=log_operand, max_log_product=log_product)


def _log_split_products(q, k, g, D_q, D_k, cfg: TileConfig) -> float:
    """``ln`` of the largest accumulator magnitude of the backward's split diagonal products
    (:func:`k3verify.kda.chunkwise._decayed_product_backward` with an anchor), bounded by the sum of
    absolute terms, in log space (the factors themselves may pass fp64's range)."""
    C, BC = cfg.chunk_size, cfg.tile
    G = to_chunks(g, C).cumsum(-2)
    lead, D = G.shape[:-2], G.shape[-1]
    Gt = G.reshape(*lead, C // BC, BC, D)
    a = diagonal_anchor(Gt, cfg.anchor, cfg.anchor_shift)[..., None, :]
    worst = -math.inf
    for x, cot in ((q, D_q), (k, D_k)):
        blocks = cot.reshape(*lead, C // BC, BC, C // BC, BC).diagonal(dim1=-4, dim2=-2).movedim(-1, -3).tril()
        log_d = torch.log(blocks.abs())  # [..., nT, r, c]
        log_key = torch.log(to_chunks(k, C).reshape(Gt.shape).abs()) + (a - Gt)  # [..., nT, c, D]
        log_x = torch.log(to_chunks(x, C).reshape(Gt.shape).abs()) + (Gt - a)  # [..., nT, r, D]
        rows = torch.logsumexp(log_d[..., :, :, None] + log_key[..., None, :, :], dim=-2)  # sum over c
        cols = torch.logsumexp(log_d[..., :, :, None] + log_x[..., :, None, :], dim=-3)  # sum over r
        worst = max(worst, float(rows.max()), float(cols.max()))
    return worst
