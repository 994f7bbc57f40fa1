"""SiTU, the bounded GLU of Stable LatentMoE's experts, and SwiGLU for comparison (docs/model.md §4).

    SiTU(g, u) = [β1 tanh(g / β1) σ(g)] ⊙ [β2 tanh(u / β2)],   β1 = 4, β2 = 25

The gate factor ``β1 tanh(g/β1) σ(g)`` lies in ``(−0.2698, β1)`` (its minimum is at g ≈ −1.22)
and the up factor in ``[−β2, β2]``, so ``|SiTU| ≤ β1 β2 = 100`` for every input. The bound
survives rounding: ``tanh`` and ``σ`` never exceed 1 in floating point and rounding is
monotone, so each factor is at most its exact bound and the product at most ``fl(4 · 25) = 100``.
SwiGLU ``g σ(g) u`` is the β → ∞ limit and grows like ``g u``.

Non-finite inputs (documented behaviour, tested):
- ``g = +inf`` gives the gate ``β1``; ``g = −inf`` gives ``β1 · (−1) · 0 = −0``, so SiTU(−inf, u) = ±0
  for finite ``u``; ``u = ±inf`` gives ``±β2`` times the gate. SiTU of infinities is finite.
- NaN in ``g`` or ``u`` gives NaN (never hidden, even where the other factor is 0).
SwiGLU returns ``inf`` for ``g = +inf`` and NaN for ``g = −inf`` (``−inf · 0``).

Both compute in fp32 at least (docs/model.md §4: computed in fp32); fp64 stays fp64.
"""

from __future__ import annotations

import torch

from ..numerics import compute_dtype

SITU_BETA1 = 4.0
SITU_BETA2 = 25.0


def _widen(g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = compute_dtype(g.dtype if g.dtype == torch.float64 else u.dtype)
    return g.to(dtype), u.to(dtype)


def situ_gate(g: torch.Tensor, beta1: float = SITU_BETA1) -> torch.Tensor:
    """``β1 tanh(g / β1) σ(g)``, in ``(−0.2698, β1)``."""
    return beta1 * torch.tanh(g / beta1) * torch.sigmoid(g)


def situ(g: torch.Tensor, u: torch.Tensor, *, beta1: float = SITU_BETA1, beta2: float = SITU_BETA2) -> torch.Tensor:
    """SiTU of pre-activations ``g, u`` (same shape); returns fp32 (fp64 for fp64 inputs)."""
    g, u = _widen(g, u)
    return situ_gate(g, beta1) * (beta2 * torch.tanh(u / beta2))


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SwiGLU ``SiLU(g) u = g σ(g) u``; returns fp32 (fp64 for fp64 inputs)."""
    g, u = _widen(g, u)
    return torch.nn.functional.silu(g) * u


def bound(beta1: float = SITU_BETA1, beta2: float = SITU_BETA2) -> float:
    """The largest ``|SiTU|``: ``β1 β2`` (100)."""
    return beta1 * beta2


def activation(g: torch.Tensor, u: torch.Tensor, name: str, *, beta1: float = SITU_BETA1,
               beta2: float = SITU_BETA2) -> torch.Tensor:
    """``situ`` or ``swiglu`` by name (a :class:`~k3verify.moe.inputs.MoEConfig` field)."""
    if name == "situ":
        return situ(g, u, beta1=beta1, beta2=beta2)
    if name == "swiglu":
        return swiglu(g, u)
    raise ValueError(f"unknown activation {name!r}; choose one of situ, swiglu")


def activation_backward(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor, name: str, *, beta1: float = SITU_BETA1,
                        beta2: float = SITU_BETA2) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dg, du)``: the gradients of ``act(g, u)`` (:func:`activation`) for an upstream ``dh``,
    all of one shape; computed in fp32 at least (fp64 stays fp64).

    SiTU's factors differentiate as ``a'(g) = sech²(g/β1) σ(g) + β1 tanh(g/β1) σ(g)(1 − σ(g))``
    and ``b'(u) = sech²(u/β2)``, with ``sech² = 1 − tanh²`` as autograd forms it: past
    saturation (``|g| ≳ 9 β1``) ``tanh`` rounds to ±1 and the derivative to exactly 0, and at
    ``g, u = ±inf`` it is 0 (finite: SiTU of infinities is finite). SwiGLU's are
    ``σ(g)(1 + g(1 − σ(g))) u`` and ``g σ(g)``.
    """
    g, u = _widen(g, u)
    dh = dh.to(g.dtype)
    if name == "situ":
        tg, sg, tu = torch.tanh(g / beta1), torch.sigmoid(g), torch.tanh(u / beta2)
        gate = beta1 * tg * sg
        dgate = (1 - tg * tg) * sg + gate * (1 - sg)
        return dh * dgate * (beta2 * tu), dh * gate * (1 - tu * tu)
    if name == "swiglu":
        sg = torch.sigmoid(g)
        return dh * sg * (1 + g * (1 - sg)) * u, dh * g * sg
    raise ValueError(f"unknown activation {name!r}; choose one of situ, swiglu")
