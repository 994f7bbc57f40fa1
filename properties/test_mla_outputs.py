"""Gated MLA's named outputs ``o`` and ``cache``, and the calling convention that makes them.

``cache`` is the logical latent-cache contents a call leaves behind: every request's live entries
in order, ``[B, Lmax, R + Dr]``, zeros past its length, fp8 codes times their scales. Each output
is judged by the runner under the row's rule (``fp64-agreement`` for fp64 rows, ``baseline``
against the same-dtype naive implementation otherwise), so a kernel that returns a correct ``o``
but corrupts live cache entries fails on ``cache``, and one that keeps the cache but computes
``o`` wrong fails on ``o`` alone.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from verdicts import assert_identical

from k3verify import mla
from k3verify.harness import registry, runner
from k3verify.harness.registry import BASELINE_RULE, FP64_RULE, Case, Implementation, Outputs
from k3verify.mla import samples
from k3verify.numerics import FAIL, PASS, dtype_name
from k3verify.testing import assert_matches_oracle

ENTRY = registry.get("mla")


@pytest.fixture(scope="module")
def case() -> Case:
    return ENTRY.make_cases(0)["default"]


def _impl(run: Callable[[Case], Outputs], dtype: str, rule: str) -> Implementation:
    return Implementation(module="mla", implementation="test", form="user", dtype=dtype, params={}, rule=rule, run=run)


def _rms(x: torch.Tensor) -> float:
    return float(x.double().pow(2).mean().sqrt())


def _one_entry_off(cache: torch.Tensor, lengths: list[int], by: float) -> torch.Tensor:
    """``cache`` with one live number (request 1, its last token, first latent) moved by ``by``
    times the RMS of the entries."""
    out = cache.clone()
    out[1, lengths[1] - 1, 0] += by * _rms(cache)
    return out


@pytest.mark.parametrize(("dtype", "rule"), [("fp64", FP64_RULE), ("fp32", BASELINE_RULE)])
def test_a_corrupted_live_cache_entry_fails_on_cache(case: Case, dtype: str, rule: str) -> None:
    """The oracle's ``o`` exactly, one live cache entry off by 1% of the entries' RMS: the row
    fails, and the failing (binding) output is ``cache`` (fp64-agreement in fp64, the baseline
    rule in fp32: 1% of one entry is far past fp32 rounding of the cache)."""
    ref = ENTRY.oracle(case)
    torch_dtype = {"fp64": torch.float64, "fp32": torch.float32}[dtype]

    bad = _one_entry_off(ref["cache"], case.params["lengths"], 0.01).to(torch_dtype)

    def run(c: Case) -> Outputs:
        return {"o": ref["o"].clone(), "cache": bad}

    row = runner.verify(ENTRY, _impl(run, dtype, rule), case)
    assert row["status"] == FAIL and row["output"] == "cache", row
    assert row["outputs"]["o"]["status"] == PASS and row["outputs"]["cache"]["status"] == FAIL


def test_a_dropped_token_fails_on_cache_in_bf16(case: Case) -> None:
    """A bf16 kernel with the right ``o`` whose cache lost one token's entry (all zeros): the
    baseline rule fails ``cache`` even at bf16's noise (one of 125 tokens is ~9% of the RMS)."""
    good = ENTRY.call(mla.tiled, case, torch.bfloat16, tile=16, operand_dtype="bf16")
    bad = good["cache"].clone()
    bad[0, 5] = 0

    row = runner.verify(ENTRY, _impl(lambda c: {"o": good["o"], "cache": bad}, "bf16", BASELINE_RULE), case)
    assert row["status"] == FAIL and row["output"] == "cache", row
    assert row["outputs"]["o"]["status"] == PASS


