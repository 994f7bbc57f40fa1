"""torch's ``flex_attention`` behind k3verify's Gated MLA signature: absorbed decode (docs/model.md §2.4).

What the adapter hands it: the absorbed queries ``[W_UK,hᵀ q^n_h ; q^p_h]`` (fp32 product, then
the operand dtype) for every head, and one shared key/value head (``enable_gqa``): keys the
cached entries ``[ĉ ; k^p]`` (576 wide for K3), values their latent part ``ĉ`` (512), read
through ``block_table`` into a contiguous copy first (an fp8 cache dequantised per token into
the operand dtype, as our kernel does); flex's own paged attention is experimental in torch, so
the page indirection is torch's gather, not flex's. The mask gives query ``t`` of request ``b``
the keys ``j <= seq_lens[b] − T + t``. flex keeps its softmax in fp32 and writes the latent
output in the operand dtype; ``o_h = W_UV,hᵀ o_lat,h`` is an fp32 product, written in the
operand dtype.

The rows need a CUDA device (flex compiled by inductor, as deployments run it);
``compiled=False`` runs flex eagerly on any device, which tests the adapter's arithmetic.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from ..mla.cache import LatentCache, gather
from ..mla.inputs import check_inputs
from ..mla.recurrent import absorb_output, absorb_query
from ..numerics import map_tensors


def unavailable_reason() -> str | None:
    """Why the compiled flex rows cannot run here, or ``None``."""
    if not torch.cuda.is_available():
        return "torch flex_attention (compiled) needs a CUDA device here"
    return None


@lru_cache(maxsize=1)
def _compiled() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def decode(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: LatentCache, w_uk: torch.Tensor, w_uv: torch.Tensor,
           *, scale: float | None = None, compiled: bool = True,
           kernel_options: dict[str, Any] | None = None) -> torch.Tensor:  # fmt: skip
    """Absorbed attention by flex_attention (the common MLA signature): ``o:[B, T, H, Dv]`` in
    the queries' dtype; ``kernel_options`` are passed to flex as they are."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    dims, scale = check_inputs(q_nope, q_pe, cache, w_uk, w_uv, scale)
    if compiled and unavailable_reason() is not None:
        raise RuntimeError(unavailable_reason())
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    op = q_nope.dtype
    q_lat = absorb_query(q_nope.to(dev, torch.float32), w_uk.to(dev, torch.float32)).to(op)
    q = torch.cat([q_lat, q_pe.to(dev)], dim=-1).transpose(1, 2).contiguous()  # [B, H, T, R + Dr]
    moved = map_tensors(cache, lambda t: t.to(dev))
    entries, _ = gather(moved, torch.float32)
    keys = entries.to(op)[:, None].contiguous()  # [B, 1, L, R + Dr]
    values = keys[..., : w_uk.shape[1]].contiguous()
    last = moved.seq_lens.to(torch.int64) - dims.T  # query t sees keys <= last[b] + t

    def visible(b, h, q_idx, kv_idx):
        return kv_idx <= last[b] + q_idx

    block_mask = create_block_mask(visible, dims.B, None, dims.T, keys.shape[2], device=dev)
    attend = _compiled() if compiled else flex_attention
    o_lat = attend(q, keys, values, block_mask=block_mask, scale=scale, enable_gqa=True, kernel_options=kernel_options)
    return absorb_output(o_lat.float(), w_uv.to(dev, torch.float32)).to(op)
