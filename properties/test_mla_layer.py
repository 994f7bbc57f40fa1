"""The Gated MLA layer: cache layout, shared key part, gate, decode/prefill consistency, TP.

Production-size checks run on the ``meta`` device (shapes only, no arithmetic); numerical
checks use the small configuration with K3's proportions in fp64.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from verdicts import assert_identical

from k3verify import mla
from k3verify.mla import layer
from k3verify.mla.cache import split_entry
from k3verify.numerics import fp64_agreement
from k3verify.numerics.ops import rms_norm

SMALL = layer.MLAConfig.small()
FORMS = {
    "recurrent": (mla.recurrent, {}),
    "chunkwise": (mla.chunkwise, {"chunk_size": 3}),
    "tiled": (mla.tiled, {"operand_dtype": "fp64", "tile": 4}),
    "split-kv": (mla.tiled, {"operand_dtype": "fp64", "tile": 2, "num_splits": 3}),
}


def _agree(x: torch.Tensor, ref: torch.Tensor) -> None:
    v = fp64_agreement(x, ref)
    assert v.passed, v.reason


def _x(B: int, T: int, cfg: layer.MLAConfig = SMALL, seed: int = 0) -> torch.Tensor:
    return torch.randn(B, T, cfg.hidden_size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _empty_cache(B: int, capacity: int, page_size: int, cfg: layer.MLAConfig = SMALL, seed: int = 0):
    return mla.allocate(B, capacity, page_size, cfg.cache_width, generator=torch.Generator().manual_seed(seed))


@given(B=st.integers(1, 2), T=st.integers(1, 8), k=st.integers(1, 4), page_size=st.sampled_from((1, 3, 4, 16)),
       form=st.sampled_from(sorted(FORMS)), seed=st.integers(0, 100))
@example(B=1, T=1, k=1, page_size=1, form="chunkwise", seed=0)
@example(B=2, T=15, k=3, page_size=16, form="split-kv", seed=1)  # decode crosses a page boundary
def test_prefill_then_decode_equals_longer_prefill(B: int, T: int, k: int, page_size: int, form: str,
                                                   seed: int) -> None:
    """fp64-agreement: prefill(T) then k one-token decode steps == prefill(T + k), for the outputs
    of the last k tokens and for the cache entries they leave behind."""
    fn, opts = FORMS[form]
    w = layer.init_weights(SMALL, seed=seed)
    x = _x(B, T + k, seed=seed)
    full = layer.forward(x, w, SMALL, _empty_cache(B, T + k, page_size, seed=seed), form=fn, **opts)
    step = layer.forward(x[:, :T], w, SMALL, _empty_cache(B, T + k, page_size, seed=seed + 1), form=fn, **opts)
    ys = []
    cache = step.cache
    for t in range(T, T + k):
        out = layer.forward(x[:, t : t + 1], w, SMALL, cache, form=fn, **opts)
        cache = out.cache
        ys.append(out.y)
    _agree(torch.cat(ys, dim=1), full.y[:, T:])
    _agree(step.y, full.y[:, :T])
    _agree(mla.gather(cache, torch.float64)[0], mla.gather(full.cache, torch.float64)[0])


def test_shared_key_part_is_shared_unnormalised_and_unrotated() -> None:
    """Structural + fp64-agreement: the Dr-wide key part is one vector per token for all heads
    (expanded keys carry it verbatim), scales linearly with x (no normalisation) while ĉ is
    RMS-normalised, and a token's entry does not depend on its position (no rotation)."""
    w = layer.init_weights(SMALL, seed=3)
    x = _x(1, 6, seed=3)
    entries = layer.project_latent(x, w, SMALL)
    c_hat, k_pe = split_entry(entries, SMALL.kv_lora_rank)
    K, _ = mla.expand(entries, w.w_uk, w.w_uv)  # [1, H, T, Dn + Dr]
    for h in range(SMALL.num_heads):  # bitwise: expand copies k^p into every head, no arithmetic
        assert_identical(K[:, h, :, SMALL.qk_nope_head_dim:], k_pe, f"head {h} does not share k^p")
    # Not normalised: k^p(c x) = c k^p(x); the normalised part keeps RMS(ĉ / γ) = sqrt(ms / (ms + ε)).
    c = 1000.0
    scaled = layer.project_latent(c * x, w, SMALL)
    _agree(split_entry(scaled, SMALL.kv_lora_rank)[1], c * k_pe)
    raw = x @ w.w_dkv[:, : SMALL.kv_lora_rank]
    ms = (raw * raw).mean(-1, keepdim=True)
    _agree((c_hat / w.kv_norm).pow(2).mean(-1, keepdim=True), ms / (ms + SMALL.rms_norm_eps))
    # Not rotated: the same token content at another position caches the same entry.
    moved = layer.project_latent(torch.cat([x[:, 3:4], x[:, :3]], dim=1), w, SMALL)
    _agree(moved[:, 0], entries[:, 3])


def test_attention_is_position_free() -> None:
    """fp64-agreement: NoPE — permuting the cached context of a decode step leaves its output unchanged."""
    w = layer.init_weights(SMALL, seed=4)
    x = _x(1, 9, seed=4)
    order = torch.tensor([5, 2, 7, 0, 3, 1, 6, 4, 8])  # the decoding token (last) stays last
    outs = []
    for xs in (x, x[:, order]):
        prefill = layer.forward(xs[:, :8], w, SMALL, _empty_cache(1, 9, 4))
        outs.append(layer.forward(xs[:, 8:], w, SMALL, prefill.cache).y)
    _agree(outs[1], outs[0])


