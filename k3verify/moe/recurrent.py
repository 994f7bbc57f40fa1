"""Stable LatentMoE recurrent form — the definition, one token and one selected expert at a time.

For each token ``t`` and each of its ``k`` selected experts ``j`` (best first):

    u_t += p_tj · SiTU(z_t W1_j, z_t W3_j) W2_j,        z_t = x_t W↓

then ``y = RMSNorm_γ(u) W↑ + SiTU(x S1, x S3) S2`` (:mod:`k3verify.moe.layer`). Run in fp64
this is the oracle. :func:`naive_baseline` is the same definition as a plain implementation
in a narrow dtype would run it: the same-dtype baseline of the tolerance policy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..numerics import compute_dtype, rounder
from ..numerics.gradients import grad_name, vjp
from ..numerics.ops import rms_norm
from .inputs import FormOptions, MoEConfig, MoEWeights, Routing, check_backward, check_inputs
from .layer import glu, latent_output, layer_output, reference_setup
from .quantize import Caster
from .router import mixture, routing_for
from .situ import activation

# What a backward differentiates: x and every weight but the bias, which only selects (the
# selection is not differentiable).
TRAINABLE = ("x", "w_router", "w_latent_down", "w1", "w3", "w2", "latent_norm", "w_latent_up", "shared_w1",
             "shared_w3", "shared_w2")
GRADIENTS = tuple(grad_name(n) for n in TRAINABLE)


def recurrent(
    x: torch.Tensor,
    weights: MoEWeights,
    config: MoEConfig,
    *,
    routing: Routing | None = None,
    tile_m: int = 16,
    tile_k: int = 64,
    operand_dtype: torch.dtype | str = torch.bfloat16,
    fp8_scaling: str = "per_row",
    fp8_static_scale: float = 1.0,
    overflow: str = "nonfinite",
) -> torch.Tensor:
    """Per-token loop over the token's selected experts. Arguments as in :mod:`k3verify.moe.inputs`.

    Computes in fp64 for fp64 inputs and in fp32 otherwise (router included); returns
    ``y:[T, d]`` in ``x``'s dtype. The tiling options are validated and unused.
    """
    options = FormOptions(tile_m, tile_k, operand_dtype, fp8_scaling, fp8_static_scale, overflow)
    dims, xw, w, r = reference_setup(x, weights, config, routing, options)
    z = xw @ w.w_latent_down
    u = torch.zeros(dims.T, dims.Dl, dtype=xw.dtype, device=x.device)
    for t in range(dims.T):
        for slot in range(dims.k):
            j = int(r.indices[t, slot])
            u[t] += r.weights[t, slot] * glu(z[t : t + 1], w.w1[j], w.w3[j], w.w2[j], config)[0]
    return layer_output(u, xw, w, config).to(x.dtype)


def autograd_backward(form: Callable[..., torch.Tensor], x: torch.Tensor, weights: MoEWeights, config: MoEConfig,
                      *, dy: torch.Tensor, indices: torch.Tensor, router_dtype: torch.dtype | None = None,
                      input_dtype: torch.dtype | str | None = None, **options: Any) -> dict[str, torch.Tensor]:
    """Gradients of ``L = sum(y * dy)`` through ``form`` (the forms' signature) by autograd, on the
    forward's selection ``indices:[T, k]``, with the mixture weights recomputed differentiably by
    the router in ``router_dtype`` (default: fp64 for fp64 ``x``, fp32 otherwise) on ``x`` as the
    layer holds it: rounded to ``input_dtype`` when given (a plain bf16 implementation's input is
    bf16, and so is its gradient through the router), else as given. Returns ``{dx, dw_router,
    ..., dshared_w2}`` (:data:`GRADIENTS`), each of its input's shape and dtype. The bias gets
    none (it only selects)."""
    check_backward(x, weights, config, dy, indices)
    dtype = router_dtype or compute_dtype(x.dtype)
    held = (lambda t: t) if input_dtype is None else rounder(input_dtype)
    tensors = weights.tensors()

    def forward(x: torch.Tensor, **named: torch.Tensor) -> dict[str, torch.Tensor]:
        w = MoEWeights(**named)
        _, p = mixture(held(x), w.w_router, indices, config, dtype)
        return {"y": form(x, w, config, routing=Routing(indices, p), **options)}

    grads = vjp(forward, dict(x=x) | tensors, {"y": dy}, wrt=TRAINABLE)
    return {n: grads[n] for n in GRADIENTS}


def router_term_sizes(x: torch.Tensor, weights: MoEWeights, config: MoEConfig, *, dy: torch.Tensor,
                      indices: torch.Tensor) -> torch.Tensor:
    """The size of the terms the backward adds into ``dw_router``, per element (fp64 in,
    ``[d, E]`` out): ``|x|ᵀ R``, ``R = s (1 − s) (ρ P + Σ_k P p) / (Σ s_I + ε)`` on the selected
    experts, from the renormalised weights' chain rule ``ds = (ρ dp − Σ_k dp p) / (Σ s_I + ε)``
    with ``P = Σ_i |du_i| |E_i|`` the terms of ``dp = du · E`` (``E`` an expert's latent output,
    ``du`` the latent's gradient). Both sums cancel at top-1: the latent RMSNorm takes the scale
    out of ``u = p E``, so ``du ⟂ E`` and ``dp`` is rounding alone (up to the norm's ε), and
    ``renorm_eps`` leaves ``ρ dp ε / (s + ε)²``; every fp64 form keeps their rounding."""
    xw, w = x.to(torch.float64), weights.to(torch.float64)
    scores, p = mixture(xw, w.w_router, indices, config, torch.float64)
    scores, p = scores.detach(), p.detach()
    z = xw @ w.w_latent_down
    experts = torch.stack([torch.stack([glu(z[t : t + 1], w.w1[j], w.w3[j], w.w2[j], config)[0]
                                        for j in indices[t].tolist()]) for t in range(xw.shape[0])])  # [T, k, Dl]
    u = (p[..., None] * experts).sum(1).requires_grad_()
    (du,) = torch.autograd.grad((latent_output(u, w, config) * dy.to(u.dtype)).sum(), u)
    terms_dp = (du.abs()[:, None, :] * experts.abs()).sum(-1)  # [T, k]
    denom = torch.gather(scores, -1, indices).sum(-1, keepdim=True) + config.renorm_eps
    terms = (config.routed_scaling_factor * terms_dp + (terms_dp * p).sum(-1, keepdim=True)) / denom
    return xw.abs().T @ (torch.zeros_like(scores).scatter_(-1, indices, terms) * scores * (1 - scores))


# The most bytes of expert weights gathered at once for the pairs' products (K3's experts are
# 3584 x 3072: 44 MB each in fp32, so a few thousand pairs would need hundreds of GB at once).
PAIR_GATHER_BYTES = 1 << 30


def _per_pair(a: torch.Tensor, weight: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """``a[i] @ weight[expert[i]]`` for every pair ``i`` (``a:[P, 1, K]``, ``weight:[E, K, N]``),
    gathering at most :data:`PAIR_GATHER_BYTES` of weights at a time; each pair's product is
    its own, so the grouping changes no result."""
    per = max(1, PAIR_GATHER_BYTES // max(1, weight[0].numel() * weight.element_size()))
    if a.shape[0] <= per:
        return a @ weight[expert]
    return torch.cat([a[i : i + per] @ weight[expert[i : i + per]] for i in range(0, a.shape[0], per)])


def naive_baseline(
    x: torch.Tensor,
    weights: MoEWeights,
    config: MoEConfig,
    *,
    dtype: torch.dtype | str,
    routing: Routing | None = None,
    fp8_scaling: str = "per_row",
    fp8_static_scale: float = 1.0,
) -> torch.Tensor:
    """The definition as a plain implementation in ``dtype`` runs it, every stored tensor rounded.

    GEMM operands (``x``, every weight matrix, ``z``, the hidden activations, the normalised
    latent) are rounded to ``dtype`` — fp8 ones with the scales of ``fp8_scaling``, the same
    quantiser as :func:`k3verify.moe.tiled` — and every other stored result (the pre-activations
    ``g, u`` of an unfused GLU, each expert's output, ``p_j E_j``, the latent sum ``u``, ``γ``,
    ``y_r``, ``y_s``, ``y``) to the output dtype (``dtype``; bf16 for fp8). Each operation computes
    in fp32, as torch does for bf16/fp16 tensors. The router is the FP32 one of docs/model.md §4 on ``x``
    as given, so this baseline routes exactly like ``tiled``. Returns fp32 (fp64 for ``dtype=fp64``).
    """
    dims = check_inputs(x, weights, config, routing)
    opts = FormOptions(operand_dtype=dtype, fp8_scaling=fp8_scaling, fp8_static_scale=fp8_static_scale)
    cast, acc = Caster.make(opts), opts.accumulator
    r = routing_for(x, weights, config, routing, acc)
    w = {n: cast.operand(n, t, weight=t.dim() > 1) for n, t in weights.tensors().items()
         if n not in ("bias", "latent_norm")}
    gamma = cast.output("latent_norm", weights.latent_norm)

    def act(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return activation(cast.output("g", g), cast.output("u", u), config.activation, beta1=config.beta1,
                          beta2=config.beta2)

    xo = cast.operand("x", x)
    z = cast.operand("z", xo @ w["w_latent_down"])
    pair_expert = r.indices.reshape(-1)  # [T k]: (token, slot) pairs in token order
    zp = z.repeat_interleave(dims.k, dim=0)[:, None, :]  # [T k, 1, Dl]
    h = cast.operand("h", act(_per_pair(zp, w["w1"], pair_expert), _per_pair(zp, w["w3"], pair_expert)))
    e = cast.output("E_j", _per_pair(h, w["w2"], pair_expert))[:, 0]  # [T k, Dl]
    pe = cast.output("p E_j", e * r.weights.reshape(-1, 1))
    u = cast.output("u", pe.reshape(dims.T, dims.k, dims.Dl).sum(1))
    normed = cast.operand("normalised u", rms_norm(u, gamma, eps=config.rms_norm_eps))
    y_r = cast.output("y_r", normed @ w["w_latent_up"])
    hs = cast.operand("h_s", act(xo @ w["shared_w1"], xo @ w["shared_w3"]))
    y_s = cast.output("y_s", hs @ w["shared_w2"])
    return cast.output("y", y_r + y_s)
