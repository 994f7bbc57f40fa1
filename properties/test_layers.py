"""Whole layers through the testing API: the KDA layer (raw gate, conv cache and state carried,
packed requests of one token), the MLA layer (output gate, ``o_proj``, paged cache) and the MoE
layer routing itself (router, balancing bias).

Each entry's own layers pass on every built-in case (no false alarm), and a layer with one bug of
a class seen in public reports fails where the bug acts, named by the output it reaches (the check
bites). A bug is planted inside the user's function only (``unittest.mock.patch`` around its
call), after the oracle and baseline have been computed.

Rules: baseline (the layer with every stored tensor in the dtype, around the naive recurrent or
chunkwise form), fp64-agreement for the fp64 rows; MoE's experts by their mismatch fraction.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from functools import partial
from typing import Any
from unittest import mock

import pytest
import torch

from k3verify import attnres, moe
from k3verify.harness import registry, runner
from k3verify.harness.modules import kda_layer, mla_layer
from k3verify.kda.layer import KDAState
from k3verify.testing import assert_matches_oracle


@pytest.mark.parametrize("module", ["kda_layer", "mla_layer"])
def test_the_own_layers_pass_every_case(module: str) -> None:
    entry = registry.get(module)
    made = entry.make_cases(0)
    for impl in entry.own_implementations():
        for name in impl.cases:
            row = runner.verify(entry, impl, made[name])
            assert row["status"] == "pass", (impl.label, name, row.get("verdict", {}).get("reason"), row.get("reason"))


def test_layer_entries_are_opt_in() -> None:
    """A run without ``--modules`` keeps to the four modules; the layers run when named."""
    assert "kda_layer" not in registry.module_names() and "kda_layer" in registry.module_names(opt_in=True)
    assert [e.name for e in registry.select(["kda_layer", "mla_layer"])] == ["kda_layer", "mla_layer"]


def _patched(target: str, replacement: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with ``target`` replaced while it runs (the oracle, computed before, never sees it)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with mock.patch(target, replacement):
            return fn(*args, **kwargs)

    return run


def _clamped_gate(z, a_log, dt_bias, *, g_min):
    """A clamp in place of ``g_min * sigmoid(e^A (z + dt_bias))``."""
    h = a_log.shape[0]
    shaped = z + dt_bias.reshape(h, -1)
    return shaped.clamp(min=g_min, max=0.0)


def _state_dropped(x, weights, state, **kw):
    fresh = KDAState(torch.zeros_like(state.conv), torch.zeros_like(state.recurrent))
    return kda_layer.layer(x, weights, fresh, **kw)


def _conv_cache_dropped(x, weights, state, **kw):
    return kda_layer.layer(x, weights, KDAState(torch.zeros_like(state.conv), state.recurrent), **kw)


def _packed_as_one(x, weights, state, *, cu_seqlens=None, **kw):
    """A packed batch run as one sequence: the state leaks from request to request."""
    if cu_seqlens is None:
        return kda_layer.layer(x, weights, state, **kw)
    y, new = kda_layer.layer(x, weights, KDAState(state.conv[:1], state.recurrent[:1]), **kw)
    n = state.conv.shape[0]
    return y, KDAState(new.conv.expand(n, -1, -1).clone(), new.recurrent.expand(n, -1, -1, -1).clone())


def _one_token_requests_zero(x, weights, state, *, cu_seqlens=None, **kw):
    """Requests of one token left unwritten (their outputs zero), as a chunk kernel skipping them."""
    y, new = kda_layer.layer(x, weights, state, cu_seqlens=cu_seqlens, **kw)
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        for a, b in itertools.pairwise(bounds):
            if b - a == 1:
                y[:, a] = 0
    return y, new


KDA_MUTANTS = {
    "raw gate clamped": (_patched("k3verify.kda.layer.lower_bound_gate", _clamped_gate, kda_layer.layer), "prefill",
                         "'y'"),
    "state not carried": (_state_dropped, "carried", "'recurrent'"),
    "conv cache not carried": (_conv_cache_dropped, "carried", "'y'"),
    "packed requests run as one": (_packed_as_one, "packed", "'y'"),
    "one-token requests skipped": (_one_token_requests_zero, "packed", "'y'"),
}


@pytest.mark.parametrize("name", list(KDA_MUTANTS))
def test_a_kda_layer_bug_is_caught(name: str) -> None:
    fn, case, output = KDA_MUTANTS[name]
    with pytest.raises(AssertionError, match=output):
        assert_matches_oracle(fn, "kda_layer", "bf16", cases=[case], baseline="chunkwise", timeout=None)


def test_the_correct_kda_layer_passes_through_the_api() -> None:
    for case in kda_layer.CASES:
        assert_matches_oracle(kda_layer.layer, "kda_layer", "bf16", cases=[case], baseline="chunkwise", timeout=None)


def _gate_from_output(x, w):
    """The output gate computed from the wrong tensor (a zero input: sigmoid(0) = 1/2)."""
    return torch.sigmoid(torch.einsum("btd,dhv->bthv", torch.zeros_like(x), w.w_g))


def _cache_not_written(x, weights, cache, **kw):
    y, _ = mla_layer.layer(x, weights, cache, **kw)
    return y, cache


def _with_scale_576(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with the softmax scale read as ``(R + Dr)^{-1/2}``, the latent width's."""
    cfg = mla_layer.CONFIG
    wrong = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) ** -0.5
    return _patched("k3verify.mla.layer.MLAConfig.softmax_scale", property(lambda self: wrong), fn)


