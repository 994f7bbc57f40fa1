"""Argument checking and chunk layout shared by the KDA forms.

Every form takes the fla-core layout: ``q, k:[B,T,H,K]``, ``v:[B,T,H,V]``, ``g:[B,T,H,K]``
(log-decay, already gated, ``<= 0``), ``beta:[B,T,H]``, state ``[B,H,K,V]``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..numerics import compute_dtype
from ..numerics.validate import (
    require_finite,
    require_float,
    require_on_device,
    require_same,
    require_scale,
    require_shape,
    require_tensor,
)

# The inputs a KDA kernel takes in fp32 whatever its operand dtype: the log-decay and the gate's
# parameters. Every kernel computes the gate and its cumulative sum in fp32; a gate rounded to bf16
# puts one coherent error on every token of a saturated gate (a drawn g_min of -4.01 stored as -4.0),
# which reaches dg and dh0 multiplied by the length of the decay product: 3 to 5x the baseline's
# error (docs/modules/kda.md, "Gates in fp32").
GATE_INPUTS = ("g", "A_log", "dt_bias")


def cast_inputs(inputs: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """KDA's inputs (any of ``q, k, v, g, beta, initial_state, do, dht, A_log, dt_bias``, with
    ``None`` or integer tensors such as ``cu_seqlens`` passed through) as a kernel in ``dtype``
    receives them: float tensors in ``dtype``, but :data:`GATE_INPUTS` in fp32 where ``dtype`` is
    narrower (fp64 stays fp64)."""
    gate_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return {n: (t.to(gate_dtype if n in GATE_INPUTS else dtype)
                if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
            for n, t in inputs.items()}


@dataclass(frozen=True)
class Dims:
    """Sizes of one KDA call."""

    B: int
    T: int
    H: int
    K: int
    V: int


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float | None,
    *,
    values: bool = True,
) -> tuple[Dims, float]:
    """Validate a KDA call; return its sizes and the effective scale (``K**-0.5`` by default).

    Raises ``TypeError``/``ValueError`` naming the offending argument for wrong types,
    shapes, mixed dtypes or devices, non-finite values and positive log-decay. ``g`` may have
    its own float dtype (kernels take bf16 operands with fp32 gates: :func:`cast_inputs`);
    ``values=False`` skips the value scans (finite, ``g <= 0``), which read every
    element and wait for the device, for callers that time kernels.
    """
    names = ["q", "k", "v", "g", "beta"]
    tensors = [require_tensor(n, t) for n, t in zip(names, (q, k, v, g, beta))]
    if initial_state is not None:
        names.append("initial_state")
        tensors.append(require_tensor("initial_state", initial_state))
    for n, t in zip(names, tensors):
        require_float(n, t)
        require_on_device(n, t)
    typed = [(n, t) for n, t in zip(names, tensors) if n != "g"]
    require_same([n for n, _ in typed], [t for _, t in typed], "dtype")
    require_same(names, tensors, "device")
    if q.dim() != 4:
        raise ValueError(f"q has shape {list(q.shape)}; expected [B, T, H, K]")
    B, T, H, K = q.shape
    if v.dim() != 4:
        raise ValueError(f"v has shape {list(v.shape)}; expected [B, T, H, V]")
    V = v.shape[-1]
    require_shape("k", k, (B, T, H, K), "B,T,H,K")
    require_shape("v", v, (B, T, H, None), "B,T,H,V")
    require_shape("g", g, (B, T, H, K), "B,T,H,K")
    require_shape("beta", beta, (B, T, H), "B,T,H")
    if initial_state is not None:
        require_shape("initial_state", initial_state, (B, H, K, V), "B,H,K,V")
    if min(B, H, K, V) == 0:
        raise ValueError(f"empty dimension in B={B}, H={H}, K={K}, V={V}")
    if not values:
        return Dims(B, T, H, K, V), _scale(scale, K)
    for n, t in zip(names, tensors):
        require_finite(n, t)
    if T and bool((g > 0).any()):
        raise ValueError(
            f"g is a log-decay and must be <= 0; max g = {float(g.max()):.3g} "
            f"at index {tuple(int(i) for i in (g > 0).nonzero()[0])}"
        )
    outside = (beta < 0) | (beta > 1)
    if T and bool(outside.any()):
        # K3's write strength is sigmoid(beta_raw) (docs/model.md §1.3); fla-core's 2*sigmoid variant for
        # negative eigenvalues is not K3's and is not modelled here.
        raise ValueError(
            f"beta is a write strength in [0, 1]; {int(outside.sum())} value(s) outside, first "
            f"{float(beta[outside][0]):.3g} at index {tuple(int(i) for i in outside.nonzero()[0])}"
        )
    return Dims(B, T, H, K, V), _scale(scale, K)


def _scale(scale: float | None, K: int) -> float:
    return K**-0.5 if scale is None else require_scale(scale)


def working_dtype(x: torch.Tensor) -> torch.dtype:
    """fp64 for fp64 inputs, fp32 otherwise (see ``numerics.compute_dtype``)."""
    return compute_dtype(x.dtype)


def to_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``[B, T, H, ...] -> [B, H, N, C, ...]``, zero-padding T up to a multiple of C.

    Zero padding is inert for KDA: a padded token has ``k = v = q = 0``, ``beta = 0`` and
    ``g = 0`` (no decay), so it neither writes the state nor changes the decay prefix.
    """
    B, T = x.shape[:2]
    N = -(-T // chunk_size)
    pad = N * chunk_size - T
    if pad:
        x = torch.cat([x, x.new_zeros((B, pad, *x.shape[2:]))], dim=1)
    x = x.reshape(B, N, chunk_size, *x.shape[2:])
    return x.movedim(3, 1)  # [B, H, N, C, ...]


def from_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """Inverse of :func:`to_chunks`: ``[B, H, N, C, D] -> [B, T, H, D]``, dropping padding."""
    B, H, N, C, D = x.shape
    return x.movedim(1, 3).reshape(B, N * C, H, D)[:, :T]


def initial(initial_state: torch.Tensor | None, dims: Dims, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The starting state ``[B, H, K, V]`` in ``dtype`` (zeros when none is given)."""
    if initial_state is None:
        return torch.zeros(dims.B, dims.H, dims.K, dims.V, dtype=dtype, device=device)
    return initial_state.to(dtype).clone()


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``cu_seqlens:[N+1]`` integer offsets from 0 to ``total``, non-decreasing; returned as int64 CPU."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
        raise TypeError("cu_seqlens must be a 1-D integer tensor of cumulative sequence offsets")
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens must start at 0 and end at the token count {total}; got {cu.tolist()}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing; got {cu.tolist()}")
    return cu


def sequence_bounds(cu_seqlens: torch.Tensor | None, B: int, T: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` of each packed sequence (``cu_seqlens`` checked; ``B`` must then be 1),
    or of the whole axis when there is none."""
    if cu_seqlens is None:
        return [(0, T)]
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch dimension must be 1 (sequences packed along T); got B={B}")
    cu = check_cu_seqlens(cu_seqlens, T).tolist()
    return list(itertools.pairwise(cu))


def check_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float | None,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> tuple[Dims, float, list[tuple[int, int]]]:
    """Validate a backward call: the forward's arguments (:func:`check_inputs`), the packed
    sequences, and the upstream gradients ``do`` (like ``o``, ``[B,T,H,V]``) and ``dht`` (like the
    final states). With ``cu_seqlens:[N+1]``, ``initial_state`` and ``dht`` are ``[N,H,K,V]``.
    Returns the sizes, the effective scale and :func:`sequence_bounds`."""
    dims, scale = check_inputs(q, k, v, g, beta, None if cu_seqlens is not None else initial_state, scale)
    bounds = sequence_bounds(cu_seqlens, dims.B, dims.T)
    states = len(bounds) if cu_seqlens is not None else dims.B
    named = [("do", do, (dims.B, dims.T, dims.H, dims.V), "B,T,H,V")]
    named += [(n, t, (states, dims.H, dims.K, dims.V), "N,H,K,V" if cu_seqlens is not None else "B,H,K,V")
              for n, t in (("initial_state", initial_state if cu_seqlens is not None else None), ("dht", dht))
              if t is not None]
    for name, t, shape, axes in named:
        require_tensor(name, t)
        require_float(name, t)
        require_on_device(name, t)
        require_shape(name, t, shape, axes)
        require_finite(name, t)
    return dims, scale, bounds
