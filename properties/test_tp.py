"""Every module sharded over 8 real ranks (gloo, one CPU thread each) against the unsharded
fp64 oracle.

Rules: fp64-agreement (the sharded fp64 forward and every rank's share against the unsharded
computation), baseline (bf16 sharded, with the all-reduce in fp32 and in bf16, against the
unsharded layer storing bf16: the rows of ``k3verify run --tp 8``), structural (planted
placement bugs and a dead rank are named). Starting eight ranks costs seconds on a two-core
machine, so each launch runs several calls (``run_calls``).
"""

from __future__ import annotations

import time

import pytest
import torch
from verdicts import assert_fp64_agrees, assert_identical

from k3verify import moe
from k3verify.harness import registry, runner
from k3verify.harness.tp import RankFailure, disagreement, run_calls, run_ranks
from k3verify.harness.tp_rows import TPOptions
from k3verify.moe import samples, sharded
from k3verify.numerics import FP64_AGREEMENT_REL, PASS

WORLD = 8
TARGET = "k3verify.moe.sharded:rank_forward"


@pytest.fixture(scope="module")
def case() -> tuple[torch.Tensor, moe.MoEWeights, moe.MoEConfig]:
    inputs, _ = samples.make_cases()["default"]
    return inputs["x"], inputs["weights"], inputs["config"]


@pytest.fixture(scope="module")
def runs(case) -> dict[str, list[dict[str, torch.Tensor]]]:
    """One launch: fp64 and the planted bug (the bf16 variants are the run's rows, below)."""
    x, w, cfg = case
    calls = [sharded.ShardedCall(x, w, cfg), sharded.ShardedCall(x, w, cfg, plant="norm_before_reduce")]
    return dict(zip(["fp64", "norm_before_reduce"], run_calls(TARGET, WORLD, calls)))


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
    from k3verify.attnres import sharded as attnres_sharded

    call = attnres_sharded.make_call("small", 3, WORLD)
    ranks = run_ranks("k3verify.attnres.sharded:rank_forward", WORLD, call)
    assert disagreement(ranks, [attnres_sharded.unsharded(call)] * WORLD, FP64_AGREEMENT_REL) is None
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


# --- the rows of `k3verify run --tp 8` -----------------------------------------------------------


def test_run_tp_rows_pass() -> None:
    """Three rows per module from one launch: fp64 within fp64-agreement of the unsharded fp64
    layer, bf16 with an fp32 and a bf16 all-reduce within the baseline rule against the
    unsharded bf16 layer; every row names its world size and backend. (MoE here; ``nox -s
    tests`` runs every module's rows and compares them with ``reports/baseline/cpu-tp8``.)"""
    entries = registry.select(["moe"])
    rows = list(runner.run(entries, tp=TPOptions(WORLD)))
    got = {(r["module"], r["dtype"], r["params"]["reduce"]): r for r in rows}
    assert sorted(got) == sorted((e.name, d, red) for e in entries
                                 for d, red in (("fp64", "fp64"), ("bf16", "fp32"), ("bf16", "bf16"))), sorted(got)
    for (module, dtype, reduce), row in got.items():
        assert row["status"] == PASS, f"{module} {dtype}/{reduce}: {row.get('reason') or row['verdict']}"
        assert row["params"]["tp"] == WORLD and row["params"]["backend"] == "gloo"
        if dtype == "fp64":
            assert row["rule"] == "fp64-agreement" and row["verdict"]["err"] <= FP64_AGREEMENT_REL, row["verdict"]
        else:
            assert row["rule"] == "baseline" and "baseline_metrics" in row


def test_run_tp_rows_report_ranks_that_do_not_finish() -> None:
    """Ranks that do not finish in time fail their module's rows with the reason, in bounded
    time, and every other row is still reported."""
    entries = registry.select(["moe", "attnres"])
    start = time.perf_counter()
    # 10 ms: ranks forked from a warm server start fast, but not eight of them, joined and done.
    rows = list(runner.run(entries, tp=TPOptions(WORLD, timeout_s=0.01)))
    assert time.perf_counter() - start < 60
    assert len(rows) == 6
    for row in rows:
        assert row["status"] == "fail" and "did not finish within 0.01 s" in row["reason"], row.get("reason")
