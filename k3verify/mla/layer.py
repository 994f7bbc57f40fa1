"""The Gated MLA layer — projections, paged-cache write, attention, output gate (docs/model.md §2).

With ``x:[T, d]`` the layer input (after AttnRes and the input RMSNorm):

    c_q = RMSNorm_{γ_q}(x W_DQ) ∈ ℝ^{q_lora}                       (1536)
    [q^n_h ; q^p_h] = (c_q W_UQ)_h ∈ ℝ^{Dn + Dr}                    (128 + 64 per head, 96 heads)
    [c ; k^p] = x W_DKV ∈ ℝ^{R + Dr},   ĉ = RMSNorm_{γ_kv}(c)        (512 + 64)
    cache ← [ĉ ; k^p]                                               (576 numbers per token)
    o_h = Σ_j softmax_j(τ (q^n_h·W_UK,hᵀĉ_j + q^p_h·k^p_j)) W_UV,hᵀĉ_j,   τ = (Dn + Dr)^{-1/2}
    y = [σ(x W_g) ⊙ o] W_O                                          (gate from x, full rank, no norm)

``k^p`` (released name ``qk_rope_head_dim``) is one 64-vector per token shared by all heads,
neither normalised nor rotated (K3 is NoPE: ``mla_use_nope = true``). The seed's view — "the
cache entry is a 576-d c_t" — is the concatenation ``[ĉ ; k^p]``.

Tensor parallelism: heads are split across ranks (12 of 96 at TP=8). ``W_UQ``, ``W_UK``,
``W_UV`` and ``W_g`` are sharded by head, ``W_O`` by its input rows (each rank's product is a
partial sum of ``y``, completed by an all-reduce); ``W_DQ``, ``W_DKV`` and both norms are
replicated, so every rank caches the full latent.

Weights are stored for ``x @ W`` (input dim first) with heads as their own axis.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

from ..numerics.ops import RMS_NORM_EPS, contract, matmul, rms_norm
from ..numerics.validate import require_positive_int
from .cache import LatentCache, append
from .recurrent import recurrent


@dataclass(frozen=True)
class MLAConfig:
    """Dimensions of one Gated MLA layer; defaults are K3's released configuration."""

    hidden_size: int = 7168
    num_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64  # the shared key part; the name is the config's, nothing is rotated
    v_head_dim: int = 128
    rms_norm_eps: float = RMS_NORM_EPS
    tp_size: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name != "rms_norm_eps":
                require_positive_int(f.name, getattr(self, f.name))
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if self.num_heads % self.tp_size:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by tp_size {self.tp_size}")

    @classmethod
    def production(cls, tp_size: int = 1) -> MLAConfig:
        """K3's released layout (96 heads, q latent 1536, cache 512 + 64, qk 128 + 64, v 128)."""
        return cls(tp_size=tp_size)

    @classmethod
    def small(cls, tp_size: int = 1) -> MLAConfig:
        """A CPU-sized layer with K3's proportions: R : Dr = 512 : 64, Dn : Dr = 128 : 64,
        Dv = Dn, q_lora = 3 R, d = 14 R (7168 = 14 · 512); 4 heads."""
        return cls(hidden_size=896, num_heads=4, q_lora_rank=192, kv_lora_rank=64, qk_nope_head_dim=16,
                   qk_rope_head_dim=8, v_head_dim=16, tp_size=tp_size)

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width of the expanded heads: ``Dn + Dr`` (192)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``τ = qk_head_dim^{-1/2}`` (``192^{-1/2}``), not ``(R + Dr)^{-1/2}``."""
        return self.qk_head_dim**-0.5

    @property
    def cache_width(self) -> int:
        """Numbers cached per token and layer: ``R + Dr`` (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def mha_cache_width(self) -> int:
        """What MHA with the same heads would cache per token: ``H (qk_head_dim + v_head_dim)`` (30720)."""
        return self.num_heads * (self.qk_head_dim + self.v_head_dim)

    @property
    def cache_ratio(self) -> float:
        """``mha_cache_width / cache_width`` (53.3 for K3)."""
        return self.mha_cache_width / self.cache_width

    @property
    def local_heads(self) -> int:
        """Heads per tensor-parallel rank (12 at TP=8)."""
        return self.num_heads // self.tp_size


@dataclass(frozen=True)
class MLAWeights:
    """One layer's parameters (all heads, or one rank's heads after :func:`shard`).

    Shapes with ``H`` heads: ``w_dq:[d, q_lora]``, ``q_norm:[q_lora]``, ``w_uq:[q_lora, H, Dn + Dr]``,
    ``w_dkv:[d, R + Dr]``, ``kv_norm:[R]``, ``w_uk:[H, R, Dn]``, ``w_uv:[H, R, Dv]``,
    ``w_g:[d, H, Dv]``, ``w_o:[H, Dv, d]``.
    """

    w_dq: torch.Tensor
    q_norm: torch.Tensor
    w_uq: torch.Tensor
    w_dkv: torch.Tensor
    kv_norm: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    w_g: torch.Tensor
    w_o: torch.Tensor

    @property
    def num_heads(self) -> int:
        return int(self.w_uk.shape[0])


def init_weights(
    cfg: MLAConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
) -> MLAWeights:
    """Random weights scaled by ``fan_in^{-1/2}`` (unit-scale activations), norm gains near 1.

    On ``device="meta"`` only shapes are produced (production-size structure checks).
    """
    d, H, Q, R = cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    Dn, Dr, Dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    shapes = {
        "w_dq": ((d, Q), d), "q_norm": ((Q,), None), "w_uq": ((Q, H, Dn + Dr), Q),
        "w_dkv": ((d, R + Dr), d), "kv_norm": ((R,), None), "w_uk": ((H, R, Dn), R),
        "w_uv": ((H, R, Dv), R), "w_g": ((d, H, Dv), d), "w_o": ((H, Dv, d), H * Dv),
    }
    if torch.device(device).type == "meta":
        return MLAWeights(**{n: torch.empty(s, dtype=dtype, device="meta") for n, (s, _) in shapes.items()})
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, fan_in) in shapes.items():
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        out[name] = (x * fan_in**-0.5 if fan_in else 1 + 0.1 * x).to(dtype=dtype, device=device)
    return MLAWeights(**out)


