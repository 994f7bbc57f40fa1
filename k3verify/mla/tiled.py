"""Gated MLA tiled low-precision form — a FlashMLA-style kernel on the latent cache (docs/model.md §2.4).

The absorbed computation of :mod:`k3verify.mla.recurrent` as a tensor-core kernel runs it:
latent MQA over the ``R + Dr`` cache entries with an online softmax over key tiles of
``tile`` tokens, every matrix-product operand rounded to ``operand_dtype`` and products,
statistics and accumulators in fp32 (fp64 for an exact fp64 run). Per query row, per tile
``K`` of cached entries (values are the ``ĉ`` part of the same entries):

    S = τ [q̃ ; q^p] Kᵀ                      q̃ = W_UK q^n (BMM1), rounded to the operand dtype
    m' = max(m, rowmax S),   α = e^{m − m'},   P = e^{S − m'}
    l  ← α l + rowsum P                       (row sums of the fp32 P: FlashAttention's order)
    O  ← α O + round(P) K[:, :R]              (P rounded to the operand dtype for the MMA)
    õ = O / l,  L = m' + log l;   o = W_UVᵀ round(õ) (BMM2), rounded to the output dtype

A row that has seen no key yet has ``m = −∞``; it uses 0 in place of ``m'`` so that
``−∞ − (−∞)`` never appears (FlashAttention ``csrc/flash_attn/src/softmax.h`` does the same).

``num_splits > 1`` is split-KV decode (flash-decoding): each request's keys are cut into
``num_splits`` contiguous ranges of ``ceil(L_b / num_splits)`` tokens, each range runs the loop
above from its own start and yields ``(õ_s, L_s)`` in fp32, and the ranges are merged by
log-sum-exp (:func:`k3verify.mla.softmax.merge_partials`; an empty range has ``L_s = −∞``).

An fp8 latent cache (``cache.quantized``) is dequantised in fp32 (code × per-token scale) and
the result rounded to ``operand_dtype`` (bf16) as the MMA operand.

``subtract_max=False`` is the known-bad softmax: ``P = e^{S}`` with no running maximum (α = 1).
It overflows once a score exceeds ``ln`` of the largest value of the dtype the exponential is
evaluated in (fp32) or stored in (the operand dtype): 88.72 for bf16, 11.09 for fp16. Its other
failure is underflow: a row whose every score is below ``ln(smallest fp32 subnormal / 2)``
≈ −103.97 gets ``l = 0`` and ``0 / 0``. :func:`overflow_quantities` and :func:`predict` turn
these statements into a per-input prediction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..numerics import exp_fits, facts, is_float8, ln_max, resolve_dtype
from ..numerics.frontier import Magnitudes, as_checks, prediction_from, underflow_threshold
from ..numerics.frontier import OverflowPrediction as _Prediction
from ..numerics.frontier import ln_abs_max as _ln_abs_max
from ..numerics.trace import OverflowEvent, TracingRounder
from .cache import LatentCache, gather, split_entry
from .chunkwise import attention_backward, backward_operands
from .inputs import Dims, FormOptions, check_inputs, heads_first, key_mask
from .recurrent import absorb_output, absorb_query
from .softmax import NEG_INF, merge_partials


@dataclass(frozen=True)
class TileConfig:
    """Tiling and precision of one tiled run; validated on construction."""

    tile: int = 64
    operand_dtype: torch.dtype | str = torch.bfloat16
    num_splits: int = 1
    subtract_max: bool = True
    overflow: str = "nonfinite"

    def __post_init__(self) -> None:
        opts = FormOptions(tile=self.tile, operand_dtype=self.operand_dtype, num_splits=self.num_splits,
                           subtract_max=self.subtract_max, overflow=self.overflow)
        object.__setattr__(self, "operand_dtype", opts.operand_dtype)

    @property
    def accumulator(self) -> torch.dtype:
        """fp64 for an exact fp64 run, fp32 (the tensor-core accumulator) otherwise."""
        return accumulator_of(self.operand_dtype)

    @property
    def output_dtype(self) -> torch.dtype:
        """Kernels write fp8 runs' outputs in bf16, all others in the operand dtype."""
        return output_dtype_of(self.operand_dtype)


def accumulator_of(operand_dtype: torch.dtype | str) -> torch.dtype:
    """Accumulator of a kernel with these operands: fp64 for fp64, fp32 otherwise."""
    return torch.float64 if resolve_dtype(operand_dtype) == torch.float64 else torch.float32


