"""Stable LatentMoE sharded over 8 real ranks (gloo, one CPU thread each) against the unsharded
fp64 oracle.

Rules: fp64-agreement (the sharded fp64 forward and every rank's share against the unsharded
computation), baseline (bf16 sharded, with the all-reduce in fp32 and in bf16, against the
unsharded naive bf16 baseline), structural (planted placement bugs and a dead rank are named).
Starting eight ranks costs seconds on a two-core machine, so each launch runs several calls
(``run_calls``).
"""

from __future__ import annotations

import time

import pytest
import torch
from verdicts import assert_fp64_agrees, assert_identical

from k3verify import moe
from k3verify.harness.tp import RankFailure, disagreement, run_calls, run_ranks
from k3verify.moe import samples, sharded
from k3verify.numerics import FP64_AGREEMENT_REL, baseline_rule, compare, noise_floor

WORLD = 8
TARGET = "k3verify.moe.sharded:rank_forward"


@pytest.fixture(scope="module")
def case() -> tuple[torch.Tensor, moe.MoEWeights, moe.MoEConfig]:
    inputs, _ = samples.make_cases()["default"]
    return inputs["x"], inputs["weights"], inputs["config"]


@pytest.fixture(scope="module")
def runs(case) -> dict[str, list[dict[str, torch.Tensor]]]:
    """One launch: fp64, bf16 with the all-reduce in fp32 and in bf16, and the planted bug."""
    x, w, cfg = case
    variants = {"fp64": ("fp64", "fp64"), "bf16/fp32 reduce": ("bf16", "fp32"), "bf16/bf16 reduce": ("bf16", "bf16")}
    calls = [sharded.ShardedCall(x, w, cfg, dtype=d, reduce_dtype=r) for d, r in variants.values()]
    calls.append(sharded.ShardedCall(x, w, cfg, plant="norm_before_reduce"))
    return dict(zip([*variants, "norm_before_reduce"], run_calls(TARGET, WORLD, calls)))


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


def test_a_norm_before_the_all_reduce_is_named(case, runs) -> None:
    """The planted bug of the issue: RMSNorm applied to each rank's partial latent."""
    x, w, cfg = case
    ranks = runs["norm_before_reduce"]
    expected = [{"u sent": sharded.partials(sharded.ShardedCall(x, w, cfg), r, WORLD)["u"]} for r in range(WORLD)]
    found = disagreement(ranks, expected, FP64_AGREEMENT_REL)
    assert found is not None and found.startswith("rank 0: 'u sent' is "), found


def test_a_dead_rank_ends_the_run_with_its_name(case) -> None:
    x, w, cfg = case
    start = time.perf_counter()
    with pytest.raises(RankFailure, match=rf"rank {WORLD - 1} of {WORLD} died \(exit code 3\)"):
        run_ranks(TARGET, WORLD, sharded.ShardedCall(x, w, cfg, plant="die"), timeout_s=60)
    assert time.perf_counter() - start < 60  # well before the timeout: death is noticed, not waited out


def test_shard_refuses_a_split_that_does_not_divide(case) -> None:
    _, w, _ = case
    with pytest.raises(ValueError, match="expert hidden size 24 does not split over 5 ranks"):
        sharded.shard(w, 0, 5)


# --- Gated MLA: heads split, latent cache replicated, output projection all-reduced ---------------

MLA_TARGET = "k3verify.mla.sharded:rank_forward"


