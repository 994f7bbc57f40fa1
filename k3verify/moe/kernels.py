"""Stable LatentMoE GPU kernels in Triton: the router and the routed experts (docs/model.md §4).

``route(x, w_router, bias, config) -> Routing`` in two launches:

- logits ``r = x W_r`` in fp32, one program per tile of tokens by experts: products of fp32
  tiles with fp32 accumulation (tf32x3 on a GPU, which keeps about 22 bits of each operand;
  exact fp32 products under the interpreter);
- one program per few tokens over all experts: ``s = σ(r)`` and the selection ``TopK_k(s + b)``
  by ``k`` rounds of a row maximum, each round taking the lowest (or, with
  ``tie_break="highest_index"``, the highest) expert index among equal biased scores, as the
  reference's stable sort does;
- the weights ``ρ s_I / (Σ s_I + renorm_eps)`` from the unbiased scores of the selected experts.

Inputs are fp32 (the fp32 router of docs/model.md §4); under Triton's interpreter the kernel is faithful
(:mod:`k3verify.triton_support`).

``grouped(x, weights, config, *, routing=None) -> y`` is the layer with its routed experts in
two grouped launches over the token rows sorted by expert (:func:`~k3verify.moe.chunkwise.sort_pairs`:
the sort, the experts' row counts and each launch's table of row tiles made on the device, so
that a call waits on it once, for its input checks):

- *up*: one program per (tile of one expert's rows, tile of the expert hidden): the rows of the
  latent ``z`` gathered by token as they load (the permutation is never materialised), ``z W1_e``
  and ``z W3_e`` with operand-dtype tiles and fp32 accumulation, and the activation fused as
  the epilogue (SiTU in fp32 from the fp32 sums, then stored in the operand dtype);
- *down*: ``h W2_e`` the same way, each row scaled by its routing weight in fp32 and stored in
  the operand dtype (as a fused MoE kernel stores it; the tiled form models that rounding) at its
  (token, slot) place, so each token's ``k`` rows are then summed in fp32, in slot order, where
  they lie, without a gather (deterministic, no atomics).

The router (the reference's fp32 router, or the routing given), ``z = x W↓``, ``RMSNorm_γ(u) W↑``
and the shared MLP run in fp32 torch operations; with ``grouped(..., production=True)`` the last
three run in the same launches with operands in the layer's dtype (one expert holding every row),
as the production layer runs them, and each token's rows are summed and normed in one launch
(:func:`combine_norm`). Operands are ``x``'s dtype: bf16 or fp16 on a GPU, fp32 anywhere Triton
runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import lru_cache, partial
from typing import NamedTuple

import torch

from ..numerics import cast_once
from ..numerics.validate import require_finite, require_float, require_shape, require_tensor
from ..triton_support import (
    block,
    check_launch,
    device_for,
    dot,
    dot_fp32,
    interpreted,
    multiprocessors,
    profiled,
    tl,
    tma_descriptor,
    triton,
)
from ..triton_support import unavailable_reason as _unavailable
from .chunkwise import SortedPairs, sort_pairs
from .inputs import TIE_BREAKS, MoEConfig, MoEWeights, Routing, check_inputs
from .layer import layer_output
from .router import routing_for

__all__ = ["grouped", "interpreted", "route", "routed_layer", "unavailable_reason"]

# (z [T, Dl], sorted pairs, p [T k] in sorted order, weights) -> p · E_e(z) [T k, Dl] in (token, slot) order
Experts = Callable[[torch.Tensor, SortedPairs, torch.Tensor, MoEWeights], torch.Tensor]

@dataclasses.dataclass(frozen=True)
class Tiles:
    """One GEMM launch's shape on a GPU: an output tile of ``rows`` x ``cols`` per program,
    ``depth`` of the product per loop step, ``warps`` and the pipeline's ``stages`` (Triton's
    ``num_warps``, ``num_stages``; the interpreter ignores those two). Sides are powers of two of
    at least 16 (a ``tl.dot`` side). ``tma``: the weight tiles (and the down launch's rows) read
    by TMA copies through tensor descriptors where the tensors' layout allows it
    (:func:`~k3verify.triton_support.tma_descriptor`), else by pointer loads. ``persistent``: 0
    for a program per tile, else that many programs per multiprocessor, each taking the tiles one
    after another (one loop over its tiles and their products, which Triton pipelines as one:
    the next tile's first loads are issued before the last one's results are stored)."""

    rows: int
    cols: int
    depth: int
    warps: int = 4
    stages: int = 3
    tma: bool = False
    persistent: int = 0

    def __post_init__(self) -> None:
        check_launch("Tiles", dict(rows=self.rows, cols=self.cols, depth=self.depth), self.warps, self.stages)
        if not isinstance(self.persistent, int) or isinstance(self.persistent, bool) or not 0 <= self.persistent <= 8:
            raise ValueError(f"Tiles: persistent is a count of programs per multiprocessor from 0 (a program per "
                             f"tile) to 8, not {self.persistent!r}")

    def __str__(self) -> str:
        return (f"{self.rows}x{self.cols}x{self.depth} w{self.warps} s{self.stages}" + (" tma" if self.tma else "")
                + (f" p{self.persistent}" if self.persistent else ""))


# Launch shapes on a GPU, timed on an H100 by benchmarks/moe_gpu.py, which sweeps them (docs/gpu.md).
# Router: logit tiles of tokens x experts; the selection takes a few tokens' full rows.
LOGIT_TILES = Tiles(128, 64, 32, warps=4, stages=3)
SELECT_TOKENS = 4
# Grouped expert launches: one expert's rows x hidden (up) or latent (down) columns. At K3's
# expert width (384) and T = 16384 on an H100 (95564bd): up with TMA weight copies and 4 stages
# 3.37 ms against 3.66 for pointer loads and 3; down with 256-column tiles, TMA and one
# persistent program per multiprocessor 2.09 against 2.60 for 128 columns, a program per tile.
# Every shape gives the same bits (the sweep compares each with the default). At width 3072 the
# older shapes were 2 % (up) and 10 % (down) faster.
UP_TILES = Tiles(128, 128, 64, warps=8, stages=4, tma=True)
DOWN_TILES = Tiles(128, 256, 64, warps=8, stages=3, tma=True, persistent=1)
# The layer's plain GEMMs (x W↓, RMSNorm(u) W↑, the shared MLP's down), the down launch over all
# rows: the persistent TMA launch 1.23 ms against 1.36 at T = 16384.
DENSE_TILES = Tiles(128, 256, 64, warps=8, stages=3, tma=True, persistent=1)
# Under the interpreter size is time: the smallest tiles.
INTERPRETED_TILES = Tiles(16, 16, 16)
EXPERT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
EXPERT_MATRICES = ("w1", "w3", "w2")
# The layer's GEMMs outside the experts: latent down and up projections, the shared MLP.
DENSE_MATRICES = ("w_latent_down", "w_latent_up", "shared_w1", "shared_w3", "shared_w2")


def unavailable_reason(dtype: torch.dtype | str = torch.float32) -> str | None:
    """Why the router kernel cannot run faithfully here for ``dtype`` inputs, or ``None``."""
    return _unavailable("the MoE router kernel", dtype, (torch.float32,))


@triton.jit
def _logits_kernel(x, w, r, T, D, E, BT: tl.constexpr, BE: tl.constexpr, BD: tl.constexpr, EXACT: tl.constexpr):
    """``r = x W_r`` in fp32 for one ``BT x BE`` tile of tokens by experts."""
    # The expert tiles of one token tile are neighbours in the launch: they read the same x rows
    # together (one read from memory, the rest from L2); all of W_r (26 MB at K3) stays in L2.
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    acc = tl.zeros([BT, BE], dtype=tl.float32)
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        xx = tl.load(x + t[:, None].to(tl.int64) * D + dd[None, :], mask=(t < T)[:, None] & (dd < D)[None, :],
                     other=0.0)  # fmt: skip
        ww = tl.load(w + dd[:, None].to(tl.int64) * E + e[None, :], mask=(dd < D)[:, None] & (e < E)[None, :],
                     other=0.0)  # fmt: skip
        acc += dot_fp32(xx, ww, EXACT)
    tl.store(r + t[:, None].to(tl.int64) * E + e[None, :], acc, mask=(t < T)[:, None] & (e < E)[None, :])


@triton.jit
def _select_kernel(r, bias, idx_out, wt_out, T, E, rho, renorm_eps, K: tl.constexpr, KP: tl.constexpr,
                   BT: tl.constexpr, BE: tl.constexpr, HIGHEST: tl.constexpr):  # fmt: skip
    """``s = σ(r)``, the top ``K`` of ``s + b`` by ``K`` rounds of a row maximum (ties to the
    lowest, or highest, index) and the renormalised weights, for ``BT`` tokens over all experts."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    e = tl.arange(0, BE)
    logits = tl.load(r + t[:, None].to(tl.int64) * E + e[None, :], mask=(t < T)[:, None] & (e < E)[None, :],
                     other=0.0)  # fmt: skip
    s = tl.sigmoid(logits)
    b = tl.load(bias + e, mask=e < E, other=0.0)
    biased = tl.where((e < E)[None, :], s + b[None, :], float("-inf"))
    cols = tl.arange(0, KP)
    picked = tl.zeros([BT, KP], dtype=tl.int32)
    chosen = tl.zeros([BT, KP], dtype=tl.float32)
    for j in tl.static_range(K):
        top = tl.max(biased, axis=1)
        at_top = biased == top[:, None]
        if HIGHEST:
            i = tl.max(tl.where(at_top, e[None, :], -1), axis=1)
        else:
            i = tl.min(tl.where(at_top, e[None, :], BE), axis=1)
        hit = e[None, :] == i[:, None]
        picked = tl.where(cols[None, :] == j, i[:, None], picked)
        chosen = tl.where(cols[None, :] == j, tl.sum(tl.where(hit, s, 0.0), axis=1)[:, None], chosen)
        biased = tl.where(hit, float("-inf"), biased)
    weights = chosen / (tl.sum(chosen, axis=1) + renorm_eps)[:, None] * rho
    out = t[:, None].to(tl.int64) * K + cols[None, :]
    keep = (t < T)[:, None] & (cols < K)[None, :]
    tl.store(idx_out + out, picked.to(tl.int64), mask=keep)
    tl.store(wt_out + out, weights, mask=keep)


def route(x: torch.Tensor, w_router: torch.Tensor, bias: torch.Tensor, config: MoEConfig, *,
          tiles: Tiles | None = None) -> Routing:  # fmt: skip
    """The router for ``x:[T, d]`` (fp32), ``w_router:[d, E]``, ``bias:[E]``: indices ``[T, k]``
    int64, best first, and weights ``[T, k]`` fp32, on the kernel's device. ``tiles``: the
    logits launch's shape on a GPU (default :data:`LOGIT_TILES`)."""
    for name, t in (("x", x), ("w_router", w_router), ("bias", bias)):
        require_tensor(name, t)
        require_float(name, t, (torch.float32,))
        require_finite(name, t)
    if x.dim() != 2:
        raise ValueError(f"x has shape {list(x.shape)}; expected [T, d]")
    T, d = x.shape
    require_shape("w_router", w_router, (d, config.num_experts), "d,E")
    require_shape("bias", bias, (config.num_experts,), "E")
    if config.tie_break not in TIE_BREAKS:
        raise ValueError(f"unknown tie_break {config.tie_break!r}; choose one of {TIE_BREAKS}")
    if config.logits_dtype is not None:
        raise ValueError("the router kernel keeps fp32 logits; logits_dtype must be None")
    dev = device_for(x, "the MoE router kernel")
    k, E = config.top_k, config.num_experts
    idx = torch.empty(T, k, dtype=torch.int64, device=dev)
    wt = torch.empty(T, k, dtype=torch.float32, device=dev)
    if T:
        # Two launches: the logits as a tiled GEMM (one program over all E experts would hold a
        # [tokens, E] accumulator and a [depth, E] weight tile: 266 KB of shared memory at E = 896),
        # then the selection, which needs every expert of a token at once but no product.
        logits = torch.empty(T, E, dtype=torch.float32, device=dev)
        lt = _shape(tiles, LOGIT_TILES)
        be = min(block(E), lt.cols)
        _logits_kernel[(triton.cdiv(E, be), triton.cdiv(T, lt.rows))](
            x.to(dev).contiguous(), w_router.to(dev).contiguous(), logits, T, d, E, BT=lt.rows, BE=be, BD=lt.depth,
            EXACT=interpreted(), num_warps=lt.warps, num_stages=lt.stages,
        )  # fmt: skip
        _select_kernel[(triton.cdiv(T, SELECT_TOKENS),)](
            logits, bias.to(dev).contiguous(), idx, wt, T, E, float(config.routed_scaling_factor),
            float(config.renorm_eps), K=k, KP=max(2, triton.next_power_of_2(k)), BT=SELECT_TOKENS, BE=block(E),
            HIGHEST=config.tie_break == "highest_index",
        )  # fmt: skip
    return Routing(idx, wt)


@triton.jit
def _tanh(y):
    """``tanh`` in fp32 to a few ulp: ``(1 − e^{−2|y|}) / (1 + e^{−2|y|})`` (no overflow), and
    below ``|y| = 1/8``, where that difference cancels, its Taylor series to ``y⁹`` (the next
    term is under 1e-12 of it). ``±1`` at ``±inf``, NaN for NaN."""
    a = tl.abs(y)
    t = tl.exp(-2.0 * a)
    far = (1.0 - t) / (1.0 + t)
    y2 = y * y
    near = y * (1.0 + y2 * (-1.0 / 3.0 + y2 * (2.0 / 15.0 + y2 * (-17.0 / 315.0 + y2 * (62.0 / 2835.0)))))
    return tl.where(a < 0.125, near, tl.where(y < 0, -far, far))


@triton.jit
def _activation(g, u, beta1, beta2, SWIGLU: tl.constexpr):
    """SiTU ``β1 tanh(g/β1) σ(g) · β2 tanh(u/β2)`` (or SwiGLU ``g σ(g) u``) of fp32 sums, in fp32
    (docs/model.md §4: computed in fp32)."""
    sig = tl.sigmoid(g)
    if SWIGLU:
        return g * sig * u
    return beta1 * _tanh(g / beta1) * sig * (beta2 * _tanh(u / beta2))


@triton.jit
def _expert_tile(tile, tile_expert, tile_row, offsets, N, BM: tl.constexpr, BN: tl.constexpr):
    """Output tile ``tile``'s expert, its first row and its rows ``[BM]`` (sorted order) with
    their mask, its first output column and its ``BN`` output columns of ``N``, and whether it
    has a row at all (the launch has programs for the most tiles the rows could need; the others
    find no row and return). The tiles are numbered with the column tiles of one row tile side
    by side: run together, they read the same rows at once (from memory, then from L2), and the
    row tiles of one expert follow each other, sharing its weights."""
    col_tiles = tl.cdiv(N, BN)
    i = tile // col_tiles
    e = tl.load(tile_expert + i).to(tl.int64)
    first = tl.load(tile_row + i)
    end = tl.load(offsets + e + 1)
    rows = first + tl.arange(0, BM)
    c0 = (tile % col_tiles) * BN
    return e, first, rows, rows < end, c0, c0 + tl.arange(0, BN), first < end


@triton.jit
def _up_kernel(z, token, w1, w3, h, tile_expert, tile_row, offsets, count, Dl, F, beta1, beta2, BM: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, SWIGLU: tl.constexpr, IEEE: tl.constexpr,
               DESC: tl.constexpr, PERSISTENT: tl.constexpr):  # fmt: skip
    """``h = act(z W1_e, z W3_e)`` for the program's tile of expert ``e``'s rows and ``BN`` hidden
    columns, or with ``PERSISTENT`` for every ``num_programs``-th of the ``count[0]`` row tiles'
    output tiles (``w1, w3`` tensor descriptors with ``DESC``)."""
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), tl.load(count) * tl.cdiv(F, BN), tl.num_programs(0), flatten=True):
            _up_tile(tile, z, token, w1, w3, h, tile_expert, tile_row, offsets, Dl, F, beta1, beta2, BM, BN, BK,
                     SWIGLU, IEEE, DESC, False)  # fmt: skip
    else:
        _up_tile(tl.program_id(0), z, token, w1, w3, h, tile_expert, tile_row, offsets, Dl, F, beta1, beta2, BM, BN,
                 BK, SWIGLU, IEEE, DESC, True)  # fmt: skip


