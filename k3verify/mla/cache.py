"""The paged latent cache of Gated MLA (docs/model.md §2.1, §2.3).

Per layer and token, MLA caches one entry of ``W = R + Dr`` numbers in the released layout

    entry = [ ĉ (R = 512, RMSNorm-ed) ; k^p (Dr = 64, shared by all heads, not normalised, not rotated) ]

576 numbers for K3; the seed's "576-d c_t" is exactly this concatenation (see
:func:`split_entry`). Expanded K/V (``96 · (192 + 128) = 30720`` numbers) are never stored.

Layout (vLLM's paged KV cache). A pool of ``P`` pages of ``page_size`` token slots,

    pool:[P, page_size, W],   block_table:[B, max_pages] (int),   seq_lens:[B] (int)

request ``b`` holds ``seq_lens[b]`` tokens; its logical position ``j`` lives at
``pool[block_table[b, j // page_size], j % page_size]``. Pages may sit anywhere in the pool in
any order. Every slot not covered by some ``j < seq_lens[b]`` is *not* cache: it may hold
anything (tests poison it with NaN) and no form may let it reach an output. Block-table entries
past a request's last live page are ignored (``-1`` by convention).

Quantised storage (the fp8 e4m3 latent cache). Each token's entry gets one scale

    s = amax / max(fp8),   amax = max_i |entry_i|   (s = 1 for an all-zero entry)

and the pool stores the codes ``round_to(entry / s, fp8)`` (computed in fp32, round to nearest
even) as real ``torch.float8_*`` storage, the scales as fp32 ``[P, page_size]``. Readers
multiply back in their compute dtype (fp32, or fp64 where the product is exact). The choice
``amax / max`` maps the token's largest magnitude onto the format's largest finite value: no
code can overflow, whatever the activation magnitude, and the largest entries keep the full
mantissa; small entries of a token with one large outlier lose relative precision (the price of
one scale per token instead of per group).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..numerics import facts, is_float8, resolve_dtype, round_to
from ..numerics.validate import require_positive_int

FP8_STORAGE = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class LatentCache:
    """One layer's paged latent cache for a batch of requests (layout in the module docstring).

    ``pool:[P, page_size, W]`` in a float dtype, or a ``torch.float8_*`` dtype holding codes
    when ``scales:[P, page_size]`` (fp32) is given. ``block_table:[B, max_pages]`` and
    ``seq_lens:[B]`` are integer tensors. Nothing is checked here; every form checks the
    cache it is given (``k3verify.mla.inputs.check_inputs``).
    """

    pool: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    scales: torch.Tensor | None = None

    @property
    def page_size(self) -> int:
        return int(self.pool.shape[1])

    @property
    def num_pages(self) -> int:
        return int(self.pool.shape[0])

    @property
    def width(self) -> int:
        """Numbers cached per token: ``R + Dr`` (576 for K3)."""
        return int(self.pool.shape[-1])

    @property
    def batch(self) -> int:
        return int(self.block_table.shape[0])

    @property
    def quantized(self) -> bool:
        """True when the pool holds fp8 codes with per-token scales."""
        return self.scales is not None

    @property
    def lengths(self) -> list[int]:
        """``seq_lens`` as Python ints."""
        return [int(n) for n in self.seq_lens.tolist()]

    def clone(self) -> LatentCache:
        """A copy that shares no memory with this cache (a function may write into it)."""
        return LatentCache(*(None if t is None else t.clone()
                             for t in (self.pool, self.block_table, self.seq_lens, self.scales)))

    def to(self, dtype: torch.dtype | str) -> LatentCache:
        """The same cache with an unquantised pool cast to ``dtype`` (a quantised cache is returned as is).

        Poisoned slots stay poisoned: NaN survives every cast.
        """
        if self.quantized:
            return self
        return replace(self, pool=self.pool.to(resolve_dtype(dtype)))


def split_entry(entry: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., R + Dr] -> (ĉ [..., R], k^p [..., Dr])``: the released view of the seed's 576-d ``c_t``."""
    return entry[..., :kv_lora_rank], entry[..., kv_lora_rank:]


