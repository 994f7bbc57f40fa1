"""KDA recurrent form — the definition, one token at a time (docs/model.md §1.4).

    S' = Diag(exp(g_t)) S_{t-1}
    S_t = S' + beta_t k_t (v_t - S'^T k_t)^T
    o_t = S_t^T (scale * q_t)

This is the oracle when run in fp64. ``naive_baseline`` is the same recurrence with every
stored tensor rounded to a narrow dtype: the "same-dtype baseline" of the tolerance policy.
``recurrent_backward`` differentiates the recurrence through torch.autograd: in fp64, the
gradient oracle (``numerics.gradients``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..numerics import rounder, storage_for
from ..numerics.gradients import vjp
from .gate import InKernelGate
from .inputs import check_backward, check_inputs, initial, working_dtype

Form = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


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


def recurrent_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    do: torch.Tensor,
    dht: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    gate: InKernelGate | None = None,
) -> dict[str, torch.Tensor]:
    """The gradients of the recurrence by autograd: :func:`autograd_backward` of :func:`recurrent`.
    On fp64 inputs this is the gradient oracle."""
    return autograd_backward(recurrent, q, k, v, g, beta, do=do, dht=dht, scale=scale, initial_state=initial_state,
                             cu_seqlens=cu_seqlens, gate=gate)


def autograd_backward(
    form: Form,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    do: torch.Tensor,
    dht: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    gate: InKernelGate | None = None,
    gate_dtype: torch.dtype | None = None,
    **options: object,
) -> dict[str, torch.Tensor]:
    """Gradients of ``L = sum(o * do) + sum(S_T * dht)`` through a differentiable KDA ``form``.

    Inputs as in :mod:`k3verify.kda.inputs`; with ``cu_seqlens:[N+1]`` (``B = 1``) each packed
    sequence runs alone from its own state (``initial_state, dht: [N,H,K,V]``). With ``gate`` the
    ``g`` argument is the decay logit and the gate runs inside the differentiated function, in
    ``gate_dtype`` when given (its values, and its gradients with the sums over tokens that form
    ``dA_log`` and ``ddt_bias``), else in the inputs' dtype.
    Returns ``dq, dk, dv, dg, dbeta`` like their inputs, ``dh0`` when there is an initial state,
    and ``dA_log, ddt_bias`` with ``gate``; each in its input's dtype (fp64 stays fp64).
    """
    _, scale, bounds = check_backward(q, k, v, g if gate is None else gate(g.detach()), beta, initial_state, scale,
                                      do, dht, cu_seqlens)
    packed = cu_seqlens is not None

    def forward(q, k, v, g, beta, h0=None, A_log=None, dt_bias=None):
        if gate is not None:
            z = g if gate_dtype is None else g.to(gate_dtype)
            g = InKernelGate(A_log, dt_bias, gate.g_min)(z).to(g.dtype)
        outs, finals = [], []
        for i, (a, b) in enumerate(bounds):
            s0 = h0[i : i + 1] if packed and h0 is not None else h0
            o, s = form(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], scale=scale, initial_state=s0,
                        output_final_state=True, **options)
            outs.append(o)
            finals.append(s)
        return {"o": torch.cat(outs, 1), "final_state": torch.cat(finals, 0)}

    inputs = dict(q=q, k=k, v=v, g=g, beta=beta, h0=initial_state)
    if gate is not None:
        inputs |= dict(A_log=gate.a_log, dt_bias=gate.dt_bias)
    cotangents = {"o": do} | ({} if dht is None else {"final_state": dht})
    return vjp(forward, inputs, cotangents)
