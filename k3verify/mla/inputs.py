"""Argument checking shared by the Gated MLA forms, and the one signature they all take.

Every form is called as

    form(q_nope, q_pe, cache, w_uk, w_uv, *, scale=None, chunk_size=64, tile=64,
         operand_dtype="bf16", num_splits=1, subtract_max=True, overflow="nonfinite") -> o

- ``q_nope:[B, T, H, Dn]``, ``q_pe:[B, T, H, Dr]``: per-head query parts of the last ``T``
  tokens of each request (``Dn = 128``, ``Dr = 64`` in K3); query ``t`` of request ``b`` sits at
  absolute position ``seq_lens[b] - T + t`` and attends causally to positions ``<=`` it.
- ``cache``: a :class:`~k3verify.mla.cache.LatentCache` already holding those ``T`` tokens
  (a layer writes the new latents first, then attends, as vLLM does).
- ``w_uk:[H, R, Dn]`` (``W_UK,h``, so ``k^n_h = W_UK,hᵀ ĉ``), ``w_uv:[H, R, Dv]`` (``W_UV,h``).
- returns ``o:[B, T, H, Dv]``, per-head attention outputs before the gate and ``o_proj``.

``scale`` defaults to ``(Dn + Dr)^-1/2`` — the qk head dim (192 in K3), never the cached
width ``R + Dr`` (576). ``chunk_size`` is used by ``chunkwise``; ``tile``, ``operand_dtype``,
``num_splits``, ``subtract_max`` and ``overflow`` by ``tiled``. Every form validates all of them
and ignores those it does not use, so one call site can switch forms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..numerics import compute_dtype, resolve_dtype
from ..numerics.rounding import OVERFLOW_MODES
from ..numerics.validate import (
    require_block,
    require_finite,
    require_float,
    require_on_device,
    require_same,
    require_shape,
    require_tensor,
)
from .cache import FP8_STORAGE, LatentCache, token_slots

INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass(frozen=True)
class Dims:
    """Sizes of one MLA call."""

    B: int
    T: int
    H: int
    Dn: int  # per-head content ("nope") query/key dim, 128
    Dr: int  # shared key part, 64 (released name qk_rope_head_dim; not rotated in K3)
    R: int  # latent rank, 512
    Dv: int  # value head dim, 128
    page_size: int
    lengths: tuple[int, ...]

    @property
    def W(self) -> int:
        """Cached numbers per token, ``R + Dr``."""
        return self.R + self.Dr


@dataclass(frozen=True)
class FormOptions:
    """The keyword options of the common signature, validated on construction."""

    chunk_size: int = 64
    tile: int = 64
    operand_dtype: torch.dtype | str = torch.bfloat16
    num_splits: int = 1
    subtract_max: bool = True
    overflow: str = "nonfinite"

    def __post_init__(self) -> None:
        require_block("chunk_size", self.chunk_size)
        require_block("tile", self.tile)
        require_block("num_splits", self.num_splits)
        object.__setattr__(self, "operand_dtype", resolve_dtype(self.operand_dtype))
        if not isinstance(self.subtract_max, bool):
            raise TypeError(f"subtract_max must be a bool, got {type(self.subtract_max).__name__}")
        if self.overflow not in OVERFLOW_MODES:
            raise ValueError(f"overflow must be one of {OVERFLOW_MODES}, got {self.overflow!r}")


def check_inputs(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: LatentCache,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float | None,
) -> tuple[Dims, float]:
    """Validate one call; return its sizes and the effective softmax scale.

    Raises ``TypeError``/``ValueError`` naming the argument for wrong types, shapes, mixed
    dtypes or devices, non-finite queries or weights, non-finite *live* cache slots (poison in
    dead slots is allowed), block-table entries outside the pool, lengths shorter than the
    query block or longer than the pages assigned, and a non-positive scale.
    """
    names = ["q_nope", "q_pe", "w_uk", "w_uv"]
    tensors = [require_tensor(n, t) for n, t in zip(names, (q_nope, q_pe, w_uk, w_uv))]
    if not isinstance(cache, LatentCache):
        raise TypeError(f"cache must be a k3verify.mla.LatentCache, got {type(cache).__name__}")
    for n in ("pool", "block_table", "seq_lens"):
        require_tensor(f"cache.{n}", getattr(cache, n))
    for n, t in zip(names, tensors):
        require_float(n, t)
        require_on_device(n, t)
    require_on_device("cache.pool", cache.pool)
    if cache.quantized:
        require_tensor("cache.scales", cache.scales)
        require_float("cache.pool", cache.pool, FP8_STORAGE)
        require_float("cache.scales", cache.scales, (torch.float32, torch.float64))
        require_same(names, tensors, "dtype")
    else:
        require_float("cache.pool", cache.pool)
        require_same([*names, "cache.pool"], [*tensors, cache.pool], "dtype")
    for n in ("block_table", "seq_lens"):
        if getattr(cache, n).dtype not in INTEGER_DTYPES:
            raise TypeError(f"cache.{n} has dtype {getattr(cache, n).dtype}; expected an integer dtype")
    devices = [*tensors, cache.pool, cache.block_table, cache.seq_lens]
    require_same([*names, "cache.pool", "cache.block_table", "cache.seq_lens"], devices, "device")

    if q_nope.dim() != 4:
        raise ValueError(f"q_nope has shape {list(q_nope.shape)}; expected [B, T, H, Dn]")
    B, T, H, Dn = q_nope.shape
    if q_pe.dim() != 4:
        raise ValueError(f"q_pe has shape {list(q_pe.shape)}; expected [B, T, H, Dr]")
    Dr = q_pe.shape[-1]
    require_shape("q_pe", q_pe, (B, T, H, Dr), "B,T,H,Dr")
    for n, t, last in (("w_uk", w_uk, "Dn"), ("w_uv", w_uv, "Dv")):
        if t.dim() != 3:
            raise ValueError(f"{n} has shape {list(t.shape)}; expected [H, R, {last}]")
    if cache.pool.dim() != 3:
        raise ValueError(f"cache.pool has shape {list(cache.pool.shape)}; expected [P, page_size, W = R + Dr]")
    # R appears in w_uk, w_uv and the cache width; two agreeing sources outvote the third,
    # so the error names the argument that is actually off.
    R = w_uk.shape[1] if w_uk.shape[1] == w_uv.shape[1] else cache.pool.shape[-1] - Dr
    Dv = w_uv.shape[-1]
    require_shape("w_uk", w_uk, (H, R, Dn), "H,R,Dn")
    require_shape("w_uv", w_uv, (H, R, Dv), "H,R,Dv")
    require_shape("cache.pool", cache.pool, (None, None, R + Dr), "P,page_size,W")
    P, page_size = cache.pool.shape[:2]
    if cache.quantized:
        require_shape("cache.scales", cache.scales, (P, page_size), "P,page_size")
    if cache.block_table.dim() != 2:
        raise ValueError(f"cache.block_table has shape {list(cache.block_table.shape)}; expected [B={B}, max_pages]")
    require_shape("cache.block_table", cache.block_table, (B, None), "B,max_pages")
    require_shape("cache.seq_lens", cache.seq_lens, (B,), "B")
    if min(B, H, Dn, Dr, R, Dv, P, page_size) == 0:
        raise ValueError(f"empty dimension in B={B}, H={H}, Dn={Dn}, Dr={Dr}, R={R}, Dv={Dv}, "
                         f"pages={P}, page_size={page_size}")

    lengths = _check_layout(cache, T, page_size, P)
    for n, t in zip(names, tensors):
        require_finite(n, t)
    _check_live_slots(cache)
    return Dims(B, T, H, Dn, Dr, R, Dv, page_size, tuple(lengths)), _scale(scale, Dn + Dr)


def _check_layout(cache: LatentCache, T: int, page_size: int, P: int) -> list[int]:
    lengths = cache.lengths
    room = cache.block_table.shape[1] * page_size
    owner: dict[int, tuple[int, int]] = {}  # live page -> (request, block_table column)
    for b, n in enumerate(lengths):
        if n < T:
            raise ValueError(f"cache.seq_lens[{b}] = {n} is shorter than the {T} query tokens; "
                             "the cache must already hold the tokens being attended from")
        if n > room:
            raise ValueError(f"cache.seq_lens[{b}] = {n} exceeds the {room} slots its block_table row can address")
        pages = cache.block_table[b, : -(-n // page_size)]
        bad = (pages < 0) | (pages >= P)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"cache.block_table[{b}, {i}] = {int(pages[i])} points outside the pool of {P} pages "
                             f"(request {b} has {n} live tokens)")
        for i, page in enumerate(pages.tolist()):
            if page in owner:
                raise ValueError(f"cache.block_table[{b}, {i}] = {page} is also cache.block_table"
                                 f"[{owner[page][0]}, {owner[page][1]}]: two live positions would share one page")
            owner[page] = (b, i)
    return lengths


def _check_live_slots(cache: LatentCache) -> None:
    """Live slots (and their scales) must be finite; poison elsewhere is fine."""
    slots, valid = token_slots(cache)
    codes = cache.pool.reshape(-1, cache.width)[slots].to(torch.float64)
    _report("cache.pool", valid & ~torch.isfinite(codes).all(-1), "non-finite value(s)")
    if cache.quantized:
        scales = cache.scales.reshape(-1)[slots]
        _report("cache.scales", valid & ~(torch.isfinite(scales) & (scales > 0)),
                "non-finite or non-positive per-token scale(s)")


def _report(name: str, bad: torch.Tensor, what: str) -> None:
    if bool(bad.any()):
        b, j = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name} has {what} in {int(bad.sum())} live token slot(s) "
                         f"(first: request {b}, position {j})")


def _scale(scale: float | None, qk_head_dim: int) -> float:
    if scale is None:
        return float(qk_head_dim) ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a number, got {type(scale).__name__}")
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return float(scale)


def working_dtype(x: torch.Tensor) -> torch.dtype:
    """fp64 for fp64 inputs, fp32 otherwise (see ``numerics.compute_dtype``)."""
    return compute_dtype(x.dtype)


def query_positions(dims: Dims, device: torch.device | str = "cpu") -> torch.Tensor:
    """Absolute position ``seq_lens[b] - T + t`` of every query: ``[B, T]`` int64."""
    lens = torch.tensor(dims.lengths, dtype=torch.int64, device=device)
    return lens[:, None] - dims.T + torch.arange(dims.T, device=device)[None, :]


def key_mask(dims: Dims, key_positions: torch.Tensor) -> torch.Tensor:
    """Which keys each query may see: ``[B, 1, T, N]`` for ``key_positions:[B, N]``.

    A key is visible when it is live (``< seq_lens[b]``, implied by causality) and not in the
    query's future (``<=`` the query's position).
    """
    q_pos = query_positions(dims, key_positions.device)
    return (key_positions[:, None, :] <= q_pos[:, :, None])[:, None]


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, H, D] -> [B, H, T, D]``."""
    return x.transpose(1, 2)