MLA_MUTANTS = {
    "output gate not from the input": (_patched("k3verify.mla.layer.output_gate", _gate_from_output, mla_layer.layer),
                                       "chunked", "'y'"),
    "softmax scale from the latent width": (_with_scale_576(mla_layer.layer), "chunked", "'y'"),
    "new entries not written": (_cache_not_written, "decode", "'cache'"),
}


@pytest.mark.parametrize("name", list(MLA_MUTANTS))
def test_an_mla_layer_bug_is_caught(name: str) -> None:
    fn, case, output = MLA_MUTANTS[name]
    with pytest.raises(AssertionError, match=output):
        assert_matches_oracle(fn, "mla_layer", "bf16", cases=[case], timeout=None)


def test_the_correct_mla_layer_passes_through_the_api() -> None:
    for case in mla_layer.CASES:
        assert_matches_oracle(mla_layer.layer, "mla_layer", "bf16", cases=[case], timeout=None)


# --- MoE: a kernel that routes itself -----------------------------------------------------------


def _self_routed(x, weights, config, *, bias_in_selection: bool = True, router_dtype=None):
    """The definition, routed by the function itself; returns ``(y, experts)``."""
    dtype = router_dtype or (torch.float64 if x.dtype == torch.float64 else torch.float32)
    w = weights if bias_in_selection else dataclasses.replace(weights, bias=torch.zeros_like(weights.bias))
    routing = moe.routing_for(x, w, config, None, dtype)
    return moe.recurrent(x, weights, config, routing=routing), routing.indices


def test_a_self_routing_moe_kernel_is_judged_on_its_own_choices() -> None:
    assert_matches_oracle(_self_routed, "moe", "fp32", kernel_routes=True, timeout=None)
    with pytest.raises(AssertionError, match="experts"):
        assert_matches_oracle(partial(_self_routed, bias_in_selection=False), "moe", "fp32", kernel_routes=True,
                              timeout=None)
    with pytest.raises(AssertionError, match="returns \\(y, experts\\)"):
        assert_matches_oracle(lambda x, w, c: moe.recurrent(x, w, c), "moe", "fp32", kernel_routes=True, timeout=None)


# --- Block AttnRes: the walk, reached through its cases ------------------------------------------


def _blocks_not_reset(embedding, weights, sublayers, **kw):
    """The stored block sums carried over block boundaries (each block also holds the ones before
    it), a reset forgotten; the final output is left as the correct walk made it."""
    walk = attnres.WALKS["recurrent"](embedding, weights, sublayers, **kw)
    return dataclasses.replace(walk, blocks=walk.blocks.cumsum(0))


def test_the_attnres_walk_is_judged_on_both_outputs() -> None:
    assert_matches_oracle(attnres.WALKS["chunkwise"], "attnres", "bf16", cases=["walk"], timeout=None)
    with pytest.raises(AssertionError, match="'blocks'"):
        assert_matches_oracle(_blocks_not_reset, "attnres", "bf16", cases=["walk"], timeout=None)
