"""An MLA decode with its softmax scale 1 % off, registered as a bf16 kernel."""

from __future__ import annotations

from typing import Any

from k3verify import mla
from k3verify.harness.registry import Implementation, Peer, implementation


def decode(q_nope: Any, q_pe: Any, cache: Any, w_uk: Any, w_uv: Any, scale: float | None = None, **kw: Any) -> Any:
    """k3verify's MLA recurrent form with the scale ``1.01 / sqrt(d_qk)`` (the planted bug)."""
    head_dim = q_nope.shape[-1] + q_pe.shape[-1]
    s = scale if scale is not None else head_dim**-0.5
    return mla.recurrent(q_nope, q_pe, cache, w_uk, w_uv, scale=1.01 * s, **kw)


def implementations() -> list[Implementation]:
    return [implementation("mla", decode, name="buggy-scale decode", dtype="bf16",
                           peer=Peer("k3verify", "kernel:decode"))]
