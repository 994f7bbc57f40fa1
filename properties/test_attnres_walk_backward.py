"""Block AttnRes's backward over the depth walk (``attnres_walk_backward``): gradients of the walk's
output with respect to the embedding and every call's ``w``, ``γ`` and norm gain, through the
stored block sums. Rules: the oracle against central differences is ``torch.autograd.gradcheck``'s
own; fp64 forms are ``fp64-agreement`` per gradient.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3verify import attnres
from k3verify.attnres import samples
from k3verify.harness import registry
from k3verify.harness.modules import attnres_walk_backward as entry
from k3verify.numerics import fp64_agreement


def test_oracle_passes_gradcheck() -> None:
    """Autograd through the recurrent walk in fp64 (3 layers, blocks of 2 sublayers, so the
    gradient crosses a block boundary and the stored sums) against central differences."""
    p = samples.make_walk(3, 2, d=4, T=2, seed=3)
    x = p.inputs

    def h(embedding, w, gamma, norm):
        weights = attnres.AttnResWeights(w, gamma, norm)
        return attnres.WALKS["recurrent"](embedding, weights, x["sublayers"], schedule=x["schedule"]).output

    leaves = [t.clone().requires_grad_() for t in (x["embedding"], x["weights"].w, x["weights"].gamma,
                                                   x["weights"].norm)]
    assert torch.autograd.gradcheck(h, leaves)


def test_every_call_gets_a_gradient() -> None:
    """The gradient reaches every call's parameters, the first block's included: nothing is cut
    off at a block boundary. The first call mixes the embedding alone (its weight is exactly 1),
    so its ``w`` and ``γ`` get exactly 0; every other call's, and every norm gain, do not."""
    case = registry.get("attnres_walk_backward").make_cases(0)["walk"]
    grads = entry.oracle(case)
    for name in ("dw", "dgamma"):
        rows = grads[name].abs().sum(-1)
        assert float(rows[0]) == 0.0 and bool(rows[1:].gt(0).all()), name
    assert bool(grads["dnorm"].abs().sum(-1).gt(0).all())


def _pinned_saturated_walk() -> registry.Case:
    """A drawn walk (found by the sweep at seed 0): one layer, width 2, one token, logit scale
    13.3. Its calls' softmaxes are saturated, so ``dw = Σ dℓ k`` cancels to 4e-8 of its terms."""
    inputs, params = entry.with_cotangent(samples.make_walk(1, 1, d=2, T=1, seed=10,
                                                            logit_scale=13.26916669878371).sample)
    return registry.Case("pinned", inputs, params)


def test_fp64_rows_hold_a_cancelled_sum_to_its_terms_and_still_bite() -> None:
    """Rule: fp64-agreement relative to the larger of ``max|ref|`` and each element's terms' size
    (``term_sizes``). On the pinned walk the two-phase walk's ``dw`` is 3.7e-8 of ``max|dw|`` off the
    oracle (fp64 rounding of terms 1e8 times larger: 5.8e-17 of them) and passes; the same form with
    ``dw`` moved by 1e-9 of ``max|dw|`` on an element of the first call, which has no terms (it mixes
    the embedding alone, its weight exactly 1), fails."""
    from k3verify.harness import runner

    e = registry.get("attnres_walk_backward")
    case = _pinned_saturated_walk()
    impl = next(i for i in e.own_implementations() if i.form == "chunkwise (autograd)" and i.dtype == "fp64")
    ref = e.oracle(case)
    got = impl.run(case)
    assert fp64_agreement(got["dw"], ref["dw"]).err > 1e-8  # relative to the cancelled value alone
    row = runner.verify(e, impl, case)
    assert row["status"] == "pass", row["outputs"]["dw"]["verdict"]
    assert "its terms' size" in row["outputs"]["dw"]["verdict"]["reason"]

    def planted(*args, **kw):
        grads = dict(impl.run(case))
        grads["dw"] = grads["dw"].clone()
        grads["dw"][0, 0] += 1e-9 * float(ref["dw"].abs().max())
        return grads

    sizes = e.term_sizes("dw", case, ref)
    assert float(sizes[0, 0]) == 0.0
    bad = dataclasses.replace(impl, run=planted)
    row = runner.verify(e, bad, case)
    assert row["status"] == "fail" and row["output"] == "dw", row["outputs"]["dw"]["verdict"]


def test_a_walks_errors_count_as_many_tokens_as_the_baselines_are_worth() -> None:
    """Rule: baseline, the RMS term; its count is the tokens, capped by Kish's number of the
    baseline's embedding-gradient tokens (``spread_over``). K3's walk over 16 tokens at logit scale
    16, seed 24: the two-phase fp32 walk's error measured 6.9 times the baseline's on ``dw`` (5.9
    with ATen's default CPU kernels), one token holding most of it; 16 counted tokens allowed 3.87
    times, what the baseline's tokens are worth allows more, and the row passes."""
    from k3verify.harness import runner
    from k3verify.numerics import policy

    e = registry.get("attnres_walk_backward")
    inputs, params = entry.with_cotangent(samples.walk_sample(attnres.Schedule(), T=16, d=64, logit_scale=16.0,
                                                              seed=24))
    case = registry.Case("pinned", inputs, params)
    impl = next(i for i in e.own_implementations() if i.form == "chunkwise (autograd)" and i.dtype == "fp32")
    row = runner.verify(e, impl, case)
    dw = row["outputs"]["dw"]
    # The ratio depends on how the host rounds (6.9x with AVX2 kernels, 5.9x with ATen's default
    # ones): what holds on any host is that counting all 16 tokens would have failed it.
    assert dw["verdict"]["err"] > policy.small_output_k(16) * dw["baseline_metrics"]["rms_ratio"] > 0
    worth = policy.effective_slices(e.oracle(case)["dembedding"], e.baseline(case, "fp32")["dembedding"])
    assert 1 <= worth < 6 and dw["verdict"]["k"] == pytest.approx(policy.small_output_k(worth))
    assert row["status"] == "pass", dw["verdict"]
