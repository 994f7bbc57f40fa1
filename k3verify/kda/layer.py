"""The whole KDA layer (docs/model.md §1.1–1.8): packed projection, short convolution with its cache,
gates, the KDA core, per-head RMSNorm, sigmoid output gate and output projection.

Prefill runs the chunkwise form over the new tokens; decode runs one recurrent step. Both
hand over the same :class:`KDAState` (conv history + recurrent state), so
``prefill(T)`` then ``k`` decode steps equals ``prefill(T + k)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..numerics.ops import matmul, rms_norm
from ..numerics.validate import require_finite, require_shape, require_tensor
from .chunkwise import chunkwise
from .gate import DEFAULT_G_MIN, l2norm, lower_bound_gate
from .recurrent import recurrent

PACKED_ORDER = ("q", "k", "v", "g_out", "f_a", "beta")


@dataclass(frozen=True)
class KDAConfig:
    """Sizes and constants of one KDA layer (unsharded).

    ``production()`` is Kimi K3's released configuration; ``small()`` keeps its proportions
    that matter numerically (head dim = gate rank, K = V, g_min, chunk 64, conv width 4) at a
    size that runs in milliseconds on a CPU.
    """

    hidden: int = 7168
    heads: int = 96
    head_dim: int = 128
    gate_rank: int = 128
    conv_size: int = 4
    g_min: float = DEFAULT_G_MIN
    chunk_size: int = 64
    norm_eps: float = 1e-5
    pad_to: int = 16

    @classmethod
    def production(cls) -> KDAConfig:
        return cls()

    @classmethod
    def small(cls) -> KDAConfig:
        return cls(hidden=112, heads=4, head_dim=32, gate_rank=32)


@dataclass(frozen=True)
class LocalShapes:
    """Per-rank shapes under tensor parallelism ``tp`` (heads split, ``f_a`` replicated)."""

    tp: int
    heads: int
    segments: dict[str, int]
    packed_columns: int
    padded_columns: int
    conv_channels: int
    conv_cache: tuple[int, int]

    def slices(self) -> dict[str, slice]:
        """Column range of each segment in the packed projection output, in ``PACKED_ORDER``."""
        out, start = {}, 0
        for name in PACKED_ORDER:
            out[name] = slice(start, start + self.segments[name])
            start += self.segments[name]
        return out


def local_shapes(cfg: KDAConfig, tp: int = 1) -> LocalShapes:
    """Shapes one rank holds: at TP=8, 12 heads, 6284 packed columns padded to 6288, conv cache [4608, 3]."""
    if tp <= 0 or cfg.heads % tp:
        raise ValueError(f"tp={tp} must be a positive divisor of heads={cfg.heads}")
    h = cfg.heads // tp
    width = h * cfg.head_dim
    segments = {"q": width, "k": width, "v": width, "g_out": width, "f_a": cfg.gate_rank, "beta": h}
    total = sum(segments.values())
    padded = -(-total // cfg.pad_to) * cfg.pad_to
    conv_channels = 3 * width
    return LocalShapes(tp, h, segments, total, padded, conv_channels, (conv_channels, cfg.conv_size - 1))


@dataclass
class KDAWeights:
    """Parameters of one rank's shard; every tensor in one dtype.

    ``w_packed:[d, padded]`` (padding columns are zero), ``w_fb:[rank, h*K]``,
    ``conv:[3*h*K, conv_size]``, ``a_log:[h]``, ``dt_bias:[h*K]``, ``norm:[K]``, ``w_o:[h*K, d]``.
    """

    w_packed: torch.Tensor
    w_fb: torch.Tensor
    conv: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    w_o: torch.Tensor


def init_weights(cfg: KDAConfig, tp: int = 1, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> KDAWeights:
    """Random weights with fan-in scaling (deterministic for a seed); ``a_log`` starts at 0 as in the paper."""
    shapes = local_shapes(cfg, tp)
    gen = torch.Generator().manual_seed(seed)

    def randn(*size: int, fan_in: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, dtype=torch.float64).mul_(fan_in**-0.5).to(dtype)

    w_packed = torch.zeros(cfg.hidden, shapes.padded_columns, dtype=dtype)
    w_packed[:, : shapes.packed_columns] = randn(cfg.hidden, shapes.packed_columns, fan_in=cfg.hidden)
    width = shapes.heads * cfg.head_dim
    return KDAWeights(
        w_packed=w_packed,
        w_fb=randn(cfg.gate_rank, width, fan_in=cfg.gate_rank),
        conv=randn(shapes.conv_channels, cfg.conv_size, fan_in=cfg.conv_size),
        a_log=torch.zeros(shapes.heads, dtype=dtype),
        dt_bias=randn(width, fan_in=1),
        norm=1 + 0.1 * randn(cfg.head_dim, fan_in=1),
        w_o=randn(width, cfg.hidden, fan_in=width),
    )


@dataclass
class KDAState:
    """What a request carries between steps: conv history ``[B, 3*h*K, conv_size-1]``
    (the last inputs of every q/k/v channel, oldest first) and the recurrent state ``[B, h, K, K]``."""

    conv: torch.Tensor
    recurrent: torch.Tensor


@dataclass
class KDALayer:
    """One rank's KDA layer: configuration, shard shapes and weights."""

    cfg: KDAConfig
    weights: KDAWeights
    tp: int = 1
    # Where a kernel keeps more than the activations' dtype: the decay gates (fp32 in every
    # kernel, computed from the low-rank GEMM's output) and the carried recurrent state.
    # ``None``: the input's dtype, as a plain implementation in that dtype would.
    gate_dtype: torch.dtype | None = None
    state_dtype: torch.dtype | None = None
    shapes: LocalShapes = field(init=False)

    def __post_init__(self) -> None:
        self.shapes = local_shapes(self.cfg, self.tp)

    def empty_state(self, batch: int, dtype: torch.dtype = torch.float64,
                    device: torch.device | str = "cpu") -> KDAState:  # fmt: skip
        """Zero conv history and zero recurrent state for ``batch`` requests."""
        return KDAState(
            conv=torch.zeros(batch, *self.shapes.conv_cache, dtype=dtype, device=device),
            recurrent=torch.zeros(batch, self.shapes.heads, self.cfg.head_dim, self.cfg.head_dim, dtype=dtype,
                                  device=device),
        )

    def prefill(
        self, x: torch.Tensor, state: KDAState | None = None, *, core: Callable | None = None
    ) -> tuple[torch.Tensor, KDAState]:
        """``x:[B, T, d] -> (y:[B, T, d], state)`` with the chunkwise core (or ``core``)."""
        core = core or (lambda *a, **kw: chunkwise(*a, chunk_size=self.cfg.chunk_size, **kw))
        return self._forward(x, state, core)

    def decode(self, x: torch.Tensor, state: KDAState, *,
               core: Callable | None = None) -> tuple[torch.Tensor, KDAState]:
        """One token per request, ``x:[B, 1, d]``, through the recurrent core (or ``core``, a
        fused decode kernel)."""
        if x.dim() != 3 or x.shape[1] != 1:
            raise ValueError(f"decode takes one token per request, x:[B, 1, d]; got {list(x.shape)}")
        return self._forward(x, state, core or recurrent)

    def _forward(self, x: torch.Tensor, state: KDAState | None, core: Callable) -> tuple[torch.Tensor, KDAState]:
        require_tensor("x", x)
        require_shape("x", x, (None, None, self.cfg.hidden), "B,T,d")
        require_finite("x", x)
        B, T, _ = x.shape
        state = state or self.empty_state(B, self.state_dtype or x.dtype, x.device)
        parts = self.project(x)
        qkv, conv_cache = short_conv(torch.cat([parts["q"], parts["k"], parts["v"]], -1), self.weights.conv, state.conv)
        h, K = self.shapes.heads, self.cfg.head_dim
        q, k, v = (t.reshape(B, T, h, K) for t in F.silu(qkv).split(h * K, dim=-1))
        q, k = l2norm(q), l2norm(k)
        gd = self.gate_dtype or x.dtype
        z = matmul(parts["f_a"], self.weights.w_fb).reshape(B, T, h, K).to(gd)
        g = lower_bound_gate(z, self.weights.a_log.to(gd), self.weights.dt_bias.to(gd), g_min=self.cfg.g_min)
        beta = torch.sigmoid(parts["beta"])
        o, S = core(q, k, v, g, beta, initial_state=state.recurrent, output_final_state=True)
        o = rms_norm(o, self.weights.norm, eps=self.cfg.norm_eps) * torch.sigmoid(parts["g_out"].reshape(B, T, h, K))
        y = matmul(o.reshape(B, T, h * K), self.weights.w_o)
        return y, KDAState(conv=conv_cache, recurrent=S.to(self.state_dtype or x.dtype))

    def prefill_packed(
        self, x: torch.Tensor, state: KDAState, cu_seqlens: torch.Tensor, *, core: Callable | None = None
    ) -> tuple[torch.Tensor, KDAState]:
        """A packed batch, as serving engines hand it over: ``x:[1, sum T_i, d]`` holds ``N``
        requests back to back, request ``i`` at ``cu_seqlens[i]:cu_seqlens[i + 1]`` (``int64
        [N + 1]``, from 0), each continuing from its own ``state`` entry (batch ``N``). The
        definition: each request through :meth:`prefill` on its own, outputs packed again."""
        if x.dim() != 3 or x.shape[0] != 1:
            raise ValueError(f"a packed batch is x:[1, sum T, d]; got {list(x.shape)}")
        bounds = [int(b) for b in cu_seqlens.tolist()]
        if bounds[0] != 0 or bounds[-1] != x.shape[1] or any(b > c for b, c in itertools.pairwise(bounds)):
            raise ValueError(f"cu_seqlens {bounds} does not split {x.shape[1]} tokens from 0")
        if state.conv.shape[0] != len(bounds) - 1:
            raise ValueError(f"{len(bounds) - 1} requests but a state for {state.conv.shape[0]}")
        ys, convs, states = [], [], []
        for i, (a, b) in enumerate(itertools.pairwise(bounds)):
            one = KDAState(state.conv[i : i + 1], state.recurrent[i : i + 1])
            y, new = self.prefill(x[:, a:b], one, core=core)
            ys.append(y)
            convs.append(new.conv)
            states.append(new.recurrent)
        return torch.cat(ys, 1), KDAState(torch.cat(convs), torch.cat(states))

    def project(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The packed GEMM ``x @ w_packed`` split into ``[q | k | v | g_out | f_a | beta]``."""
        packed = matmul(x, self.weights.w_packed)
        return {name: packed[..., s] for name, s in self.shapes.slices().items()}


def short_conv(x: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution with carried history.

    ``x:[B, T, C]``, ``weight:[C, W]``, ``cache:[B, C, W-1]`` (the previous ``W-1`` inputs,
    oldest first). Returns ``y:[B, T, C]`` with ``y_t = sum_i weight[:, i] * x_{t-W+1+i}`` and
    the new cache (the last ``W-1`` inputs, including those taken from the old cache when
    ``T < W-1``). No activation here; the layer applies SiLU after.
    """
    W = weight.shape[-1]
    history = torch.cat([cache.transpose(1, 2), x], dim=1)  # [B, W-1+T, C]
    windows = history.unfold(1, W, 1)  # [B, T, C, W]
    y = (windows * weight).sum(-1)
    return y, history[:, history.shape[1] - (W - 1) :].transpose(1, 2).contiguous()
