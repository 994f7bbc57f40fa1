"""Stable LatentMoE tiled low-precision form — grouped-GEMM tiles as a fused MoE kernel runs them.

The chunkwise dispatch (:func:`k3verify.moe.chunkwise.dispatch`) with the structure of vLLM's
fused MoE: each expert's rows are padded to a multiple of ``tile_m`` (``moe_align_block_size``;
padding rows are zeros and are dropped), and every tile of ``tile_m`` rows runs

    G, U = Z W1_e, Z W3_e          (operands in operand_dtype, fp32 accumulation over K-steps of tile_k)
    H    = round(act(G, U))        (SiTU in the fp32 epilogue; H is the next GEMM's operand: "hidden dtype")
    O    = round(p ⊙ (H W2_e))     (mixture weight applied in the fp32 epilogue, stored in the output dtype)

then each token's ``k`` rows are summed in fp32 (``moe_sum``) and stored, normalised in fp32
(RMSNorm), rounded as the operand of W↑, and the shared MLP runs the same tiles on ``x``.
Tensors a kernel stores are rounded (:class:`~k3verify.moe.quantize.Caster`): GEMM operands to
``operand_dtype`` (fp8 with the scales of ``fp8_scaling``), results to the output dtype (the
operand dtype; bf16 for fp8). ``G``, ``U``, the routing weights and every sum stay fp32.
The router is the FP32 one of docs/model.md §4 on ``x`` as given; operand rounding never reaches it.

Overflow is visible: an operand past its dtype's range becomes inf/NaN (``overflow="nonfinite"``)
and :func:`explain_overflow` names it (:func:`overflow_events` gives the events themselves). One
failure stays finite: when ``Σ u²`` of a token overflows fp32, the RMSNorm multiplies ``u`` by
``rsqrt(inf) = 0`` and the token's routed output becomes exactly 0; :func:`predict` reports it as
``predicted_zeroed``.

:func:`overflow_quantities` and :func:`predict` give the analytic prediction: every stored
tensor's largest magnitude, computed exactly (fp64) for the given inputs, against the range of
the dtype it is stored in. SiTU bounds the hidden tensor by 100 whatever the input, and each
expert's output by ``100 · max ‖W2_j[:, c]‖₁``, so with SiTU only the inputs (``x``, ``z``) can
overflow; SwiGLU's hidden ``g σ(g) u`` grows like the square of the input scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from ..numerics import exp_fits, facts, is_float8, ln_max, resolve_dtype
from ..numerics.frontier import Magnitudes, as_checks, prediction_from
from ..numerics.frontier import OverflowPrediction as RangePrediction
from ..numerics.frontier import ln_abs_max as _ln_abs_max
from ..numerics.ops import rms_norm
from ..numerics.trace import OverflowEvent
from .chunkwise import Dispatch, backward_pass, dispatch
from .inputs import Dims, FormOptions, MoEConfig, MoEWeights, Routing, check_backward, check_inputs
from .quantize import Caster
from .router import mixture, routing_for
from .situ import activation, bound


def tiled(
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
    """Tiled low-precision MoE. Arguments as in :mod:`k3verify.moe.inputs`.

    Returns ``y:[T, d]`` in :attr:`FormOptions.output_dtype` (fp64 for fp64 operands, which is
    the exact dispatch-and-tile algebra).
    """
    opts = FormOptions(tile_m, tile_k, operand_dtype, fp8_scaling, fp8_static_scale, overflow)
    dims = check_inputs(x, weights, config, routing)
    return _tiled(x, weights, config, routing, dims, Caster.make(opts))


def tiled_traced(
    x: torch.Tensor, weights: MoEWeights, config: MoEConfig, *, routing: Routing | None = None, **tiling: object
) -> tuple[torch.Tensor, list[OverflowEvent]]:
    """:func:`tiled`'s output together with every stored tensor that overflowed, in computing order."""
    opts = FormOptions(**tiling)  # type: ignore[arg-type]
    dims = check_inputs(x, weights, config, routing)
    cast = Caster.make(opts, trace=True)
    return _tiled(x, weights, config, routing, dims, cast), cast.rounder.events


