"""The whole Gated MLA layer's backward (``mla_layer_backward``): gradients of the layer input and
of every weight through the paged cache. Rules: the oracle against central differences is
``torch.autograd.gradcheck``'s own; fp64 forms are ``fp64-agreement`` per gradient; bf16 and fp32
forms the ``baseline`` rule.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from verdicts import assert_fp64_agrees

from k3verify import mla
from k3verify.harness import registry, selftest
from k3verify.harness.modules import mla_layer, mla_layer_backward
from k3verify.mla import layer as layer_mod
from k3verify.mla.samples import PAGE_SIZE
from k3verify.numerics import fp64_agreement
from k3verify.testing import assert_matches_oracle

TINY = layer_mod.MLAConfig(hidden_size=8, num_heads=2, q_lora_rank=4, kv_lora_rank=4, qk_nope_head_dim=2,
                           qk_rope_head_dim=2, v_head_dim=2)


def test_oracle_passes_gradcheck() -> None:
    """Autograd through the layer around the expanded definition in fp64 against central
    differences, with respect to ``x`` and every weight, after two tokens of context in a paged
    cache (a tiny layer: every weight's every element is perturbed)."""
    weights = layer_mod.init_weights(TINY, seed=1)
    gen = torch.Generator().manual_seed(2)
    context = layer_mod.project_latent(torch.randn(1, 2, TINY.hidden_size, generator=gen, dtype=torch.float64),
                                       weights, TINY)
    cache = mla.build(context, [2], PAGE_SIZE, generator=gen, capacity=5)
    x = torch.randn(1, 3, TINY.hidden_size, generator=gen, dtype=torch.float64)
    names = mla_layer_backward.WEIGHTS

    def y(x, *tensors):
        w = layer_mod.MLAWeights(**dict(zip(names, tensors)))
        return mla_layer.layer(x, w, cache.clone(), config=TINY, form=mla.expanded)[0]

    leaves = [x.clone().requires_grad_()] + [getattr(weights, n).clone().requires_grad_() for n in names]
    assert torch.autograd.gradcheck(y, leaves)


@settings(max_examples=6, deadline=None)
@given(sample=mla_layer.strategy())
def test_the_layer_forms_under_autograd_match_the_oracle(sample) -> None:
    """Autograd through the layer around the recurrent (absorbed) and the chunkwise forms agrees
    with the expanded definition's in fp64, for any mix of requests, context and new tokens."""
    inputs, params = mla_layer_backward.with_cotangent(sample)
    case = registry.Case("drawn", inputs, params)
    ref = mla_layer_backward.oracle(case)
    for form, options in ((mla.recurrent, {}), (mla.chunkwise, {"chunk_size": 8})):
        got = mla_layer_backward.call(mla_layer_backward._through(form, **options), case, torch.float64)
        for name in mla_layer_backward.OUTPUTS:
            assert_fp64_agrees(got[name], ref[name], f"{form.__name__}: {name}")


TOUCHED = {
    "new latents detached at the cache write": {"dx", "dw_dkv", "dkv_norm"},
    "output gate held constant": {"dx", "dw_g"},
}


@pytest.mark.parametrize("name", list(TOUCHED))
def test_a_planted_layer_backward_bug_fails_and_names_its_gradients(name: str) -> None:
    """selftest's layer mutants, in fp64 on chunked prefill: each fails exactly the gradients it
    touches (the attention's own up-projections keep theirs)."""
    entry = registry.get("mla_layer_backward")
    case = entry.make_cases(0)["chunked"]
    fn = entry.from_forward(selftest.mutant("mla_layer_backward", name).fn)
    got, ref = mla_layer_backward.call(fn, case, torch.float64), entry.oracle(case)
    assert {n for n in ref if not fp64_agreement(got[n], ref[n]).passed} == TOUCHED[name]


def test_every_mla_layer_backward_mutant_is_pinned_here() -> None:
    assert {m.name for m in selftest.mutants(["mla_layer_backward"])} == set(TOUCHED)


def test_the_testing_api_judges_a_layer_forward_on_its_gradients() -> None:
    """``direction="backward"`` on the layer: the layer around the chunkwise form, under
    autograd in bf16, passes on every case (rule: baseline)."""
    assert_matches_oracle(mla_layer.layer, "mla_layer", torch.bfloat16, direction="backward",
                          cases=list(mla_layer_backward.CASES), form=mla.chunkwise, chunk_size=8)
