"""KDA gates and normalisations (docs/model.md §1.2–1.3).

All functions keep the dtype they are given (fp64 stays fp64) and work on any leading shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6
DEFAULT_G_MIN = -5.0


def lower_bound_gate(
    z: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    g_min: float = DEFAULT_G_MIN,
) -> torch.Tensor:
    """K3's bounded log-decay ``g = g_min * sigmoid(exp(A_h) * (z + dt_bias))``.

    ``z:[..., H, K]`` decay logits, ``a_log:[H]`` (``A_h``), ``dt_bias:[H*K]`` or ``[H, K]``.
    Returns ``g`` in ``(g_min, 0]`` with ``z``'s dtype; in floating point ``g`` can round to
    exactly 0 (the sigmoid underflows) or to ``g_min``.
    """
    if not g_min < 0:
        raise ValueError(f"g_min must be negative, got {g_min}")
    H, K = z.shape[-2:]
    x = torch.exp(a_log).reshape(H, 1) * (z + dt_bias.reshape(H, K))
    return g_min * torch.sigmoid(x)


def softplus_gate(z: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Kimi Linear's unbounded log-decay ``g = -exp(A_h) * softplus(z + dt_bias)``, for sweeps."""
    H, K = z.shape[-2:]
    return -torch.exp(a_log).reshape(H, 1) * F.softplus(z + dt_bias.reshape(H, K))


def beta_gate(beta_raw: torch.Tensor, *, allow_negative_eigenvalues: bool = False) -> torch.Tensor:
    """Write strength ``beta = sigmoid(beta_raw)``, or ``2 * sigmoid`` when negative eigenvalues are allowed."""
    b = torch.sigmoid(beta_raw)
    return 2 * b if allow_negative_eigenvalues else b


def l2norm(x: torch.Tensor, *, eps: float = L2NORM_EPS) -> torch.Tensor:
    """FLA's kernel form ``x / sqrt(sum x^2 + eps)`` over the last axis (not ``F.normalize``)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


@dataclass(frozen=True)
class InKernelGate:
    """The gate a kernel computes itself (fla-core's ``use_gate_in_kernel``): the form's ``g``
    argument is then the decay logit ``z``, and ``g = lower_bound_gate(z, a_log, dt_bias)``.

    ``a_log:[H]``, ``dt_bias:[H*K]`` or ``[H, K]``; the backward also returns their gradients
    (``dA_log``, ``ddt_bias``) and ``dg`` is the gradient of ``z``.
    """

    a_log: torch.Tensor
    dt_bias: torch.Tensor
    g_min: float = DEFAULT_G_MIN

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        return lower_bound_gate(z, self.a_log.to(z.dtype), self.dt_bias.to(z.dtype), g_min=self.g_min)


def lower_bound_gate_backward(
    dg: torch.Tensor, z: torch.Tensor, gate: InKernelGate
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dz, dA_log, ddt_bias)`` from the gradient ``dg`` of :func:`lower_bound_gate`'s output.

    ``dg, z:[..., H, K]``; the parameters' gradients have their own shapes, in ``dg``'s dtype.
    The sigmoid's derivative is formed as ``sigmoid(x) * sigmoid(-x)``, which is 0 (never
    ``0 * inf = NaN``) where the sigmoid saturates.
    """
    H, K = z.shape[-2:]
    dtype = dg.dtype
    a = gate.a_log.to(dtype).reshape(H, 1).exp()
    x = a * (z.to(dtype) + gate.dt_bias.to(dtype).reshape(H, K))
    dx = dg * gate.g_min * torch.sigmoid(x) * torch.sigmoid(-x)
    d_bias = (dx * a).reshape(-1, H, K).sum(0)
    d_alog = (dx * x).reshape(-1, H, K).sum((0, 2))
    return dx * a, d_alog.reshape(gate.a_log.shape), d_bias.reshape(gate.dt_bias.shape)
