"""KDA recurrent form — the definition, one token at a time (docs/model.md §1.4).

    S' = Diag(exp(g_t)) S_{t-1}
    S_t = S' + beta_t k_t (v_t - S'^T k_t)^T
    o_t = S_t^T (scale * q_t)

This is the oracle when run in fp64. ``naive_baseline`` is the same recurrence with every
stored tensor rounded to a narrow dtype: the "same-dtype baseline" of the tolerance policy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..numerics import rounder, storage_for
from .inputs import check_inputs, initial, working_dtype


def recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA. Shapes as in :mod:`k3verify.kda.inputs`.

    Computes in fp64 for fp64 inputs and in fp32 otherwise; returns ``o:[B,T,H,V]`` in the
    input dtype and the final state ``[B,H,K,V]`` in the compute dtype (or ``None``).
    """
    dims, scale = check_inputs(q, k, v, g, beta, initial_state, scale)
    return _recurrence(q, k, v, g, beta, scale, initial_state, output_final_state, dims, None, v.dtype)


def naive_baseline(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    dtype: torch.dtype | str,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The recurrence as a plain implementation in ``dtype`` would run it.

    Inputs, the state after each update and every output are rounded to ``dtype``; each
    operation computes in fp32 and rounds its result, which is what torch does for bf16/fp16
    tensors and what we assume for fp8 storage. The log-decay and its exponential stay fp32,
    as in every kernel (gates arrive in fp32). Returns fp32 tensors holding ``dtype`` values
    (fp64 for ``dtype=fp64``, which is then the exact recurrence).
    """
    dims, scale = check_inputs(q, k, v, g, beta, initial_state, scale)
    rnd, storage = rounder(dtype), storage_for(dtype)
    q, k, v, beta = (rnd(t) for t in (q, k, v, beta))
    s0 = None if initial_state is None else rnd(initial_state)
    return _recurrence(q, k, v, g.to(storage), beta, scale, s0, output_final_state, dims, rnd, storage)


def _recurrence(
    q,
    k,
    v,
    g,
    beta,
    scale,
    initial_state,
    output_final_state,
    dims,
    rnd: Callable[[torch.Tensor], torch.Tensor] | None,
    out_dtype: torch.dtype,
):
    """Shared loop; ``rnd`` (or identity) is applied to every stored intermediate."""
    keep = rnd if rnd is not None else (lambda x: x)
    dtype = working_dtype(q)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    q = keep(q * scale)
    alpha = torch.exp(g)
    S = keep(initial(initial_state, dims, dtype, q.device))
    o = torch.empty(dims.B, dims.T, dims.H, dims.V, dtype=dtype, device=q.device)
    for t in range(dims.T):
        k_t = k[:, t]
        S = keep(S * alpha[:, t, :, :, None])
        pred = keep(torch.einsum("bhkv,bhk->bhv", S, k_t))
        delta = keep(beta[:, t, :, None] * (v[:, t] - pred))
        S = keep(S + k_t[..., :, None] * delta[..., None, :])
        o[:, t] = keep(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return o.to(out_dtype), (S if output_final_state else None)
