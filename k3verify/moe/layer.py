"""The Stable LatentMoE layer — weights, sizes, the shared pieces of the math (docs/model.md §4).

With ``x:[T, d]`` the layer input:

    routing = router(x)                                       (FP32 logits, see router.py)
    z   = x W↓ ∈ ℝ^{Dl}                                       (3584: what dispatch moves)
    E_j(z) = SiTU(z W1_j, z W3_j) W2_j ∈ ℝ^{Dl}                (expert hidden H = 3072)
    u   = Σ_{j∈I} p_j E_j(z),   y_r = RMSNorm_γ(u) W↑        (W↑: Dl → d)
    y_s = SiTU(x S1, x S3) S2                                 (two shared experts merged: Hs = 6144)
    y   = y_r + y_s

Because of the RMSNorm, multiplying every ``p_j`` by ρ changes ``y_r`` only through
``RMSNorm(ρu) = u / sqrt(ms(u) + ε/ρ²)``: ρ is irrelevant while ``rms(u) ≫ sqrt(ε)``.
Under tensor parallelism the norm sees ``u`` after the all-reduce of the partial sums.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..numerics import compute_dtype
from ..numerics.ops import matmul, rms_norm
from .inputs import Dims, FormOptions, MoEConfig, MoEWeights, Routing, check_inputs, weight_shapes
from .router import routing_for
from .situ import activation


def init_weights(
    cfg: MoEConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
) -> MoEWeights:
    """Random weights scaled by ``fan_in^{-1/2}`` (unit-scale activations), norm gains near 1,
    bias 0 (train it with :func:`k3verify.moe.balancing.quantile_balancing`).

    On ``device="meta"`` only shapes are produced (production-size structure checks).
    """
    shapes = weight_shapes(cfg)
    if torch.device(device).type == "meta":
        return MoEWeights(**{n: torch.empty(s, dtype=dtype, device="meta") for n, s in shapes.items()})
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        if name == "bias":
            x = torch.zeros(shape, dtype=torch.float64)
        elif name == "latent_norm":
            x = 1 + 0.1 * x
        else:
            x = x * shape[-2] ** -0.5  # the contraction axis is the second to last
        out[name] = x.to(dtype=dtype, device=device)
    return MoEWeights(**out)


def parameter_counts(cfg: MoEConfig) -> dict[str, int]:
    """Parameters per part of one layer (``bias`` is a buffer, counted apart)."""
    count = {n: 1 for n in weight_shapes(cfg)}
    for n, shape in weight_shapes(cfg).items():
        for s in shape:
            count[n] *= s
    return {
        "router": count["w_router"],
        "bias": count["bias"],
        "latent_projections": count["w_latent_down"] + count["w_latent_up"] + count["latent_norm"],
        "routed_experts": count["w1"] + count["w3"] + count["w2"],
        "shared": count["shared_w1"] + count["shared_w3"] + count["shared_w2"],
    }


def active_parameters(cfg: MoEConfig) -> int:
    """Parameters one token touches: router, both latent projections, k experts, the shared MLP."""
    c = parameter_counts(cfg)
    return c["router"] + c["latent_projections"] + c["routed_experts"] * cfg.top_k // cfg.num_experts + c["shared"]


def glu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """``act(x W1, x W3) W2`` in the inputs' dtype (fp32 for fp32; the activation widens bf16)."""
    h = activation(matmul(x, w1), matmul(x, w3), cfg.activation, beta1=cfg.beta1, beta2=cfg.beta2)
    return matmul(h.to(x.dtype), w2)


def latent_output(u: torch.Tensor, w: MoEWeights, cfg: MoEConfig) -> torch.Tensor:
    """``y_r = RMSNorm_γ(u) W↑``: ``u:[T, Dl] -> [T, d]``."""
    return matmul(rms_norm(u, w.latent_norm, eps=cfg.rms_norm_eps), w.w_latent_up)


def shared_output(x: torch.Tensor, w: MoEWeights, cfg: MoEConfig) -> torch.Tensor:
    """``y_s``: the merged shared SiTU MLP fed ``x`` (not the latent): ``[T, d] -> [T, d]``."""
    return glu(x, w.shared_w1, w.shared_w3, w.shared_w2, cfg)


def layer_output(u: torch.Tensor, x: torch.Tensor, w: MoEWeights, cfg: MoEConfig) -> torch.Tensor:
    """``y = RMSNorm_γ(u) W↑ + y_s(x)`` from the routed latent ``u:[T, Dl]`` and the input ``x:[T, d]``."""
    return latent_output(u, w, cfg) + shared_output(x, w, cfg)


def reference_setup(
    x: torch.Tensor, weights: MoEWeights, config: MoEConfig, routing: Routing | None, options: FormOptions
) -> tuple[Dims, torch.Tensor, MoEWeights, Routing]:
    """What the exact forms start from: sizes, ``x`` and weights in the compute dtype (fp64 for
    fp64 inputs, fp32 otherwise) and the routing in it. ``options`` is only validated."""
    dims = check_inputs(x, weights, config, routing)
    dtype = compute_dtype(x.dtype)
    w, xw = weights.to(dtype), x.to(dtype)
    return dims, xw, w, routing_for(xw, w, config, routing, dtype)


Form = Callable[..., torch.Tensor]


def forward(x: torch.Tensor, w: MoEWeights, cfg: MoEConfig, *, form: Form, **options: object) -> torch.Tensor:
    """Run ``form`` (``recurrent``, ``chunkwise`` or ``tiled``) on ``x:[..., d]``; returns ``[..., d]``.

    The MoE keeps nothing across tokens, so leading axes are flattened into one token axis.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise TypeError("x must be a tensor [..., d]")
    lead = x.shape[:-1]
    return form(x.reshape(-1, x.shape[-1]), w, cfg, **options).reshape(*lead, -1)