def test_gate_is_taken_from_x_and_applied_before_o_proj() -> None:
    """Exact equality: the gate does not depend on the attention output (changing the cached
    context changes o but not the gate: both calls run the same operations on the same x in one
    process, so the bits agree on any host). fp64-agreement: the gate is σ(x W_g), and
    y = (gate ⊙ o) W_O (products written here need not sum in the layer's order)."""
    w = layer.init_weights(SMALL, seed=5)
    x = _x(1, 4, seed=5)
    a = layer.forward(x[:, 2:], w, SMALL, layer.forward(x[:, :2], w, SMALL, _empty_cache(1, 6, 4)).cache)
    other_context = _x(1, 2, seed=6)
    b = layer.forward(x[:, 2:], w, SMALL, layer.forward(other_context, w, SMALL, _empty_cache(1, 6, 4)).cache)
    assert not torch.allclose(a.o, b.o), "the test needs different attention outputs"
    assert_identical(a.gate, b.gate)
    _agree(a.gate, torch.sigmoid(torch.einsum("btd,dhv->bthv", x[:, 2:], w.w_g)))
    _agree(a.y, torch.einsum("bthv,hvd->btd", a.gate * a.o, w.w_o))


@pytest.mark.parametrize("tp", [1, 8])
def test_production_shapes_and_cache_size(tp: int) -> None:
    """Structural (meta device): released layout shapes, TP-local heads with a replicated latent,
    and the per-token cache size against MHA's, computed from the tensors the layer produces."""
    cfg = layer.MLAConfig.production(tp_size=tp)
    w_full = layer.init_weights(cfg, device="meta")
    w = layer.shard(w_full, cfg, rank=tp - 1)
    x = torch.empty(1, 3, cfg.hidden_size, dtype=torch.float64, device="meta")
    q_nope, q_pe = layer.project_query(x, w, cfg)
    entries = layer.project_latent(x, w, cfg)
    K, V = mla.expand(entries, w.w_uk, w.w_uv)
    assert K.shape == (1, cfg.local_heads, 3, cfg.qk_head_dim)
    assert V.shape == (1, cfg.local_heads, 3, cfg.v_head_dim)
    gate = layer.output_gate(x, w)
    assert w.num_heads == cfg.num_heads // tp == cfg.local_heads
    assert q_nope.shape == (1, 3, cfg.local_heads, cfg.qk_nope_head_dim)
    assert q_pe.shape == (1, 3, cfg.local_heads, cfg.qk_rope_head_dim)
    assert gate.shape == (1, 3, cfg.local_heads, cfg.v_head_dim)
    assert layer.output_projection(torch.empty_like(gate), gate, w).shape == x.shape
    # Every rank caches the whole latent entry: [ĉ (R) ; k^p (Dr)].
    mla_numbers = entries.shape[-1]
    assert mla_numbers == cfg.kv_lora_rank + cfg.qk_rope_head_dim == cfg.cache_width
    # MHA would cache every head's expanded key and value.
    K_full, V_full = mla.expand(layer.project_latent(x, w_full, cfg), w_full.w_uk, w_full.w_uv)
    mha_numbers = K_full.shape[1] * (K_full.shape[-1] + V_full.shape[-1])
    assert mha_numbers == cfg.mha_cache_width
    assert mha_numbers / mla_numbers == cfg.cache_ratio
    print(f"TP={tp}: {mla_numbers} cached numbers per token and layer vs MHA {mha_numbers}: "
          f"ratio {mha_numbers / mla_numbers:.1f}")


def test_tensor_parallel_partial_outputs_sum_to_the_layer() -> None:
    """fp64-agreement: Σ over ranks of each rank's (its heads, replicated latent) output == the
    unsharded layer. Exact: each rank writes the same cache (bitwise on any host: the latent
    projection uses only replicated weights, so every rank runs the same operations on the
    same tensors in one process)."""
    cfg = dataclasses.replace(SMALL, tp_size=2)
    w = layer.init_weights(cfg, seed=7)
    x = _x(2, 5, cfg, seed=7)
    full = layer.forward(x, w, cfg, _empty_cache(2, 5, 4))
    parts = [layer.forward(x, layer.shard(w, cfg, r), cfg, _empty_cache(2, 5, 4)) for r in range(cfg.tp_size)]
    _agree(sum(p.y for p in parts), full.y)
    for p in parts:
        assert_identical(p.entries, full.entries)


def test_seed_view_is_the_concatenation() -> None:
    """Exact equality: the seed's 576-d c_t is [ĉ ; k^p] in that order, as stored in the pool.
    Bitwise on any host: the pool holds copies of the entries (writing and gathering move data
    only), and raw and ĉ repeat the layer's own operations on the same shapes and strides."""
    w = layer.init_weights(SMALL, seed=8)
    x = _x(1, 3, seed=8)
    out = layer.forward(x, w, SMALL, _empty_cache(1, 3, 2))
    stored, _ = mla.gather(out.cache, torch.float64)
    c_hat, k_pe = split_entry(stored, SMALL.kv_lora_rank)
    raw = x @ w.w_dkv
    assert_identical(k_pe, raw[..., SMALL.kv_lora_rank:])
    assert_identical(c_hat, rms_norm(raw[..., : SMALL.kv_lora_rank], w.kv_norm, eps=SMALL.rms_norm_eps))
    assert_identical(torch.cat([c_hat, k_pe], -1), stored)
