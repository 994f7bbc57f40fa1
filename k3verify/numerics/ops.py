"""Small operators several modules share (normalisations, activations), kept in one place.

They follow SPEC's definitions exactly and keep the input dtype (fp64 stays fp64).
"""

from __future__ import annotations

import torch

RMS_NORM_EPS = 1e-5


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, *, eps: float = RMS_NORM_EPS) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last axis (SPEC notation, eps 1e-5)."""
    y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight
