"""Stable LatentMoE as the harness sees it: registry rows on the built-in cases, the named outputs
``y`` and ``experts``, the overflow map and the routing-flips study.

Rows are judged by the runner under each implementation's rule (``fp64-agreement`` or
``baseline``; a predicted overflow is ``expected-nonfinite``); ``experts`` by the mismatch rule
(the fraction of tokens whose expert set differs from the oracle's: 0 under fp64-agreement, at
most 2x the same-dtype baseline's otherwise). The quick overflow map must agree with its
analytic prediction in every cell that is not frontier-adjacent, and must show the physics:
SwiGLU overflowing fp16 and statically scaled fp8 at a smaller input scale than SiTU.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hypothesis import given
from registry_contract import quick_map as contract_quick_map
from strategies.moe import one_thread  # noqa: F401
from verdicts import assert_identical

from k3verify import moe
from k3verify.harness import registry, runner
from k3verify.harness.map_files import write_map
from k3verify.harness.overflow_map import (
    MapDefinition,
    MapResult,
)
from k3verify.harness.registry import BASELINE_RULE, FP64_RULE, Implementation
from k3verify.moe import samples, studies
from k3verify.numerics import FAIL, PASS, fp64_agreement
from k3verify.testing import assert_matches_oracle


def _returning(y: torch.Tensor, experts: torch.Tensor, dtype: str, rule: str) -> Implementation:
    return Implementation(module="moe", implementation="test", form="user", dtype=dtype, params={}, rule=rule,
                          run=lambda case: {"y": y.clone(), "experts": experts.clone()})


def test_one_changed_expert_set_fails_on_experts() -> None:
    """Mismatch rule: an implementation returning the oracle's ``y`` exactly but another expert
    set for one token fails with output ``experts`` (mismatch 1/T), under fp64-agreement (0
    allowed) and under the baseline rule (the bf16 baseline routes like the oracle on this case,
    so 2 x 0 is allowed), while its ``y`` passes; the oracle's own sets pass."""
    entry = registry.get("moe")
    case = entry.make_cases(0)["default"]
    ref = entry.oracle(case)
    experts = ref["experts"].clone()
    spare = next(e for e in range(case.params["E"]) if e not in experts[0].tolist())
    experts[0, 0] = spare
    experts[0] = experts[0].sort().values
    for dtype, rule in (("fp64", FP64_RULE), ("bf16", BASELINE_RULE)):
        row = runner.verify(entry, _returning(ref["y"], experts, dtype, rule), case)
        assert row["status"] == FAIL and row["output"] == "experts", (dtype, row["output"], row["status"])
        assert row["outputs"]["y"]["status"] == PASS
        assert row["outputs"]["experts"]["metrics"]["mismatch"] == 1 / case.params["T"]
        assert runner.verify(entry, _returning(ref["y"], ref["experts"], dtype, rule), case)["status"] == PASS


def test_call_reports_the_routing_the_form_computed_with() -> None:
    """Exact, bitwise on any host: ``entry.call`` routes first with the router the form would run
    (fp32 for bf16 operands and for fp32 inputs, fp64 for fp64 forms) and passes it in, so ``y``
    is the form's own output and ``experts`` its choices, sorted ascending as int64; a function
    that routes otherwise and returns its own ``(y, experts)`` is reported with its experts
    (sorted)."""
    entry = registry.get("moe")
    case = entry.make_cases(0)["default"]
    x, w, cfg = (case.inputs[n] for n in samples.INPUT_NAMES)
    for fn, dtype, opts, router in ((moe.tiled, torch.float64, {"operand_dtype": "bf16"}, torch.float32),
                                    (moe.recurrent, torch.float64, {}, torch.float64),
                                    (moe.chunkwise, torch.float64, {}, torch.float64),
                                    (moe.recurrent, torch.float32, {}, torch.float32)):
        out = entry.call(fn, case, dtype, **opts)
        chosen = moe.routing_for(x, w, cfg, None, router).indices
        assert out["experts"].dtype == torch.int64 and torch.equal(out["experts"], chosen.sort(-1).values)
        assert_identical(out["y"], fn(x.to(dtype), w.to(dtype), cfg, **opts))
    fp64 = moe.routing_for(x, w, cfg, None, torch.float64)
    shifted = moe.Routing((fp64.indices + 1) % cfg.num_experts, fp64.weights)

    def own_routing(x: torch.Tensor, w: moe.MoEWeights, c: moe.MoEConfig, *, routing: moe.Routing) -> tuple:
        return moe.recurrent(x, w, c, routing=shifted), shifted.indices.flip(-1)

    out = entry.call(own_routing, case, torch.float64)
    assert_identical(out["experts"], shifted.indices.sort(-1).values)
    assert not torch.equal(out["experts"], entry.oracle(case)["experts"])
    assert_identical(out["y"], moe.recurrent(x, w, cfg, routing=shifted))