@triton.jit
def _up_tile(tile, z, token, w1, w3, h, tile_expert, tile_row, offsets, Dl, F, beta1, beta2, BM: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr, SWIGLU: tl.constexpr, IEEE: tl.constexpr, DESC: tl.constexpr,
             SPARE: tl.constexpr):  # fmt: skip
    """One output tile of :func:`_up_kernel`; with ``SPARE`` the tile may hold no row (a spare
    program's), and then nothing is done. A persistent loop's tiles all hold rows: no branch
    there keeps Triton from making one loop of the tiles and their products."""
    e, _, rows, rm, c0, cols, live = _expert_tile(tile, tile_expert, tile_row, offsets, F, BM, BN)
    if SPARE:
        if not live:
            return
    src = tl.load(token + rows, mask=rm, other=0)  # the token each sorted row comes from
    cm = cols < F
    if DESC:  # TMA copies of [1, BK, BN] blocks of w1, w3:[E, Dl, F], zero outside
        e32 = e.to(tl.int32)
    else:
        w1_at = w1 + e * Dl * F
        w3_at = w3 + e * Dl * F
    g = tl.zeros([BM, BN], dtype=tl.float32)
    u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, Dl, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < Dl
        a = tl.load(z + src[:, None] * Dl + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        if DESC:
            b1 = w1.load([e32, k0, c0]).reshape(BK, BN)
            b3 = w3.load([e32, k0, c0]).reshape(BK, BN)
        else:
            wm = km[:, None] & cm[None, :]
            b1 = tl.load(w1_at + kk[:, None] * F + cols[None, :], mask=wm, other=0.0)
            b3 = tl.load(w3_at + kk[:, None] * F + cols[None, :], mask=wm, other=0.0)
        g = dot(a, b1, IEEE, g)
        u = dot(a, b3, IEEE, u)
    out = _activation(g, u, beta1, beta2, SWIGLU)
    tl.store(h + rows[:, None].to(tl.int64) * F + cols[None, :], out.to(h.dtype.element_ty),
             mask=rm[:, None] & cm[None, :])  # fmt: skip


@triton.jit
def _down_kernel(h, w2, weight, out, dest, tile_expert, tile_row, offsets, count, F, Dl, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, SCATTER: tl.constexpr, IEEE: tl.constexpr,
                 DESC: tl.constexpr, PERSISTENT: tl.constexpr):  # fmt: skip
    """``out = p · (h W2_e)`` for the program's tile of expert ``e``'s rows and ``BN`` latent
    columns, or with ``PERSISTENT`` for every ``num_programs``-th of the ``count[0]`` row tiles'
    output tiles (the product and weight in fp32, stored in ``out``'s dtype), each row at row
    ``dest[row]`` of ``out`` with ``SCATTER`` (its token's slot), else at its own row. With
    ``DESC`` ``h`` and ``w2`` are tensor descriptors (``[BM, BK]`` and ``[1, BK, BN]`` blocks):
    the tile's rows are copied whole, past its expert's last row too, and those rows are never
    stored (a row of the product depends on its own row of ``h`` only)."""
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), tl.load(count) * tl.cdiv(Dl, BN), tl.num_programs(0), flatten=True):
            _down_tile(tile, h, w2, weight, out, dest, tile_expert, tile_row, offsets, F, Dl, BM, BN, BK, SCATTER,
                       IEEE, DESC, False)  # fmt: skip
    else:
        _down_tile(tl.program_id(0), h, w2, weight, out, dest, tile_expert, tile_row, offsets, F, Dl, BM, BN, BK,
                   SCATTER, IEEE, DESC, True)  # fmt: skip


