"""Softmax over part of the keys, and the log-sum-exp merge of such parts (docs/model.md §2.3).

Attention over a key set split into parts ``a`` and ``b`` is recovered from each part's
normalised output and log-sum-exp:

    o_x = Σ_{j∈x} e^{s_j − L_x} v_j,   L_x = log Σ_{j∈x} e^{s_j}
    L = log(e^{L_a} + e^{L_b}),   o = e^{L_a − L} o_a + e^{L_b − L} o_b

An empty part has ``L_x = −∞`` and contributes weight ``e^{−∞} = 0``. The naive formulas
produce NaN there (``max`` of nothing is ``−∞`` and ``−∞ − (−∞)`` is NaN; ``0 / 0`` in the
normalisation), so both functions guard those points explicitly — the same guard as
FlashAttention's ``softmax.h`` (a row whose max is ``−∞`` uses 0 as its max).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

NEG_INF = float("-inf")


def partial_attention(s: torch.Tensor, visible: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention restricted to the ``visible`` keys, with its log-sum-exp.

    ``s:[..., Tq, Tk]`` scores (already scaled), ``visible`` a bool mask broadcastable to ``s``,
    ``v:[..., Tk, Dv]``. Returns ``o:[..., Tq, Dv]`` (exact zeros for a row that sees no key) and
    ``lse:[..., Tq]`` (``−inf`` for such a row). Works in ``s``'s dtype.
    """
    s = s.masked_fill(~visible, NEG_INF)
    if s.shape[-1] == 0:
        shape = s.shape[:-1]
        return s.new_zeros(*shape, v.shape[-1]), s.new_full(shape, NEG_INF)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # empty row: max is −inf
    p = torch.exp(s - m)  # hidden keys: exp(−inf) = 0
    z = p.sum(-1, keepdim=True)
    o = (p @ v) / torch.where(z > 0, z, torch.ones_like(z))
    lse = (m + torch.log(z)).squeeze(-1)  # log(0) = −inf for an empty row
    return o, lse


def merge_partials(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine ``(o_x [..., Dv], L_x [...])`` pairs over disjoint key sets into ``(o, L)``.

    Parts with ``L_x = −∞`` get weight exactly 0 (and their ``o_x``, which is 0 by
    :func:`partial_attention`'s convention, is never multiplied by a NaN weight). If every part
    is empty the result is ``(0, −∞)``.
    """
    if not parts:
        raise ValueError("merge_partials needs at least one part")
    lses = torch.stack([lse for _, lse in parts])
    total = torch.logsumexp(lses, dim=0)  # −inf when every part is empty
    safe_total = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    o = torch.zeros_like(parts[0][0])
    for o_x, lse_x in parts:
        w = torch.where(lse_x == NEG_INF, torch.zeros_like(lse_x), torch.exp(lse_x - safe_total))
        o = o + w[..., None] * o_x
    return o, total
