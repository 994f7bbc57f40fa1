"""The numerics core: dtype facts, rounding emulation, metrics and the tolerance policy.

Rules: rounding is checked bit for bit (exact equality) against the reference rounding, which
itself is derived from torch.finfo facts; metrics and verdicts are checked on constructed
inputs whose answers follow from their definitions.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from verdicts import assert_identical

from k3verify.numerics import (
    EXPECTED_NONFINITE,
    FAIL,
    PASS,
    baseline_rule,
    compare,
    expected_nonfinite,
    facts,
    fp64_agreement,
    noise_floor,
    resolve_dtype,
    round_to,
    round_to_reference,
    spacing,
    supported_dtypes,
)
from k3verify.numerics.ops import PREFIX_ORDERS, prefix_sum

NARROW = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2")


@pytest.mark.parametrize("name", supported_dtypes())
def test_facts_come_from_finfo(name: str) -> None:
    f = facts(name)
    fi = torch.finfo(f.dtype)
    assert f.max == fi.max and f.eps == fi.eps and f.smallest_normal == fi.smallest_normal
    assert f.unit_roundoff == fi.eps / 2
    assert math.isclose(f.ln_max, math.log(fi.max))
    assert math.frexp(f.max)[1] - 1 == f.emax
    # The largest value is representable and the next binade step past it is not.
    assert torch.tensor(f.max, dtype=torch.float64).to(f.dtype).double().item() == f.max


def test_e4m3fn_has_no_infinity() -> None:
    assert not facts("fp8_e4m3").has_inf
    assert all(facts(n).has_inf for n in ("bf16", "fp16", "fp8_e5m2", "fp32"))


def _all_finite_values(dtype: torch.dtype) -> torch.Tensor:
    bits = facts(dtype).bits
    raw = torch.arange(0, 256, dtype=torch.uint8) if bits == 8 else torch.arange(-(2**15), 2**15, dtype=torch.int16)
    vals = raw.view(dtype).to(torch.float64)
    return torch.unique(vals[torch.isfinite(vals)])


def _boundary_probes(dtype: torch.dtype) -> torch.Tensor:
    """Every representable value, every midpoint (tie) and the fp32 neighbours of each tie."""
    vals = _all_finite_values(dtype)
    mids = ((vals[1:] + vals[:-1]) / 2).float()
    f = facts(dtype)
    beyond = torch.tensor(
        [f.overflow_threshold, f.max * 1.5, 1e30, -f.overflow_threshold, float("inf"), -float("inf"), float("nan")],
        dtype=torch.float32,
    )
    probes = [
        vals.float(),
        mids,
        torch.nextafter(mids, torch.tensor(math.inf)),
        torch.nextafter(mids, torch.tensor(-math.inf)),
        beyond,
    ]
    return torch.cat(probes)


@pytest.mark.parametrize("name", NARROW)
@pytest.mark.parametrize("overflow", ["nonfinite", "saturate"])
def test_fast_rounding_matches_reference_at_every_tie(name: str, overflow: str) -> None:
    x = _boundary_probes(resolve_dtype(name))
    fast = round_to(x, name, overflow=overflow)
    ref = round_to_reference(x, name, overflow=overflow)
    same = (fast == ref) | (torch.isnan(fast) & torch.isnan(ref))
    assert bool(same.all()), f"{int((~same).sum())} mismatches, first at {x[~same][:4].tolist()}"


def _fp64_probes(dtype: torch.dtype) -> torch.Tensor:
    """In fp64: every representable value of ``dtype``, every tie, the fp64 neighbours of each tie,
    the overflow edge's neighbours, and 20,000 seeded random bit patterns (every exponent, NaNs
    and infinities among them)."""
    vals = _all_finite_values(dtype)
    mids = (vals[1:] + vals[:-1]) / 2  # exact in fp64
    f = facts(dtype)
    edge = torch.tensor([f.overflow_threshold, -f.overflow_threshold, f.max, f.smallest_normal], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    noise = torch.randint(-(2**63), 2**63 - 1, (20_000,), generator=gen, dtype=torch.int64).view(torch.float64)
    inf, ninf = torch.tensor(math.inf, dtype=torch.float64), torch.tensor(-math.inf, dtype=torch.float64)
    near = [torch.nextafter(t, inf) for t in (mids, edge)] + [torch.nextafter(t, ninf) for t in (mids, edge)]
    return torch.cat([vals, mids, edge, *near, noise])


@pytest.mark.parametrize("name", NARROW)
@pytest.mark.parametrize("overflow", ["nonfinite", "saturate"])
def test_fp64_rounding_matches_reference_at_every_tie(name: str, overflow: str) -> None:
    """Rule: bit for bit. round_to's fp64 path (integer rounding of the bit pattern where the
    result is normal) against the reference, signs of zeros included."""
    x = _fp64_probes(resolve_dtype(name))
    fast = round_to(x, name, overflow=overflow)
    ref = round_to_reference(x, name, overflow=overflow)
    same = ((fast == ref) & (torch.signbit(fast) == torch.signbit(ref))) | (torch.isnan(fast) & torch.isnan(ref))
    assert bool(same.all()), f"{int((~same).sum())} mismatches, first at {x[~same][:4].tolist()}"


def test_reference_rounds_fp64_once() -> None:
    """1 + 2^-8 + 2^-40 is above the bf16 tie; rounding through fp32 first would hit the tie."""
    x = torch.tensor([1 + 2**-8 + 2**-40], dtype=torch.float64)
    assert round_to(x, "bf16").item() == 1 + 2**-7
    assert round_to(x.float(), "bf16").item() == 1.0


def test_overflow_policies() -> None:
    x = torch.tensor([447.0, 464.0, 465.0, 1e6, float("inf")])
    assert round_to(x, "fp8_e4m3", overflow="saturate").tolist() == [448.0, 448.0, 448.0, 448.0, 448.0]
    nf = round_to(x, "fp8_e4m3")
    assert nf[:2].tolist() == [448.0, 448.0] and bool(torch.isnan(nf[2:]).all())
    assert bool(torch.isinf(round_to(torch.tensor([65520.0]), "fp16")).all())  # the tie goes up
    assert round_to(torch.tensor([65519.0]), "fp16").item() == 65504.0


@given(st.floats(-1e6, 1e6, allow_nan=False, width=32), st.sampled_from(NARROW))
def test_rounding_is_idempotent_and_nearest(x: float, name: str) -> None:
    t = torch.tensor([x], dtype=torch.float64)
    r = round_to(t, name)
    if torch.isfinite(r).all():
        assert_identical(round_to(r, name), r)
        assert abs(r.item() - x) <= spacing(r, name).item() / 2


def test_spacing() -> None:
    assert spacing(torch.tensor([1.0]), "bf16").item() == 2**-7
    assert spacing(torch.tensor([0.0]), "fp16").item() == facts("fp16").smallest_subnormal
    assert spacing(torch.tensor([300.0]), "fp8_e4m3").item() == 32.0


def test_metrics_from_definitions() -> None:
    ref = torch.linspace(1, 2, 100, dtype=torch.float64)
    assert compare(ref, ref, ulp_dtype="bf16").rms_ratio == 0.0
    zero = compare(torch.zeros_like(ref), ref, ulp_dtype="bf16")
    assert zero.rms_ratio == 1.0 and zero.one_minus_cos == 1.0
    one_ulp = ref + spacing(ref, "bf16")
    m = compare(one_ulp, ref, ulp_dtype="bf16")
    assert m.ulp_max == 1.0 and m.ulp_mean == 1.0
    bad = ref.clone()
    bad[3] = float("nan")
    assert compare(bad, ref, ulp_dtype="bf16").nonfinite == 1
    with pytest.raises(ValueError, match="shape"):
        compare(ref[:5], ref, ulp_dtype="bf16")


def test_baseline_rule_rejects_an_all_zero_output() -> None:
    ref = torch.randn(1000, dtype=torch.float64)
    base = compare(round_to(ref, "bf16") * (1 + 2**-8), ref, ulp_dtype="bf16")
    floor = noise_floor(ref, "bf16")
    assert baseline_rule(compare(torch.zeros_like(ref), ref, ulp_dtype="bf16"), base, floor).status == FAIL
    exact = baseline_rule(compare(ref, ref, ulp_dtype="bf16"), base, floor)
    assert exact.status == PASS and exact.margin == 1.0


def test_fp64_agreement_rule() -> None:
    ref = torch.randn(50, dtype=torch.float64)
    assert fp64_agreement(ref * (1 + 1e-12), ref).status == PASS
    assert fp64_agreement(ref * (1 + 1e-8), ref).status == FAIL
    with pytest.raises(TypeError, match="fp64"):
        fp64_agreement(ref.float(), ref)


def test_expected_nonfinite_verdicts() -> None:
    ref = torch.ones(4, dtype=torch.float64)
    inf = compare(torch.full((4,), math.inf), ref, ulp_dtype="bf16")
    ok = compare(ref, ref, ulp_dtype="bf16")
    assert expected_nonfinite(inf, predicted_finite=False, explanation="x").status == EXPECTED_NONFINITE
    assert expected_nonfinite(ok, predicted_finite=False, explanation="x").status == FAIL
    assert expected_nonfinite(inf, predicted_finite=True, explanation="x").status == FAIL
    assert expected_nonfinite(ok, predicted_finite=True, explanation="x") is None


def test_unknown_dtype_is_named() -> None:
    with pytest.raises(ValueError, match="int4"):
        resolve_dtype("int4")


def test_the_test_helpers_say_what_differs() -> None:
    """Rule: structural. The shared assertions fail with the mismatch count, the greatest
    difference and its index, not a bare ``assert False``."""
    from verdicts import assert_rel_within

    a = torch.zeros(3, 4, dtype=torch.float64)
    b = a.clone()
    b[2, 1] = 1e-3
    with pytest.raises(AssertionError, match=r"state: not bitwise identical; 1 of 12 elements differ; "
                                             r"greatest difference 1\.000e-03 at \(2, 1\)"):  # fmt: skip
        assert_identical(a, b, "state")
    with pytest.raises(AssertionError, match=r"shapes differ: \[3, 4\] vs \[4, 3\]"):
        assert_identical(a, b.T)
    with pytest.raises(AssertionError, match=r"relative max error 1\.000e\+00 > 1\.0e-10; .* at \(2, 1\)"):
        assert_rel_within(a, b, 1e-10)
    assert_identical(a, a.clone())
    assert_rel_within(b, b.clone(), 0.0)


@given(n=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_prefix_sum_orders(n: int, seed: int) -> None:
    """Rule: bitwise where no rounding happens (every order on small integers, fp64 kept
    fp64), and each ``rounded`` prefix within half an fp32 ulp of the exact sum (``math.fsum``;
    the bound allows the fp64 step's own half ulp); ``sequential`` one add after another."""
    gen = torch.Generator().manual_seed(seed)
    ints = torch.randint(-50, 50, (n, 3), generator=gen).float()
    for order in PREFIX_ORDERS:
        assert_identical(prefix_sum(ints, 0, order), ints.cumsum(0))
        assert prefix_sum(ints.double(), 0, order).dtype == torch.float64
    x = -5 * torch.rand(3, n, generator=gen)
    exact = torch.tensor([[math.fsum(row[: i + 1].tolist()) for i in range(n)] for row in x], dtype=torch.float64)
    error = (prefix_sum(x, 1, "rounded").double() - exact).abs()
    assert bool((error <= 0.5 * spacing(exact, "fp32") * (1 + 2.0**-28)).all()), f"max error {error.max():.3g}"
    running, seq = x[:, 0], [x[:, 0]]
    for i in range(1, n):
        running = running + x[:, i]
        seq.append(running)
    assert_identical(prefix_sum(x, 1, "sequential"), torch.stack(seq, 1))


def test_prefix_sum_names_a_bad_order() -> None:
    with pytest.raises(ValueError, match="unknown prefix order 'tree'; choose one of rounded, sequential, parallel"):
        prefix_sum(torch.zeros(4), 0, "tree")


@pytest.mark.parametrize("shape", [(40, 7), (5, 3, 4), (1, 200), (300,)])
@given(st.data())
def test_a_large_tensor_is_checked_finite_in_parts_with_the_same_verdict(shape, data) -> None:
    """Rule: structural. ``require_finite`` scans a tensor larger than its part size slice by
    slice (a K3 expert matrix's whole mask needed 9.2 GiB): finite passes, and a tensor with
    non-finite values gets the message a whole-tensor scan gives (count, first index)."""
    from k3verify.numerics import validate

    t = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    places = data.draw(st.lists(st.integers(0, t.numel() - 1), max_size=4, unique=True))
    for i, place in enumerate(places):
        t.view(-1)[place] = (float("nan"), float("inf"), -float("inf"))[i % 3]

    def message() -> str | None:
        try:
            validate.require_finite("w", t)
        except ValueError as exc:
            return str(exc)
        return None

    whole = message()
    with mock.patch.object(validate, "FINITE_SCAN", 16):
        assert len(validate._parts(t)) > 1 or t.shape[0] == 1
        assert message() == whole
    assert (whole is None) == (not places)
    if places:
        first = tuple(int(i) for i in (~torch.isfinite(t)).nonzero()[0])
        assert whole == f"w has {len(places)} non-finite value(s) (first at index {first})"


def test_all_hold_raises_the_first_failing_checks_own_error() -> None:
    """Rule: structural. The flags are read together; the full check of the first flag that does
    not hold names the problem (later failing checks are not reached); a flag that says a check
    fails while its full check passes is a defect, named as one."""
    from k3verify.numerics import validate

    called: list[str] = []

    def full(name: str, fails: bool):
        def check() -> None:
            called.append(name)
            if fails:
                raise ValueError(f"{name} is wrong")

        return check

    yes, no = torch.tensor(True), torch.tensor(False)
    validate.all_hold([(yes, full("a", False)), (yes, full("b", False))])
    assert called == []
    with pytest.raises(ValueError, match="b is wrong"):
        validate.all_hold([(yes, full("a", True)), (no, full("b", True)), (no, full("c", True))])
    assert called == ["b"]
    with pytest.raises(RuntimeError, match="disagree"):
        validate.all_hold([(no, full("d", False))])
    assert bool(validate.finite(torch.ones(3, 2))) and not bool(validate.finite(torch.tensor([1.0, float("nan")])))


@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=300),
       st.sampled_from([0.0, 0.5, 0.9, 0.99, 1.0]))  # fmt: skip
def test_the_p99_selection_is_torch_quantile_bit_for_bit(values: list[float], q: float) -> None:
    """Rule: same-process bitwise. ``metrics.quantile`` (two selections) equals ``torch.quantile``
    (a sort) exactly, ties and single values included: the ``ulp_p99`` of every report is unchanged."""
    from k3verify.numerics.metrics import quantile

    v = torch.tensor(values, dtype=torch.float64)
    assert quantile(v, q) == float(torch.quantile(v, q))


def test_a_stamp_holds_for_its_tensor_until_it_is_written() -> None:
    """Structural: the identity every cache of unchanged inputs keys on (held casts, parameters
    checked finite, a plugin process's kept inputs). Another object with equal values, an
    in-place write, and a tensor with no version counter (inference mode) are not the stamped
    tensor unchanged."""
    from k3verify.numerics.tensors import Stamp

    t = torch.ones(4)
    stamp = Stamp.of(t)
    assert stamp is not None and stamp.holds(t) and not stamp.holds(t.clone())
    t.add_(0.0)
    assert not stamp.holds(t)
    with torch.inference_mode():
        frozen = torch.ones(4)
    assert Stamp.of(frozen) is None
    assert not stamp.holds(frozen)
