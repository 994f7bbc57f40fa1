"""Configuration, weights and argument checking shared by the Stable LatentMoE forms.

Every form is called as

    form(x, weights, config, *, routing=None, tile_m=16, tile_k=64, operand_dtype="bf16",
         fp8_scaling="per_row", fp8_static_scale=1.0, overflow="nonfinite") -> y

- ``x:[T, d]``: one row per token (the layer input after AttnRes and the input RMSNorm);
  :func:`k3verify.moe.layer.forward` flattens leading axes.
- ``weights``: a :class:`MoEWeights` (``x @ W`` layout: input dim first).
- ``config``: a :class:`MoEConfig` (sizes, ρ, SiTU's β, tie rule, activation, router dtype).
- ``routing``: ``None`` (route with the router of docs/model.md §4) or a :class:`Routing` whose expert
  choices and mixture weights are used as given — this separates the discontinuous selection
  from the arithmetic of the experts when two runs must be compared token for token.
- returns ``y:[T, d]``, the routed plus the shared path.

``tile_m``, ``tile_k``, ``operand_dtype``, ``fp8_scaling``, ``fp8_static_scale`` and
``overflow`` are used by ``tiled``; every form validates them and ignores those it does not
use, so one call site can switch forms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from ..numerics import cast_once, compute_dtype, dtype_name, is_float8, resolve_dtype
from ..numerics.ops import RMS_NORM_EPS
from ..numerics.rounding import OVERFLOW_MODES
from ..numerics.validate import (
    Check,
    all_hold,
    finite,
    require_block,
    require_finite,
    require_finite_parameter,
    require_float,
    require_on_device,
    require_positive_int,
    require_same,
    require_shape,
    require_tensor,
)

ACTIVATIONS = ("situ", "swiglu")
# Order among equal biased scores. torch.topk documents none (on CPU it returned [2, 4, 1] for
# three equal scores at 1, 2, 4), so the rule is explicit and applied by a stable sort.
TIE_BREAKS = ("lowest_index", "highest_index")
FP8_SCALINGS = ("per_row", "per_tensor", "static")


def _require_positive_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return float(value)


def _require_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")


@dataclass(frozen=True)
class MoEConfig:
    """One Stable LatentMoE layer; defaults are K3's (docs/model.md §4), [assumed] items are fields.

    ``routed_scaling_factor`` (ρ) is [assumed]: vLLM's default 1.0 (a public test uses 2.827).
    ``tie_break`` [assumed]: among equal biased scores the lower (or higher) expert index wins.
    ``renorm_eps`` [assumed]: added to ``Σ_{i∈I} s_i``; 0 is the formula of docs/model.md §4 (a token whose
    selected scores all underflow to 0 then gets 0/0 = NaN weights, visibly).
    ``logits_dtype``: ``None`` keeps the logits in the router's compute dtype (fp32, fp64 for
    fp64 inputs: fp32 is the minimum, docs/model.md §4); ``"bf16"`` rounds them, as a router GEMM writing
    bf16 would (for measuring how many expert choices that changes).
    ``activation``: ``"situ"`` (K3) or ``"swiglu"`` (the β → ∞ limit, for comparisons).
    """

    hidden_size: int = 7168
    num_experts: int = 896
    top_k: int = 16
    latent_size: int = 3584
    expert_hidden: int = 3072
    num_shared_experts: int = 2
    routed_scaling_factor: float = 1.0
    tie_break: str = "lowest_index"
    renorm_eps: float = 0.0
    beta1: float = 4.0
    beta2: float = 25.0
    activation: str = "situ"
    rms_norm_eps: float = RMS_NORM_EPS
    logits_dtype: str | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_experts", "top_k", "latent_size", "expert_hidden", "num_shared_experts"):
            require_positive_int(name, getattr(self, name))
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} exceeds num_experts {self.num_experts}")
        for name in ("routed_scaling_factor", "beta1", "beta2", "rms_norm_eps"):
            _require_positive_float(name, getattr(self, name))
        if isinstance(self.renorm_eps, bool) or not isinstance(self.renorm_eps, (int, float)) or not (
            math.isfinite(self.renorm_eps) and self.renorm_eps >= 0
        ):
            raise ValueError(f"renorm_eps must be finite and >= 0, got {self.renorm_eps!r}")
        _require_choice("tie_break", self.tie_break, TIE_BREAKS)
        _require_choice("activation", self.activation, ACTIVATIONS)
        if self.logits_dtype is not None:
            # Kept as a name (not a torch.dtype) so the config stays plain data (goldens, reports).
            object.__setattr__(self, "logits_dtype", dtype_name(resolve_dtype(self.logits_dtype)))

    @classmethod
    def production(cls, **changes: object) -> MoEConfig:
        """K3: d 7168, 896 experts, top 16, latent 3584, expert hidden 3072, 2 shared (6144)."""
        return cls(**changes)  # type: ignore[arg-type]

    @classmethod
    def small(cls, **changes: object) -> MoEConfig:
        """A CPU-sized layer with K3's width ratios (latent = d / 2, shared = 2 experts):
        d 64, 16 experts, top 4, latent 32, expert hidden 24, shared 48."""
        sizes = dict(hidden_size=64, num_experts=16, top_k=4, latent_size=32, expert_hidden=24)
        return cls(**(sizes | changes))  # type: ignore[arg-type]

    @property
    def shared_hidden(self) -> int:
        """Width of the merged shared MLP: ``num_shared_experts × expert_hidden`` (6144)."""
        return self.num_shared_experts * self.expert_hidden


@dataclass(frozen=True)
class MoEWeights:
    """One layer's parameters, stored for ``x @ W``.

    ``w_router:[d, E]``, ``bias:[E]`` (``e_score_correction_bias``, selection only),
    ``w_latent_down:[d, Dl]`` (W↓, shared by every routed expert), ``w1, w3:[E, Dl, H]`` (gate
    and up of each expert), ``w2:[E, H, Dl]`` (each expert's down projection),
    ``latent_norm:[Dl]`` (γ of the RMSNorm of the aggregated latent), ``w_latent_up:[Dl, d]``
    (W↑), ``shared_w1, shared_w3:[d, Hs]``, ``shared_w2:[Hs, d]`` (the merged shared MLP).
    """

    w_router: torch.Tensor
    bias: torch.Tensor
    w_latent_down: torch.Tensor
    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor
    latent_norm: torch.Tensor
    w_latent_up: torch.Tensor
    shared_w1: torch.Tensor
    shared_w3: torch.Tensor
    shared_w2: torch.Tensor

    def to(self, dtype: torch.dtype) -> MoEWeights:
        """Every tensor cast to ``dtype`` (kept for the next call inside :func:`~k3verify.numerics.held_casts`)."""
        return MoEWeights(**{f.name: cast_once(getattr(self, f.name), dtype) for f in fields(self)})

    def tensors(self) -> dict[str, torch.Tensor]:
        """Name -> tensor, in declaration order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def weight_shapes(cfg: MoEConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of every :class:`MoEWeights` tensor for ``cfg``."""
    d, E, Dl, H, Hs = cfg.hidden_size, cfg.num_experts, cfg.latent_size, cfg.expert_hidden, cfg.shared_hidden
    return {
        "w_router": (d, E), "bias": (E,), "w_latent_down": (d, Dl), "w1": (E, Dl, H), "w3": (E, Dl, H),
        "w2": (E, H, Dl), "latent_norm": (Dl,), "w_latent_up": (Dl, d), "shared_w1": (d, Hs),
        "shared_w3": (d, Hs), "shared_w2": (Hs, d),
    }


@dataclass(frozen=True)
class Routing:
    """The router's decision for ``T`` tokens.

    ``indices:[T, k]`` int64, the selected experts best first (by biased score, ties by the
    config's rule); ``weights:[T, k]`` the mixture weights ``p = ρ s_I / Σ s_I`` in the router's
    compute dtype; ``scores:[T, E]`` ``σ(logits)`` (``None`` when given from outside).
    """

    indices: torch.Tensor
    weights: torch.Tensor
    scores: torch.Tensor | None = None

    def to(self, dtype: torch.dtype) -> Routing:
        """The same choices with weights (and scores) in ``dtype``."""
        scores = None if self.scores is None else self.scores.to(dtype)
        return Routing(self.indices, self.weights.to(dtype), scores)


@dataclass(frozen=True)
class Dims:
    """Sizes of one MoE call."""

    T: int
    d: int
    E: int
    k: int
    Dl: int
    H: int
    Hs: int


@dataclass(frozen=True)
class FormOptions:
    """The tiling keyword options of the common signature, validated on construction.

    ``tile_m``: token rows per grouped-GEMM tile (each expert's rows are padded to a multiple);
    ``tile_k``: the contraction step whose fp32 partial sums are added in order;
    ``fp8_scaling``: how fp8 e4m3 operands are scaled — ``per_row`` (dynamic amax/448 per token
    row of an activation, per output column of a weight), ``per_tensor`` (dynamic, one per
    activation tensor, one per weight matrix), ``static`` (activations divided by the fixed
    ``fp8_static_scale`` so that past ``448 × scale`` they overflow; weights per column).
    """

    tile_m: int = 16
    tile_k: int = 64
    operand_dtype: torch.dtype | str = torch.bfloat16
    fp8_scaling: str = "per_row"
    fp8_static_scale: float = 1.0
    overflow: str = "nonfinite"

    def __post_init__(self) -> None:
        require_block("tile_m", self.tile_m)
        require_block("tile_k", self.tile_k)
        object.__setattr__(self, "operand_dtype", resolve_dtype(self.operand_dtype))
        _require_choice("fp8_scaling", self.fp8_scaling, FP8_SCALINGS)
        _require_positive_float("fp8_static_scale", self.fp8_static_scale)
        if self.overflow not in OVERFLOW_MODES:
            raise ValueError(f"overflow must be one of {OVERFLOW_MODES}, got {self.overflow!r}")

    @property
    def accumulator(self) -> torch.dtype:
        """fp64 for an exact fp64 run, fp32 (the tensor-core accumulator) otherwise."""
        return compute_dtype(self.operand_dtype)

    @property
    def output_dtype(self) -> torch.dtype:
        """Kernels write fp8 runs' outputs in bf16, all others in the operand dtype."""
        return torch.bfloat16 if is_float8(self.operand_dtype) else self.operand_dtype


def check_inputs(x: torch.Tensor, weights: MoEWeights, config: MoEConfig, routing: Routing | None = None) -> Dims:
    """Validate a call; return its sizes.

    Raises ``TypeError``/``ValueError`` naming the argument for wrong types, shapes, mixed
    dtypes or devices, non-finite values and routing that names a missing or repeated expert.
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    if not isinstance(weights, MoEWeights):
        raise TypeError(f"weights must be a MoEWeights, got {type(weights).__name__}")
    x = require_tensor("x", x)
    named = {"x": x} | {f"weights.{n}": require_tensor(f"weights.{n}", t) for n, t in weights.tensors().items()}
    for name, t in named.items():
        require_float(name, t)
        require_on_device(name, t)
    require_same(list(named), list(named.values()), "dtype")
    require_same(list(named), list(named.values()), "device")
    d = config.hidden_size
    if x.dim() != 2 or x.shape[1] != d:
        raise ValueError(f"x has shape {list(x.shape)}; expected [T, d={d}] (layer.forward flattens leading axes)")
    for name, shape in weight_shapes(config).items():
        require_shape(f"weights.{name}", getattr(weights, name), shape, _axis_names(name))
    for name, t in named.items():
        if name != "x":
            require_finite_parameter(name, t)
    T = x.shape[0]
    checks: list[Check] = [(finite(x), lambda: require_finite("x", x))]
    if routing is not None:
        checks += routing_checks(routing, T, config)
    all_hold(checks)
    return Dims(T, d, config.num_experts, config.top_k, config.latent_size, config.expert_hidden, config.shared_hidden)


def _axis_names(name: str) -> str:
    return {
        "w_router": "d,E", "bias": "E", "w_latent_down": "d,Dl", "w1": "E,Dl,H", "w3": "E,Dl,H", "w2": "E,H,Dl",
        "latent_norm": "Dl", "w_latent_up": "Dl,d", "shared_w1": "d,Hs", "shared_w3": "d,Hs", "shared_w2": "Hs,d",
    }[name]


def check_routing(routing: Routing, T: int, config: MoEConfig) -> None:
    """A given routing must name ``top_k`` distinct existing experts per token with finite weights."""
    all_hold(routing_checks(routing, T, config))


def routing_checks(routing: Routing, T: int, config: MoEConfig) -> list[Check]:
    """:func:`check_routing` with its value checks deferred (:func:`~k3verify.numerics.validate.all_hold`):
    types and shapes are checked now, the values' flags returned."""
    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a Routing or None, got {type(routing).__name__}")
    checks = _selection_checks(routing.indices, T, config, "routing.indices")
    wts = require_tensor("routing.weights", routing.weights)
    require_float("routing.weights", wts)
    require_shape("routing.weights", wts, (T, config.top_k), "T,k")

    def negative() -> None:
        # p = rho * s / sum(s) with sigmoid scores and rho > 0: a mixture weight is never negative.
        below = wts < 0
        t, j = (int(i) for i in below.nonzero()[0])
        raise ValueError(f"routing.weights has {int(below.sum())} negative value(s) (first {float(wts[t, j]):.3g} "
                         f"at token {t}, slot {j}); mixture weights are rho * s / sum(s) >= 0")  # fmt: skip

    return [*checks, (finite(wts), lambda: require_finite("routing.weights", wts)), (~(wts < 0).any(), negative)]


def check_selection(indices: object, T: int, config: MoEConfig, name: str = "indices") -> torch.Tensor:
    """``indices:[T, k]`` (int64 or int32) must name ``top_k`` distinct existing experts per token."""
    all_hold(_selection_checks(indices, T, config, name))
    return indices  # type: ignore[return-value]  # a tensor: _selection_checks checked


def _selection_checks(indices: object, T: int, config: MoEConfig, name: str) -> list[Check]:
    """:func:`check_selection`'s type and shape checks now, its value checks as flags."""
    idx = require_tensor(name, indices)
    if idx.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} has dtype {idx.dtype}; expected torch.int64 or torch.int32")
    require_shape(name, idx, (T, config.top_k), "T,k")
    if not idx.numel():
        return []

    def out_of_range() -> None:
        raise ValueError(f"{name} must lie in [0, {config.num_experts}); got [{int(idx.min())}, {int(idx.max())}]")

    repeated = (idx.sort(-1).values.diff(dim=-1) == 0).any(-1)

    def repeats() -> None:
        raise ValueError(f"{name} repeats an expert for token {int(repeated.nonzero()[0])}")

    in_range = (idx.min() >= 0) & (idx.max() < config.num_experts)
    return [(in_range, out_of_range), (~repeated.any(), repeats)]


def check_backward(x: torch.Tensor, weights: MoEWeights, config: MoEConfig, dy: object, indices: object) -> Dims:
    """Validate a backward call: the forward's arguments (:func:`check_inputs`), the cotangent
    ``dy:[T, d]`` (finite, ``x``'s dtype and device) and the forward's selection ``indices:[T, k]``."""
    dims = check_inputs(x, weights, config)
    dy = require_tensor("dy", dy)
    require_float("dy", dy)
    require_same(["x", "dy"], [x, dy], "dtype")
    require_same(["x", "dy"], [x, dy], "device")
    require_shape("dy", dy, (dims.T, dims.d), "T,d")
    require_finite("dy", dy)
    check_selection(indices, dims.T, config)
    return dims
