"""Stable LatentMoE sharded over 8 real ranks (gloo, one CPU thread each) against the unsharded
fp64 oracle.

Rules: fp64-agreement (the sharded fp64 forward and every rank's share against the unsharded
computation), baseline (bf16 sharded, with the all-reduce in fp32 and in bf16, against the
unsharded naive bf16 baseline), structural (planted placement bugs and a dead rank are named).
Starting eight ranks costs seconds on a two-core machine, so each launch runs several calls.
"""

from __future__ import annotations

import time

import pytest
import torch
from verdicts import assert_fp64_agrees, assert_identical

from k3verify import moe
from k3verify.harness.tp import RankFailure, disagreement, run_ranks
from k3verify.moe import samples, sharded
from k3verify.numerics import FP64_AGREEMENT_REL, baseline_rule, compare, noise_floor

WORLD = 8
TARGET = "k3verify.moe.sharded:rank_forward_all"


@pytest.fixture(scope="module")
def case() -> tuple[torch.Tensor, moe.MoEWeights, moe.MoEConfig]:
    inputs, _ = samples.make_cases()["default"]
    return inputs["x"], inputs["weights"], inputs["config"]


@pytest.fixture(scope="module")
def runs(case) -> dict[str, list[dict[str, torch.Tensor]]]:
    """One launch: fp64, and bf16 with the all-reduce in fp32 and in bf16."""
    x, w, cfg = case
    variants = {"fp64": ("fp64", "fp64"), "bf16/fp32 reduce": ("bf16", "fp32"), "bf16/bf16 reduce": ("bf16", "bf16")}
    calls = [sharded.ShardedCall(x, w, cfg, dtype=d, reduce_dtype=r) for d, r in variants.values()]
    per_rank = run_ranks(TARGET, WORLD, calls)
    return {name: [ranks[i] for ranks in per_rank] for i, name in enumerate(variants)}


def test_fp64_sharded_equals_the_unsharded_oracle(case, runs) -> None:
    x, w, cfg = case
    ranks = runs["fp64"]
    assert_fp64_agrees(ranks[0]["y"], moe.recurrent(x, w, cfg), "y, TP=8 against unsharded")
    # Every rank's share is the unsharded computation restricted to its slice.
    expected = [sharded.partials(sharded.ShardedCall(x, w, cfg), r, WORLD) for r in range(WORLD)]
    assert disagreement(ranks, [{"u sent": e["u"], "y_s sent": e["y_s"]} for e in expected],
                        FP64_AGREEMENT_REL) is None  # fmt: skip
    for r in ranks[1:]:  # bitwise within one run: every rank holds the all-reduce's one result
        assert_identical(r["y"], ranks[0]["y"], "y on another rank")


@pytest.mark.parametrize("variant", ["bf16/fp32 reduce", "bf16/bf16 reduce"])
def test_bf16_sharded_within_policy(case, runs, variant: str) -> None:
    x, w, cfg = case
    ref = moe.recurrent(x, w, cfg)
    base = moe.naive_baseline(x, w, cfg, dtype="bf16")
    verdict = baseline_rule(compare(runs[variant][0]["y"], ref, ulp_dtype="bf16"), compare(base, ref, ulp_dtype="bf16"),
                            noise_floor(ref, torch.bfloat16))  # fmt: skip
    assert verdict.passed, f"{variant}: {verdict.reason}"


def test_a_norm_before_the_all_reduce_is_named(case) -> None:
    """The planted bug of the issue: RMSNorm applied to each rank's partial latent."""
    x, w, cfg = case
    (ranks,) = zip(*run_ranks(TARGET, WORLD, [sharded.ShardedCall(x, w, cfg, plant="norm_before_reduce")]))
    expected = [{"u sent": sharded.partials(sharded.ShardedCall(x, w, cfg), r, WORLD)["u"]} for r in range(WORLD)]
    found = disagreement(list(ranks), expected, FP64_AGREEMENT_REL)
    assert found is not None and found.startswith("rank 0: u sent differs"), found


def test_a_dead_rank_ends_the_run_with_its_name(case) -> None:
    x, w, cfg = case
    start = time.perf_counter()
    with pytest.raises(RankFailure, match=rf"rank {WORLD - 1} of {WORLD} died \(exit code 3\)"):
        run_ranks(TARGET, WORLD, [sharded.ShardedCall(x, w, cfg, plant="die")], timeout_s=60)
    assert time.perf_counter() - start < 60  # well before the timeout: death is noticed, not waited out


def test_shard_refuses_a_split_that_does_not_divide(case) -> None:
    _, w, _ = case
    with pytest.raises(ValueError, match="expert hidden size 24 does not split over 5 ranks"):
        sharded.shard(w, 0, 5)
