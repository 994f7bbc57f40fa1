"""Bad input to any Gated MLA form is a TypeError/ValueError naming the argument.

Structural checks: each mutation of a valid call must raise the right exception type with the
offending argument's name in the message, and the valid call (dead slots poisoned with NaN)
must not raise.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3verify import mla
from k3verify.mla.samples import make_problem

FORMS = {"recurrent": mla.recurrent, "chunkwise": mla.chunkwise, "tiled": mla.tiled, "expanded": mla.expanded}


def _valid() -> dict:
    p = make_problem((5, 2), 3, H=2, Dr=2, page_size=4, seed=1)
    q_nope, q_pe, cache, w_uk, w_uv = p.args()
    return dict(q_nope=q_nope, q_pe=q_pe, cache=cache, w_uk=w_uk, w_uv=w_uv)


def _with_cache(**changes):
    def mutate(a: dict) -> None:
        a["cache"] = dataclasses.replace(a["cache"], **{k: v(a["cache"]) for k, v in changes.items()})
    return mutate


def _set(name, fn):
    def mutate(a: dict) -> None:
        a[name] = fn(a[name])
    return mutate


def _live_nan(cache: mla.LatentCache) -> torch.Tensor:
    pool = cache.pool.clone()
    page = int(cache.block_table[0, 0])
    pool[page, 0, 3] = float("nan")  # position 0 of request 0 is live
    return pool


def _outside(cache: mla.LatentCache) -> torch.Tensor:
    table = cache.block_table.clone()
    table[1, 0] = cache.num_pages  # request 1's only live page
    return table


def _negative(cache: mla.LatentCache) -> torch.Tensor:
    table = cache.block_table.clone()
    table[0, 1] = -1  # request 0 has 8 tokens: page 1 is live
    return table


# (id, mutation of the arguments, extra keyword options, exception, text the message must contain)
BAD = [
    ("q_nope rank", _set("q_nope", lambda t: t[0]), {}, ValueError, "q_nope"),
    ("q_pe heads", _set("q_pe", lambda t: t[:, :, :1]), {}, ValueError, "q_pe"),
    ("w_uk rank dim", _set("w_uk", lambda t: t[:, :-1]), {}, ValueError, "w_uk"),
    ("w_uv heads", _set("w_uv", lambda t: t[:1]), {}, ValueError, "w_uv"),
    ("pool width", _with_cache(pool=lambda c: c.pool[..., :-1]), {}, ValueError, "cache.pool"),
    ("mixed dtypes", _set("q_pe", lambda t: t.float()), {}, TypeError, "q_pe"),
    ("pool dtype", _with_cache(pool=lambda c: c.pool.float()), {}, TypeError, "cache.pool"),
    ("integer queries", _set("q_nope", lambda t: t.long()), {}, TypeError, "q_nope"),
    ("not a tensor", _set("w_uv", lambda t: t.tolist()), {}, TypeError, "w_uv"),
    ("not a cache", _set("cache", lambda c: (c.pool, c.block_table, c.seq_lens)), {}, TypeError, "cache"),
    ("NaN query", _set("q_nope", lambda t: t.index_fill(1, torch.tensor([1]), float("nan"))), {}, ValueError,
     "q_nope"),
    ("inf weight", _set("w_uv", lambda t: t.index_fill(0, torch.tensor([0]), float("inf"))), {}, ValueError, "w_uv"),
    ("NaN in a live slot", _with_cache(pool=_live_nan), {}, ValueError, "cache.pool"),
    ("page outside the pool", _with_cache(block_table=_outside), {}, ValueError, "cache.block_table"),
    ("negative live page", _with_cache(block_table=_negative), {}, ValueError, "cache.block_table"),
    ("float block table", _with_cache(block_table=lambda c: c.block_table.double()), {}, TypeError,
     "cache.block_table"),
    ("length shorter than T", _with_cache(seq_lens=lambda c: torch.tensor([8, 2])), {}, ValueError, "cache.seq_lens"),
    ("length beyond the pages", _with_cache(seq_lens=lambda c: torch.tensor([8, 9])), {}, ValueError,
     "cache.seq_lens"),
    ("batch mismatch", _with_cache(seq_lens=lambda c: c.seq_lens[:1], block_table=lambda c: c.block_table[:1]), {},
     ValueError, "cache.block_table"),
    ("scale zero", None, {"scale": 0.0}, ValueError, "scale"),
    ("scale negative", None, {"scale": -0.1}, ValueError, "scale"),
    ("scale NaN", None, {"scale": float("nan")}, ValueError, "scale"),
    ("scale bool", None, {"scale": True}, TypeError, "scale"),
    ("chunk size zero", None, {"chunk_size": 0}, ValueError, "chunk_size"),
    ("tile negative", None, {"tile": -4}, ValueError, "tile"),
    ("no splits", None, {"num_splits": 0}, ValueError, "num_splits"),
    ("unknown operand dtype", None, {"operand_dtype": "fp7"}, ValueError, "fp7"),
    ("subtract_max not bool", None, {"subtract_max": "yes"}, TypeError, "subtract_max"),
    ("unknown overflow mode", None, {"overflow": "clip"}, ValueError, "overflow"),
]


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize(("mutate", "options", "error", "name"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_named(form: str, mutate, options: dict, error: type, name: str) -> None:
    """Structural: the right exception, naming the argument."""
    args = _valid()
    if mutate is not None:
        mutate(args)
    with pytest.raises(error, match=name.replace(".", r"\.")):
        FORMS[form](args["q_nope"], args["q_pe"], args["cache"], args["w_uk"], args["w_uv"], **options)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_valid_call_with_poisoned_dead_slots_is_accepted(form: str) -> None:
    """Structural: the unmutated call (NaN in every dead slot) runs and is finite."""
    a = _valid()
    assert bool(torch.isnan(a["cache"].pool).any()), "the valid call must carry poison"
    out = FORMS[form](a["q_nope"], a["q_pe"], a["cache"], a["w_uk"], a["w_uv"])
    assert bool(torch.isfinite(out).all())


def test_bad_fp8_cache_scales_are_named() -> None:
    """Structural: a non-positive per-token scale in a live slot of an fp8 cache is rejected."""
    a = _valid()
    q = mla.quantize(a["cache"])
    scales = q.scales.clone()
    scales[int(q.block_table[0, 0]), 0] = 0.0
    with pytest.raises(ValueError, match=r"cache\.scales"):
        mla.tiled(a["q_nope"], a["q_pe"], dataclasses.replace(q, scales=scales), a["w_uk"], a["w_uv"])