def test_a_correct_cache_with_o_off_fails_on_o_only(case: Case) -> None:
    """The oracle's cache exactly and ``o`` off by a 1e-6 relative gain: under fp64-agreement
    ``cache`` passes and ``o`` fails and decides the row."""
    ref = ENTRY.oracle(case)
    run = lambda c: {"o": ref["o"] * (1 + 1e-6), "cache": ref["cache"].clone()}  # noqa: E731
    row = runner.verify(ENTRY, _impl(run, "fp64", FP64_RULE), case)
    assert row["status"] == FAIL and row["output"] == "o", row
    assert row["outputs"]["cache"]["status"] == PASS and row["outputs"]["o"]["status"] == FAIL


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16, "fp8_e4m3"])
def test_call_returns_what_the_same_dtype_baseline_stores(case: Case, dtype: torch.dtype | str) -> None:
    """``call`` on a form (which does not write the cache): ``cache`` is the live entries of the
    cache the form was given, bit for bit what the same-dtype baseline stores (an fp8 dtype:
    the per-token quantised cache, dequantised exactly) and, in fp64, the oracle's
    (fp64-agreement holds with 0 error). Dead positions are exact zeros."""
    out = ENTRY.call(mla.recurrent, case, dtype)
    assert_identical(out["cache"], ENTRY.baseline(case, dtype_name(dtype), "recurrent")["cache"])
    if dtype == torch.float64:
        assert_identical(out["cache"], ENTRY.oracle(case)["cache"])
    lens = case.params["lengths"]
    assert out["cache"].shape == (len(lens), max(lens), case.inputs["cache"].width)
    for b, n in enumerate(lens):
        assert not out["cache"][b, n:].any()
    assert torch.isfinite(out["cache"]).all()
    assert out["o"].shape == (*case.inputs["q_nope"].shape[:3], case.inputs["w_uv"].shape[-1])


def test_call_sees_what_a_cache_writing_kernel_leaves(case: Case) -> None:
    """A function that writes into the cache it is given shows its writes in ``cache`` (and
    fails there under fp64-agreement) without touching the case; one that returns a new cache
    as ``(o, cache)`` (here: the given one with one more token appended) is judged on that."""
    before = case.inputs["cache"].pool.clone()

    def writes_in_place(q_nope, q_pe, cache, w_uk, w_uv, **options):
        o = mla.recurrent(q_nope, q_pe, cache, w_uk, w_uv, **options)
        slots, _ = mla.cache.token_slots(cache)
        cache.pool.reshape(-1, cache.width)[slots[0, 3]] *= 1.01  # a live slot of request 0
        return o

    row = runner.verify(ENTRY, _impl(lambda c: ENTRY.call(writes_in_place, c, torch.float64), "fp64", FP64_RULE), case)
    assert row["status"] == FAIL and row["output"] == "cache" and row["outputs"]["o"]["status"] == PASS, row
    assert_identical(case.inputs["cache"].pool.nan_to_num(7.0), before.nan_to_num(7.0))

    def appends(q_nope, q_pe, cache, w_uk, w_uv, **options):
        o = mla.recurrent(q_nope, q_pe, cache, w_uk, w_uv, **options)
        return o, mla.append(cache, torch.zeros(cache.batch, 1, cache.width, dtype=cache.pool.dtype))

    grown = ENTRY.call(appends, case, torch.float64)["cache"]
    assert grown.shape[1] == max(case.params["lengths"]) + 1
    assert_identical(grown[:, :-1], ENTRY.oracle(case)["cache"])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float8_e4m3fn])
def test_users_kernel_passes_through_the_testing_api(dtype: torch.dtype) -> None:
    """``k3verify.testing.assert_matches_oracle`` on the tiled form with operands in the dtype
    (bf16 with an fp8 cache): every named output passes its rule (fp64-agreement in fp64,
    baseline otherwise) on the default and decode cases."""
    operands = "bf16" if dtype == torch.float8_e4m3fn else dtype
    rows = assert_matches_oracle(mla.tiled, "mla", dtype, ["default", "decode"], tile=16, operand_dtype=operands)
    assert all(set(r["outputs"]) == {"o", "cache"} for r in rows)


@given(sample=samples.strategy())
def test_drawn_samples_run_through_the_entry(sample) -> None:
    """Every drawn sample is a valid case: the oracle makes both outputs, the absorbed form agrees
    with it (fp64-agreement, through ``call``) and the cache output has the drawn lengths."""
    case = Case("drawn", sample[0], dict(sample[1]))
    row = runner.verify(ENTRY, _impl(lambda c: ENTRY.call(mla.recurrent, c, torch.float64), "fp64", FP64_RULE), case)
    assert row["status"] == PASS, row
    lengths = sample[1]["lengths"]
    assert ENTRY.oracle(case)["cache"].shape[:2] == (len(lengths), max(lengths))
