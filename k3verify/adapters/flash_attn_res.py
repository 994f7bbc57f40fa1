"""flash-attn-res (PyPI ``flash-attn-res``, Triton) behind k3verify's Block AttnRes signatures.

What it computes, read from its 0.1.12 sources (``ops/phase_1.py``, ``kernels/phase_1.py``,
``kernels/phase_2.py``) and checked on the GPU against the fp64 oracle:

- logits ``ℓ = (q · v) · rsqrt(mean(v²) + eps)`` in fp32, with a *plain* RMSNorm: there is no
  key gain ``γ``. The logit ``wᵀ RMSNorm_γ(v)`` of docs/model.md §3 equals that with ``q = w ⊙ γ``, which this adapter
  passes (in fp32).
- ``eps`` is an argument of every op (its own default elsewhere is fp32's machine epsilon,
  1.19e-7); the adapter passes K3's 1e-5.
- phase 1 (one program per token, the whole width and every source in registers) writes each
  query's normalised output ``N / Z`` in **bf16**, whatever the stream dtype, and
  ``lse = m + log Z`` in fp32; phase 2 merges ``h = o + σ(r − lse) (p − o)`` and writes bf16.
  So ``h`` is rounded twice (phase-1 output, then the merge) where the definition rounds once.
- its kernels take the width as a ``tl.arange`` bound, which Triton requires to be a power of
  two: K3's d = 7168 cannot compile (the rows at that width say so).

Rows are bf16 only (its outputs are bf16) and need a CUDA device (under Triton's interpreter its
bf16 stores truncate). Nothing here imports flash-attn-res until called.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Sequence
from typing import Any

import torch

from ..attnres.inputs import Sublayers
from ..attnres.kernels import walk_with
from ..attnres.layer import AttnResWeights, Walk
from ..attnres.schedule import Schedule
from ..numerics.ops import RMS_NORM_EPS

PACKAGE = "flash-attn-res"


def version() -> str | None:
    """Installed flash-attn-res version, or ``None``."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def unavailable_reason() -> str | None:
    """Why flash-attn-res cannot run here (not installed, no CUDA), or ``None``."""
    found = version()
    if found is None:
        return "flash-attn-res is not installed (pip install 'k3verify[attnres]')"
    if not torch.cuda.is_available():
        return f"flash-attn-res {found} needs a CUDA device (its bf16 outputs are not faithful under the interpreter)"
    return None


def _ops() -> Any:
    return importlib.import_module("flash_attn_res")


def _queries(w: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``w ⊙ γ`` in fp32: its plain RMSNorm with these queries is the ``RMSNorm_γ`` logit of docs/model.md §3."""
    return (w.float() * gamma.float()).contiguous()


class _Phases:
    """flash-attn-res's two ops as a :class:`k3verify.attnres.kernels.TwoPhase`."""

    def first(self, stored: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor, eps: float) -> list:
        o, lse = _ops().phase_1_batched_attention_triton_op(stored[:, None].contiguous(), _queries(w, gamma), eps)
        return [(o[q, 0], lse[q, 0]) for q in range(o.shape[0])]

    def second(self, state: tuple[torch.Tensor, torch.Tensor], partial: torch.Tensor | None, w: torch.Tensor,
               gamma: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        o, lse = state
        if partial is None:  # a block start: the stored set alone
            return o.to(out_dtype)
        merge = _ops().phase_2_online_softmax_merge_triton_op
        h = merge(partial[None].contiguous(), _queries(w, gamma), o[None], lse[None], eps)
        return h[0].to(out_dtype)


def aggregate(sources: torch.Tensor | Sequence[torch.Tensor], w: torch.Tensor, gamma: torch.Tensor, *,
              eps: float = RMS_NORM_EPS) -> torch.Tensor:  # fmt: skip
    """One call over ``sources:[N, T, d]`` (N >= 2: its phase 1 needs a stored block) on the GPU:
    ``h:[T, d]`` in bf16."""
    v = torch.stack(list(sources)) if not isinstance(sources, torch.Tensor) else sources
    if v.dim() != 3 or v.shape[0] < 2:
        raise ValueError(f"flash-attn-res mixes stored blocks and a partial sum: sources [N >= 2, T, d], "
                         f"got {list(v.shape)}")  # fmt: skip
    v, w, gamma = v.cuda(), w.cuda(), gamma.cuda()
    phases = _Phases()
    state = phases.first(v[:-1], w[None], gamma[None], eps)
    return phases.second(state[0], v[-1], w, gamma, eps, torch.bfloat16)


def walk(embedding: torch.Tensor, weights: AttnResWeights, sublayers: Sublayers, *, schedule: Schedule | None = None,
         eps: float = RMS_NORM_EPS) -> Walk:  # fmt: skip
    """The depth walk with flash-attn-res's two phases, a bf16 stream on the GPU."""
    return walk_with(_Phases(), embedding.cuda(), weights, sublayers, schedule=schedule, eps=eps)
