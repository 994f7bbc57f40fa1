"""Sequences of one token, as a KDA strategy drawing T < 64 finds them.

Drawn one-token cases fail two of our tiled forms under the baseline rule. Each failure is
pinned as it was found and marked as an expected failure. The marks are strict: a fix turns a
mark into an error, so it goes with the fix. The findings are in docs/sensitivity.md.

- ``tiled[fp8_e4m3, tile_start]`` measures rms_ratio 1.08 and 0.50 where the fp8 chunkwise
  baseline measures 0.16 and 0.12. This is a real loss. With one token, the whole output is the
  diagonal tile, and splitting it at the tile's start multiplies the queries by ``e^g``. On
  strongly decaying channels (``e^g`` down to 0.004) that puts them in fp8's subnormal range.
  The same form with ``diagonal="fp32"`` passes on both cases (0.044, 0.121).
- ``tiled[fp32]`` with every gate at its bound measures 4.5x the baseline's error. This is a
  false alarm of the rule. The error is one scalar rounding, ``e = -2.8e-7 x oracle``
  (cos -0.991), but the small-output factor counts the 1,024 elements as independent errors.

The chunkwise form passes on each case, at fp32 and bf16.

Rule: baseline (the chunkwise family, in the row's dtype).
"""

from __future__ import annotations

from typing import Any

import pytest

from k3verify.harness import registry, runner
from k3verify.harness.registry import Case
from k3verify.kda.samples import random_inputs, saturated_inputs

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


@pytest.mark.xfail(strict=True, reason="tiled fp8, tile_start: anchored queries underflow fp8 (docs/sensitivity.md)")
@pytest.mark.parametrize("pinned", list(PINNED))
def test_tiled_fp8_on_one_token(pinned: str) -> None:
    row = _row("tiled", "fp8_e4m3", pinned)
    assert row["status"] == "pass", row["outputs"]["o"]["verdict"]["reason"]


@pytest.mark.xfail(strict=True, reason="a false alarm: one coherent scalar rounding, counted as 1024 errors")
def test_tiled_fp32_on_one_token_with_saturated_gates() -> None:
    row = _row("tiled", "fp32", "one token, gates at -5.33")
    assert row["status"] == "pass", row["outputs"]["o"]["verdict"]["reason"]
