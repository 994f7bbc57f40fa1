"""The edges of the tolerance policy, and evidence that they are guarded.

The baseline rule is ``err <= k * err(baseline) + floor``, with ``k = 2`` and ``floor`` the
noise floor (what rounding the oracle's output to the dtype costs); a non-finite baseline grants
the floor alone. Each check below holds one of those facts at its edge: an error exactly at the
limit passes and the next double above it fails, an implementation that only rounds the oracle
passes on the floor alone, a non-finite baseline never widens the limit, a small output gets the
small-sample factor and a large one does not.

The second half is the evidence that the checks bite: hand-made changes of
``k3verify/numerics/policy.py`` (the mutants of :data:`MUTANTS`: the floor dropped, halved or
doubled, ``k`` changed, a non-finite baseline granting ``k x inf``, the small-output factor
dropped or misapplied) are loaded as modules beside
the real one, and every one of them must fail at least one check. A mutant whose text no longer
occurs in the policy fails too, so the list cannot go stale silently.

Rules: the policy's own definition (DESIGN.md, numerical policy), checked at its edges.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

from k3verify.numerics import policy
from k3verify.numerics.metrics import Metrics, compare

POLICY = Path(policy.__file__)
DESIGN_K = 2.0  # DESIGN.md: k = 2, FlashAttention's rule


def _ref() -> torch.Tensor:
    return torch.randn(4096, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def _at_rms(ref: torch.Tensor, rms_ratio: float, seed: int) -> torch.Tensor:
    """``ref`` plus noise whose ``rms(noise) / rms(ref)`` is ``rms_ratio`` exactly (in fp64)."""
    noise = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return ref + noise * (rms_ratio * ref.norm() / noise.norm())


def _metrics_with(m: Metrics, **changes: float) -> Metrics:
    return dataclasses.replace(m, **changes)


# --- the checks: each takes a policy module -----------------------------------------------------


def check_limit_is_k_baseline_plus_floor(p: ModuleType) -> None:
    """The limit is ``2 * err(baseline) + floor``, to the last bit: an error at the limit passes,
    the next double above fails."""
    ref = _ref()
    base = compare(_at_rms(ref, 3e-3, 1), ref, ulp_dtype="bf16")
    floor = p.noise_floor(ref, "bf16")
    limit = DESIGN_K * base.rms_ratio + floor
    at = p.baseline_rule(_metrics_with(base, rms_ratio=limit), base, floor)
    above = p.baseline_rule(_metrics_with(base, rms_ratio=math.nextafter(limit, math.inf)), base, floor)
    assert at.status == p.PASS and at.limit == limit and at.margin == 0.0, at
    assert above.status == p.FAIL, above


def check_rounded_oracle_passes_on_the_floor_alone(p: ModuleType) -> None:
    """An implementation that returns the oracle rounded to bf16 beats no baseline, but it is as
    good as bf16 can be: with an exact baseline (error 0) it passes on the floor alone."""
    ref = _ref()
    exact = compare(ref, ref, ulp_dtype="bf16")
    rounded = compare(ref.to(torch.bfloat16), ref, ulp_dtype="bf16")
    floor = p.noise_floor(ref, "bf16")
    assert rounded.rms_ratio == floor > 0
    verdict = p.baseline_rule(rounded, exact, floor)
    assert verdict.status == p.PASS and verdict.limit == floor, verdict


def check_twice_the_floor_fails(p: ModuleType) -> None:
    """Error of 1.5 floors with an exact baseline fails: the floor is an allowance, not a scale."""
    ref = _ref()
    exact = compare(ref, ref, ulp_dtype="bf16")
    floor = p.noise_floor(ref, "bf16")
    verdict = p.baseline_rule(compare(_at_rms(ref, 1.5 * floor, 2), ref, ulp_dtype="bf16"), exact, floor)
    assert verdict.status == p.FAIL, verdict


def check_a_nonfinite_baseline_grants_the_floor_only(p: ModuleType) -> None:
    """A baseline that overflowed (inf metrics, or a NaN error) grants no ``k x`` allowance: an
    implementation far above the floor fails, one within it passes, and the limit is the floor."""
    ref = _ref()
    floor = p.noise_floor(ref, "bf16")
    overflowed = ref.clone()
    overflowed[7] = math.inf
    base_inf = compare(overflowed, ref, ulp_dtype="bf16")
    base_nan = _metrics_with(compare(ref, ref, ulp_dtype="bf16"), rms_ratio=math.nan)
    assert base_inf.nonfinite == 1
    for base in (base_inf, base_nan):
        bad = p.baseline_rule(compare(_at_rms(ref, 0.1, 3), ref, ulp_dtype="bf16"), base, floor)
        good = p.baseline_rule(compare(ref.to(torch.bfloat16), ref, ulp_dtype="bf16"), base, floor)
        assert bad.status == p.FAIL and bad.limit == floor, bad
        assert good.status == p.PASS and good.limit == floor, good


def check_a_small_output_gets_the_small_sample_factor(p: ModuleType) -> None:
    """An 8-element output 3.56x its baseline's error (the pinned MLA case below) passes: two
    RMS of 8 normal errors differ by more than 8.68x once in a million draws. The same ratio on
    4096 elements fails: there the factor is 2."""
    ref = _ref()
    for n, status in ((8, p.PASS), (4096, p.FAIL)):
        base = _metrics_with(compare(_at_rms(ref, 1e-7, 4), ref, ulp_dtype="fp32"), n=n, rms_ratio=1.021e-7)
        impl = _metrics_with(base, rms_ratio=3.634e-7)
        verdict = p.baseline_rule(impl, base, 3.437e-8)
        assert verdict.status == status, (n, verdict)
    assert p.small_output_k(8) == pytest.approx(8.68, abs=0.01) and p.small_output_k(52) == DESIGN_K


def check_a_nonfinite_output_fails(p: ModuleType) -> None:
    ref = _ref()
    out = ref.clone()
    out[0] = math.nan
    base = compare(ref, ref, ulp_dtype="bf16")
    assert p.baseline_rule(compare(out, ref, ulp_dtype="bf16"), base, math.inf).status == p.FAIL


CHECKS: list[Callable[[ModuleType], None]] = [
    check_limit_is_k_baseline_plus_floor,
    check_rounded_oracle_passes_on_the_floor_alone,
    check_twice_the_floor_fails,
    check_a_nonfinite_baseline_grants_the_floor_only,
    check_a_nonfinite_output_fails,
    check_a_small_output_gets_the_small_sample_factor,
]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_the_policy_holds_at_its_edges(check: Callable[[ModuleType], None]) -> None:
    check(policy)


# --- the mutants: each must fail a check ----------------------------------------------------------

# (name, text in policy.py, its replacement)
MUTANTS = [
    ("floor dropped", "limit = base_term + floor", "limit = base_term"),
    ("floor halved", "limit = base_term + floor", "limit = base_term + 0.5 * floor"),
    ("floor doubled", "limit = base_term + floor", "limit = base_term + 2 * floor"),
    ("floor scaled by 1.01", "limit = base_term + floor", "limit = base_term + 1.01 * floor"),
    ("k = 3", "BASELINE_K = 2.0", "BASELINE_K = 3.0"),
    ("non-finite baseline grants k x inf", "if baseline.nonfinite or not math.isfinite(base):", "if False:"),
    ("NaN baseline error grants k x NaN", "if baseline.nonfinite or not math.isfinite(base):",
     "if baseline.nonfinite:"),
    ("non-finite baseline grants k x its error", "base_term, note = 0.0, \" (baseline non-finite: floor only)\"",
     "base_term, note = k * 1e3, \"\""),
    ("non-finite output judged by its error", "if impl.nonfinite:", "if False:"),
    ("floor from a coarser dtype", "compare(round_to(r64, dtype), r64, ulp_dtype=dtype)",
     "compare(round_to(r64, 'fp8_e4m3'), r64, ulp_dtype=dtype)"),
    ("small-output factor dropped", "    k = small_output_k(impl.n, k)\n", ""),
    ("small-output factor at every size", "k = small_output_k(impl.n, k)", "k = small_output_k(8, k)"),
    ("small-output tail 1e-3", "SMALL_OUTPUT_ALPHA = 1e-6", "SMALL_OUTPUT_ALPHA = 1e-3"),
    ("< in place of <=", "ok = err <= limit\n    reason = f\"{metric}", "ok = err < limit\n    reason = f\"{metric}"),
]


def _mutant(replace: str, by: str) -> ModuleType:
    source = POLICY.read_text()
    assert source.count(replace) == 1, f"the mutant's text no longer occurs once in {POLICY.name}: {replace!r}"
    name = "k3verify.numerics._policy_mutant"
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "k3verify.numerics"  # its relative imports resolve to the real numerics
    sys.modules[name] = module
    try:
        exec(compile(source.replace(replace, by), f"<{POLICY.name} mutant>", "exec"), module.__dict__)
    finally:
        del sys.modules[name]
    return module


@pytest.mark.parametrize(("name", "replace", "by"), MUTANTS, ids=[m[0] for m in MUTANTS])
def test_every_policy_mutant_fails_a_check(name: str, replace: str, by: str) -> None:
    mutant = _mutant(replace, by)
    failed = []
    for check in CHECKS:
        try:
            check(mutant)
        except AssertionError:
            failed.append(check.__name__)
    assert failed, f"the policy mutant {name!r} passes every edge check"


def test_the_unmutated_copy_passes_every_check() -> None:
    """The mutants are loaded the same way as this copy: what fails them is the change alone."""
    copy = _mutant("BASELINE_K = 2.0", "BASELINE_K = 2.0")
    for check in CHECKS:
        check(copy)


# --- the small-output factor, against what is known of it -------------------------------------


def test_the_small_output_factor_meets_its_closed_forms() -> None:
    """For n = 1 and 2 the tail has a closed form: ``P(|X/Y| > c) = (2/pi) atan(1/c)`` for one
    normal each, and ``1 / (1 + c^2)`` for the ratio of two chi-squared of 2 (an F(2, 2))."""
    alpha = policy.SMALL_OUTPUT_ALPHA
    assert policy.small_output_k(1) == pytest.approx(1 / math.tan(math.pi * alpha / 2), rel=1e-6)
    assert policy.small_output_k(2) == pytest.approx(math.sqrt(1 / alpha - 1), rel=1e-6)


@pytest.mark.parametrize("n", [3, 8, 20])
def test_the_small_output_tail_matches_a_simulation(n: int) -> None:
    """The tail function at a probability a simulation can see (about 1 %): 200 000 draws of two
    sets of n normals; the simulated frequency is within 4 standard errors of the integral."""
    gen = torch.Generator().manual_seed(n)
    e = torch.randn(2, 200_000, n, generator=gen, dtype=torch.float64)
    ratio = e[0].pow(2).mean(-1).sqrt() / e[1].pow(2).mean(-1).sqrt()
    c = float(ratio.quantile(0.99))
    p = policy._ratio_tail(n, c)
    assert abs(p - 0.01) < 4 * math.sqrt(0.01 * 0.99 / 200_000), (n, c, p)


def test_the_pinned_drawn_mla_case_passes() -> None:
    """The reproduction: a drawn MLA case with an 8-element output, on which the correct fp32
    definition measured 3.56x its baseline's error and failed the rule at k = 2."""
    from k3verify.harness import registry, runner
    from k3verify.harness.registry import Case
    from k3verify.mla.samples import random_inputs

    shape = dict(T=2, H=1, Dr=2, Dv=4, page_size=4, seed=200)
    entry = registry.get("mla")
    impl = next(i for i in entry.own_implementations() if i.form == "recurrent" and i.dtype == "fp32")
    row = runner.verify(entry, impl, Case("pinned", random_inputs([3], **shape), dict(shape, contexts=[3])))
    o = row["outputs"]["o"]
    assert o["metrics"]["n"] == 8 and o["verdict"]["err"] > 3 * o["verdict"]["baseline_err"]
    assert row["status"] == policy.PASS, o["verdict"]["reason"]