def test_a_bf16_call_routes_like_the_baseline() -> None:
    """baseline rule and mismatch rule, through the public assertion: our tiled form called on
    inputs cast to bf16 passes on every case that does not overflow, ``experts`` included. On
    ``default`` the fp32 router on bf16-rounded router weights would move one near-tied token to
    another expert; ``call`` routes on the inputs as given, as the forms and the baseline do."""
    cases = ["default", "decode", "skewed", "scaled", "scaled_swiglu"]
    rows = assert_matches_oracle(moe.tiled, "moe", dtype=torch.bfloat16, cases=cases, operand_dtype="bf16")
    assert [r["outputs"]["experts"]["metrics"]["mismatch"] for r in rows] == [0.0] * len(cases)
    x, w, cfg = (registry.get("moe").make_cases(0)["default"].inputs[n] for n in samples.INPUT_NAMES)
    rounded = moe.routing_for(x.bfloat16(), w.to(torch.bfloat16), cfg, None, torch.float32).indices
    assert not torch.equal(rounded, moe.routing_for(x, w, cfg, None, torch.float32).indices)


@given(sample=samples.strategy())
def test_drawn_samples_run_through_the_entry(sample: tuple[dict, dict]) -> None:
    """fp64-agreement and exact routing on ``samples.strategy()``'s samples: the chunkwise form
    equals the oracle's ``y`` and routes exactly as it does (the same fp64 router on the same
    tensors); ``experts`` are [T, k] int64, ascending and distinct per token."""
    entry = registry.get("moe")
    case = registry.Case("drawn", *sample)
    ref = entry.oracle(case)
    out = entry.call(moe.chunkwise, case, torch.float64)
    T, k = sample[1]["T"], sample[1]["k"]
    assert ref["experts"].shape == (T, k) and ref["experts"].dtype == torch.int64
    assert bool((ref["experts"].diff(dim=-1) > 0).all())
    assert_identical(out["experts"], ref["experts"])
    verdict = fp64_agreement(out["y"], ref["y"])
    assert verdict.passed, verdict.reason


def quick_map() -> MapResult:
    """The quick map of the declared :class:`MapDefinition`, after the checks
    ``registry_contract.quick_map`` makes of every map."""
    assert isinstance(registry.get("moe").overflow_map, MapDefinition)
    return contract_quick_map("moe")


def test_quick_overflow_map_agrees_with_its_prediction(tmp_path: Path) -> None:
    """Prediction vs observation: no disagreement away from the frontier; SwiGLU's first overflow
    comes at a smaller scale than SiTU's in fp16 and static fp8; SiTU in bf16 and dynamic fp8
    never overflows on the grid; every cell keeps the prediction's keys (zeroing, binding check,
    the ln magnitudes it read); JSON + PNG are written."""
    result = quick_map()
    assert len(result.cells) == 2 * 9 * 2 * 4  # inputs x quick scales x activations x settings
    keys = {"setting", "fp8_scaling", "tile_k", "input_scale", "predicted_zeroed", "binding", "headroom",
            "ln_z", "ln_hidden", "ln_sum_squares", "ln_output", "ln_situ_bound"}
    assert all(keys <= c.keys() for c in result.cells)
    assert all("overflow" in c for c in result.cells if not c["finite"])

    frontier = result.meta["frontier"]
    for setting in ("fp16", "fp8_e4m3 static"):
        for kind in ("gaussian", "outlier"):
            swiglu = frontier[f"{setting} | {kind} | swiglu"]["first_nonfinite"]
            situ = frontier[f"{setting} | {kind} | situ"]["first_nonfinite"]
            assert swiglu is not None and (situ is None or swiglu < situ), (setting, kind, swiglu, situ)
    for setting in ("bf16", "fp8_e4m3 per_row"):
        assert frontier[f"{setting} | gaussian | situ"]["first_nonfinite"] is None
    paths = write_map(result, tmp_path, {"test": True})
    assert paths[0].suffix == ".json" and any(p.suffix == ".png" for p in paths)


def test_routing_flips_study_covers_every_map_scale() -> None:
    """Structural: the entry lists the study as ``moe_routing_flips.json``; by default it covers
    every log2 input scale of the full map (so every quick-map scale too); each changed fraction
    lies in [0, 1] and no more pairs than tokens change (a changed token has at least one of its
    k pairs changed); the error each router's choices cause in ``y`` is recorded beside them."""
    entry = registry.get("moe")
    assert set(entry.studies) == {"moe_routing_flips.json"}
    quick = entry.studies["moe_routing_flips.json"](0, True)  # what a quick map writes
    assert [f["log2_input_scale"] for f in quick["by_scale"]] == samples.log2_scale_grid(quick=True)
    assert quick["router"]["tokens"] == studies.QUICK_FLIP_TOKENS
    doc = studies.routing_flips(0, tokens=64)  # the full grid, on few tokens
    assert set(doc) == {"title", "router", "definition", "by_scale"} and doc["router"]["tokens"] == 64
    scales = [f["log2_input_scale"] for f in doc["by_scale"]]
    assert scales == samples.log2_scale_grid(quick=False)
    assert set(samples.log2_scale_grid(quick=True)) <= set(scales)
    for f in doc["by_scale"]:
        for key in ("bf16_vs_fp32", "bf16_vs_fp64", "fp32_vs_fp64"):
            assert 0.0 <= f[key]["changed_pairs"] <= f[key]["changed_tokens"] <= 1.0
        # What the choices cost in y: none where the choices and weights agree to fp32 rounding
        # (an fp32 router's weights differ from fp64's by rounding only), more where bf16 logits
        # change choices.
        assert f["fp32_y_error"] < 1e-5
        if f["bf16_vs_fp64"]["changed_pairs"] > 0:
            assert f["bf16_y_error"] > f["fp32_y_error"]
