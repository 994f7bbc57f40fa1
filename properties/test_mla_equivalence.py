"""Every fp64 form of Gated MLA computes the definition (docs/model.md §2.3–2.4).

The absorbed decode (``recurrent``), the chunked expanded prefill (``chunkwise``), the tiled
latent kernel (``tiled`` with fp64 operands, with and without split-KV) and an independent
oracle — ``torch.nn.functional.scaled_dot_product_attention`` on expanded K/V — all agree with
``expanded`` under the ``fp64-agreement`` rule (normwise relative error <= 1e-10).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st

from k3verify import mla
from k3verify.mla.samples import MLAProblem, make_problem
from k3verify.mla.samples import problems as mla_problems
from k3verify.numerics import fp64_agreement, relative_max_error


def _agree(x: torch.Tensor, ref: torch.Tensor) -> None:
    verdict = fp64_agreement(x, ref)
    assert verdict.passed, verdict.reason


@given(p=mla_problems())
@example(p=make_problem((0,), 1, page_size=1))  # one token, one key: the softmax is exactly 1
@example(p=make_problem((17, 0), 5, page_size=3, H=3, Dr=4))  # ragged: one request has no context
def test_absorbed_decode_equals_expanded(p: MLAProblem) -> None:
    """fp64-agreement: q̃ = W_UK q^n, latent MQA, W_UV after == expanded K/V attention."""
    _agree(mla.recurrent(*p.args()), mla.expanded(*p.args()))


@given(p=mla_problems(max_T=12), chunk_size=st.integers(1, 16))
@example(p=make_problem((0, 9), 7, page_size=2), chunk_size=3)  # fresh prefill: empty prefix in chunk 0
@example(p=make_problem((5,), 4, page_size=16), chunk_size=64)  # one chunk larger than T
def test_chunked_prefill_equals_definition(p: MLAProblem, chunk_size: int) -> None:
    """fp64-agreement: query chunks over (up-projected prefix) + (causal self), merged by LSE."""
    o = mla.chunkwise(*p.args(), chunk_size=chunk_size)
    assert bool(torch.isfinite(o).all()), "an empty prefix produced non-finite output"
    _agree(o, mla.expanded(*p.args()))


@given(p=mla_problems(max_T=12), tile=st.integers(1, 24), num_splits=st.integers(1, 5),
       subtract_max=st.booleans())
@example(p=make_problem((0,), 3, page_size=2), tile=1, num_splits=5, subtract_max=True)  # empty key ranges
@example(p=make_problem((30, 2), 1, page_size=8), tile=16, num_splits=3, subtract_max=True)  # split-KV decode
def test_tiled_fp64_equals_definition(p: MLAProblem, tile: int, num_splits: int, subtract_max: bool) -> None:
    """fp64-agreement: online softmax over key tiles (and split-KV + LSE merge) with exact operands.

    Unit-scale scores, so the softmax without max subtraction is also exact here.
    """
    o = mla.tiled(*p.args(), tile=tile, operand_dtype="fp64", num_splits=num_splits, subtract_max=subtract_max)
    assert o.dtype == torch.float64
    _agree(o, mla.expanded(*p.args()))


def sdpa_reference(p: MLAProblem, scale: float | None = None) -> torch.Tensor:
    """Expanded K/V per request through torch's SDPA in fp64, queries aligned to the end."""
    outs = []
    for b, n in enumerate(p.lengths):
        K, V = mla.expand(p.entries[b : b + 1, :n], p.w_uk, p.w_uv)  # [1, H, n, Dn + Dr], [1, H, n, Dv]
        q = torch.cat([p.q_nope[b : b + 1], p.q_pe[b : b + 1]], dim=-1).transpose(1, 2)  # [1, H, T, Dn + Dr]
        # Query t sits at position n - T + t and may see keys j <= n - T + t.
        allowed = torch.arange(n)[None, :] <= (n - p.T + torch.arange(p.T))[:, None]
        outs.append(F.scaled_dot_product_attention(q, K, V, attn_mask=allowed, scale=scale).transpose(1, 2))
    return torch.cat(outs)


@given(p=mla_problems())
@example(p=make_problem((40, 3), 6, page_size=16, H=2, Dr=8))
def test_sdpa_oracle_matches_prefill(p: MLAProblem) -> None:
    """fp64-agreement: an independent oracle (torch SDPA, its own default scale 1/sqrt(Dn + Dr))
    matches the definition and the chunked prefill."""
    ref = sdpa_reference(p)
    _agree(mla.expanded(*p.args()), ref)
    _agree(mla.chunkwise(*p.args(), chunk_size=4), ref)


def test_scale_is_one_over_sqrt_qk_head_dim_not_cache_width() -> None:
    """fp64-agreement against SDPA at τ = (Dn + Dr)^-1/2 computed from the query shapes; the
    alternative τ = (R + Dr)^-1/2 (the absorbed dot-product width, 576 in K3) must be detectably
    different, so every form defaulting to it would fail this test."""
    p = make_problem((12, 5), 4, H=2, Dr=4, page_size=4, q_scale=3.0)
    qk_head_dim = p.q_nope.shape[-1] + p.q_pe.shape[-1]
    cache_width = p.cache.width
    assert qk_head_dim != cache_width
    right = sdpa_reference(p, scale=qk_head_dim**-0.5)
    wrong = sdpa_reference(p, scale=cache_width**-0.5)
    assert relative_max_error(wrong, right) > 1e-3, "test cannot tell the two scales apart"
    for form, kw in ((mla.recurrent, {}), (mla.chunkwise, {"chunk_size": 3}), (mla.tiled, {"operand_dtype": "fp64"})):
        _agree(form(*p.args(), **kw), right)
    cfg = mla.MLAConfig.production()
    assert cfg.softmax_scale == (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    assert cfg.softmax_scale != cfg.cache_width**-0.5
