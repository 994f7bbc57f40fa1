"""Bad input to any Block AttnRes form is a TypeError/ValueError naming the argument.

Structural checks: each mutation of a valid call must raise the right exception type with the
offending argument's name in the message, in every form; the valid calls must not raise.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from strategies.attnres import FORMS
from verdicts import assert_identical

from k3verify import attnres
from k3verify.attnres.samples import make_aggregation, make_walk


def _aggregation() -> dict:
    p = make_aggregation(4, 3, 8, seed=1)
    return dict(sources=p.sources, w=p.w, gamma=p.gamma)


def _set(name, fn):
    def mutate(a: dict) -> None:
        a[name] = fn(a[name])
    return mutate


def _nan_at(index):
    def fn(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[index] = float("nan")
        return t
    return fn


# (id, mutation of the arguments, extra keyword options, exception, text the message must contain)
BAD_AGGREGATION = [
    ("sources rank", _set("sources", lambda t: t[0]), {}, ValueError, "sources"),
    ("no sources", _set("sources", lambda t: t[:0]), {}, ValueError, "sources"),
    ("empty list", _set("sources", lambda t: []), {}, ValueError, "sources"),
    ("list of mismatched shapes", _set("sources", lambda t: [t[0], t[1, :, :-1]]), {}, ValueError, "sources[1]"),
    ("list of mixed dtypes", _set("sources", lambda t: [t[0], t[1].float()]), {}, TypeError, "sources[1]"),
    ("list entry not a tensor", _set("sources", lambda t: [t[0], t[1].tolist()]), {}, TypeError, "sources[1]"),
    ("w width", _set("w", lambda t: t[:-1]), {}, ValueError, "w"),
    ("gamma rank", _set("gamma", lambda t: t[None]), {}, ValueError, "gamma"),
    ("mixed dtypes", _set("gamma", lambda t: t.float()), {}, TypeError, "gamma"),
    ("integer sources", _set("sources", lambda t: t.long()), {}, TypeError, "sources"),
    ("not a tensor", _set("w", lambda t: t.tolist()), {}, TypeError, "w"),
    ("NaN source", _set("sources", _nan_at((2, 1, 3))), {}, ValueError, "sources"),
    ("inf gain", _set("gamma", lambda t: t.index_fill(0, torch.tensor([0]), float("inf"))), {}, ValueError, "gamma"),
    ("NaN query", _set("w", _nan_at(5)), {}, ValueError, "w"),
    ("unknown stream dtype", None, {"stream_dtype": "bf17"}, ValueError, "bf17"),
    ("fp8 stream", None, {"stream_dtype": "fp8_e4m3"}, ValueError, "stream_dtype"),
    ("fp8 logits", None, {"logit_dtype": "fp8_e5m2"}, ValueError, "logit_dtype"),
    ("tile zero", None, {"tile": 0}, ValueError, "tile"),
    ("tile float", None, {"tile": 2.0}, ValueError, "tile"),
    ("subtract_max not a bool", None, {"subtract_max": 1}, TypeError, "subtract_max"),
    ("eps zero", None, {"eps": 0.0}, ValueError, "eps"),
    ("eps NaN", None, {"eps": float("nan")}, ValueError, "eps"),
    ("eps bool", None, {"eps": True}, TypeError, "eps"),
]


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize(("mutate", "options", "error", "text"), [b[1:] for b in BAD_AGGREGATION],
                         ids=[b[0] for b in BAD_AGGREGATION])
def test_bad_aggregation_is_a_clear_error(form, mutate, options, error, text) -> None:
    fn, opts = FORMS[form]
    args = _aggregation()
    if mutate is not None:
        mutate(args)
    with pytest.raises(error, match=text.replace("[", r"\[").replace("]", r"\]")):
        fn(**args, **(opts | options))


@pytest.mark.parametrize("form", sorted(FORMS))
def test_valid_aggregation_and_source_list(form) -> None:
    fn, opts = FORMS[form]
    args = _aggregation()
    stacked = fn(**args, **opts)
    listed = fn(list(args["sources"]), args["w"], args["gamma"], **opts)
    # Bitwise on any host: stacking the list rebuilds the same contiguous [N, T, d] tensor, so
    # both calls run the same operations on the same shapes in one process.
    assert_identical(stacked, listed)


def _walk() -> dict:
    p = make_walk(2, 3, d=4, T=2, seed=1)
    return dict(p.inputs)


def _weights(**changes):
    def mutate(a: dict) -> None:
        a["weights"] = dataclasses.replace(a["weights"], **{k: v(a["weights"]) for k, v in changes.items()})
    return mutate


def _bad_sublayer(a: dict) -> None:
    good = a["sublayers"]
    a["sublayers"] = lambda s, x: good(s, x)[:, :-1]


BAD_WALK = [
    ("embedding rank", _set("embedding", lambda t: t[0]), ValueError, "embedding"),
    ("embedding NaN", _set("embedding", _nan_at((1, 2))), ValueError, "embedding"),
    ("embedding dtype", _set("embedding", lambda t: t.float()), TypeError, "embedding"),
    ("weights type", _set("weights", lambda w: (w.w, w.gamma, w.norm)), TypeError, "weights"),
    ("too few queries", _weights(w=lambda w: w.w[:-1]), ValueError, "weights.w"),
    ("gain width", _weights(gamma=lambda w: w.gamma[:, :-1]), ValueError, "weights.gamma"),
    ("norm for the output call", _weights(norm=lambda w: torch.cat([w.norm, w.norm[:1]])), ValueError,
     "weights.norm"),
    ("inf query", _weights(w=lambda w: w.w.index_fill(0, torch.tensor([2]), float("inf"))), ValueError,
     "weights.w"),
    ("sublayers not callable", _set("sublayers", lambda f: 3), TypeError, "sublayers"),
    ("sublayer output shape", _bad_sublayer, ValueError, "sublayers"),
    ("schedule type", _set("schedule", lambda s: (s.num_layers, s.block_sublayers)), TypeError, "schedule"),
    ("schedule of other depth", _set("schedule", lambda s: attnres.Schedule(3, 3)), ValueError, "weights.w"),
]


@pytest.mark.parametrize("form", sorted(attnres.WALKS))
@pytest.mark.parametrize(("mutate", "error", "text"), [b[1:] for b in BAD_WALK], ids=[b[0] for b in BAD_WALK])
def test_bad_walk_is_a_clear_error(form, mutate, error, text) -> None:
    args = _walk()
    mutate(args)
    schedule = args.pop("schedule")
    with pytest.raises(error, match=text):
        attnres.WALKS[form](**args, schedule=schedule)


@pytest.mark.parametrize(("kwargs", "text"), [({"num_layers": 0}, "num_layers"), ({"block_sublayers": 0},
                                              "block_sublayers"), ({"num_layers": 2.5}, "num_layers")])
def test_bad_schedule_is_a_clear_error(kwargs, text) -> None:
    with pytest.raises(ValueError, match=text):
        attnres.Schedule(**kwargs)
    with pytest.raises(ValueError, match="block_size"):
        attnres.Schedule.layers(0)
