"""FlashKDA (the ``tokenspeed-flashkda`` wheel, import name ``flash_kda``) behind k3verify's KDA
signature: the fused CUTLASS forward that serving engines run for K3's chunked prefill on SM90.

What the wheel (0.0.1.post20260901) offers is one function,

    flash_kda.fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound,
                  initial_state=None, final_state=None, cu_seqlens=None)

with ``q, k, v:[B, T, H, 128]`` bf16 (K = V = 128 only), ``g:[B, T, H, K]`` the decay *logits*
in bf16, ``beta:[B, T, H]`` the write-strength *logits* in bf16, ``A_log:[H]`` and
``dt_bias:[H, K]`` in fp32, ``out`` a bf16 buffer it writes, and the states ``[B, H, V, K]``
(value axis first; bf16 or fp32). It computes the gate itself,
``g = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (fla-core's ``safe_gate`` gate; the
docstring expects ``lower_bound`` in ``[-5, 0]``), applies ``sigmoid`` to ``beta`` and
l2-normalises ``q`` and ``k`` in the kernel (fla-core 0.6.0 hands it only calls that set all
three ``*_in_kernel`` flags: ``fla/ops/kda/backends/flash_kda.py``).

k3verify's forms take the gate and ``beta`` after their activations, so :func:`arguments` maps
them back: ``A_log = 0``, ``dt_bias = 0`` and ``g_raw = logit(g / lower_bound)``,
``beta_raw = logit(beta)``, both rounded to bf16 because the kernel takes them so (at K3's
default case that rounding alone costs 4.6e-4 of the output's RMS, against 4.3e-3 for the whole
bf16 chunkwise baseline). Saturated gates (``g = lower_bound`` exactly) and ``g = 0`` map to
logits of +32 and -64, whose fp32 sigmoids are 1 and 1.6e-28. ``q`` and ``k`` must already have
unit rows (the kernel would normalise other rows, which is another function); the state is
transposed to the kernel's ``[B, H, V, K]`` and back. :func:`emulate` is that documented math in
k3verify's recurrent form, so the mapping is tested on the CPU; the kernel itself needs an SM90
GPU. Nothing here imports ``flash_kda`` until asked.

Which wheel runs depends on the torch beside it: under torch 2.11.0+cu130 (an H100) the wheels of
2026-05-26 and 2026-07-28 run, while 0.0.1.post20260901 links but rejects CUDA tensors at its first
check; :func:`unavailable_reason` calls the kernel once to tell (docs/modules/kda.md, "Production
kernels").
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from typing import Any

import torch

from ..kda import recurrent
from ..kda.gate import DEFAULT_G_MIN, l2norm

PACKAGE = "tokenspeed-flashkda"
MODULE = "flash_kda"
HEAD_DIM = 128  # the kernel is built for K = V = 128 only
# Logits that stand for the gate's ends: fp32 sigmoid(32) == 1 exactly and sigmoid(-64) = 1.6e-28,
# so g = lower_bound and g = 0 come back exactly (the decay exp(-8e-28) is 1 in fp32). Both are
# powers of two, exact in bf16.
LOGIT_MAX = 32.0
LOGIT_MIN = -64.0
# How far a row of q or k may be from unit length: bf16 rounding of a unit row moves its norm by
# about 2^-9; the kernel's own normalisation then differs from the identity by no more.
UNIT_TOLERANCE = 1e-2


def version() -> str | None:
    """Installed ``tokenspeed-flashkda`` version, or ``None``."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def _load_error() -> str | None:
    """Import ``flash_kda`` once: ``None`` if it loads, else what went wrong. Its extension links
    libtorch, libc10_cuda and libcudart.so.13, so a torch built for another CUDA or with another
    C++ ABI fails here (an undefined symbol), not at the call."""
    try:
        importlib.import_module(MODULE)
    except Exception as exc:  # ImportError, OSError: whatever the loader says is the reason
        message = str(exc).splitlines()[0] if str(exc) else ""
        hint = ""
        if "undefined symbol" in message:
            hint = f" (built against another torch's C++ ABI; this is torch {torch.__version__})"
        elif "libcudart" in message:
            hint = f" (it links the CUDA 13 runtime; this torch is built for CUDA {torch.version.cuda})"
        return f"{type(exc).__name__}: {message}{hint}"
    return None


