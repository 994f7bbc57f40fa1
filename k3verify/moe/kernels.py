"""Stable LatentMoE GPU kernels in Triton: the router (SPEC §4).

``route(x, w_router, bias, config) -> Routing`` in one launch, one program per tile of tokens:

- logits ``r = x W_r`` in fp32: products of fp32 tiles with fp32 accumulation (tf32x3 on a
  GPU, which keeps about 22 bits of each operand; exact fp32 products under the interpreter);
- ``s = σ(r)`` and the selection ``TopK_k(s + b)`` by ``k`` rounds of a row maximum, each
  round taking the lowest (or, with ``tie_break="highest_index"``, the highest) expert index
  among equal biased scores, as the reference's stable sort does;
- the weights ``ρ s_I / (Σ s_I + renorm_eps)`` from the unbiased scores of the selected experts.

Inputs are fp32 (SPEC's FP32 router); under Triton's interpreter the kernel is faithful
(:mod:`k3verify.triton_support`).
"""

from __future__ import annotations

import torch

from ..numerics.validate import require_finite, require_float, require_shape, require_tensor
from ..triton_support import block, device_for, dot_fp32, interpreted, tl, triton
from ..triton_support import unavailable_reason as _unavailable
from .inputs import TIE_BREAKS, MoEConfig, Routing

__all__ = ["interpreted", "route", "unavailable_reason"]

TOKENS = 16  # a tl.dot side
WIDTH = 32


def unavailable_reason(dtype: torch.dtype | str = torch.float32) -> str | None:
    """Why the router kernel cannot run faithfully here for ``dtype`` inputs, or ``None``."""
    return _unavailable("the MoE router kernel", dtype, (torch.float32,))


@triton.jit
def _router_kernel(x, w, bias, idx_out, wt_out, T, D, E, rho, renorm_eps, K: tl.constexpr, KP: tl.constexpr,
                   BT: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr, HIGHEST: tl.constexpr,
                   EXACT: tl.constexpr):  # fmt: skip
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    e = tl.arange(0, BE)
    acc = tl.zeros([BT, BE], dtype=tl.float32)
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        xx = tl.load(x + t[:, None].to(tl.int64) * D + dd[None, :], mask=(t < T)[:, None] & (dd < D)[None, :],
                     other=0.0)  # fmt: skip
        ww = tl.load(w + dd[:, None].to(tl.int64) * E + e[None, :], mask=(dd < D)[:, None] & (e < E)[None, :],
                     other=0.0)  # fmt: skip
        acc += dot_fp32(xx, ww, EXACT)
    s = tl.sigmoid(acc)
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


def route(x: torch.Tensor, w_router: torch.Tensor, bias: torch.Tensor, config: MoEConfig) -> Routing:
    """The router for ``x:[T, d]`` (fp32), ``w_router:[d, E]``, ``bias:[E]``: indices ``[T, k]``
    int64, best first, and weights ``[T, k]`` fp32, on the kernel's device."""
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
        _router_kernel[(triton.cdiv(T, TOKENS),)](
            x.to(dev).contiguous(), w_router.to(dev).contiguous(), bias.to(dev).contiguous(), idx, wt, T, d, E,
            float(config.routed_scaling_factor), float(config.renorm_eps), K=k, KP=max(2, triton.next_power_of_2(k)),
            BT=TOKENS, BD=WIDTH, BE=block(E), HIGHEST=config.tie_break == "highest_index", EXACT=interpreted(),
        )  # fmt: skip
    return Routing(idx, wt)
