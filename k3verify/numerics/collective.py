"""The one collective the sharded forms need: a sum over ranks in a chosen dtype, which is what
decides what a tensor-parallel reduction costs (bf16 sums round after every rank's term)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .dtypes import resolve_dtype


def all_reduce(t: torch.Tensor, dtype: torch.dtype | str) -> torch.Tensor:
    """The sum of ``t`` over every rank, taken in ``dtype``, returned in ``t``'s dtype. ``t`` is
    left as it was (the collective works in place, and ``to`` of the same dtype would not copy)."""
    buf = t.to(resolve_dtype(dtype), copy=True).contiguous()
    dist.all_reduce(buf)
    return buf.to(t.dtype)
