"""The whole KDA layer: TP-local shapes, the packed projection, the conv cache, and the
prefill/decode handoff.

Rules: shapes are structural (derived from the config, compared to the numbers of docs/model.md §1.1);
the handoff uses fp64-agreement (prefill(T) + k decode steps vs prefill(T + k)).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from verdicts import assert_identical, assert_rel_within

from k3verify.kda.layer import PACKED_ORDER, KDAConfig, KDALayer, init_weights, local_shapes, short_conv
from k3verify.numerics import FP64_AGREEMENT_REL


def test_tp8_shapes_match_the_seed() -> None:
    cfg = KDAConfig.production()
    s = local_shapes(cfg, tp=8)
    h = cfg.heads // 8
    assert s.heads == h
    assert s.packed_columns == 4 * h * cfg.head_dim + cfg.gate_rank + h
    assert s.padded_columns % cfg.pad_to == 0 and s.padded_columns - s.packed_columns < cfg.pad_to
    assert (s.packed_columns, s.padded_columns) == (6284, 6288)  # docs/model.md §1.1
    assert s.conv_cache == (4608, 3)  # docs/model.md §1.2
    full = local_shapes(cfg, tp=1)
    assert full.padded_columns == 49376 and full.conv_cache == (36864, 3)


def test_packed_order_and_slices() -> None:
    s = local_shapes(KDAConfig.production(), tp=8)
    slices = s.slices()
    assert list(slices) == list(PACKED_ORDER)
    assert slices["q"].start == 0 and slices["beta"].stop == s.packed_columns
    assert all(slices[a].stop == slices[b].start for a, b in itertools.pairwise(PACKED_ORDER))


def test_bad_tp_is_named() -> None:
    with pytest.raises(ValueError, match="tp=5"):
        local_shapes(KDAConfig.production(), tp=5)


@given(T=st.integers(1, 7), width=st.integers(2, 5), seed=st.integers(0, 100))
def test_short_conv_cache_holds_the_last_inputs(T: int, width: int, seed: int) -> None:
    """Two pieces equal one piece (fp64-agreement); the cache is exactly the last width-1 inputs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, T + 3, 5, generator=gen, dtype=torch.float64)
    w = torch.randn(5, width, generator=gen, dtype=torch.float64)
    empty = torch.zeros(2, 5, width - 1, dtype=torch.float64)
    y_all, c_all = short_conv(x, w, empty)
    y1, c1 = short_conv(x[:, :T], w, empty)
    y2, c2 = short_conv(x[:, T:], w, c1)
    assert_rel_within(torch.cat([y1, y2], 1), y_all, FP64_AGREEMENT_REL)
    # Bitwise on any host: the cache is a copy of input columns, no arithmetic touches it.
    assert_identical(c2, c_all)
    history = torch.cat([empty.transpose(1, 2), x], 1)
    assert_identical(c_all, history[:, -(width - 1) :].transpose(1, 2))


@given(T=st.integers(1, 140), k=st.integers(1, 6), seed=st.integers(0, 1000), tp=st.sampled_from([1, 2, 4]))
def test_prefill_then_decode_equals_longer_prefill(T: int, k: int, seed: int, tp: int) -> None:
    cfg = KDAConfig.small()
    layer = KDALayer(cfg, init_weights(cfg, tp, seed=seed), tp=tp)
    x = torch.randn(2, T + k, cfg.hidden, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    y_ref, state_ref = layer.prefill(x)
    y, state = layer.prefill(x[:, :T])
    steps = [y]
    for t in range(T, T + k):
        y_t, state = layer.decode(x[:, t : t + 1], state)
        steps.append(y_t)
    assert_rel_within(torch.cat(steps, 1), y_ref, FP64_AGREEMENT_REL)
    # The conv cache holds projections of the last inputs: computed by a one-row product in
    # decode and a T-row one in prefill, which BLAS may sum in another order (MKL's AVX2 and
    # generic paths do), so fp64-agreement, not equality.
    assert_rel_within(state.conv, state_ref.conv, FP64_AGREEMENT_REL)
    assert_rel_within(state.recurrent, state_ref.recurrent, FP64_AGREEMENT_REL)


def test_decode_takes_one_token() -> None:
    cfg = KDAConfig.small()
    layer = KDALayer(cfg, init_weights(cfg))
    x = torch.randn(1, 2, cfg.hidden, dtype=torch.float64)
    with pytest.raises(ValueError, match="one token"):
        layer.decode(x, layer.empty_state(1))
    with pytest.raises(ValueError, match="x has shape"):
        layer.prefill(torch.randn(1, 3, cfg.hidden + 1, dtype=torch.float64))
