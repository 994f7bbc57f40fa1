"""Stable LatentMoE's verification inputs: layers whose bias is trained by Quantile Balancing,
the named cases a run and the goldens use, the overflow map's inputs and a Hypothesis strategy.

A case is ``(inputs, params)``: ``inputs`` the form arguments by name (``x:[T, d]`` fp64, a
:class:`MoEWeights` in fp64, a :class:`MoEConfig`), ``params`` what generated them (JSON-ready),
including how safe the case's routing is (its smallest top-k gap, whether fp32 and fp64 routers
choose alike). Nothing here knows the harness.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from .balancing import expert_load, imbalance, quantile_balancing
from .inputs import MoEConfig, MoEWeights
from .layer import init_weights
from .router import router_logits, routing_for, topk_gap

INPUT_NAMES = ("x", "weights", "config")

# The small layer with ρ = 2.827 (the public test's value) so that ρ is exercised.
CONFIG = MoEConfig.small(routed_scaling_factor=2.827)
TOKENS = 64
CALIBRATION_TOKENS = 512
BALANCING_STEPS = 3
HOT_EXPERTS = 4  # the skewed case sends every token to these
HOT_BIAS = 8.0  # > the range of σ, so the bias alone decides
# Input scale of the "scaled" cases: SwiGLU's hidden g σ(g) u reaches ~1e6 > 65504 (fp16) while
# x and z (~1e3) still fit fp16 and SiTU's hidden stays within 100.
SCALED_EXPONENT = 8

# The overflow map's layer and inputs: unit-scale tokens times 2^e.
MAP_CONFIG = MoEConfig.small()
MAP_TOKENS = 64
MAP_INPUTS = ("gaussian", "outlier")
OUTLIER_CHANNELS = 2
OUTLIER_SIZE = 32.0
MAP_EXPONENTS = (*range(0, 21), *range(24, 69, 4))  # fine where fp16/fp8 break, coarse up to fp32's
QUICK_EXPONENTS = (0, 4, 8, 12, 16, 24, 32, 48, 64)

Sample = tuple[dict[str, Any], dict[str, Any]]


def calibrated_weights(cfg: MoEConfig, *, seed: int = 0, tokens: int = CALIBRATION_TOKENS,
                       steps: int = BALANCING_STEPS) -> MoEWeights:
    """Random fp64 weights whose bias is trained by Quantile Balancing on ``steps`` fresh batches of
    ``tokens`` unit-scale tokens (each step computed on one batch and applied to the next)."""
    w = init_weights(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    bias = w.bias
    for _ in range(steps):
        x = torch.randn(tokens, cfg.hidden_size, generator=gen, dtype=torch.float64)
        scores = torch.sigmoid(router_logits(x, w.w_router, cfg))
        bias = quantile_balancing(scores, bias, cfg.top_k)
    return dataclasses.replace(w, bias=bias)


def routing_params(x: torch.Tensor, w: MoEWeights, cfg: MoEConfig) -> dict[str, Any]:
    """How safe a case's routing is: the smallest top-k gap of its fp64 biased scores, whether
    the fp32 router chooses as the fp64 one does, idle experts and ``max load / mean load``."""
    r64 = routing_for(x, w, cfg, None, torch.float64)
    r32 = routing_for(x, w, cfg, None, torch.float32)
    gap = topk_gap(r64.scores, w.bias, cfg.top_k)
    load = expert_load(r64.indices, cfg.num_experts)
    return {
        "min_topk_gap": float(gap.min()) if gap.numel() else math.inf,
        "fp32_routing_equals_fp64": bool(torch.equal(r32.indices, r64.indices)),
        "idle_experts": int((load == 0).sum()),
        "load_imbalance": imbalance(load),
    }


def _sample(x: torch.Tensor, w: MoEWeights, cfg: MoEConfig, params: dict[str, Any]) -> Sample:
    return {"x": x, "weights": w, "config": cfg}, params | routing_params(x, w, cfg)


def make_cases(seed: int = 0) -> dict[str, Sample]:
    """``default`` (64 tokens), ``decode`` (one token), ``skewed`` (every token to the same 4
    experts, 12 idle), ``scaled`` / ``scaled_swiglu`` (inputs × 2^8, SiTU and SwiGLU); all on
    :data:`CONFIG` with a bias from Quantile Balancing."""
    w = calibrated_weights(CONFIG, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(TOKENS, CONFIG.hidden_size, generator=gen, dtype=torch.float64)
    hot = w.bias.clone()
    hot[:HOT_EXPERTS] += HOT_BIAS
    swiglu = dataclasses.replace(CONFIG, activation="swiglu")
    scale = 2.0**SCALED_EXPONENT
    specs = {
        "default": (x, w, CONFIG, {}),
        "decode": (x[:1], w, CONFIG, {}),
        "skewed": (x, dataclasses.replace(w, bias=hot), CONFIG, {"hot_experts": HOT_EXPERTS}),
        "scaled": (x * scale, w, CONFIG, {"input_scale": scale}),
        "scaled_swiglu": (x * scale, w, swiglu, {"input_scale": scale}),
    }
    base = dict(E=CONFIG.num_experts, k=CONFIG.top_k, d=CONFIG.hidden_size, Dl=CONFIG.latent_size,
                H=CONFIG.expert_hidden, Hs=CONFIG.shared_hidden, rho=CONFIG.routed_scaling_factor, seed=seed,
                bias=f"Quantile Balancing, {BALANCING_STEPS} steps of {CALIBRATION_TOKENS} tokens")
    return {name: _sample(xc, wc, cfg, base | {"T": xc.shape[0], "activation": cfg.activation} | extra)
            for name, (xc, wc, cfg, extra) in specs.items()}


def map_tokens(kind: str, seed: int = 0) -> torch.Tensor:
    """The overflow map's unit-scale tokens ``[64, 64]`` fp64: ``gaussian``, or ``outlier`` (the
    same with 2 channels × 32, the activation outliers SiTU is meant to tame)."""
    gen = torch.Generator().manual_seed(seed + 7)
    x = torch.randn(MAP_TOKENS, MAP_CONFIG.hidden_size, generator=gen, dtype=torch.float64)
    if kind == "outlier":
        x[:, :OUTLIER_CHANNELS] *= OUTLIER_SIZE
    return x


def map_inputs(kind: str, log2_input_scale: float, activation: str, seed: int = 0) -> Sample:
    """The overflow map's input at one point: :func:`map_tokens` times ``2^log2_input_scale``
    through :data:`MAP_CONFIG` with ``activation``; the bias is trained by Quantile Balancing on
    unit-scale tokens (the router does not depend on the activation)."""
    cfg = dataclasses.replace(MAP_CONFIG, activation=activation)
    x = map_tokens(kind, seed) * 2.0**log2_input_scale
    params = dict(T=MAP_TOKENS, E=cfg.num_experts, k=cfg.top_k, d=cfg.hidden_size, input=kind,
                  activation=activation, log2_input_scale=log2_input_scale, seed=seed)
    return {"x": x, "weights": calibrated_weights(MAP_CONFIG, seed=seed), "config": cfg}, params


def log2_scale_grid(quick: bool) -> list[float]:
    """The map's log2 input scales: 0…20 by 1 then 24…68 by 4 (33 values), or 9 for a quick map."""
    return list(QUICK_EXPONENTS if quick else MAP_EXPONENTS)


