"""torch's ``_grouped_mm`` behind k3verify's Stable LatentMoE signature: the routed experts as two
grouped GEMMs with SiTU applied between them.

The layer around it is ours (:func:`k3verify.moe.kernels.routed_layer`: the routing, ``z = x
W↓``, the expert-sorted order, each token's rows summed in slot order, ``RMSNorm_γ(u) W↑`` and
the shared MLP in fp32), so a row compares the expert GEMMs alone:

1. the sorted rows of ``z`` written out (``z[token]``, the permutation a grouped GEMM needs);
2. ``[g | u] = z [W1_e | W3_e]`` in one ``torch._grouped_mm`` over the experts' row groups
   (``offs``: each group's end), output in the operand dtype;
3. SiTU (or SwiGLU) by :func:`k3verify.moe.situ.activation` in fp32 from those rounded
   pre-activations, then the operand dtype;
4. ``h W2_e`` in a second ``_grouped_mm``, output in the operand dtype, scaled by the routing
   weights in fp32.

On CUDA (Hopper) ``_grouped_mm`` runs CUTLASS in bf16; torch builds without it fall back to a
loop of matrix products, which is what runs on the CPU (there the rows test the adapter's own
arithmetic).
"""

from __future__ import annotations

from functools import lru_cache, partial

import torch

from ..moe.chunkwise import SortedPairs
from ..moe.inputs import MoEConfig, MoEWeights, Routing
from ..moe.kernels import routed_layer
from ..moe.situ import activation


@lru_cache(maxsize=1)
def _cpu_fallback() -> str | None:
    """Why torch cannot run ``_grouped_mm`` on the CPU (its loop of matrix products), or ``None``."""
    try:
        torch._grouped_mm(torch.zeros(2, 16), torch.zeros(1, 16, 16), offs=torch.tensor([2], dtype=torch.int32))
    except Exception as exc:  # the reason is the row's
        return f"torch {torch.__version__} runs no _grouped_mm on the CPU ({type(exc).__name__})"
    return None


def unavailable_reason(dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why ``_grouped_mm`` cannot run here for ``dtype`` (bf16: CUTLASS on a CUDA device; any
    other dtype: torch's CPU loop, which tests the adapter's arithmetic), or ``None``."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no _grouped_mm"
    if dtype == torch.bfloat16:
        if not torch.cuda.is_available():
            return "torch._grouped_mm in bf16 is measured on a CUDA device (CUTLASS); none is visible"
        return None
    return _cpu_fallback()


def fused_up(w: MoEWeights) -> torch.Tensor:
    """``[W1_e | W3_e]`` of every expert, ``[E, Dl, 2H]``: the up weight a deployment stores
    fused (made once, outside anything timed)."""
    return torch.cat([w.w1, w.w3], dim=-1).contiguous()


def _experts(z: torch.Tensor, d: SortedPairs, p: torch.Tensor, w: MoEWeights, config: MoEConfig,
             w13: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``p · act(z W1_e, z W3_e) W2_e`` of the sorted rows by two ``_grouped_mm`` calls, fp32, each
    row put back at its (token, slot) place ``[T k, Dl]``; ``w13`` is :func:`fused_up` of ``w``
    when the caller made it already."""
    H = w.w1.shape[-1]
    rows = z[d.token].contiguous()
    ends = d.offsets[1:]  # int32 on the device: each expert's end row
    pre = torch._grouped_mm(rows, fused_up(w) if w13 is None else w13, offs=ends)
    h = activation(pre[:, :H], pre[:, H:], config.activation, beta1=config.beta1, beta2=config.beta2).to(z.dtype)
    sorted_out = torch._grouped_mm(h.contiguous(), w.w2.contiguous(), offs=ends).float() * p[:, None]
    return torch.empty_like(sorted_out).index_copy_(0, d.order, sorted_out)


def grouped(x: torch.Tensor, weights: MoEWeights, config: MoEConfig, *, routing: Routing | None = None) -> torch.Tensor:
    """The layer ``y:[T, d]`` in ``x``'s dtype with the routed experts in ``torch._grouped_mm``
    (bf16 on the CUDA device, any other dtype on the CPU)."""
    reason = unavailable_reason(x.dtype)
    if reason is not None:
        raise RuntimeError(reason)
    dev = torch.device("cuda" if x.dtype == torch.bfloat16 else "cpu")
    return routed_layer(partial(_experts, config=config), x, weights, config, routing, dev)
