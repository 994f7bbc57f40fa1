"""Block AttnRes's backward over the depth walk (``attnres_walk_backward``): gradients of the walk's
output with respect to the embedding and every call's ``w``, ``γ`` and norm gain, through the
stored block sums. Rules: the oracle against central differences is ``torch.autograd.gradcheck``'s
own; fp64 forms are ``fp64-agreement`` per gradient.
"""

from __future__ import annotations

import torch

from k3verify import attnres
from k3verify.attnres import samples
from k3verify.harness import registry
from k3verify.harness.modules import attnres_walk_backward as entry


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