def random_inputs(cfg: MoEConfig, T: int, *, seed: int = 0, x_scale: float = 1.0,
                  bias_scale: float = 0.1) -> dict[str, Any]:
    """``x:[T, d]`` ~ N(0, x_scale²), :func:`init_weights` with a bias ~ N(0, bias_scale²), ``cfg``
    (fp64; one seed gives the same tensors bit for bit)."""
    w = init_weights(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    bias = bias_scale * torch.randn(cfg.num_experts, generator=gen, dtype=torch.float64)
    x = x_scale * torch.randn(T, cfg.hidden_size, generator=gen, dtype=torch.float64)
    return {"x": x, "weights": dataclasses.replace(w, bias=bias), "config": cfg}


def strategy() -> Any:
    """A Hypothesis strategy of MoE samples ``(inputs, params)``: sizes that shrink toward one
    token, four experts, top-1 and width 8 (latent = d / 2, K3's ratio); SiTU or SwiGLU; ρ 1 or
    2.827; a random bias (0.1 or 3: a few experts win every token) or one trained by Quantile
    Balancing (for users' property tests; needs ``hypothesis``)."""
    from hypothesis import strategies as st

    @st.composite
    def draw(d: Any) -> Sample:
        E = d(st.sampled_from((4, 8, 16)))
        sizes = dict(hidden_size=d(st.sampled_from((8, 16, 32))), num_experts=E, top_k=d(st.integers(1, min(4, E))),
                     expert_hidden=d(st.sampled_from((4, 8, 12))))
        cfg = MoEConfig(latent_size=sizes["hidden_size"] // 2, activation=d(st.sampled_from(("situ", "swiglu"))),
                        routed_scaling_factor=d(st.sampled_from((1.0, 2.827))), **sizes)
        T, seed = d(st.integers(1, 16)), d(st.integers(0, 2**16))
        # Quantile Balancing needs an expert left over (top_k < E).
        bias = d(st.sampled_from(("random 0.1", "random 3", "quantile balancing")[: 2 + (cfg.top_k < E)]))
        x = random_inputs(cfg, T, seed=seed, bias_scale=3.0 if bias == "random 3" else 0.1)
        if bias == "quantile balancing":
            x["weights"] = calibrated_weights(cfg, seed=seed, tokens=64)
        params = dict(T=T, E=E, k=cfg.top_k, d=cfg.hidden_size, H=cfg.expert_hidden, activation=cfg.activation,
                      rho=cfg.routed_scaling_factor, seed=seed, bias=bias)
        return _sample(x["x"], x["weights"], cfg, params)

    return draw()