@triton.jit
def _down_tile(tile, h, w2, weight, out, dest, tile_expert, tile_row, offsets, F, Dl, BM: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, SCATTER: tl.constexpr, IEEE: tl.constexpr, DESC: tl.constexpr,
               SPARE: tl.constexpr):  # fmt: skip
    """One output tile of :func:`_down_kernel` (``SPARE`` as for :func:`_up_tile`)."""
    e, first, rows, rm, c0, cols, live = _expert_tile(tile, tile_expert, tile_row, offsets, Dl, BM, BN)
    if SPARE:
        if not live:
            return
    cm = cols < Dl
    if DESC:  # TMA copies of [BM, BK] blocks of h and [1, BK, BN] blocks of w2:[E, F, Dl], zero outside
        e32 = e.to(tl.int32)
    else:
        w2_at = w2 + e * F * Dl
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, F, BK):
        if DESC:
            a = h.load([first, k0])
            b = w2.load([e32, k0, c0]).reshape(BK, BN)
        else:
            kk = k0 + tl.arange(0, BK)
            km = kk < F
            a = tl.load(h + rows[:, None].to(tl.int64) * F + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
            b = tl.load(w2_at + kk[:, None] * Dl + cols[None, :], mask=km[:, None] & cm[None, :], other=0.0)
        acc = dot(a, b, IEEE, acc)
    p = tl.load(weight + rows, mask=rm, other=0.0)
    at = rows.to(tl.int64)
    if SCATTER:
        at = tl.load(dest + rows, mask=rm, other=0).to(tl.int64)
    tl.store(out + at[:, None] * Dl + cols[None, :], (acc * p[:, None]).to(out.dtype.element_ty),
             mask=rm[:, None] & cm[None, :])  # fmt: skip


@triton.jit
def _combine_kernel(rows, gain, normed, Dl, eps, K: tl.constexpr, BD: tl.constexpr):
    """``RMSNorm_γ(u)`` for one token, ``u`` the fp32 sum of its ``K`` weighted expert rows
    (``rows:[T, K, Dl]``) in slot order; stored in ``normed``'s dtype."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    m = d < Dl
    u = tl.zeros([BD], dtype=tl.float32)
    for j in tl.static_range(K):
        u += tl.load(rows + (t * K + j) * Dl + d, mask=m, other=0.0).to(tl.float32)
    scale = 1.0 / tl.sqrt_rn(tl.sum(u * u, axis=0) / Dl + eps)
    y = u * scale * tl.load(gain + d, mask=m, other=0.0)
    tl.store(normed + t * Dl + d, y.to(normed.dtype.element_ty), mask=m)


def experts_unavailable_reason(dtype: torch.dtype | str = torch.bfloat16) -> str | None:
    """Why the grouped expert kernels cannot give faithful results for ``dtype`` here, or ``None``."""
    return _unavailable("the MoE expert kernels", dtype, EXPERT_DTYPES, (torch.float32, torch.float16))


def tile_bound(total: int, experts: int, rows: int) -> int:
    """The most tiles of ``rows`` that ``total`` sorted rows of ``experts`` experts can need: an
    expert's last tile is short by at most ``rows - 1``, and at most ``min(experts, total)``
    experts have rows."""
    return (total + min(experts, total) * (rows - 1)) // rows


@triton.jit
def _table_kernel(offsets, expert_out, first_out, count_out, E, total, bound, ROWS: tl.constexpr, BE: tl.constexpr,
                  BT: tl.constexpr):  # fmt: skip
    """``BT`` entries of the tile table (:func:`_tile_table`) from the experts' row offsets: each
    program counts every expert's tiles itself (``E <= BE``), then an entry's expert is the
    number of experts whose tiles all lie before it; the first program stores the count."""
    e = tl.arange(0, BE)
    em = e < E
    lo = tl.load(offsets + e, mask=em, other=0)
    hi = tl.load(offsets + e + 1, mask=em, other=0)
    tiles = (hi - lo + ROWS - 1) // ROWS
    ends = tl.cumsum(tiles, 0)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    before = ends[None, :] <= t[:, None]
    ex = tl.minimum(tl.sum(before.to(tl.int32), 1), E - 1)
    done = tl.sum(tl.where(before, tiles[None, :], 0), 1)
    first = tl.load(offsets + ex) + (t - done) * ROWS
    first = tl.where(t < tl.sum(tiles, 0), first, total)
    tm = t < bound
    tl.store(expert_out + t, ex, mask=tm)
    tl.store(first_out + t, first, mask=tm)
    if tl.program_id(0) == 0:
        tl.store(count_out, tl.sum(tiles, 0))


def _tile_table(offsets: torch.Tensor, total: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(expert, first row, count)`` of the tiles of ``rows`` sorted rows, no tile across two
    experts (an expert with no rows has no tile), from the experts' row offsets
    ``offsets:[E + 1]`` (int32, ``total`` rows in all), int32 on their device, made there in one
    launch: the host never waits for the counts. :func:`tile_bound` entries, the tiles in order
    first; the rest (the launch's spare programs) name the last expert and first row ``total``,
    which holds no row. ``count:[1]``: how many tiles there are (what a persistent launch
    loops over)."""
    E = offsets.numel() - 1
    bound = tile_bound(total, E, rows)
    expert = torch.empty(bound, dtype=torch.int32, device=offsets.device)
    first = torch.empty(bound, dtype=torch.int32, device=offsets.device)
    # written by the launch's first program (a memset would be one more small launch a call)
    count = (torch.empty if bound else torch.zeros)(1, dtype=torch.int32, device=offsets.device)
    if bound:
        bt = 16
        _table_kernel[(triton.cdiv(bound, bt),)](offsets.to(torch.int32).contiguous(), expert, first, count, E,
                                                 total, bound, ROWS=rows, BE=triton.next_power_of_2(E), BT=bt,
                                                 num_warps=8)  # fmt: skip
    return expert, first, count


def _moved(weights: MoEWeights, names: Sequence[str], dev: torch.device, dtype: torch.dtype) -> MoEWeights:
    """``weights`` with the tensors ``names`` on ``dev`` in ``dtype`` (the others as they are; kept
    for the next call inside :func:`~k3verify.numerics.held_casts`)."""
    return dataclasses.replace(weights, **{n: cast_once(getattr(weights, n), dtype, dev) for n in names})


def routed_layer(experts: Experts, x: torch.Tensor, weights: MoEWeights, config: MoEConfig, routing: Routing | None,
                 dev: torch.device, *, dense: Dense | None = None) -> torch.Tensor:  # fmt: skip
    """The layer ``y:[T, d]`` in ``x``'s dtype with its routed experts computed by ``experts``:
    the routing (given, or the fp32 router on ``x``), ``z = x W↓`` rounded to ``x``'s dtype and
    the expert-sorted order on ``dev`` (:class:`~k3verify.moe.chunkwise.SortedPairs`, made on the
    device); ``experts(z, pairs, p, weights)`` returns each
    (token, slot) pair's weighted expert output ``p · E_e(z)`` ``[T k, Dl]`` (fp32 or ``x``'s dtype), row
    ``token k + slot`` (``p:[T k]`` fp32 in sorted order, the expert matrices ``w1, w3, w2`` of
    ``weights`` in ``x``'s dtype on ``dev``); each token's rows are summed in slot order (fp32),
    then ``RMSNorm_γ(u) W↑`` plus the shared MLP. Without ``dense`` the layer's other GEMMs run
    in fp32 on the host's torch; with it they take operands in ``x``'s dtype, as the production
    layer does and the tiled form models (``z`` and ``RMSNorm_γ(u)`` rounded as operands, fp32
    accumulation, the shared hidden stored in ``x``'s dtype, the routed and shared outputs each
    stored in ``x``'s dtype and then added): ``dense.matmul(a, w)`` and ``dense.shared(x, w1, w3,
    w2)`` return their operands' dtype. The host waits on the device once, for the input checks'
    flags: nothing after them reads a device value back. Its parts are named ``moe.*`` to the
    torch profiler (``benchmarks/moe_gpu.py`` names the device's idle gaps after them)."""
    with profiled("moe.checks"):
        dims = check_inputs(x, weights, config, routing)
    op = x.dtype
    # The expert matrices (most of the layer: 59 GB in bf16 at K3's full hidden size) reach the
    # experts in x's dtype only, and with ``dense`` the other GEMMs' matrices too; the router and
    # the norm's scale stay fp32.
    in_op = EXPERT_MATRICES + (DENSE_MATRICES if dense is not None else ())
    others = [n for n in weights.tensors() if n not in in_op]
    w32 = _moved(weights, others, dev, torch.float32)
    # fp32 x for the router (when no routing is given) and the fp32 host path only
    x32 = x.to(dev, torch.float32) if routing is None or dense is None else None
    with profiled("moe.routing"):
        r = routing_for(x if x32 is None else x32, w32, config,
                        None if routing is None else routing.to(torch.float32), torch.float32)  # fmt: skip
    with profiled("moe.dispatch"):
        d = sort_pairs(r.indices.to(dev), dims.E)
    with profiled("moe.unrouted"):
        if dense is None:
            z, shared = (x32 @ w32.w_latent_down).to(op).contiguous(), None
        else:
            wop = _moved(weights, DENSE_MATRICES, dev, op)
            xop = x.to(dev, op).contiguous()
            z = dense.matmul(xop, wop.w_latent_down).contiguous()
            shared = dense.shared(xop, wop.shared_w1, wop.shared_w3, wop.shared_w2)
    with profiled("moe.experts"):
        p = r.weights.to(dev).reshape(-1)[d.order].contiguous()
        out = experts(z, d, p, _moved(weights, EXPERT_MATRICES, dev, op))
    with profiled("moe.output"):
        rows = out.reshape(dims.T, dims.k, dims.Dl)
        if dense is None:
            # each token's rows summed in fp32, in slot order, as the recurrent form
            return layer_output(rows.sum(1, dtype=torch.float32), x32, w32, config).to(op)
        normed = dense.combine(rows, w32.latent_norm, config.rms_norm_eps, op)
        return dense.matmul(normed, wop.w_latent_up) + shared


def _shape(given: Tiles | None, default: Tiles) -> Tiles:
    """The tiles ``given``, else ``default`` on a GPU and the smallest under the interpreter
    (where size is time)."""
    return given or (INTERPRETED_TILES if interpreted() else default)


class _Table(NamedTuple):
    """One tile height's table (:func:`_tile_table`) and the experts' row offsets, in the order
    the grouped kernels take them."""

    expert: torch.Tensor
    first: torch.Tensor
    offsets: torch.Tensor
    count: torch.Tensor


class _RowTables:
    """What a grouped launch reads of one expert-sorted order of ``total`` rows: every row
    tile's expert and first row and the tile count (:func:`_tile_table`), and the experts' row
    offsets (``offsets:[E + 1]`` int32), on the offsets' device; built once per tile height
    for all the launches of a call."""

    def __init__(self, offsets: torch.Tensor, total: int) -> None:
        self.offsets, self.total = offsets, total
        self.made: dict[int, _Table] = {}

    @classmethod
    def whole(cls, total: int, dev: torch.device) -> _RowTables:
        """One expert holding all ``total`` rows (a plain GEMM's)."""
        return cls(torch.arange(2, dtype=torch.int32, device=dev) * total, total)

    def __call__(self, rows: int) -> _Table:
        if rows not in self.made:
            expert, first, count = _tile_table(self.offsets, self.total, rows)
            self.made[rows] = _Table(expert, first, self.offsets, count)
        return self.made[rows]


def _programs(table: _Table, col_tiles: int, tiles: Tiles, dev: torch.device) -> int:
    """A grouped launch's program count: one per output tile the rows could need, or with
    ``tiles.persistent`` that many per multiprocessor (no more than there could be tiles)."""
    most = table.expert.numel() * col_tiles
    return min(most, tiles.persistent * multiprocessors(dev)) if tiles.persistent else most


def _operands(tiles: Tiles, *given: tuple[torch.Tensor, Sequence[int]]) -> tuple[list[object], bool]:
    """The launch's operands ``given`` (tensor, TMA block), contiguous: all as descriptors when
    ``tiles.tma`` and each one allows it, else all as tensors; and whether they are descriptors."""
    tensors = [t.contiguous() for t, _ in given]
    if tiles.tma:
        descs = [tma_descriptor(t, block) for t, (_, block) in zip(tensors, given)]
        if all(d is not None for d in descs):
            return descs, True
    return list(tensors), False


def _up(z: torch.Tensor, token: torch.Tensor, table: _RowTables, w1: torch.Tensor, w3: torch.Tensor,
        config: MoEConfig, tiles: Tiles | None = None) -> torch.Tensor:  # fmt: skip
    """``h = act(z[token] W1_e, z[token] W3_e)`` ``[P, F]`` in ``z``'s dtype for the sorted rows of
    each expert ``e`` (``w1, w3:[E, Dl, F]``; ``tiles`` the launch's shape, default
    :data:`UP_TILES`)."""
    P, (Dl, F) = token.numel(), w1.shape[1:]
    t = _shape(tiles, UP_TILES)
    h = torch.empty(P, F, dtype=z.dtype, device=z.device)
    tab = table(t.rows)
    if tab.expert.numel():
        block = (1, t.depth, t.cols)
        (w1, w3), desc = _operands(t, (w1, block), (w3, block))
        _up_kernel[(_programs(tab, triton.cdiv(F, t.cols), t, z.device),)](
            z, token.to(torch.int32), w1, w3, h, *tab, Dl, F, float(config.beta1), float(config.beta2), BM=t.rows,
            BN=t.cols, BK=t.depth, SWIGLU=config.activation == "swiglu", IEEE=z.dtype == torch.float32, DESC=desc,
            PERSISTENT=t.persistent > 0, num_warps=t.warps, num_stages=t.stages,
        )  # fmt: skip
    return h


def _down(h: torch.Tensor, table: _RowTables, w2: torch.Tensor, p: torch.Tensor, tiles: Tiles | None = None,
          dest: torch.Tensor | None = None, *, dense: bool = False,
          out_dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """``p · (h W2_e)`` ``[P, Dl]`` in ``out_dtype`` (computed in fp32) for the sorted rows of each
    expert (``w2:[E, F, Dl]``), sorted row ``r`` at row ``dest[r]`` when ``dest:[P]`` (int64) is
    given, else at ``r``; ``tiles`` the launch's shape (default :data:`DOWN_TILES`, or
    :data:`DENSE_TILES` for a ``dense`` GEMM: one expert holding every row)."""
    P, (F, Dl) = h.shape[0], w2.shape[1:]
    t = _shape(tiles, DENSE_TILES if dense else DOWN_TILES)
    out = torch.empty(P, Dl, dtype=out_dtype, device=h.device)
    tab = table(t.rows)
    if tab.expert.numel():
        (a, w2), desc = _operands(t, (h, (t.rows, t.depth)), (w2, (1, t.depth, t.cols)))
        _down_kernel[(_programs(tab, triton.cdiv(Dl, t.cols), t, h.device),)](
            a, w2, p, out, p if dest is None else dest, *tab, F, Dl, BM=t.rows, BN=t.cols, BK=t.depth,
            SCATTER=dest is not None, IEEE=h.dtype == torch.float32, DESC=desc, PERSISTENT=t.persistent > 0,
            num_warps=t.warps, num_stages=t.stages,
        )  # fmt: skip
    return out


def _grouped_experts(z: torch.Tensor, d: SortedPairs, p: torch.Tensor, w: MoEWeights, config: MoEConfig,
                     up: Tiles | None = None, down: Tiles | None = None) -> torch.Tensor:  # fmt: skip
    """The two grouped launches on the sorted rows: ``p · SiTU(z W1_e, z W3_e) W2_e`` ``[T k, Dl]``
    in ``z``'s dtype (the weighted product in fp32, stored rounded, as a fused MoE kernel stores
    it and the tiled form models it), each row at its (token, slot) place (the down launch
    stores it there: the combine reads the rows in place). ``up``, ``down``: the launches'
    shapes (default :data:`UP_TILES`, :data:`DOWN_TILES`)."""
    table = _RowTables(d.offsets, d.order.numel())
    h = _up(z, d.token, table, w.w1, w.w3, config, up)
    return _down(h, table, w.w2, p, down, dest=d.order, out_dtype=z.dtype)


@dataclasses.dataclass(frozen=True)
class Dense:
    """The layer's GEMMs outside the experts, operands in their dtype, fp32 sums, results stored
    in the operands' dtype (as the production layer stores them and the tiled form models it):
    ``matmul(a:[M, K], w:[K, N])`` and ``shared(x, w1, w3, w2)``, the shared MLP; and
    ``combine(rows:[T, k, Dl], gain:[Dl] fp32, eps, dtype)``, ``RMSNorm_γ`` of each token's rows
    summed in fp32, in slot order, computed in fp32 and stored in ``dtype`` (the operand of
    ``W↑``)."""

    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    shared: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    combine: Callable[[torch.Tensor, torch.Tensor, float, torch.dtype], torch.Tensor]


@lru_cache(maxsize=16)
def _whole_rows(total: int, dev: torch.device) -> tuple[_RowTables, torch.Tensor, torch.Tensor]:
    """The tile tables, unit weights (fp32) and row indices (int32, each row its own token) of a
    plain GEMM over ``total`` rows on ``dev``: every GEMM of a layer call has the same rows, and
    every call of one width the same, so they are made once (their launches ran in the call's
    first milliseconds, where the device waited for the host)."""
    return (_RowTables.whole(total, dev), torch.ones(total, dtype=torch.float32, device=dev),
            torch.arange(total, dtype=torch.int32, device=dev))  # fmt: skip


def kernel_dense(config: MoEConfig) -> Dense:
    """:class:`Dense` on our grouped launches with one expert holding every row: a plain GEMM is
    the down launch with unit weights, the shared MLP the up launch (its activation fused) and
    then the down launch."""

    def matmul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        table, ones, _ = _whole_rows(a.shape[0], a.device)
        return _down(a.contiguous(), table, w[None], ones, dense=True, out_dtype=a.dtype)

    def shared(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        table, ones, token = _whole_rows(x.shape[0], x.device)
        h = _up(x, token, table, w1[None], w3[None], config)
        return _down(h, table, w2[None], ones, dense=True, out_dtype=x.dtype)

    return Dense(matmul, shared, combine_norm)


def combine_norm(rows: torch.Tensor, gain: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """``RMSNorm_γ(u)`` ``[T, Dl]`` in ``dtype``, ``u`` each token's ``k`` rows of ``rows:[T, k, Dl]``
    (any float dtype) summed in fp32 in slot order, the norm in fp32 with ``gain:[Dl]`` (fp32),
    in one launch of one program per token: the rows are read once (at K3 and T = 16384 on an
    H100: 0.66 ms, against 1.45 ms for the sum, the norm and the rounding as torch operations,
    which pass over the fp32 sum several times)."""
    T, k, Dl = rows.shape
    normed = torch.empty(T, Dl, dtype=dtype, device=rows.device)
    if T:
        bd = triton.next_power_of_2(Dl)
        _combine_kernel[(T,)](rows.contiguous(), gain.to(rows.device, torch.float32).contiguous(), normed, Dl,
                              float(eps), K=k, BD=bd, num_warps=max(1, min(8, bd // 512)))  # fmt: skip
    return normed


def grouped(x: torch.Tensor, weights: MoEWeights, config: MoEConfig, *, routing: Routing | None = None,
            production: bool = False) -> torch.Tensor:  # fmt: skip
    """The layer ``y:[T, d]`` in ``x``'s dtype with the routed experts in the grouped kernels
    (module docstring); ``routing`` as the forms take it (default: the fp32 router on ``x``).
    ``production``: the layer's other GEMMs (``x W↓``, ``RMSNorm_γ(u) W↑``, the shared MLP) in
    the same kernels with operands in ``x``'s dtype, as the production layer runs them, instead
    of fp32 torch operations."""
    reason = experts_unavailable_reason(x.dtype)
    if reason is not None:
        raise RuntimeError(reason)
    experts = partial(_grouped_experts, config=config)
    dense = kernel_dense(config) if production else None
    return routed_layer(experts, x, weights, config, routing, device_for(x, "the MoE expert kernels"), dense=dense)
