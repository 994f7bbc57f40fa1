"""Sequences of one token, as the KDA strategy draws them (T from 1).

Two one-token cases failed our tiled forms under the baseline rule when KDA's RMS term counted
every element as an independent error. It counts the rows along the value axis (one per batch,
position and head): a rounded key or query reaches every value channel of its row alike.

- ``tiled[fp32]`` with every gate at its bound measured 4.5x the baseline's error, a false
  alarm: the error is one scalar rounding, ``e = -2.8e-7 x oracle`` (cos -0.991). With one row
  it is one error, and the row passes under the small-output factor of one.
- ``tiled[fp8_e4m3, tile_start]`` measures rms_ratio 1.08 and 0.50 where the fp8 chunkwise
  baseline measures 0.16 and 0.12: a real loss. With one token the whole output is the diagonal
  tile, and splitting it at the tile's start multiplies the queries by ``e^g``; on strongly
  decaying channels (``e^g`` down to 0.004) that puts them in fp8's subnormal range. One or two
  rows cannot show it statistically (any error passes at one row), so the loss is held here: the
  form's trace names the underflow, and the same form with ``diagonal="fp32"`` is 4-24x closer.

The chunkwise form passes on each case, at fp32 and bf16.

Rule: baseline (the chunkwise family, in the row's dtype); the underflow is the form's trace.
"""

from __future__ import annotations

from typing import Any

import pytest

from k3verify import kda
from k3verify.harness import registry, runner
from k3verify.harness.registry import Case
from k3verify.kda.samples import random_inputs, saturated_inputs
from k3verify.numerics import policy

# (name, inputs maker, shape and gates as the strategy drew them)
PINNED = {
    "one token, gates at -5.33": (saturated_inputs, dict(B=1, T=1, H=1, K=32, V=32, g_min=-5.33, seed=401),
                                  dict(one_hot=False)),
    "one token, random gates": (random_inputs, dict(B=2, T=1, H=1, K=16, V=16, g_min=-8.0, seed=0),
                                dict(initial_state=False)),
}
TILED = "tiled[fp{bits} chunk_size=64 tile=16 anchor=tile_start]"


def _row(form: str, dtype: str, pinned: str) -> dict[str, Any]:
    make, shape, extra = PINNED[pinned]
    entry = registry.get("kda")
    impl = next(i for i in entry.own_implementations()
                if i.form == form and i.dtype == dtype and i.params.get("anchor", "tile_start") == "tile_start"
                and "diagonal" not in i.params and i.params.get("tile", 16) == 16)
    return runner.verify(entry, impl, Case(pinned, make(**shape, **extra), dict(shape)))


@pytest.mark.parametrize("pinned", list(PINNED))
def test_the_chunkwise_form_passes_on_one_token(pinned: str) -> None:
    for dtype in ("fp32", "bf16"):
        row = _row("chunkwise", dtype, pinned)
        assert row["status"] == "pass", (dtype, row.get("verdict", {}).get("reason"))


@pytest.mark.parametrize("pinned", list(PINNED))
def test_tiled_fp8_with_an_fp32_diagonal_passes_on_one_token(pinned: str) -> None:
    """What locates the fp8 loss in the diagonal tile's split: without it the form passes."""
    entry = registry.get("kda")
    impl = next(i for i in entry.own_implementations()
                if i.form == "tiled" and i.dtype == "fp8_e4m3" and i.params.get("diagonal") == "fp32")
    make, shape, extra = PINNED[pinned]
    row = runner.verify(entry, impl, Case(pinned, make(**shape, **extra), dict(shape)))
    assert row["status"] == "pass", row["outputs"]["o"]["verdict"]["reason"]


@pytest.mark.parametrize("pinned", list(PINNED))
def test_tiled_fp8_on_one_token_loses_to_underflow(pinned: str) -> None:
    """The loss is real and named: the diagonal queries are subnormal, and an fp32 diagonal
    (the same form otherwise) has less than half the error (measured: 0.044 against 1.08, and
    0.121 against 0.50)."""
    make, shape, extra = PINNED[pinned]
    x = make(**shape, **extra)
    lines = kda.explain_underflow(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                  chunk_size=64, tile=16, operand_dtype="fp8_e4m3", anchor="tile_start")
    assert lines and lines[0].startswith("diagonal") and "fp8_e4m3's smallest normal" in lines[0], lines
    entry = registry.get("kda")
    fp32_diagonal = next(i for i in entry.own_implementations()
                         if i.form == "tiled" and i.dtype == "fp8_e4m3" and i.params.get("diagonal") == "fp32")
    split = _row("tiled", "fp8_e4m3", pinned)["outputs"]["o"]["metrics"]["rms_ratio"]
    whole = runner.verify(entry, fp32_diagonal, Case(pinned, x, dict(shape)))["outputs"]["o"]["metrics"]["rms_ratio"]
    assert whole < split / 2, (whole, split)


def test_tiled_fp32_on_one_token_with_saturated_gates_is_one_error() -> None:
    """The former false alarm: one row of one token is one independent error, so the factor is
    that of one error and the coherent scalar rounding passes."""
    row = _row("tiled", "fp32", "one token, gates at -5.33")
    o = row["outputs"]["o"]
    assert row["status"] == "pass" and o["verdict"]["k"] == pytest.approx(policy.small_output_k(1)), o["verdict"]
