"""KDA gates and normalisations (docs/model.md §1.2–1.3).

All functions keep the dtype they are given (fp64 stays fp64) and work on any leading shape.
"""

from __future__ import annotations

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