def overflow_events(
    x: torch.Tensor, weights: MoEWeights, config: MoEConfig, *, routing: Routing | None = None, **tiling: object
) -> list[OverflowEvent]:
    """The overflow events of :func:`tiled_traced` alone (same arguments)."""
    return tiled_traced(x, weights, config, routing=routing, **tiling)[1]


def explain_overflow(
    x: torch.Tensor, weights: MoEWeights, config: MoEConfig, *, routing: Routing | None = None, **tiling: object
) -> list[str]:
    """Each stored tensor that overflowed in :func:`tiled` (same arguments): which, where and by
    how much, one line each, in computing order."""
    return [e.describe() for e in overflow_events(x, weights, config, routing=routing, **tiling)]


def tiled_backward(
    x: torch.Tensor,
    weights: MoEWeights,
    config: MoEConfig,
    *,
    dy: torch.Tensor,
    indices: torch.Tensor,
    tile_m: int = 16,
    tile_k: int = 64,
    operand_dtype: torch.dtype | str = torch.bfloat16,
    fp8_scaling: str = "per_row",
    fp8_static_scale: float = 1.0,
    overflow: str = "nonfinite",
) -> dict[str, torch.Tensor]:
    """The backward of :func:`tiled` on the forward's selection ``indices:[T, k]``
    (:func:`k3verify.moe.chunkwise.backward_pass`) as a grouped-GEMM kernel runs it: operands
    (the recomputed ``x``, ``z``, ``H``, the normalised latent, the shared hidden, ``dy`` and every
    gradient a GEMM reads) in ``operand_dtype``, gradients written in the output dtype, fp32
    accumulation over K-steps of ``tile_k`` (for a weight's gradient the K axis is the expert's
    rows). The router's gradient stays fp32 (its GEMM is fp32). Padding rows of a tile are zeros
    and change no value, so ``tile_m`` is validated and unused. Returns the gradients by name in
    the accumulator dtype (fp64 for fp64 operands: the exact algebra)."""
    opts = FormOptions(tile_m, tile_k, operand_dtype, fp8_scaling, fp8_static_scale, overflow)
    return _backward_run(x, weights, config, dy, indices, opts, trace=False)[0]


def tiled_backward_traced(
    x: torch.Tensor, weights: MoEWeights, config: MoEConfig, *, dy: torch.Tensor,
    indices: torch.Tensor, **tiling: object
) -> tuple[dict[str, torch.Tensor], list[OverflowEvent]]:
    """:func:`tiled_backward`'s gradients and every stored tensor that overflowed, in computing order."""
    return _backward_run(x, weights, config, dy, indices, FormOptions(**tiling), trace=True)  # type: ignore[arg-type]


def _backward_run(x: torch.Tensor, weights: MoEWeights, config: MoEConfig, dy: torch.Tensor, indices: torch.Tensor,
                  opts: FormOptions, *, trace: bool) -> tuple[dict[str, torch.Tensor], list[OverflowEvent]]:
    """The tiled backward under ``opts`` (fp8 refused), and its overflow events when tracing."""
    if is_float8(opts.operand_dtype):
        raise ValueError("the MoE backward runs with bf16, fp16, fp32 or fp64 operands (fp8 gradients take e5m2 "
                         f"and scales of their own); got {opts.operand_dtype}")
    check_backward(x, weights, config, dy, indices)
    cast = Caster.make(opts, trace=trace)
    grads = backward_pass(x, weights, config, dy, indices, cast, partial(gemm, tile_k=opts.tile_k))
    return grads, cast.rounder.events


