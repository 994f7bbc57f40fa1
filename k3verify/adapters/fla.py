"""fla-core (flash-linear-attention) KDA implementations behind k3verify's KDA signature.

``naive_recurrent`` and ``naive_chunk`` are fla-core's CPU references
(``fla/ops/kda/naive.py``; they compute in fp32 whatever the input dtype). ``chunk_gpu`` and
``fused_recurrent_gpu`` are its Triton kernels and need a CUDA device. Nothing here imports
fla-core until called, so a missing package is reported, not raised at import.

fla-core 0.6.0 dispatches its ops to other backends by itself (``fla/backends.py``): ``chunk_kda``
to FlashKDA whenever ``flash_kda`` is importable and a call sets the gate, l2 norm and sigmoid
in the kernel, and parts of its backward to TileLang where ``tilelang`` and nvcc are present. A
row named fla-core must measure fla's own Triton kernels, so the kernels run under
:func:`triton_only` (those backends switched off through fla's own variables, which it reads at
every call) and ``chunk_gpu`` refuses to run if fla would still hand the call elsewhere
(:func:`dispatched_backend`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import inspect
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..kda.gate import DEFAULT_G_MIN

NAIVE_CHUNK = 64  # naive_chunk_kda asserts T % 64 == 0
# fla-core's switches for the backends it would dispatch KDA to ("0" turns one off; fla reads them
# at every call). FLA_DISABLE_BACKEND_DISPATCH=1 turns all off, but only if set before fla is imported.
BACKEND_SWITCHES = {"FLA_FLASH_KDA": "0", "FLA_TILELANG": "0"}
TRITON = "triton"  # what dispatched_backend calls fla's own path


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


@contextlib.contextmanager
def triton_only() -> Iterator[None]:
    """Within: fla-core runs its own Triton kernels, its backend dispatch (FlashKDA for
    ``chunk_kda``, TileLang for parts of the backward) switched off through
    :data:`BACKEND_SWITCHES`; the variables are restored on leaving."""
    before = {name: os.environ.get(name) for name in BACKEND_SWITCHES}
    os.environ.update(BACKEND_SWITCHES)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def dispatched_backend(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """Which backend fla-core would run ``fn(*args, **kwargs)`` on (a function it dispatches, such
    as ``chunk_kda``): the ``backend_type`` of the first backend that is installed, switched on and
    accepts the call (``flash_kda``, ``tilelang``, ...), or :data:`TRITON` for fla's own kernels.
    Asks the same questions as fla's dispatcher, without running anything."""
    backends = importlib.import_module("fla.backends")
    if getattr(backends, "_DISPATCH_DISABLED", False):
        return TRITON
    registry = getattr(backends, "_function_registries", {}).get(inspect.unwrap(fn))
    if registry is None:
        return TRITON
    for backend in registry._get_sorted_backends():
        if not (backend.is_available() and backend.is_enabled()):
            continue
        accepted, _ = backend.verify(fn.__name__, *args, **kwargs)
        if accepted and backend.get_implementation(fn.__name__) is not None:
            return str(backend.backend_type)
    return TRITON


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
    """fla-core ``chunk_kda`` on CUDA with pre-computed gates (``use_gate_in_kernel=False``), on
    fla's own Triton kernels (:func:`triton_only`); ``RuntimeError`` if fla would still dispatch
    the call to another backend."""
    fn = _import("fla.ops.kda").chunk_kda
    args, s0, back = _to_cuda((q, k, v, g, beta), initial_state)
    options = dict(scale=scale, initial_state=s0, output_final_state=output_final_state, safe_gate=safe_gate,
                   lower_bound=lower_bound)
    with triton_only():
        backend = dispatched_backend(fn, *args, **options)
        if backend != TRITON:
            raise RuntimeError(f"fla-core would run this chunk_kda call on its {backend!r} backend, not its own "
                               f"Triton kernels, with {', '.join(f'{k}={v}' for k, v in BACKEND_SWITCHES.items())}")
        o, S = fn(*args, **options)
    return back(o), (back(S) if S is not None else None)


def fused_recurrent_gpu(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False):
    """fla-core ``fused_recurrent_kda`` on CUDA (the decode kernel)."""
    fn = _import("fla.ops.kda").fused_recurrent_kda
    args, s0, back = _to_cuda((q, k, v, g, beta), initial_state)
    with triton_only():
        o, S = fn(*args, scale=scale, initial_state=s0, output_final_state=output_final_state)
    return back(o), (back(S) if S is not None else None)