def shard(weights: MLAWeights, cfg: MLAConfig, rank: int) -> MLAWeights:
    """The weights tensor-parallel rank ``rank`` of ``cfg.tp_size`` holds: its heads, replicated latents."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < cfg.tp_size:
        raise ValueError(f"rank must be in [0, {cfg.tp_size}), got {rank!r}")
    h = cfg.local_heads
    heads = slice(rank * h, (rank + 1) * h)
    return replace(weights, w_uq=weights.w_uq[:, heads], w_uk=weights.w_uk[heads], w_uv=weights.w_uv[heads],
                   w_g=weights.w_g[:, heads], w_o=weights.w_o[heads])


def project_query(x: torch.Tensor, w: MLAWeights, cfg: MLAConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``x:[..., d] -> (q^n [..., H, Dn], q^p [..., H, Dr])`` through the normalised q latent."""
    c_q = rms_norm(matmul(x, w.w_dq), w.q_norm, eps=cfg.rms_norm_eps)
    q = contract("...c,chk->...hk", c_q, w.w_uq)
    return q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]


def project_latent(x: torch.Tensor, w: MLAWeights, cfg: MLAConfig) -> torch.Tensor:
    """``x:[..., d] -> [ĉ ; k^p]:[..., R + Dr]``: the cache entry (only ``ĉ`` is normalised)."""
    ckv = matmul(x, w.w_dkv)
    c, k_pe = ckv[..., : cfg.kv_lora_rank], ckv[..., cfg.kv_lora_rank:]
    return torch.cat([rms_norm(c, w.kv_norm, eps=cfg.rms_norm_eps), k_pe], dim=-1)


def output_gate(x: torch.Tensor, w: MLAWeights) -> torch.Tensor:
    """``σ(x W_g):[..., H, Dv]`` — from the layer input, never from the attention output."""
    return torch.sigmoid(contract("...d,dhv->...hv", x, w.w_g))


def output_projection(o: torch.Tensor, gate: torch.Tensor, w: MLAWeights) -> torch.Tensor:
    """``y = [gate ⊙ o] W_O``: ``o, gate:[..., H, Dv] -> [..., d]`` (a partial sum under TP)."""
    return contract("...hv,hvd->...d", gate * o, w.w_o)


@dataclass(frozen=True)
class LayerOutput:
    """What one layer call produced: ``y:[B, T, d]``, the updated cache and the intermediates."""

    y: torch.Tensor
    cache: LatentCache
    o: torch.Tensor  # attention output before the gate, [B, T, H, Dv]
    gate: torch.Tensor  # σ(x W_g), [B, T, H, Dv]
    entries: torch.Tensor  # the new cache entries [B, T, R + Dr]


Form = Callable[..., torch.Tensor]


def forward(
    x: torch.Tensor,
    w: MLAWeights,
    cfg: MLAConfig,
    cache: LatentCache,
    *,
    form: Form = recurrent,
    tap: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    **options: object,
) -> LayerOutput:
    """Run the layer on ``x:[B, T, d]``: write the ``T`` new latents to ``cache``, attend, gate, project.

    Prefill is ``T > 1`` on a cache holding the earlier context (possibly none); decode is
    ``T = 1``. ``form`` is any of ``recurrent``, ``chunkwise``, ``tiled`` (or ``expanded``);
    ``options`` are its keyword options. The scale is ``cfg.softmax_scale``. ``tap(name, t)``, when
    given, sees the intermediates ``q_nope``, ``q_pe``, ``entries``, ``o`` and ``gate`` and returns
    what the layer goes on with (a probe, or a planted bug of :mod:`k3verify.harness.selftest`).
    """
    def seen(name: str, t: torch.Tensor) -> torch.Tensor:
        return t if tap is None else tap(name, t)

    q_nope, q_pe = (seen(n, t) for n, t in zip(("q_nope", "q_pe"), project_query(x, w, cfg)))
    entries = seen("entries", project_latent(x, w, cfg))
    cache = append(cache, entries)
    o = seen("o", form(q_nope, q_pe, cache, w.w_uk, w.w_uv, scale=cfg.softmax_scale, **options))
    gate = seen("gate", output_gate(x, w))
    # A GPU kernel's output comes back to x's device (a kernel form may run where x is not).
    o = o.to(x.device, x.dtype)
    return LayerOutput(output_projection(o, gate, w), cache, o, gate, entries)
