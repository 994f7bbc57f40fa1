"""The real losses the false-alarm sweep found, pinned (``k3verify.harness.selftest.FINDINGS``).

Each is one of our own forms failing the baseline rule on one drawn case, because its design
loses precision there: not a false alarm of the rule. Each row must still fail, its
``explanation`` must name the mechanism (an operand of the diagonal tile's split in the subnormal
range; logits stored in bf16; the rounding that holds a gradient's error; a peer's own
arithmetic, measured against ours on the same inputs), and the same form without the lossy
choice must pass on that case. A fix of a form turns its test red, so the pin goes with the fix.

Rules: baseline (the row's own family, in its dtype); the explanation is the form's trace.
"""

from __future__ import annotations

import dataclasses

import pytest

from k3verify.adapters import fla as fla_adapter
from k3verify.harness import registry, runner, selftest

# finding label -> the same form without the lossy choice, which passes on the pinned case
CLEAN = {
    "kda/k3verify:tiled[bf16 chunk_size=64 tile=32 anchor=tile_start]":
        "kda/k3verify:tiled[bf16 chunk_size=64 tile=16 anchor=row0_shift]",
    "kda/k3verify:tiled[fp16 chunk_size=64 tile=16 anchor=tile_start]":
        "kda/k3verify:tiled[bf16 chunk_size=64 tile=16 anchor=tile_start]",
    "attnres/k3verify:tiled[bf16 tile=4 logit_dtype=bf16]": "attnres/k3verify:tiled[bf16 tile=4]",
    f"kda_backward/fla-core {fla_adapter.version() or '(missing)'}:chunkwise (autograd)[fp32]":
        "kda_backward/k3verify:chunkwise[fp32 chunk_size=64]",
}


@pytest.mark.parametrize("finding", selftest.FINDINGS, ids=lambda f: f.label)
def test_a_pinned_finding_still_fails_and_is_explained(finding: selftest.Finding) -> None:
    entry = registry.get(finding.module)
    case = finding.case()
    impls = {i.label: i for i in entry.own_implementations()}
    row = runner.verify(entry, impls[finding.label], case)
    assert row["status"] == "fail", row.get("verdict")
    assert any(finding.mechanism in line for line in row.get("explanation", [])), row.get("explanation")
    assert runner.verify(entry, impls[CLEAN[finding.label]], case)["status"] == "pass"


def test_every_finding_has_a_clean_counterpart() -> None:
    assert {f.label for f in selftest.FINDINGS} == set(CLEAN)


def test_a_failure_of_a_finding_form_without_its_mechanism_is_a_false_alarm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep files a failure under a finding only when the row's explanation names the
    finding's mechanism: with the explanation silenced, the pinned fp16 case counts as a failure."""
    finding = selftest.FINDINGS[1]
    entry = registry.get(finding.module)
    (impl,) = [i for i in entry.own_implementations() if i.label == finding.label]
    quiet = dataclasses.replace(impl, explain=lambda case: [])
    monkeypatch.setattr(registry, "get", lambda name: dataclasses.replace(entry, own_implementations=lambda: [quiet],
                                                                          make_cases=lambda seed: {}))
    monkeypatch.setattr(selftest, "drawn_cases", lambda module, n, seed=0: [finding.case()])
    result = selftest.sweep(finding.module, 1)
    assert len(result.failures) == 1 and not result.findings, result
    monkeypatch.setattr(registry, "get", lambda name: dataclasses.replace(entry, own_implementations=lambda: [impl],
                                                                          make_cases=lambda seed: {}))
    result = selftest.sweep(finding.module, 1)
    assert len(result.findings) == 1 and not result.failures, result
