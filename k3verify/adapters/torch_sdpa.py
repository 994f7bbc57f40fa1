"""torch's ``scaled_dot_product_attention`` behind k3verify's Gated MLA signature: the expanded
chunked prefill (docs/model.md §2.3) on one of its CUDA backends.

The adapter reads the same operands as our prefill kernel
(:func:`k3verify.mla.kernels.expanded_operands`: the cached latents up-projected per head in
fp32, then the queries' dtype), joins ``[q^n ; q^p]`` and ``[k^n ; k^p]`` into one 192-wide
query/key head (K3: 128 + 64; values 128 wide) and calls SDPA once per request with a causal mask
aligned to the bottom right (``torch.nn.attention.bias.causal_lower_right``): query ``t`` of a
request with ``L`` cached positions sees keys ``j <= L − T + t``, the prefix and the chunk's
own tokens in one softmax. SDPA keeps its softmax in fp32 and writes the output in the operand
dtype.

A backend is chosen with ``torch.nn.attention.sdpa_kernel``. Whether it accepts K3's head widths
(q/k 192, v 128) is asked of the backend itself, once per process, on a two-token call: one that
refuses them (torch 2.11's flash backend wants one width for q, k and v) makes its rows
``unavailable`` with torch's own reasons, rather than failing rows. The rows need a CUDA device:
on the CPU only the math backend would run, which is not what a GPU deployment runs (``math``
is accepted here, on any device, so that the adapter's own arithmetic can be tested anywhere).
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from ..mla.cache import LatentCache
from ..mla.inputs import check_inputs
from ..mla.kernels import expanded_operands
from ..mla.layer import MLAConfig

BACKENDS = ("cudnn", "efficient", "flash")


def _backend(name: str):
    from torch.nn.attention import SDPBackend

    table = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}  # fmt: skip
    if name not in table:
        raise ValueError(f"unknown SDPA backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return table[name]


def unavailable_reason(backend: str = "cudnn") -> str | None:
    """Why the ``backend`` rows cannot run here, or ``None``."""
    _backend(backend)
    if backend == "math":
        return None
    if not torch.cuda.is_available():
        return f"torch SDPA's {backend} backend needs a CUDA device"
    return _refusal(backend)


@functools.cache
def _refusal(backend: str) -> str | None:
    """Run ``backend`` once on K3's head widths (two bf16 tokens, causal, on the GPU): ``None`` if
    it runs, else its error with the reasons torch gave as warnings."""
    from torch.nn.attention import sdpa_kernel

    cfg = MLAConfig()
    q = torch.zeros(1, 1, 2, cfg.qk_head_dim, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros(1, 1, 2, cfg.v_head_dim, dtype=torch.bfloat16, device="cuda")
    with warnings.catch_warnings(record=True) as said, sdpa_kernel(_backend(backend)):
        warnings.simplefilter("always")
        try:
            F.scaled_dot_product_attention(q, q, v, is_causal=True)
            return None
        except RuntimeError as exc:
            why = specific_reasons([str(w.message) for w in said])
            return (f"torch {torch.__version__} SDPA's {backend} backend refuses K3's head widths (q/k "
                    f"{cfg.qk_head_dim}, v {cfg.v_head_dim}): {exc}" + (f" ({'; '.join(why)})" if why else ""))


def specific_reasons(messages: list[str]) -> list[str]:
    """The warnings in which torch says why a backend refused, without its source locations,
    without the "... not used because:" headers and without the other backends' "has been
    runtime disabled" (``sdpa_kernel`` disables every backend but the one asked for)."""
    kept = [m.split(" (Triggered internally")[0].strip() for m in messages]
    return [m for m in kept if m and not m.endswith("because:") and "has been runtime disabled" not in m]


def prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: LatentCache, w_uk: torch.Tensor, w_uv: torch.Tensor,
            *, scale: float | None = None, backend: str = "cudnn") -> torch.Tensor:  # fmt: skip
    """Expanded prefill by torch SDPA's ``backend`` on the GPU: ``o:[B, T, H, Dv]`` in the
    queries' dtype (arguments as :func:`k3verify.mla.kernels.prefill`)."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    dims, scale = check_inputs(q_nope, q_pe, cache, w_uk, w_uv, scale)
    chosen = _backend(backend)
    reason = unavailable_reason(backend)
    if reason is not None:
        raise RuntimeError(reason)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    q_n, q_p, k_n, k_p, v, starts = expanded_operands(q_nope, q_pe, cache, w_uk, w_uv, dev)
    q = torch.cat([q_n, q_p], dim=-1)
    k = torch.cat([k_n, k_p[:, None].expand(-1, dims.H, -1, -1)], dim=-1)
    out = torch.empty(dims.B, dims.H, dims.T, v.shape[-1], dtype=q.dtype, device=q.device)
    for b, length in enumerate((starts + dims.T).tolist()):
        with sdpa_kernel(chosen):
            out[b] = F.scaled_dot_product_attention(
                q[b : b + 1], k[b : b + 1, :, :length], v[b : b + 1, :, :length],
                attn_mask=causal_lower_right(dims.T, length), scale=scale,
            )[0]  # fmt: skip
    return out.transpose(1, 2)
