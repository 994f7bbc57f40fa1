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


# --- drawn problems: the strategy MoE's tests and users draw from --------------------------------


@dataclasses.dataclass
class MoEProblem:
    """One drawn problem: fp64 inputs, weights and the configuration that made them."""

    T: int
    E: int
    k: int
    d: int
    H: int
    seed: int
    x_scale: float
    activation: str
    rho: float
    bias_scale: float
    cfg: MoEConfig = dataclasses.field(repr=False)
    weights: MoEWeights = dataclasses.field(repr=False)
    x: torch.Tensor = dataclasses.field(repr=False)
    balanced: bool = False  # the bias trained by Quantile Balancing instead of drawn

    def __repr__(self) -> str:
        # Replayable: the make_problem call that rebuilds this problem bit for bit.
        return (f"make_problem({self.T}, E={self.E}, k={self.k}, d={self.d}, H={self.H}, seed={self.seed}, "
                f"x_scale={self.x_scale!r}, activation={self.activation!r}, rho={self.rho!r}, "
                f"bias_scale={self.bias_scale!r}{', balanced=True' if self.balanced else ''})")

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        # Hypothesis pretty-prints dataclasses field by field (tensors included); print the replay call.
        printer.text(repr(self))

    def args(self, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, MoEWeights, MoEConfig]:
        """``(x, weights, config)`` with tensors in ``dtype``."""
        return self.x.to(dtype), self.weights.to(dtype), self.cfg

    def with_weights(self, **changes: torch.Tensor) -> MoEProblem:
        """The same problem with some weight tensors replaced."""
        return dataclasses.replace(self, weights=dataclasses.replace(self.weights, **changes))

    def with_config(self, **changes: object) -> MoEProblem:
        """The same problem under another configuration (same tensors)."""
        return dataclasses.replace(self, cfg=dataclasses.replace(self.cfg, **changes))

    @property
    def sample(self) -> Sample:
        """The problem as a sample ``(inputs, params)``."""
        bias = "quantile balancing" if self.balanced else f"random {self.bias_scale:g}"
        params = dict(T=self.T, E=self.E, k=self.k, d=self.d, Dl=self.cfg.latent_size, H=self.H,
                      activation=self.activation, rho=self.rho, seed=self.seed, bias=bias)
        return _sample(self.x, self.weights, self.cfg, params)


def make_problem(T: int = 8, *, E: int = 8, k: int = 2, d: int = 16, H: int = 8, seed: int = 0,
                 x_scale: float = 1.0, activation: str = "situ", rho: float = 1.0,
                 bias_scale: float = 0.1, balanced: bool = False) -> MoEProblem:
    """A problem built directly (for pinned examples and plain tests) by :func:`random_inputs`:
    bias ~ N(0, bias_scale²) (with ``balanced``, trained by Quantile Balancing on 64-token
    batches instead), x ~ N(0, x_scale²). Widths keep K3's ratio latent = d / 2."""
    cfg = MoEConfig(hidden_size=d, num_experts=E, top_k=k, latent_size=d // 2, expert_hidden=H,
                    routed_scaling_factor=rho, activation=activation)
    made = random_inputs(cfg, T, seed=seed, x_scale=x_scale, bias_scale=bias_scale)
    weights = calibrated_weights(cfg, seed=seed, tokens=64) if balanced else made["weights"]
    return MoEProblem(T, E, k, d, H, seed, x_scale, activation, rho, bias_scale, cfg, weights, made["x"], balanced)


def problems(*, min_T: int = 1, max_T: int = 12, experts: tuple[int, ...] = (4, 8, 16), max_k: int = 4,
             widths: tuple[int, ...] = (8, 16, 32), hidden: tuple[int, ...] = (4, 8, 12), x_scale: Any = None,
             activation: Any = None, rho: Any = None, bias_scale: Any = None, balanced: Any = None) -> Any:
    """A Hypothesis strategy of :class:`MoEProblem` (needs ``hypothesis``): any token count, top-k
    up to ``max_k`` of the experts, a random bias. Sizes are drawn directly (they shrink toward
    one token, few experts, top-1, narrow widths); the tensors come from a drawn seed, so a
    failing example replays from its printed :func:`make_problem` call. ``x_scale``,
    ``activation``, ``rho``, ``bias_scale`` and ``balanced`` are strategies (defaults 1, SiTU, 1,
    0.1 and no balancing); balancing needs an expert left over (top-k < E)."""
    from hypothesis import strategies as st

    @st.composite
    def moe_problems(draw: Any) -> MoEProblem:
        T = draw(st.integers(min_T, max_T))
        E = draw(st.sampled_from(experts))
        k = draw(st.integers(1, min(max_k, E)))
        d = draw(st.sampled_from(widths))
        H = draw(st.sampled_from(hidden))
        seed = draw(st.integers(0, 2**16))
        return make_problem(
            T, E=E, k=k, d=d, H=H, seed=seed,
            x_scale=draw(x_scale) if x_scale is not None else 1.0,
            activation=draw(activation) if activation is not None else "situ",
            rho=draw(rho) if rho is not None else 1.0,
            bias_scale=draw(bias_scale) if bias_scale is not None else 0.1,
            balanced=draw(balanced) if balanced is not None and k < E else False,
        )

    return moe_problems()


def strategy() -> Any:
    """A Hypothesis strategy of MoE samples ``(inputs, params)`` (:func:`problems`): sizes that
    shrink toward one token, four experts, top-1 and width 8 (latent = d / 2, K3's ratio); SiTU or
    SwiGLU; ρ 1 or 2.827; a random bias (0.1 or 3: a few experts win every token) or one trained
    by Quantile Balancing (for users' property tests; needs ``hypothesis``)."""
    from hypothesis import strategies as st

    return problems(max_T=16, activation=st.sampled_from(("situ", "swiglu")), rho=st.sampled_from((1.0, 2.827)),
                    bias_scale=st.sampled_from((0.1, 3.0)), balanced=st.booleans()).map(lambda p: p.sample)