def output_dtype_of(operand_dtype: torch.dtype | str) -> torch.dtype:
    """Output dtype of a kernel with these operands: bf16 for fp8 operands, else the operand dtype."""
    dtype = resolve_dtype(operand_dtype)
    return torch.bfloat16 if is_float8(dtype) else dtype


@dataclass
class _Caster:
    """Rounds stored tensors to the operand dtype, held in the accumulator; traces overflows."""

    cfg: TileConfig
    rounder: TracingRounder

    @classmethod
    def make(cls, cfg: TileConfig, *, trace: bool = False) -> _Caster:
        return cls(cfg, TracingRounder(cfg.operand_dtype, overflow=cfg.overflow, trace=trace))

    def __call__(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Round to the operand dtype, held in the accumulator dtype."""
        return self.rounder(name, t).to(self.cfg.accumulator)

    def output(self, t: torch.Tensor) -> torch.Tensor:
        """Round to the output dtype and return a tensor of that dtype."""
        return self.rounder("output o", t, self.cfg.output_dtype).to(self.cfg.output_dtype)


def tiled(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: LatentCache,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    scale: float | None = None,
    chunk_size: int = 64,
    tile: int = 64,
    operand_dtype: torch.dtype | str = torch.bfloat16,
    num_splits: int = 1,
    subtract_max: bool = True,
    overflow: str = "nonfinite",
) -> torch.Tensor:
    """Tiled low-precision latent attention. Arguments as in :mod:`k3verify.mla.inputs`.

    Returns ``o:[B, T, H, Dv]`` in :attr:`TileConfig.output_dtype`. Overflowing tensors become
    inf/NaN (``overflow="nonfinite"``) so they show in the output; :func:`explain_overflow`
    says which and where. ``chunk_size`` is validated and unused.
    """
    FormOptions(chunk_size=chunk_size)
    cfg = TileConfig(tile, operand_dtype, num_splits, subtract_max, overflow)
    dims, scale = check_inputs(q_nope, q_pe, cache, w_uk, w_uv, scale)
    return _tiled(q_nope, q_pe, cache, w_uk, w_uv, scale, dims, cfg, _Caster.make(cfg))


def overflow_events(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: LatentCache,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    scale: float | None = None,
    **tiling: object,
) -> list[OverflowEvent]:
    """Run :func:`tiled` and list every stored tensor that overflowed, in the order computed.

    ``tiling`` takes the keyword arguments of :class:`TileConfig`.
    """
    return tiled_traced(q_nope, q_pe, cache, w_uk, w_uv, scale=scale, **tiling)[1]


def explain_overflow(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: LatentCache,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    scale: float | None = None,
    **options: object,
) -> list[str]:
    """Each stored tensor that overflowed in :func:`tiled` with these arguments: which, where
    and by how much, one line each, in computing order. Takes any of the forms' options; those
    :func:`tiled` does not use (``chunk_size``) are ignored."""
    tiling = {k: v for k, v in options.items() if k in TileConfig.__dataclass_fields__}
    return [e.describe() for e in overflow_events(q_nope, q_pe, cache, w_uk, w_uv, scale=scale, **tiling)]


def tiled_traced(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: LatentCache,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    scale: float | None = None,
    **tiling: object,
) -> tuple[torch.Tensor, list[OverflowEvent]]:
    """:func:`tiled`'s output together with :func:`overflow_events`' events, from one run."""
    cfg = TileConfig(**tiling)  # type: ignore[arg-type]
    dims, scale = check_inputs(q_nope, q_pe, cache, w_uk, w_uv, scale)
    caster = _Caster.make(cfg, trace=True)
    o = _tiled(q_nope, q_pe, cache, w_uk, w_uv, scale, dims, cfg, caster)
    return o, caster.rounder.events


def _tiled(q_nope, q_pe, cache: LatentCache, w_uk, w_uv, scale: float, dims: Dims, cfg: TileConfig,
           cast: _Caster) -> torch.Tensor:
    acc = cfg.accumulator
    # Kernel inputs arrive in the operand dtype.
    q_abs = cast("absorbed query q̃ = W_UK q^n", absorb_query(cast("input q_nope", q_nope), cast("input W_UK", w_uk)))
    q_full = heads_first(torch.cat([q_abs, cast("input q_pe", q_pe)], dim=-1))  # [B, H, T, R + Dr]
    entries, _ = gather(cache, acc)  # an fp8 cache is dequantised here, in the accumulator
    latents = cast("latent cache entries [ĉ ; k^p]", entries)
    lens = torch.tensor(dims.lengths, dtype=torch.int64, device=latents.device)
    per_split = -(-lens // cfg.num_splits)
    parts = []
    for s in range(cfg.num_splits):
        lo = torch.minimum(lens, s * per_split)
        hi = torch.minimum(lens, (s + 1) * per_split)
        parts.append(_key_range(q_full, latents, lo, hi, scale, dims, cfg, cast))
    o_latent = parts[0][0] if len(parts) == 1 else merge_partials(parts)[0]
    o_latent = cast("latent output õ", o_latent)
    return cast.output(absorb_output(o_latent, cast("input W_UV", w_uv)))


def _key_range(q_full, latents, lo, hi, scale: float, dims: Dims, cfg: TileConfig,
               cast: _Caster) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax over keys ``lo[b] <= j < hi[b]`` in tiles; returns ``(õ [B,H,T,R], L [B,H,T])``."""
    B, H, T, W = q_full.shape
    acc = q_full.dtype
    m = torch.full((B, H, T), NEG_INF if cfg.subtract_max else 0.0, dtype=acc, device=q_full.device)
    m_use = torch.zeros_like(m)
    l = torch.zeros_like(m)
    o = torch.zeros(B, H, T, dims.R, dtype=acc, device=q_full.device)
    seen = torch.zeros(B, 1, T, dtype=torch.bool, device=q_full.device)
    span = int((hi - lo).max()) if B else 0
    offsets = torch.arange(cfg.tile, device=q_full.device)
    for j0 in range(0, span, cfg.tile):
        keys = lo[:, None] + j0 + offsets[None, :]  # [B, tile] absolute positions
        visible = (keys < hi[:, None])[:, None, None, :] & key_mask(dims, keys)  # [B, 1, T, tile]
        index = keys.clamp(max=latents.shape[1] - 1)[..., None].expand(-1, -1, W)
        K = torch.gather(latents, 1, index)[:, None]  # [B, 1, tile, W]: one latent head for all heads (MQA)
        S = (scale * (q_full @ K.transpose(-1, -2))).masked_fill(~visible, NEG_INF)
        if cfg.subtract_max:
            m_new = torch.maximum(m, S.amax(-1))
            m_use = torch.where(m_new == NEG_INF, torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - m_use)  # 0 while the row has seen nothing (m = −inf)
            m = m_new
        else:
            alpha = torch.ones_like(m)
        P = torch.exp(S - m_use[..., None])
        l = alpha * l + P.sum(-1)
        o = alpha[..., None] * o + cast("probabilities P", P) @ K[..., : dims.R]
        seen = seen | visible.any(-1)
    # A row without keys in this range is an empty part; any other row divides by its l
    # (which is 0 only when every e^S underflowed — the no-max variant's failure).
    o = torch.where(seen[..., None], o / l[..., None], torch.zeros((), dtype=acc))
    lse = torch.where(seen, m_use + torch.log(l), torch.full((), NEG_INF, dtype=acc))
    return o, lse


# ----------------------------------------------------------------------------------------------
# Analytic overflow prediction


@dataclass(frozen=True)
class OverflowQuantities:
    """Magnitudes an input set drives through the tiled kernel, computed exactly (fp64).

    ``ln_*`` fields are natural logs of largest magnitudes. Scores are ``τ [q̃ ; q^p]·[ĉ ; k^p]``
    over visible (causal, live) pairs. ``score_bound`` is the a-priori Cauchy–Schwarz bound
    ``τ · max_t ‖[q̃_t ; q^p_t]‖ · max_j ‖[ĉ_j ; k^p_j]‖ >= |score|``; ``max_score`` is the
    realised maximum, which the prediction uses: the bound holds for any inputs but is loose
    (2.5x on the registry's hot case; up to ``sqrt(R + Dr)`` for one pair of unaligned vectors),
    which would misplace the no-max frontier by one to three factor-2 steps of an input scale.
    Row statistics are taken per key range of the split, over rows that have keys in it.
    """

    ln_inputs: dict[str, float]
    ln_q_abs: float
    max_score: float
    min_score: float
    score_bound: float
    min_row_max: float  # smallest row maximum: underflow of the no-max row sum
    max_lse: float  # largest log Σ_j e^{s_j}: the no-max row sum l
    ln_weighted_values: float  # largest ln Σ_j e^{s_j} |ĉ_{j,r}|: bounds every partial no-max accumulator
    ln_latent_out: float  # ln max |õ|
    ln_output: float  # ln max |o|
    output: torch.Tensor  # o in fp64, [B, T, H, Dv]: the oracle for these inputs

    def as_dict(self) -> dict[str, object]:
        """The scalar fields (for map cells and reports)."""
        return {k: v for k, v in self.__dict__.items() if k != "output"}


def overflow_quantities(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: LatentCache,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    scale: float | None = None,
    num_splits: int = 1,
    **_options: object,
) -> OverflowQuantities:
    """Compute :class:`OverflowQuantities` for these inputs in fp64 (dequantising an fp8 cache).

    Independent of the operand dtype and of the tile size, so one call serves a whole row of
    an overflow map. ``num_splits`` decides the key ranges of the row statistics; the forms'
    other options do not move any quantity and are ignored.
    """
    dims, scale = check_inputs(q_nope, q_pe, cache, w_uk, w_uv, scale)
    f64 = torch.float64
    qn, qp, wuk, wuv = (t.to(f64) for t in (q_nope, q_pe, w_uk, w_uv))
    entries, _ = gather(cache, f64)
    c_hat, _ = split_entry(entries, dims.R)
    q_abs = absorb_query(qn, wuk)
    if dims.T == 0:
        nothing = -math.inf
        return OverflowQuantities({}, nothing, nothing, math.inf, 0.0, math.inf, nothing, nothing, nothing, nothing,
                                  qn.new_zeros(dims.B, 0, dims.H, dims.Dv))
    q_full = heads_first(torch.cat([q_abs, qp], dim=-1))  # [B, H, T, W]
    s = scale * (q_full @ entries[:, None].transpose(-1, -2))  # [B, H, T, L]
    L = entries.shape[1]
    key_pos = torch.arange(L)[None, :].expand(dims.B, L)
    visible = key_mask(dims, key_pos)  # [B, 1, T, L]
    lens = torch.tensor(dims.lengths, dtype=torch.int64)
    per_split = -(-lens // num_splits)
    row_max, lse, weighted = [], [], []
    for i in range(num_splits):
        lo = torch.minimum(lens, i * per_split)[:, None]
        hi = torch.minimum(lens, (i + 1) * per_split)[:, None]
        part = visible & ((key_pos >= lo) & (key_pos < hi))[:, None, None, :]
        has = part.any(-1).expand(-1, dims.H, -1)  # [B, H, T]
        sm = s.masked_fill(~part, NEG_INF)
        mx = sm.amax(-1)
        row_max.append(mx[has])
        lse.append(torch.logsumexp(sm, -1)[has])
        safe = torch.where(has, mx, torch.zeros_like(mx))[..., None]
        w = torch.exp(sm - safe) @ c_hat.abs()[:, None]  # [B, H, T, R]
        weighted.append((safe + torch.log(w))[has[..., None].expand_as(w)])
    p = torch.softmax(s.masked_fill(~visible, NEG_INF), dim=-1)
    o_latent = p @ c_hat[:, None]  # [B, H, T, R]
    o = absorb_output(o_latent, wuv)
    norms_q = q_full.norm(dim=-1).max()
    norms_k = torch.where(torch.arange(L)[None, :] < lens[:, None], entries.norm(dim=-1), 0.0).max()
    return OverflowQuantities(
        ln_inputs={"input q_nope": _ln_abs_max(qn), "input q_pe": _ln_abs_max(qp), "input W_UK": _ln_abs_max(wuk),
                   "input W_UV": _ln_abs_max(wuv), "latent cache entries": _ln_abs_max(entries)},
        ln_q_abs=_ln_abs_max(q_abs),
        max_score=float(s.masked_fill(~visible, NEG_INF).max()),
        min_score=float(s.masked_fill(~visible, math.inf).min()),
        score_bound=float(scale * norms_q * norms_k),
        min_row_max=float(torch.cat(row_max).min()),
        max_lse=float(torch.cat(lse).max()),
        ln_weighted_values=float(torch.cat(weighted).max()),
        ln_latent_out=_ln_abs_max(o_latent),
        ln_output=_ln_abs_max(o),
        output=o,
    )


@dataclass(frozen=True)
class OverflowPrediction(_Prediction):
    """The range checks' verdict with the score statistics it read: the realised largest score,
    its Cauchy–Schwarz bound, the smallest row maximum and the largest row log-sum-exp."""

    max_score: float = 0.0
    score_bound: float = 0.0
    min_row_max: float = 0.0
    max_lse: float = 0.0


def predict(
    quantities: OverflowQuantities,
    *,
    operand_dtype: torch.dtype | str = torch.bfloat16,
    subtract_max: bool = True,
    **_options: object,
) -> OverflowPrediction:
    """Will :func:`tiled` with these settings return finite values for these inputs?

    Each stored tensor must fit the dtype it is rounded to (``exp_fits(ln|x|, dtype)``, which
    also requires the fp32 accumulator to hold it): the inputs, ``q̃``, the dequantised
    latents and ``õ`` in the operand dtype, ``o`` in the output dtype, the scores in the
    accumulator. Without max subtraction also ``P = e^{s}`` (``exp_fits(max_score, operand)``),
    the row sum ``l`` (``max_lse``), the accumulator (``ln_weighted_values``) and the underflow
    of a whole row (``min_row_max`` above :func:`underflow_threshold`). An fp8 cache's codes
    cannot overflow (``amax / max`` scaling), so only its dequantised value is checked. The
    forms' other options (``tile``, ``num_splits``: already in ``quantities``) are ignored.
    """
    op = resolve_dtype(operand_dtype)
    acc = accumulator_of(op)
    out = output_dtype_of(op)
    checks: list[tuple[str, bool, float]] = []  # (what, passes, headroom in ln units)

    def fits(what: str, ln_value: float, dtype: torch.dtype) -> None:
        limit = min(ln_max(dtype), ln_max(acc))
        ok = exp_fits(ln_value, dtype, compute_dtype=acc)
        checks.append((f"{what} (ln {ln_value:.2f} vs ln max {facts(dtype).name} {limit:.2f})", ok,
                       limit - ln_value if not math.isnan(ln_value) else -math.inf))

    for name, value in quantities.ln_inputs.items():
        fits(name, value, op)
    fits("absorbed query q̃", quantities.ln_q_abs, op)
    biggest_score = max(abs(quantities.max_score), abs(quantities.min_score))
    fits("scores |s|", math.log(biggest_score) if biggest_score > 0 else -math.inf, acc)
    if not subtract_max:
        fits("P = exp(s) without max subtraction", quantities.max_score, op)
        fits("row sum l = Σ exp(s)", quantities.max_lse, acc)
        fits("accumulator Σ exp(s) ĉ", quantities.ln_weighted_values, acc)
        floor = underflow_threshold(acc)
        checks.append((f"row sum underflow (smallest row max {quantities.min_row_max:.2f} vs "
                       f"ln(min subnormal/2) {floor:.2f}; l = 0 gives 0/0)",
                       quantities.min_row_max > floor, quantities.min_row_max - floor))
    fits("latent output õ", quantities.ln_latent_out, op)
    fits("output o", quantities.ln_output, out)
    failing = tuple(what for what, ok, _ in checks if not ok)
    what, _, room = min(checks, key=lambda c: c[2])
    return OverflowPrediction(finite=not failing, reasons=failing, binding=what, headroom=room,
                              max_score=quantities.max_score, score_bound=quantities.score_bound,
                              min_row_max=quantities.min_row_max, max_lse=quantities.max_lse)


# --- the backward (docs/model.md §2.6) --------------------------------------------------------

DELTAS = ("output", "fp32")


def tiled_backward(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: LatentCache,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    do: torch.Tensor,
    scale: float | None = None,
    chunk_size: int = 64,
    tile: int = 64,
    operand_dtype: torch.dtype | str = torch.bfloat16,
    num_splits: int = 1,
    subtract_max: bool = True,
    overflow: str = "nonfinite",
    delta: str = "output",
) -> dict[str, torch.Tensor]:
    """The expanded prefill's backward as FlashAttention-2 runs it in ``operand_dtype``: the
    algebra of :func:`k3verify.mla.chunkwise.chunkwise_backward` over key tiles of ``tile`` with
    every matrix-product operand (the inputs, the expanded ``K`` and ``V``, ``dO``, ``P``, ``dS``,
    the key and value gradients) rounded to the operand dtype, fp32 statistics and accumulators,
    and the output ``O`` stored in the output dtype. ``delta`` says what ``δ = rowsum(dO ∘ O)``
    reads: ``"output"`` the stored ``O`` (FlashAttention-2's preprocessing kernel), ``"fp32"``
    the accumulator's. ``dq_nope, dq_pe, dkv`` come back in the output dtype, the weights'
    gradients in fp32.
    """
    cfg = TileConfig(tile, operand_dtype, num_splits, subtract_max, overflow)
    FormOptions(chunk_size=chunk_size)
    return _backward_run((q_nope, q_pe, cache, w_uk, w_uv), do, scale, cfg, delta, _Caster.make(cfg))


def tiled_backward_traced(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: LatentCache, w_uk: torch.Tensor,
                          w_uv: torch.Tensor, *, do: torch.Tensor, scale: float | None = None, delta: str = "output",
                          **tiling: object) -> tuple[dict[str, torch.Tensor], list[OverflowEvent]]:
    """:func:`tiled_backward`'s gradients and every stored tensor that overflowed, in computing order."""
    cfg = TileConfig(**{k: v for k, v in tiling.items() if k != "chunk_size"})  # type: ignore[arg-type]
    caster = _Caster.make(cfg, trace=True)
    grads = _backward_run((q_nope, q_pe, cache, w_uk, w_uv), do, scale, cfg, delta, caster)
    return grads, caster.rounder.events


def _backward_run(args: tuple, do: torch.Tensor, scale: float | None, cfg: TileConfig, delta: str,
                  caster: _Caster) -> dict[str, torch.Tensor]:
    if delta not in DELTAS:
        raise ValueError(f"delta is one of {', '.join(DELTAS)}, got {delta!r}")
    acc = cfg.accumulator
    x, scale, dims = backward_operands(*args, do, scale, acc)

    def output(name: str, t: torch.Tensor) -> torch.Tensor:
        return caster.rounder(name, t, cfg.output_dtype).to(acc)

    return attention_backward(*x, scale, dims, key_tile=cfg.tile, cast=caster, output=output, delta_from=delta)


@dataclass(frozen=True)
class BackwardOverflowQuantities:
    """What the tiled backward stores, measured exactly (fp64) in one pass (``stored``: every
    operand, output and the weights' fp32 gradients), the gradients of that pass (the map's
    reference) and the forward's quantities (``forward``: the scores and what the forward stores)."""

    stored: Magnitudes
    gradients: dict[str, torch.Tensor]
    forward: OverflowQuantities


def backward_overflow_quantities(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: LatentCache, w_uk: torch.Tensor,
                                 w_uv: torch.Tensor, *, do: torch.Tensor, scale: float | None = None,
                                 key_tile: int = 64, **_: object) -> BackwardOverflowQuantities:
    """:class:`BackwardOverflowQuantities` of these inputs (independent of the operand dtype)."""
    x, tau, dims = backward_operands(q_nope, q_pe, cache, w_uk, w_uv, do, scale, torch.float64)
    seen = Magnitudes()
    grads = attention_backward(*x, tau, dims, key_tile=key_tile, cast=seen.hook("operand"),
                               output=seen.hook("output"))
    for name in ("dw_uk", "dw_uv"):
        seen(f"gradient {name}", grads[name], "accumulator")
    return BackwardOverflowQuantities(seen, grads, overflow_quantities(q_nope, q_pe, cache, w_uk, w_uv, scale=scale))


def predict_backward(q: BackwardOverflowQuantities, *, operand_dtype: torch.dtype | str = torch.bfloat16,
                     **_: object) -> _Prediction:
    """Will :func:`tiled_backward` return finite gradients for these inputs? The forward's checks
    (:func:`predict` with max subtraction: the backward recomputes ``P = e^{S − lse}``) and every
    stored tensor against its dtype: operands the operand dtype, ``O`` and the activations'
    gradients the output dtype, the weights' gradients fp32."""
    op = resolve_dtype(operand_dtype)
    out = output_dtype_of(op)
    forward = predict(q.forward, operand_dtype=op, subtract_max=True)
    dtypes = {"operand": op, "output": out, "accumulator": torch.float32 if op != torch.float64 else op}
    return prediction_from([*as_checks(forward), *q.stored.checks(dtypes, dtypes["accumulator"])])