@pytest.fixture(scope="module")
def mla_case():
    from dataclasses import replace

    from k3verify import mla
    from k3verify.mla import layer

    cfg = replace(layer.MLAConfig.small(), num_heads=WORLD)  # one head per rank
    w = layer.init_weights(cfg, seed=7)
    x = torch.randn(2, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    cache = mla.allocate(2, 5, 4, cfg.cache_width, generator=torch.Generator().manual_seed(9))
    return x, w, cfg, cache, layer.forward(x, w, cfg, cache)


@pytest.fixture(scope="module")
def mla_runs(mla_case):
    from k3verify.mla import sharded as mla_sharded

    x, w, cfg, cache, _ = mla_case
    calls = [mla_sharded.ShardedCall(x, w, cfg, cache), mla_sharded.ShardedCall(x, w, cfg, cache, plant="split_latent")]
    return run_calls(MLA_TARGET, WORLD, calls)


def test_mla_fp64_sharded_equals_the_unsharded_layer(mla_case, mla_runs) -> None:
    *_, full = mla_case
    ranks = mla_runs[0]
    assert_fp64_agrees(ranks[0]["y"], full.y, "y, TP=8 against unsharded")
    # Replicated latents: every rank wrote the unsharded layer's cache entries.
    assert disagreement(ranks, [{"entries": full.entries}] * WORLD, FP64_AGREEMENT_REL) is None
    for r in ranks[1:]:
        assert_identical(r["y"], ranks[0]["y"], "y on another rank")


def test_mla_a_split_latent_projection_is_named(mla_case, mla_runs) -> None:
    """The planted bug: W_DKV split across ranks instead of replicated."""
    *_, full = mla_case
    found = disagreement(mla_runs[1], [{"entries": full.entries}] * WORLD, FP64_AGREEMENT_REL)
    assert found is not None and found.startswith("rank 0: 'entries' is "), found


# --- Block AttnRes: on the full-width stream after the all-reduce ----------------------------------


def test_attnres_every_rank_mixes_the_same() -> None:
    """Every rank's mixture equals the unsharded step (fp64-agreement) and the others' (bitwise:
    one all-reduce result, the same arithmetic on every rank of one run)."""
    from k3verify.attnres import samples as attnres_samples
    from k3verify.attnres import sharded as attnres_sharded

    inputs, _ = attnres_samples.aggregation_sample(9, 16, 64, logit_scale=8.0, seed=3)
    gen = torch.Generator().manual_seed(4)
    call = attnres_sharded.ShardedCall(inputs["sources"], inputs["w"], inputs["gamma"],
                                       torch.randn(16, 32, generator=gen, dtype=torch.float64),
                                       torch.randn(32, 64, generator=gen, dtype=torch.float64) / 32**0.5)  # fmt: skip
    ranks = run_ranks("k3verify.attnres.sharded:rank_forward", WORLD, call)
    assert disagreement(ranks, [{"h": attnres_sharded.unsharded(call)}] * WORLD, FP64_AGREEMENT_REL) is None
    for r, got in enumerate(ranks[1:], start=1):
        assert_identical(got["h"], ranks[0]["h"], f"rank {r}'s mixture")


# --- KDA: heads split, packed projection re-padded per rank, state per rank -----------------------


def _kda_heads(r: int, heads: int, K: int) -> tuple[slice, torch.Tensor]:
    """Rank ``r``'s heads (one per rank here) and its conv channels (q, k, v rows)."""
    width = heads * K
    rows = torch.cat([torch.arange(i * width + r * K, i * width + (r + 1) * K) for i in range(3)])
    return slice(r, r + 1), rows


@pytest.fixture(scope="module")
def kda_case():
    from k3verify.kda import layer

    cfg = layer.KDAConfig(hidden=112, heads=WORLD, head_dim=16, gate_rank=16)  # one head per rank
    full = layer.init_weights(cfg, seed=2)
    x = torch.randn(2, 70, cfg.hidden, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    y, state = layer.KDALayer(cfg, full).prefill(x)
    expected = []
    for r in range(WORLD):
        heads, rows = _kda_heads(r, cfg.heads, cfg.head_dim)
        expected.append({"conv": state.conv[:, rows], "recurrent": state.recurrent[:, heads]})
    return x, full, cfg, y, expected


def test_kda_fp64_sharded_equals_the_unsharded_layer(kda_case) -> None:
    from k3verify.kda import sharded as kda_sharded

    x, full, cfg, y, expected = kda_case
    calls = [kda_sharded.ShardedCall(x, full, cfg), kda_sharded.ShardedCall(x, full, cfg, plant="ignore_padding")]
    right, planted = run_calls("k3verify.kda.sharded:rank_forward", WORLD, calls)
    assert_fp64_agrees(right[0]["y"], y, "y, TP=8 against unsharded")
    # Each rank's conv and recurrent state are the unsharded layer's rows for its heads.
    assert disagreement(right, expected, FP64_AGREEMENT_REL) is None
    # The planted bug: the padded packed projection cut into equal column ranges.
    found = disagreement(planted, expected, FP64_AGREEMENT_REL)
    assert found is not None and found.startswith("rank 0: 'conv' is "), found


def test_kda_production_shard_sizes_come_from_the_sharded_weights() -> None:
    """6288 packed columns (6284 padded to a multiple of 16) and a [4608, 3] conv cache per rank
    at TP = 8, read off weights cut from full-size (meta) ones."""
    from k3verify.kda import layer
    from k3verify.kda import sharded as kda_sharded

    cfg = layer.KDAConfig.production()
    s = layer.local_shapes(cfg, 1)
    width = cfg.heads * cfg.head_dim

    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, device="meta", dtype=torch.bfloat16)

    full = layer.KDAWeights(w_packed=meta(cfg.hidden, s.padded_columns), w_fb=meta(cfg.gate_rank, width),
                            conv=meta(s.conv_channels, cfg.conv_size), a_log=meta(cfg.heads), dt_bias=meta(width),
                            norm=meta(cfg.head_dim), w_o=meta(width, cfg.hidden))  # fmt: skip
    mine = kda_sharded.shard(full, cfg, 3, 8)
    sizes = {"packed": mine.w_packed.shape[1], "conv cache": (mine.conv.shape[0], mine.conv.shape[1] - 1)}
    assert sizes == {"packed": 6288, "conv cache": (4608, 3)}, sizes
    assert mine.w_o.shape == (12 * 128, 7168) and mine.a_log.shape == (12,)
