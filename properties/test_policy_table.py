"""The policy as a value: ``numerics.policy.POLICY`` maps each rule name to the object that judges
one output, and every status is one member of ``Status``.

Rules: fp64-agreement for the fp64 rule's own cases, the baseline rule for the lower precisions
(each check names which). Each rule is shown to bite (a planted 1 % scale error, a changed
expert set) and not to cry wolf (correct outputs over drawn cases: 0 false failures).
"""

from __future__ import annotations

import json

import pytest
import torch

from k3verify.numerics import (
    BASELINE_RULE,
    FAIL,
    FP64_RULE,
    PASS,
    POLICY,
    RULES,
    STATUSES,
    Status,
    resolve_dtype,
    round_to,
    rule_for,
    supported_dtypes,
)

DRAWN = 40


def test_the_table_names_every_rule_a_row_can_name() -> None:
    assert RULES == tuple(POLICY) == (FP64_RULE, BASELINE_RULE)
    for name, rule in POLICY.items():
        assert rule.name == name
    for dtype in supported_dtypes():
        assert rule_for(dtype) in POLICY
    assert not POLICY[rule_for("fp64")].uses_baseline and POLICY[rule_for("bf16")].uses_baseline
    with pytest.raises(TypeError):
        POLICY["made-up"] = POLICY[FP64_RULE]  # type: ignore[index]


def test_every_status_is_its_string() -> None:
    assert STATUSES == (PASS, FAIL, Status.EXPECTED_NONFINITE, Status.UNAVAILABLE)
    for status in Status:
        assert status == status.value and f"{status}" == status.value and str(status) == status.value
        assert json.loads(json.dumps({"s": status})) == {"s": status.value}
        assert {status.value: 1}[status] == 1


def _drawn(seed: int) -> torch.Tensor:
    return torch.randn(4, 64, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_the_baseline_rule_passes_rounding_and_catches_a_scale_error(dtype: str) -> None:
    """Baseline rule: the oracle rounded to ``dtype`` (what a correct kernel at best returns) passes
    against a baseline that rounded the same way, on every drawn case; the same output 1 % off
    fails on every one."""
    rule = POLICY[rule_for(dtype)]
    for seed in range(DRAWN):
        ref = _drawn(seed)
        out = round_to(ref, dtype).to(torch.float32)
        base = round_to(ref, dtype).to(torch.float32)
        judged = rule.judge(out, ref, dtype=dtype, baseline=base, rms_n=ref.numel(), bias_n=ref.shape[0])
        assert judged.verdict.status == PASS, (seed, judged.verdict.reason)
        assert judged.baseline_metrics is not None and judged.metrics["n"] == ref.numel()
        off = rule.judge(round_to(ref * 1.01, dtype).to(torch.float32), ref, dtype=dtype, baseline=base,
                         rms_n=ref.numel(), bias_n=ref.shape[0])
        assert off.verdict.status == FAIL, (seed, off.verdict.reason)


@pytest.mark.parametrize(("declared", "stored"), [("bf16", "fp8_e5m2"), ("fp32", "fp8_e5m2"), ("fp32", "bf16"),
                                                  ("fp64", "fp8_e4m3")])
def test_an_output_stored_coarser_than_its_row_is_floored_at_the_rows_dtype(declared: str, stored: str) -> None:
    """Baseline rule, its noise floor: a kernel that returns the oracle rounded to a coarser format
    than its row declares (fp8 codes for a bf16 row) fails on every drawn case. Its floor is the
    row's dtype's, not the coarse one it chose to store in, which once let fp8 codes pass an fp32
    row. A row that declares the coarse format and stores finer (an fp8 run writing bf16) keeps
    the finer floor and passes with the oracle rounded to its storage."""
    rule = POLICY[BASELINE_RULE]
    for seed in range(DRAWN):
        ref = _drawn(seed)
        base = round_to(ref, declared).to(torch.float32 if declared != "fp64" else torch.float64)
        coarse = round_to(ref, stored).to(resolve_dtype(stored))
        judged = rule.judge(coarse, ref, dtype=declared, baseline=base, rms_n=ref.numel(), bias_n=ref.shape[0])
        assert judged.verdict.status == FAIL, (seed, judged.verdict.reason)
        fine = round_to(ref, declared).to(resolve_dtype(declared))
        kept = rule.judge(fine, ref, dtype=stored, baseline=round_to(ref, stored).float(), rms_n=ref.numel(),
                          bias_n=ref.shape[0])
        assert kept.verdict.status == PASS, (seed, kept.verdict.reason)


def test_the_baseline_rule_needs_its_baseline() -> None:
    with pytest.raises(ValueError, match="baseline"):
        POLICY[BASELINE_RULE].judge(_drawn(0).float(), _drawn(0), dtype="fp32")


def test_the_fp64_rule_passes_agreement_and_catches_a_drift() -> None:
    """fp64-agreement: a relative change of 1e-12 passes, one of 1e-9 fails, on every drawn case."""
    rule = POLICY[FP64_RULE]
    for seed in range(DRAWN):
        ref = _drawn(seed)
        assert rule.judge(ref * (1 + 1e-12), ref).verdict.status == PASS
        assert rule.judge(ref * (1 + 1e-9), ref).verdict.status == FAIL


def test_the_fp64_rule_refuses_a_lower_precision() -> None:
    with pytest.raises(TypeError, match="fp64 must stay fp64"):
        POLICY[FP64_RULE].judge(_drawn(0).float(), _drawn(0))


def test_discrete_outputs_are_judged_by_rows() -> None:
    """A discrete output (expert sets): fp64-agreement wants every row equal; the baseline rule
    allows k = 2 times the baseline's mismatched rows."""
    ref = torch.arange(40).reshape(10, 4)
    one_off = ref.clone()
    one_off[3, 0] = 99
    assert POLICY[FP64_RULE].judge(ref.clone(), ref).verdict.status == PASS
    assert POLICY[FP64_RULE].judge(one_off, ref).verdict.status == FAIL
    two_off = one_off.clone()
    two_off[5, 1] = 99
    three_off = two_off.clone()
    three_off[7, 2] = 99
    baseline = POLICY[BASELINE_RULE]
    assert baseline.judge(two_off, ref, dtype="bf16", baseline=one_off).verdict.status == PASS
    assert baseline.judge(three_off, ref, dtype="bf16", baseline=one_off).verdict.status == FAIL
    assert baseline.judge(one_off, ref, dtype="bf16", baseline=ref.clone()).verdict.status == FAIL