@functools.cache
def _run_error() -> str | None:
    """Call the kernel once on a 16-token problem built on the GPU: ``None`` if it runs, else its
    error. An extension built against another torch can link (every symbol found) and still
    misread this torch's tensors: FlashKDA 0.0.1.post20260901 under torch 2.11 rejects CUDA
    tensors with "all tensors must be on CUDA" (docs/modules/kda.md, "Production kernels")."""
    flash_kda = importlib.import_module(MODULE)
    dev, bf16, T, H = torch.device("cuda"), torch.bfloat16, 16, 1
    eye = torch.eye(HEAD_DIM, device=dev, dtype=bf16)[:T].reshape(1, T, H, HEAD_DIM)
    zeros = torch.zeros(1, T, H, HEAD_DIM, device=dev, dtype=bf16)
    try:
        flash_kda.fwd(eye, eye.clone(), zeros.clone(), zeros.clone(), torch.zeros(1, T, H, device=dev, dtype=bf16),
                      HEAD_DIM**-0.5, zeros.clone(), A_log=torch.zeros(H, device=dev),
                      dt_bias=torch.zeros(H, HEAD_DIM, device=dev), lower_bound=DEFAULT_G_MIN)  # fmt: skip
        torch.cuda.synchronize()
    except Exception as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"a plain 16-token call under torch {torch.__version__} raised {type(exc).__name__}: {message}"
    return None


def unavailable_reason() -> str | None:
    """Why FlashKDA cannot run here (not installed, no CUDA device, not an SM90 device, its
    extension does not load, or it loads but refuses a plain call), or ``None`` if it can."""
    v = version()
    if v is None:
        return f"{PACKAGE} is not installed (pip install {PACKAGE}; an SM90 GPU runs it)"
    if not torch.cuda.is_available():
        return f"{PACKAGE} {v} needs a CUDA device (an SM90 GPU); none is visible"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"{PACKAGE} {v} is built for SM90 (TMA, wgmma); this device is sm_{major}{minor}"
    error = _load_error()
    if error is not None:
        return f"{PACKAGE} {v} does not load: {error}"
    error = _run_error()
    if error is not None:
        return f"{PACKAGE} {v} loads but does not run: {error}"
    return None


# --- the mapping (pure torch: tested on the CPU) -------------------------------------------------


def _logit(p: torch.Tensor) -> torch.Tensor:
    """``log(p) - log(1 - p)`` in fp64 for ``p`` in ``[0, 1]``, the ends clamped to
    :data:`LOGIT_MIN` and :data:`LOGIT_MAX`."""
    p = p.to(torch.float64)
    return (torch.log(p) - torch.log1p(-p)).clamp(LOGIT_MIN, LOGIT_MAX)


