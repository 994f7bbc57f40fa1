"""Small operators several modules share (normalisations, activations), kept in one place.

They follow the definitions of docs/model.md exactly and keep the input dtype (fp64 stays fp64).
"""

from __future__ import annotations

import torch

RMS_NORM_EPS = 1e-5


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, *, eps: float = RMS_NORM_EPS) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last axis (docs/model.md notation, eps 1e-5)."""
    y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rms_norm_backward(n: torch.Tensor, rstd: torch.Tensor, dn: torch.Tensor) -> torch.Tensor:
    """The gradient of ``x`` through ``n = x · rstd``, ``rstd = 1 / sqrt(mean(x²) + eps)`` over the
    last axis, for the gradient ``dn`` of ``n`` (the gain's product already taken):
    ``rstd (dn − n mean(dn ∘ n))`` — the projection removes what only rescales ``x``.
    ``n, dn:[..., D]``, ``rstd:[..., 1]``; computes in their dtype."""
    return rstd * (dn - n * (dn * n).mean(-1, keepdim=True))


PREFIX_ORDERS = ("rounded", "sequential", "parallel")


def require_prefix_order(order: str) -> str:
    """``order`` if it is one of :data:`PREFIX_ORDERS`, else a ``ValueError`` naming them."""
    if order not in PREFIX_ORDERS:
        raise ValueError(f"unknown prefix order {order!r}; choose one of {', '.join(PREFIX_ORDERS)}")
    return order


def prefix_sum(x: torch.Tensor, dim: int, order: str = "rounded") -> torch.Tensor:
    """Inclusive prefix sum of ``x`` along ``dim`` in ``x``'s dtype, summed in a given order.

    ``rounded``: each prefix correctly rounded (summed in fp64, rounded once; torch's CPU
    ``cumsum`` does the same for fp32). ``sequential``: one add after another in ``x``'s dtype,
    as a loop over rows does. ``parallel``: a Hillis-Steele scan in ``x``'s dtype (log2 n
    rounds of strided adds), the shape of a GPU scan such as ``tl.cumsum``: neighbouring
    prefixes round along different paths, so their difference carries an error of the
    prefix's ulp, not of the difference's. fp64 input is summed in fp64 by every order.
    """
    if require_prefix_order(order) == "rounded":
        return x.to(torch.float64).cumsum(dim).to(x.dtype)
    rows = x.movedim(dim, 0)
    if rows.shape[0] == 0:
        return x.clone()
    if order == "sequential":
        out = [rows[0]]
        for row in rows[1:]:
            out.append(out[-1] + row)
        return torch.stack(out).movedim(0, dim)
    stride = 1
    while stride < rows.shape[0]:
        rows = torch.cat([rows[:stride], rows[stride:] + rows[:-stride]])
        stride *= 2
    return rows.movedim(0, dim)


_HALF = (torch.bfloat16, torch.float16)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as a GEMM computes it: for bf16/fp16 operands fp32 accumulation and the result
    rounded once to their dtype (tensor cores, and torch's CPU kernels, do the same; going through
    fp32 here also avoids CPU bf16 matmuls, 20-30x slower than fp32 on hosts without native bf16);
    other dtypes as they are (fp64 stays fp64)."""
    if a.dtype in _HALF and b.dtype == a.dtype:
        return (a.float() @ b.float()).to(a.dtype)
    return a @ b


def contract(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.einsum(equation, a, b)`` with :func:`matmul`'s arithmetic for bf16/fp16 operands."""
    if a.dtype in _HALF and b.dtype == a.dtype:
        return torch.einsum(equation, a.float(), b.float()).to(a.dtype)
    return torch.einsum(equation, a, b)

