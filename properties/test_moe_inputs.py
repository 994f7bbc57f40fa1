"""Bad input to any Stable LatentMoE form, or a bad configuration, is a TypeError/ValueError
naming the argument.

Structural checks: each mutation of a valid call must raise the right exception type with the
offending argument's name in the message; the valid call must not raise.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from strategies.moe import one_thread  # noqa: F401

from k3verify import moe
from k3verify.moe.samples import make_problem

FORMS = {"recurrent": moe.recurrent, "chunkwise": moe.chunkwise, "tiled": moe.tiled}


def _valid() -> dict:
    p = make_problem(5, E=8, k=2, d=16, H=8, seed=1)
    x, w, cfg = p.args()
    return dict(x=x, weights=w, config=cfg, routing=None)


def _set(name, fn):
    def mutate(a: dict) -> None:
        a[name] = fn(a[name])
    return mutate


def _weight(name, fn):
    def mutate(a: dict) -> None:
        a["weights"] = dataclasses.replace(a["weights"], **{name: fn(getattr(a["weights"], name))})
    return mutate


def _routing(indices=None, weights=None):
    def mutate(a: dict) -> None:
        r = moe.route(a["x"], a["weights"].w_router, a["weights"].bias, a["config"])
        a["routing"] = moe.Routing(indices(r.indices) if indices else r.indices,
                                   weights(r.weights) if weights else r.weights)
    return mutate


def _nan_at(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[1] = float("nan")
    return t


# (id, mutation of the arguments, extra keyword options, exception, text the message must contain)
BAD = [
    ("x rank", _set("x", lambda t: t[None]), {}, ValueError, "x has shape"),
    ("x width", _set("x", lambda t: t[:, :-1]), {}, ValueError, "x has shape"),
    ("x NaN", _set("x", _nan_at), {}, ValueError, "x has 1 non-finite"),
    ("x integer", _set("x", lambda t: t.long()), {}, TypeError, "x has dtype"),
    ("x not a tensor", _set("x", lambda t: t.tolist()), {}, TypeError, "x must be"),
    ("mixed dtypes", _weight("w2", lambda t: t.float()), {}, TypeError, "weights.w2"),
    ("w1 shape", _weight("w1", lambda t: t[:, :, :-1]), {}, ValueError, "weights.w1"),
    ("bias shape", _weight("bias", lambda t: t[:-1]), {}, ValueError, "weights.bias"),
    ("router inf", _weight("w_router", lambda t: t.index_fill(0, torch.tensor([0]), float("inf"))), {},
     ValueError, "weights.w_router"),
    ("shared shape", _weight("shared_w2", lambda t: t[1:]), {}, ValueError, "weights.shared_w2"),
    ("weights type", _set("weights", lambda w: w.tensors()), {}, TypeError, "weights must be"),
    ("config type", _set("config", dataclasses.asdict), {}, TypeError, "config must be"),
    ("config mismatch", _set("config", lambda c: dataclasses.replace(c, num_experts=16)), {}, ValueError,
     "weights.w_router"),
    ("routing type", _set("routing", lambda r: (1, 2)), {}, TypeError, "routing must be"),
    ("expert out of range", _routing(indices=lambda i: i + 8), {}, ValueError, "routing.indices"),
    ("negative expert", _routing(indices=lambda i: i - 8), {}, ValueError, "routing.indices"),
    ("repeated expert", _routing(indices=lambda i: i[:, :1].expand(-1, 2)), {}, ValueError,
     "routing.indices repeats"),
    ("float indices", _routing(indices=lambda i: i.double()), {}, TypeError, "routing.indices"),
    ("indices shape", _routing(indices=lambda i: i[:, :1]), {}, ValueError, "routing.indices"),
    ("NaN weight", _routing(weights=_nan_at), {}, ValueError, "routing.weights"),
    ("tile_m zero", None, {"tile_m": 0}, ValueError, "tile_m"),
    ("tile_k negative", None, {"tile_k": -1}, ValueError, "tile_k"),
    ("unknown operand dtype", None, {"operand_dtype": "fp7"}, ValueError, "fp7"),
    ("unknown fp8 scaling", None, {"fp8_scaling": "per_block"}, ValueError, "fp8_scaling"),
    ("static scale zero", None, {"fp8_static_scale": 0.0}, ValueError, "fp8_static_scale"),
    ("unknown overflow mode", None, {"overflow": "clip"}, ValueError, "overflow"),
]


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize(("mutate", "options", "error", "text"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_named(form: str, mutate, options: dict, error: type, text: str) -> None:
    """Structural: the right exception, naming the argument."""
    a = _valid()
    if mutate is not None:
        mutate(a)
    with pytest.raises(error, match=text):
        FORMS[form](a["x"], a["weights"], a["config"], routing=a["routing"], **options)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_valid_call_is_accepted(form: str) -> None:
    """Structural: the unmutated call runs and is finite."""
    a = _valid()
    assert bool(torch.isfinite(FORMS[form](a["x"], a["weights"], a["config"])).all())


BAD_CONFIG = [
    ("top_k above experts", {"top_k": 9}, ValueError, "top_k 9 exceeds num_experts 8"),
    ("top_k zero", {"top_k": 0}, ValueError, "top_k"),
    ("experts float", {"num_experts": 8.0}, ValueError, "num_experts"),
    ("rho zero", {"routed_scaling_factor": 0.0}, ValueError, "routed_scaling_factor"),
    ("rho NaN", {"routed_scaling_factor": float("nan")}, ValueError, "routed_scaling_factor"),
    ("rho text", {"routed_scaling_factor": "2"}, TypeError, "routed_scaling_factor"),
    ("beta1 negative", {"beta1": -4.0}, ValueError, "beta1"),
    ("eps zero", {"rms_norm_eps": 0.0}, ValueError, "rms_norm_eps"),
    ("renorm_eps negative", {"renorm_eps": -1e-20}, ValueError, "renorm_eps"),
    ("activation", {"activation": "gelu"}, ValueError, "activation"),
    ("tie rule", {"tie_break": "random"}, ValueError, "tie_break"),
    ("logits dtype", {"logits_dtype": "fp7"}, ValueError, "fp7"),
]


@pytest.mark.parametrize(("changes", "error", "text"), [b[1:] for b in BAD_CONFIG], ids=[b[0] for b in BAD_CONFIG])
def test_bad_config_is_named(changes: dict, error: type, text: str) -> None:
    """Structural: MoEConfig validates every field on construction."""
    with pytest.raises(error, match=text):
        moe.MoEConfig.small(**({"num_experts": 8} | changes))