def gemm(a: torch.Tensor, b: torch.Tensor, tile_k: int) -> torch.Tensor:
    """``a:[..., M, K] @ b:[..., K, N]`` as a kernel's K loop: one product per ``tile_k`` step,
    partial sums added in order in ``a``'s dtype (the accumulator)."""
    K = a.shape[-1]
    out = a[..., :tile_k] @ b[..., :tile_k, :]
    for k0 in range(tile_k, K, tile_k):
        out = out + a[..., k0 : k0 + tile_k] @ b[..., k0 : k0 + tile_k, :]
    return out


def align_blocks(d: Dispatch, tile_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiles of ``tile_m`` permuted rows, each of one expert: ``(rows [nb, tile_m], expert [nb])``.

    ``rows`` holds permuted-row indices, ``-1`` for padding; an expert with no rows has no tile.
    """
    counts = torch.tensor(d.counts, dtype=torch.int64)
    per_expert = -(-counts // tile_m)
    expert = torch.repeat_interleave(torch.arange(len(d.counts)), per_expert)
    first_block = torch.cumsum(per_expert, 0) - per_expert
    within = torch.arange(len(expert)) - first_block[expert]  # tile index inside its expert
    offset = within[:, None] * tile_m + torch.arange(tile_m)[None, :]  # row inside the expert
    start = torch.tensor(d.offsets[:-1], dtype=torch.int64)[expert]
    rows = torch.where(offset < counts[expert][:, None], start[:, None] + offset, -1)
    return rows, expert


def _tiled(x, weights: MoEWeights, cfg: MoEConfig, routing: Routing | None, dims: Dims, cast: Caster) -> torch.Tensor:
    opts = cast.opts
    acc, tk = opts.accumulator, opts.tile_k
    r = routing_for(x, weights, cfg, routing, acc)
    w = {n: cast.operand(f"weight {n}", t, weight=True) for n, t in weights.tensors().items()
         if n not in ("bias", "latent_norm", "w_router")}
    gamma = cast.output("weight latent_norm γ", weights.latent_norm)

    def act(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return activation(g, u, cfg.activation, beta1=cfg.beta1, beta2=cfg.beta2)

    xo = cast.operand("input x", x)
    z = cast.operand("latent z = x W↓ (dispatch payload)", gemm(xo, w["w_latent_down"], tk))
    d = dispatch(r.indices, dims.E)
    rows, expert = align_blocks(d, opts.tile_m)
    valid = rows >= 0
    safe = rows.clamp(min=0)
    zb = torch.where(valid[..., None], z[d.token[safe]], torch.zeros((), dtype=acc))  # [nb, tile_m, Dl]
    g, u = gemm(zb, w["w1"][expert], tk), gemm(zb, w["w3"][expert], tk)
    h = cast.operand("expert hidden h = act(g, u)", act(g, u))
    p = torch.where(valid, r.weights.reshape(-1)[d.order[safe]], torch.zeros((), dtype=acc))
    o = cast.output("weighted expert output p·E_j", gemm(h, w["w2"][expert], tk) * p[..., None])
    pairs = torch.zeros(dims.T * dims.k, dims.Dl, dtype=acc, device=x.device)
    pairs[d.order[rows[valid]]] = o[valid]
    u_lat = cast.output("latent u = Σ p_j E_j", pairs.reshape(dims.T, dims.k, dims.Dl).sum(1))
    normed = cast.operand("normalised latent RMSNorm(u)", rms_norm(u_lat, gamma, eps=cfg.rms_norm_eps))
    y_r = cast.output("routed output y_r", gemm(normed, w["w_latent_up"], tk))
    hs = cast.operand("shared hidden", act(gemm(xo, w["shared_w1"], tk), gemm(xo, w["shared_w3"], tk)))
    y_s = cast.output("shared output y_s", gemm(hs, w["shared_w2"], tk))
    return cast.output("output y", y_r + y_s).to(opts.output_dtype)


# ----------------------------------------------------------------------------------------------
# Analytic overflow prediction


@dataclass(frozen=True)
class OverflowQuantities:
    """Natural logs of the largest magnitudes the tiled form stores or accumulates, exact (fp64).

    ``inputs``: ``x`` and each weight matrix; ``logits``: router logits; ``z``; ``preact``: the
    experts' ``g, u`` (fp32 accumulators); ``hidden``: ``act(g, u)``; ``expert_out``: ``p_j E_j``;
    ``latent``: ``u``; ``sum_squares``: the largest ``Σ u²`` of a token (the RMSNorm's fp32 sum);
    ``normed``; ``routed``: ``y_r``; ``shared_preact``, ``shared_hidden``, ``shared``: the shared
    MLP's; ``output``: ``y``. ``situ_bound``: ``ln`` of the a-priori ``β1 β2 max ‖W2_j[:, c]‖₁``
    bound on every SiTU expert output (independent of the input). ``oracle`` is ``y`` in fp64.
    """

    inputs: dict[str, float]
    logits: float
    z: float
    preact: float
    hidden: float
    expert_out: float
    latent: float
    sum_squares: float
    normed: float
    routed: float
    shared_preact: float
    shared_hidden: float
    shared: float
    output: float
    situ_bound: float
    oracle: torch.Tensor

    def as_dict(self) -> dict[str, object]:
        """The scalar fields (for map cells and reports)."""
        return {k: v for k, v in self.__dict__.items() if k != "oracle"}


def overflow_quantities(
    x: torch.Tensor, weights: MoEWeights, config: MoEConfig, *, routing: Routing | None = None, **_: object
) -> OverflowQuantities:
    """:class:`OverflowQuantities` of these inputs, computed in fp64.

    Without ``routing`` the experts are chosen as the low-precision forms choose them (the FP32
    router on ``x`` as given). Independent of the operand dtype and of the tiling (the forms'
    other keyword options are accepted and ignored).
    """
    dims = check_inputs(x, weights, config, routing)
    r = routing_for(x, weights, config, routing, torch.float32).to(torch.float64)
    w, xd = weights.to(torch.float64), x.to(torch.float64)
    logits = xd @ w.w_router
    z = xd @ w.w_latent_down
    e = r.indices.reshape(-1)
    zp = z.repeat_interleave(dims.k, dim=0)[:, None, :]
    g, u = zp @ w.w1[e], zp @ w.w3[e]
    h = activation(g, u, config.activation, beta1=config.beta1, beta2=config.beta2)
    pe = (h @ w.w2[e])[:, 0] * r.weights.reshape(-1, 1)
    lat = pe.reshape(dims.T, dims.k, dims.Dl).sum(1)
    normed = rms_norm(lat, w.latent_norm, eps=config.rms_norm_eps)
    y_r = normed @ w.w_latent_up
    gs, us = xd @ w.shared_w1, xd @ w.shared_w3
    hs = activation(gs, us, config.activation, beta1=config.beta1, beta2=config.beta2)
    y_s = hs @ w.shared_w2
    y = y_r + y_s
    col_l1 = w.w2.abs().sum(-2).max()  # max over experts and columns of ‖W2_j[:, c]‖₁
    return OverflowQuantities(
        inputs={"input x": _ln_abs_max(xd)} | {f"weight {n}": _ln_abs_max(t) for n, t in w.tensors().items()
                                               if n not in ("bias", "w_router")},
        logits=_ln_abs_max(logits),
        z=_ln_abs_max(z),
        preact=max(_ln_abs_max(g), _ln_abs_max(u)),
        hidden=_ln_abs_max(h),
        expert_out=_ln_abs_max(pe),
        latent=_ln_abs_max(lat),
        sum_squares=_ln_abs_max((lat * lat).sum(-1)) if dims.T else -math.inf,
        normed=_ln_abs_max(normed),
        routed=_ln_abs_max(y_r),
        shared_preact=max(_ln_abs_max(gs), _ln_abs_max(us)),
        shared_hidden=_ln_abs_max(hs),
        shared=_ln_abs_max(y_s),
        output=_ln_abs_max(y),
        situ_bound=math.log(bound(config.beta1, config.beta2) * float(col_l1)) if float(col_l1) > 0 else -math.inf,
        oracle=y,
    )


@dataclass(frozen=True)
class OverflowPrediction(RangePrediction):
    """Finite or not, every failing range check, the tightest one, and the silent RMSNorm zeroing.

    ``predicted_zeroed``: some token's ``Σu²`` overflows fp32, so its routed output becomes exactly
    0 (finite, wrong). The ``ln_*`` fields are the :class:`OverflowQuantities` the checks read
    (natural logs of the largest magnitudes), so that a map cell records what decided it.
    """

    predicted_zeroed: bool = False
    ln_logits: float = math.nan
    ln_z: float = math.nan
    ln_preact: float = math.nan
    ln_hidden: float = math.nan
    ln_expert_out: float = math.nan
    ln_latent: float = math.nan
    ln_sum_squares: float = math.nan
    ln_normed: float = math.nan
    ln_routed: float = math.nan
    ln_shared_preact: float = math.nan
    ln_shared_hidden: float = math.nan
    ln_shared: float = math.nan
    ln_output: float = math.nan
    ln_situ_bound: float = math.nan

    def explanation(self) -> str:
        """One line: the failing checks (or the binding one and its headroom), and any zeroing."""
        text = "; ".join(self.reasons) if self.reasons else (
            f"all ranges fit; tightest: {self.binding} ({self.headroom:.2f} ln units of headroom)")
        if self.predicted_zeroed:
            text += "; RMSNorm's fp32 Σu² overflows: those tokens' routed output becomes 0"
        return text


def predict(
    q: OverflowQuantities,
    *,
    operand_dtype: torch.dtype | str = torch.bfloat16,
    fp8_scaling: str = "per_row",
    fp8_static_scale: float = 1.0,
    **_: object,
) -> OverflowPrediction:
    """Will :func:`tiled` with these settings return finite values for these inputs?

    Every stored tensor must fit its dtype (``ln|x| < ln max``, and the accumulator must hold it
    first): GEMM operands the operand dtype, results the output dtype, ``g, u`` and the sums the
    accumulator. An fp8 operand with a dynamic scale cannot overflow (only its fp32 value must be
    finite); with the static scale ``s`` it must satisfy ``ln|x| − ln s < ln 448``. The tiling
    (``tile_m``, ``tile_k``) and the forms' other options do not move it and are ignored.
    """
    opts = FormOptions(operand_dtype=operand_dtype, fp8_scaling=fp8_scaling, fp8_static_scale=fp8_static_scale)
    op, acc, out = resolve_dtype(opts.operand_dtype), opts.accumulator, opts.output_dtype
    checks: list[tuple[str, bool, float]] = []  # (what, passes, headroom in ln units)

    def fits(what: str, ln_value: float, dtype: torch.dtype, shift: float = 0.0) -> None:
        limit = min(ln_max(dtype) + shift, ln_max(acc))
        ok = exp_fits(ln_value - shift, dtype, compute_dtype=acc) and exp_fits(ln_value, acc, compute_dtype=acc)
        room = limit - ln_value if not math.isnan(ln_value) else -math.inf
        checks.append((f"{what} (ln {ln_value:.2f} vs {limit:.2f}: {facts(dtype).name})", ok, room))

    def operand(what: str, ln_value: float, *, weight: bool = False) -> None:
        if not is_float8(op):
            fits(what, ln_value, op)
        elif opts.fp8_scaling == "static" and not weight:
            fits(f"{what} / static scale", ln_value, op, shift=math.log(opts.fp8_static_scale))
        else:
            fits(f"{what} (dynamic fp8 scale: only fp32 must hold it)", ln_value, acc)

    for name, value in q.inputs.items():
        operand(name, value, weight=name.startswith("weight"))
    fits("router logits", q.logits, acc)
    operand("latent z", q.z)
    fits("expert pre-activations g, u", q.preact, acc)
    operand("expert hidden h", q.hidden)
    fits("weighted expert outputs p·E_j", q.expert_out, out)
    fits("latent u", q.latent, out)
    zeroed = not exp_fits(q.sum_squares, acc, compute_dtype=acc)
    operand("normalised latent", q.normed)
    fits("routed output y_r", q.routed, out)
    fits("shared pre-activations", q.shared_preact, acc)
    operand("shared hidden", q.shared_hidden)
    fits("shared output y_s", q.shared, out)
    fits("output y", q.output, out)
    failing = tuple(what for what, ok, _ in checks if not ok)
    what, _, room = min(checks, key=lambda c: c[2])
    read = {f"ln_{k}": v for k, v in q.as_dict().items() if k != "inputs"}
    return OverflowPrediction(finite=not failing, reasons=failing, binding=what, headroom=room, predicted_zeroed=zeroed,
                              **read)


# ----------------------------------------------------------------------------------------------
# The backward's overflow model


@dataclass
class _Measured:
    """:class:`~k3verify.moe.quantize.Caster`'s interface over a
    :class:`~k3verify.numerics.frontier.Magnitudes`: nothing rounded (fp64), every stored tensor
    and every GEMM's accumulator measured."""

    opts: FormOptions
    seen: Magnitudes

    def operand(self, name: str, t: torch.Tensor, *, weight: bool = False) -> torch.Tensor:
        return self.seen(name, t, "operand")

    def output(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return self.seen(name, t, "output")

    def gemm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.seen("GEMM accumulators", a @ b, "accumulator")


@dataclass(frozen=True)
class BackwardOverflowQuantities:
    """Natural logs of the largest magnitudes the tiled backward stores (``stored``: name ->
    (``operand``, ``output`` or ``accumulator``, ln max)), exact (fp64), with the fp64
    gradients of the same pass (``gradients``: the map's reference) and the forward's quantities
    (``forward``: what the recomputed forward stores)."""

    stored: Magnitudes
    gradients: dict[str, torch.Tensor]
    forward: OverflowQuantities


def backward_overflow_quantities(x: torch.Tensor, weights: MoEWeights, config: MoEConfig, *, dy: torch.Tensor,
                                 indices: torch.Tensor, **_: object) -> BackwardOverflowQuantities:
    """:class:`BackwardOverflowQuantities` of these inputs, from one fp64 pass of
    :func:`~k3verify.moe.chunkwise.backward_pass` (independent of the operand dtype and tiling)."""
    check_backward(x, weights, config, dy, indices)
    probe = _Measured(FormOptions(operand_dtype=torch.float64), Magnitudes())
    x64, w64, dy64 = x.to(torch.float64), weights.to(torch.float64), dy.to(torch.float64)
    grads = backward_pass(x64, w64, config, dy64, indices, probe, probe.gemm)  # type: ignore[arg-type]
    fixed = Routing(indices, mixture(x64, w64.w_router, indices, config, torch.float64)[1])
    return BackwardOverflowQuantities(probe.seen, grads, overflow_quantities(x64, w64, config, routing=fixed))


def predict_backward(q: BackwardOverflowQuantities, *, operand_dtype: torch.dtype | str = torch.bfloat16,
                     **_: object) -> RangePrediction:
    """Will :func:`tiled_backward` return finite gradients for these inputs? Every tensor it
    stores must fit its dtype (operands the operand dtype, results the output dtype, accumulators
    fp32) and so must everything the forward stores (:func:`predict`). The tiling is ignored."""
    opts = FormOptions(operand_dtype=operand_dtype)
    dtypes = {"operand": opts.operand_dtype, "output": opts.output_dtype, "accumulator": opts.accumulator}
    forward = predict(q.forward, operand_dtype=operand_dtype)
    return prediction_from([*as_checks(forward), *q.stored.checks(dtypes, opts.accumulator)])