def allocate(
    batch: int,
    max_tokens: int,
    page_size: int,
    width: int,
    *,
    dtype: torch.dtype | str = torch.float64,
    device: torch.device | str = "cpu",
    page_order: str | torch.Tensor = "shuffled",
    spare_pages: int = 1,
    generator: torch.Generator | None = None,
    storage: torch.dtype | str | None = None,
) -> LatentCache:
    """An empty cache with room for ``max_tokens`` per request, every slot poisoned with NaN.

    ``page_order``: ``"in_order"`` (request 0 gets pages 0, 1, ...), ``"shuffled"`` (a random
    permutation from ``generator``) or an explicit permutation of ``range(num_pages)`` whose
    first ``batch * pages_per_request`` entries are handed out row by row. ``spare_pages``
    extra pages stay unowned (poisoned) so that out-of-order placement leaves gaps.
    ``storage`` = ``"fp8_e4m3"``/``"fp8_e5m2"`` makes a quantised cache (pool of codes + fp32
    scales); otherwise the pool has ``dtype``.
    """
    require_positive_int("batch", batch)
    require_positive_int("page_size", page_size)
    require_positive_int("width", width)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise ValueError(f"max_tokens must be a non-negative integer, got {max_tokens!r}")
    if isinstance(spare_pages, bool) or not isinstance(spare_pages, int) or spare_pages < 0:
        raise ValueError(f"spare_pages must be a non-negative integer, got {spare_pages!r}")
    per_request = max(1, -(-max_tokens // page_size))
    num_pages = batch * per_request + spare_pages
    order = _page_order(page_order, num_pages, generator)
    block_table = order[: batch * per_request].reshape(batch, per_request).to(device)
    seq_lens = torch.zeros(batch, dtype=torch.int64, device=device)
    if storage is None:
        pool = torch.full((num_pages, page_size, width), float("nan"), dtype=resolve_dtype(dtype), device=device)
        return LatentCache(pool, block_table, seq_lens)
    code_dtype = _fp8_storage(storage)
    pool = torch.full((num_pages, page_size, width), float("nan"), device=device).to(code_dtype)
    scales = torch.full((num_pages, page_size), float("nan"), dtype=torch.float32, device=device)
    return LatentCache(pool, block_table, seq_lens, scales)


def _page_order(page_order: str | torch.Tensor, num_pages: int, generator: torch.Generator | None) -> torch.Tensor:
    if isinstance(page_order, torch.Tensor):
        order = page_order.to(torch.int64).cpu()
        if sorted(order.tolist()) != list(range(num_pages)):
            raise ValueError(f"page_order must be a permutation of range({num_pages}), got {order.tolist()}")
        return order
    if page_order == "in_order":
        return torch.arange(num_pages)
    if page_order == "shuffled":
        return torch.randperm(num_pages, generator=generator)
    raise ValueError(f"page_order must be 'in_order', 'shuffled' or a permutation tensor, got {page_order!r}")


def _fp8_storage(storage: torch.dtype | str) -> torch.dtype:
    dtype = resolve_dtype(storage)
    if dtype not in FP8_STORAGE:
        raise ValueError(f"quantised storage must be an fp8 format (fp8_e4m3, fp8_e5m2), got {dtype}")
    return dtype


def quantize_entries(
    entries: torch.Tensor, storage: torch.dtype | str = "fp8_e4m3"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp8 codes and scales of ``entries:[..., W]`` (see the module docstring).

    Returns ``(codes [..., W] in the fp8 dtype, scales [...] fp32)``. Computed in fp32, the
    cache writer's arithmetic; a NaN entry (poison) gives NaN codes.
    """
    code_dtype = _fp8_storage(storage)
    x = entries.to(torch.float32)
    amax = x.abs().amax(-1)
    scales = torch.where(amax > 0, amax / facts(code_dtype).max, torch.ones_like(amax))
    scales = torch.where(torch.isnan(amax), amax, scales)
    codes = round_to(x / scales[..., None], code_dtype)
    # The values are exact fp8 numbers now, so this cast only changes the storage.
    return codes.to(code_dtype), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes * scales`` computed in ``dtype`` (fp32 in kernels; fp64 is exact)."""
    return codes.to(dtype) * scales.to(dtype)[..., None]


def slots_of(cache: LatentCache, positions: torch.Tensor) -> torch.Tensor:
    """Flat slot index ``page * page_size + offset`` of logical ``positions:[B, N]`` (no bounds check)."""
    ps = cache.page_size
    pages = torch.gather(cache.block_table.to(torch.int64), 1, positions // ps)
    return pages * ps + positions % ps


def append(cache: LatentCache, entries: torch.Tensor) -> LatentCache:
    """A new cache with ``entries:[B, T, W]`` written after each request's last token.

    Token ``t`` of request ``b`` goes to logical position ``seq_lens[b] + t``; a quantised cache
    stores it through :func:`quantize_entries`. The input cache is not modified.
    """
    B, T = _check_append(cache, entries)
    lens = cache.seq_lens.to(torch.int64)
    positions = lens[:, None] + torch.arange(T, device=lens.device)[None, :]
    return _write(cache, entries, positions, torch.ones(B, T, dtype=torch.bool, device=lens.device))


def build(
    entries: torch.Tensor,
    seq_lens: Sequence[int] | torch.Tensor,
    page_size: int,
    *,
    page_order: str | torch.Tensor = "shuffled",
    spare_pages: int = 1,
    generator: torch.Generator | None = None,
    storage: torch.dtype | str | None = None,
    capacity: int | None = None,
) -> LatentCache:
    """A cache holding ``entries[b, :seq_lens[b]]`` for each request (``entries:[B, L, W]``).

    Slots past each request's length stay NaN-poisoned. ``capacity`` (tokens per request,
    default ``L``) leaves room for later :func:`append` calls.
    """
    if entries.dim() != 3:
        raise ValueError(f"entries has shape {list(entries.shape)}; expected [B, L, W]")
    B, L, W = entries.shape
    lens = torch.as_tensor(seq_lens, dtype=torch.int64)
    if lens.shape != (B,) or bool((lens < 0).any()) or bool((lens > L).any()):
        raise ValueError(f"seq_lens must be {B} lengths in [0, {L}], got {lens.tolist()}")
    cap = L if capacity is None else capacity
    if cap < L:
        raise ValueError(f"capacity {cap} is smaller than the {L} tokens given")
    cache = allocate(B, cap, page_size, W, dtype=entries.dtype, device=entries.device, page_order=page_order,
                     spare_pages=spare_pages, generator=generator, storage=storage)
    positions = torch.arange(L)[None, :].expand(B, L)
    return _write(cache, entries, positions, positions < lens[:, None])


def quantize(cache: LatentCache, storage: torch.dtype | str = "fp8_e4m3") -> LatentCache:
    """The fp8 cache a kernel would hold for the same tokens: live slots quantised per token.

    Slots that are not live stay poisoned (NaN codes and NaN scales).
    """
    if cache.quantized:
        raise ValueError("cache is already quantised")
    live = live_slots(cache)
    codes, scales = quantize_entries(cache.pool, storage)
    nan = torch.tensor(float("nan"))
    codes = torch.where(live[..., None], codes.to(torch.float32), nan).to(codes.dtype)
    scales = torch.where(live, scales, nan)
    return LatentCache(codes, cache.block_table, cache.seq_lens, scales)


def live_slots(cache: LatentCache) -> torch.Tensor:
    """``[P, page_size]`` bool: the slots that hold a live token of some request."""
    live = torch.zeros(cache.num_pages * cache.page_size, dtype=torch.bool, device=cache.pool.device)
    Lmax = max(cache.lengths, default=0)
    if Lmax:
        positions = torch.arange(Lmax, device=live.device)[None, :].expand(cache.batch, Lmax)
        valid = positions < cache.seq_lens.to(torch.int64)[:, None]
        live[slots_of(cache, torch.where(valid, positions, 0))[valid]] = True
    return live.reshape(cache.num_pages, cache.page_size)


def token_slots(cache: LatentCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat slot of every logical position: ``(slots [B, Lmax] int64, valid [B, Lmax] bool)``.

    ``slots`` indexes ``pool.reshape(-1, W)``; dead positions (``j >= seq_lens[b]``) get some
    in-range slot (indices are clamped) and ``valid = False``. Assumes a checked layout.
    """
    B = cache.batch
    lens = cache.seq_lens.to(torch.int64)
    Lmax = max(cache.lengths, default=0)
    positions = torch.arange(Lmax, device=lens.device)[None, :].expand(B, Lmax)
    valid = positions < lens[:, None]
    page_index = (positions // cache.page_size).clamp(max=cache.block_table.shape[1] - 1)
    pages = torch.gather(cache.block_table.to(torch.int64), 1, page_index)
    pages = torch.where(valid, pages, 0).clamp(0, cache.num_pages - 1)
    return pages * cache.page_size + positions % cache.page_size, valid


def gather(cache: LatentCache, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Read every live token: ``(entries [B, Lmax, W] in dtype, valid [B, Lmax] bool)``.

    Positions ``j >= seq_lens[b]`` come back as exact zeros and ``valid = False``: whatever their
    slot holds (NaN poison included) is selected away by ``torch.where``, never multiplied,
    so it cannot leak into any product. Quantised caches are dequantised in ``dtype``.
    """
    slots, valid = token_slots(cache)
    flat = cache.pool.reshape(-1, cache.width)[slots]
    if cache.quantized:
        values = dequantize(flat, cache.scales.reshape(-1)[slots], dtype)
    else:
        values = flat.to(dtype)
    return torch.where(valid[..., None], values, torch.zeros((), dtype=dtype, device=values.device)), valid


def live_entries(cache: LatentCache) -> torch.Tensor:
    """The logical contents of the cache: every request's live entries in order, ``[B, Lmax, W]``,
    zeros past each request's length (dead slots never show, NaN poison included).

    An unquantised cache comes back in its pool's dtype; a quantised one as its codes times
    their per-token scales, in fp64 (where that product of an fp8 code and an fp32 scale is
    exact), so two caches holding the same codes and scales compare equal bit for bit.
    """
    return gather(cache, torch.float64 if cache.quantized else cache.pool.dtype)[0]


def _check_append(cache: LatentCache, entries: torch.Tensor) -> tuple[int, int]:
    if not isinstance(cache, LatentCache):
        raise TypeError(f"cache must be a LatentCache, got {type(cache).__name__}")
    if not isinstance(entries, torch.Tensor):
        raise TypeError(f"entries must be a torch.Tensor, got {type(entries).__name__}")
    if entries.dim() != 3 or entries.shape[0] != cache.batch or entries.shape[2] != cache.width:
        raise ValueError(f"entries has shape {list(entries.shape)}; expected [B={cache.batch}, T, W={cache.width}]")
    B, T, _ = entries.shape
    room = cache.block_table.shape[1] * cache.page_size
    full = [b for b, n in enumerate(cache.lengths) if n + T > room]
    if full:
        raise ValueError(f"cache has room for {room} tokens per request; request(s) {full} would exceed it")
    return B, T


def _write(cache: LatentCache, entries: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> LatentCache:
    """Write ``entries[b, i]`` at logical ``positions[b, i]`` where ``valid``; returns the new cache."""
    lens = cache.seq_lens.to(torch.int64)
    new_lens = torch.maximum(lens, torch.where(valid, positions + 1, 0).amax(-1) if positions.numel() else lens)
    pages = torch.gather(cache.block_table.to(torch.int64), 1, torch.where(valid, positions, 0) // cache.page_size)
    bad = valid & ((pages < 0) | (pages >= cache.num_pages))
    if bool(bad.any()):
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"cache.block_table has no valid page for request {b}, position {int(positions[b, i])}")
    slots = (pages * cache.page_size + positions % cache.page_size)[valid]
    rows = entries[valid]
    pool = cache.pool.clone().reshape(-1, cache.width)
    if cache.quantized:
        codes, scales = quantize_entries(rows, cache.pool.dtype)
        pool[slots] = codes
        flat_scales = cache.scales.clone().reshape(-1)
        flat_scales[slots] = scales
        new_scales = flat_scales.reshape(cache.scales.shape)
    else:
        if is_float8(cache.pool.dtype):
            raise TypeError("an fp8 pool needs scales; build it with storage='fp8_e4m3'")
        pool[slots] = rows.to(cache.pool.dtype)
        new_scales = None
    return LatentCache(pool.reshape(cache.pool.shape), cache.block_table, new_lens, new_scales)


def with_entries(cache: LatentCache, entries: torch.Tensor) -> LatentCache:
    """``cache`` with its live entries replaced by ``entries:[B, Lmax, W]`` (same pages and slots,
    dead slots as they were), differentiable in ``entries``: autograd reaches the latent entries
    through any form that reads the cache. Unquantised caches only."""
    if cache.quantized:
        raise ValueError("with_entries needs an unquantised cache (an fp8 code has no gradient)")
    slots, valid = token_slots(cache)
    flat = cache.pool.reshape(-1, cache.width).to(entries.dtype)
    flat = flat.index_put((slots[valid],), entries[valid])
    return LatentCache(flat.reshape(cache.pool.shape), cache.block_table, cache.seq_lens)


def release(cache: LatentCache, lengths: Sequence[int]) -> LatentCache:
    """``cache`` cut back to ``lengths[b] <= seq_lens[b]`` tokens per request (a speculative
    decoder rolling back rejected tokens): the released slots are poisoned with NaN again, so a
    form that still read them would show it. The input cache is not modified."""
    keep = torch.as_tensor(list(lengths), dtype=torch.int64, device=cache.seq_lens.device)
    old = cache.seq_lens.to(torch.int64)
    if keep.shape != old.shape or bool((keep < 0).any()) or bool((keep > old).any()):
        raise ValueError(f"release keeps 0 <= n <= seq_lens per request; got {keep.tolist()} for {old.tolist()}")
    Lmax = int(old.max()) if old.numel() else 0
    positions = torch.arange(Lmax, device=old.device)[None, :].expand(cache.batch, Lmax)
    freed = (positions >= keep[:, None]) & (positions < old[:, None])
    slots = slots_of(cache, torch.where(freed, positions, 0))[freed]
    pool = cache.pool.clone().reshape(-1, cache.width)
    pool[slots] = torch.full((), float("nan"), device=pool.device).to(pool.dtype)
    scales = None
    if cache.quantized:
        scales = cache.scales.clone().reshape(-1)
        scales[slots] = float("nan")
        scales = scales.reshape(cache.scales.shape)
    return LatentCache(pool.reshape(cache.pool.shape), cache.block_table, keep.to(cache.seq_lens.dtype), scales)
