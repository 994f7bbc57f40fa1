"""fla-core (flash-linear-attention) KDA implementations behind k3verify's KDA signature.

``naive_recurrent`` and ``naive_chunk`` are fla-core's CPU references
(``fla/ops/kda/naive.py``; they compute in fp32 whatever the input dtype). ``chunk_gpu`` and
``fused_recurrent_gpu`` are its Triton kernels and need a CUDA device. Nothing here imports
fla-core until called, so a missing package is reported, not raised at import.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import warnings

import torch

from ..kda.gate import DEFAULT_G_MIN

NAIVE_CHUNK = 64  # naive_chunk_kda asserts T % 64 == 0


def unavailable_reason(*, gpu: bool = False) -> str | None:
    """Why fla-core cannot run here (not installed, no CUDA), or ``None`` if it can."""
    try:
        version = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return "fla-core is not installed (pip install 'k3verify[fla]')"
    if gpu and not torch.cuda.is_available():
        return f"fla-core {version} kernels need a CUDA device; none is visible"
    return None


def version() -> str | None:
    """Installed fla-core version, or ``None``."""
    try:
        return importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def _import(name: str):
    with warnings.catch_warnings():
        # fla warns that Triton cannot target a CPU; its naive forms do not need it.
        warnings.simplefilter("ignore", UserWarning)
        return importlib.import_module(name)


def naive_recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False):
    """fla-core ``naive_recurrent_kda`` (fp32 arithmetic; output in ``v``'s dtype)."""
    fn = _import("fla.ops.kda.naive").naive_recurrent_kda
    return fn(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state)


def naive_chunk(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False):
    """fla-core ``naive_chunk_kda`` with chunk 64; T is padded to a multiple of 64 here.

    The padding tokens are inert for KDA (zero q/k/v, ``beta = 0``, ``g = 0``), so the output
    over the real tokens and the final state are unchanged.
    """
    fn = _import("fla.ops.kda.naive").naive_chunk_kda
    T = q.shape[1]
    pad = -T % NAIVE_CHUNK
    if pad:

        def extend(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x.new_zeros((x.shape[0], pad, *x.shape[2:]))], dim=1)

        q, k, v, g, beta = map(extend, (q, k, v, g, beta))
    o, S = fn(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        chunk_size=NAIVE_CHUNK,
    )
    return o[:, :T], S


def _to_cuda(tensors, initial_state):
    """Inputs on the CUDA device (the state in fp32), and how to bring outputs back: results
    stay on the device when the inputs came from it, else they return to the CPU."""
    dev = torch.device("cuda")
    back = (lambda t: t) if tensors[0].is_cuda else (lambda t: t.cpu())
    s0 = initial_state.to(dev, torch.float32) if initial_state is not None else None
    return [t.to(dev) for t in tensors], s0, back


def chunk_gpu(
    q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, safe_gate=True,
    lower_bound=DEFAULT_G_MIN,
):
    """fla-core ``chunk_kda`` on CUDA with pre-computed gates (``use_gate_in_kernel=False``)."""
    fn = _import("fla.ops.kda").chunk_kda
    args, s0, back = _to_cuda((q, k, v, g, beta), initial_state)
    o, S = fn(
        *args,
        scale=scale,
        initial_state=s0,
        output_final_state=output_final_state,
        safe_gate=safe_gate,
        lower_bound=lower_bound,
    )
    return back(o), (back(S) if S is not None else None)


def fused_recurrent_gpu(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False):
    """fla-core ``fused_recurrent_kda`` on CUDA (the decode kernel)."""
    fn = _import("fla.ops.kda").fused_recurrent_kda
    args, s0, back = _to_cuda((q, k, v, g, beta), initial_state)
    o, S = fn(*args, scale=scale, initial_state=s0, output_final_state=output_final_state)
    return back(o), (back(S) if S is not None else None)