def gate_logits(g: torch.Tensor, lower_bound: float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The logits ``z`` with ``lower_bound * sigmoid(z) = g`` (``A_log = 0``, ``dt_bias = 0``),
    rounded to ``dtype`` (bf16: what FlashKDA takes). ``g:[B, T, H, K]`` must lie in
    ``[lower_bound, 0]``; ``ValueError`` names the first value outside."""
    if not lower_bound < 0:
        raise ValueError(f"lower_bound must be negative, got {lower_bound}")
    r = g.to(torch.float64) / lower_bound
    outside = (r < 0) | (r > 1 + 1e-6)
    if bool(outside.any()):
        where = tuple(int(i) for i in outside.nonzero()[0])
        raise ValueError(f"FlashKDA's gate lies in [lower_bound, 0] = [{lower_bound:g}, 0]; "
                         f"g = {float(g[where]):.6g} at index {where} does not")
    return _logit(r.clamp(0, 1)).to(dtype)


def beta_logits(beta: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``logit(beta)`` rounded to ``dtype``: ``beta:[B, T, H]`` in ``[0, 1]``."""
    if bool(((beta < 0) | (beta > 1)).any()):
        raise ValueError("beta is a write strength in [0, 1]; FlashKDA takes its logit")
    return _logit(beta).to(dtype)


def to_kernel_state(state: torch.Tensor) -> torch.Tensor:
    """k3verify's state ``[B, H, K, V]`` in FlashKDA's layout ``[B, H, V, K]`` (contiguous)."""
    return state.transpose(-1, -2).contiguous()


def from_kernel_state(state: torch.Tensor) -> torch.Tensor:
    """FlashKDA's state ``[B, H, V, K]`` in k3verify's layout ``[B, H, K, V]``."""
    return state.transpose(-1, -2).contiguous()


def _require_unit_rows(name: str, x: torch.Tensor) -> None:
    norms = x.float().norm(dim=-1)
    off = (norms - 1).abs() > UNIT_TOLERANCE
    off &= norms != 0
    if bool(off.any()):
        where = tuple(int(i) for i in off.nonzero()[0])
        raise ValueError(f"FlashKDA l2-normalises {name} in the kernel, so it computes k3verify's KDA only for "
                         f"unit-length rows; {name} row {where} has norm {float(norms[where]):.4g}")


def arguments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    lower_bound: float = DEFAULT_G_MIN,
    operand_dtype: torch.dtype = torch.bfloat16,
    state_dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """``flash_kda.fwd``'s keyword arguments for a k3verify KDA call, on the inputs' device
    (``out`` and ``final_state`` aside, which the caller allocates).

    ``q, k:[B, T, H, K]`` with unit rows, ``v:[B, T, H, V]``, ``g:[B, T, H, K]`` log-decays in
    ``[lower_bound, 0]``, ``beta:[B, T, H]`` in ``[0, 1]``, ``initial_state:[B, H, K, V]``.
    Returns ``q, k, v`` in ``operand_dtype``, the logits ``g`` and ``beta`` in ``operand_dtype``,
    ``A_log:[H]`` and ``dt_bias:[H, K]`` zeros in fp32, ``scale`` (``K**-0.5`` by default),
    ``lower_bound`` and ``initial_state:[B, H, V, K]`` in ``state_dtype`` (or ``None``).
    ``operand_dtype=torch.float64`` keeps every value exact, for testing the mapping.
    """
    _require_unit_rows("q", q)
    _require_unit_rows("k", k)
    H, K = q.shape[2], q.shape[3]
    f32 = dict(dtype=torch.float32, device=q.device)
    return dict(
        q=q.to(operand_dtype).contiguous(), k=k.to(operand_dtype).contiguous(), v=v.to(operand_dtype).contiguous(),
        g=gate_logits(g, lower_bound, operand_dtype).contiguous(), beta=beta_logits(beta, operand_dtype).contiguous(),
        scale=float(K**-0.5 if scale is None else scale), A_log=torch.zeros(H, **f32),
        dt_bias=torch.zeros(H, K, **f32), lower_bound=float(lower_bound),
        initial_state=None if initial_state is None else to_kernel_state(initial_state.to(state_dtype)),
    )  # fmt: skip


def emulate(args: dict[str, Any], *, output_final_state: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FlashKDA's documented math on :func:`arguments`' output, in k3verify's recurrent form and
    the arguments' precision (fp64 in, fp64 out): the in-kernel l2 norm, gate and ``sigmoid(beta)``,
    the state in ``[B, H, V, K]``. Returns ``(o:[B, T, H, V], final_state:[B, H, V, K])``, as the
    kernel leaves them; the CPU's stand-in for the kernel when testing the mapping."""
    work = args["q"].dtype if args["q"].dtype == torch.float64 else torch.float32
    H, K = args["q"].shape[2:]
    x = args["A_log"].to(work).exp().reshape(H, 1) * (args["g"].to(work) + args["dt_bias"].to(work).reshape(H, K))
    g = args["lower_bound"] * torch.sigmoid(x)
    beta = torch.sigmoid(args["beta"].to(work))
    s0 = args["initial_state"]
    o, S = recurrent(l2norm(args["q"].to(work)), l2norm(args["k"].to(work)), args["v"].to(work), g, beta,
                     scale=args["scale"], initial_state=None if s0 is None else from_kernel_state(s0.to(work)),
                     output_final_state=output_final_state)  # fmt: skip
    return o, (to_kernel_state(S) if S is not None else None)


# --- the kernel ------------------------------------------------------------------------------------


def chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    lower_bound: float = DEFAULT_G_MIN,
    state_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FlashKDA's forward with k3verify's KDA signature (``q, k:[B, T, H, 128]`` unit rows,
    ``v:[B, T, H, 128]``, ``g:[B, T, H, 128]`` log-decays in ``[lower_bound, 0]``,
    ``beta:[B, T, H]``, state ``[B, H, K, V]``): returns ``o:[B, T, H, V]`` in bf16 and, with
    ``output_final_state``, the final state ``[B, H, K, V]`` in ``state_dtype`` (fp32 as fla-core
    asks for it; bf16 is the kernel's other choice). Inputs on the CPU are moved to the GPU and
    the outputs brought back; inputs on the GPU stay there."""
    if q.shape[-1] != HEAD_DIM or v.shape[-1] != HEAD_DIM:
        raise ValueError(f"FlashKDA is built for K = V = {HEAD_DIM}; got K = {q.shape[-1]}, V = {v.shape[-1]}")
    flash_kda = importlib.import_module(MODULE)
    dev = torch.device("cuda")
    back = (lambda t: t) if q.is_cuda else (lambda t: t.cpu())
    moved = [t.to(dev) for t in (q, k, v, g, beta)]
    s0 = initial_state.to(dev) if initial_state is not None else None
    args = arguments(*moved, scale=scale, initial_state=s0, lower_bound=lower_bound, state_dtype=state_dtype)
    out = torch.empty_like(args["v"])
    B, _, H, _ = q.shape
    final = torch.empty(B, H, HEAD_DIM, HEAD_DIM, dtype=state_dtype, device=dev) if output_final_state else None
    with torch.no_grad():
        flash_kda.fwd(args["q"], args["k"], args["v"], args["g"], args["beta"], args["scale"], out,
                      A_log=args["A_log"], dt_bias=args["dt_bias"], lower_bound=args["lower_bound"],
                      initial_state=args["initial_state"], final_state=final)  # fmt: skip
    return back(out), (back(from_kernel_state(final)) if final is not None else None)
