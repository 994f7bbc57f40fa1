"""The backward passes' overflow models (Gated MLA, Block AttnRes, Stable LatentMoE): one exact
(fp64) pass measures every tensor the tiled backward stores; the prediction says a run is finite
iff each fits its dtype and the forward's checks hold. Rule: structural for the prediction
(predicted finite = observed finite, on every point tried), fp64-agreement for the measured
pass's gradients against the module's oracle.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from verdicts import assert_fp64_agrees

from k3verify import moe
from k3verify.attnres import samples as attnres_samples
from k3verify.attnres.chunkwise import aggregate_backward
from k3verify.harness import registry
from k3verify.harness.modules import attnres_backward, mla_backward
from k3verify.mla import samples as mla_samples
from k3verify.moe import samples as moe_samples
from k3verify.moe.recurrent import autograd_backward
from k3verify.numerics.frontier import Magnitudes

# The modules (each package exports a function of the same name).
mla_tiled, attnres_tiled, moe_tiled = (importlib.import_module(f"k3verify.{m}.tiled")
                                       for m in ("mla", "attnres", "moe"))


def _finite(grads: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(g).all()) for g in grads.values())


def test_magnitudes_record_the_largest_value_and_check_it_against_its_dtype() -> None:
    seen = Magnitudes()
    seen("a", torch.tensor([1.0, -70000.0]), "operand")
    seen("a", torch.tensor([3.0]), "operand")
    seen("b", torch.tensor([2.0]), "accumulator")
    checks = {what.split(" (")[0]: ok for what, ok, _ in seen.checks({"operand": "fp16", "accumulator": "fp32"},
                                                                       "fp32")}
    assert checks == {"a": False, "b": True}  # 70000 > 65504 (fp16)


@pytest.mark.parametrize("log2_q, log2_latent", [(0, 0), (0, 16), (16, 0), (40, 8)])
def test_mla_backward_prediction_matches_the_tiled_backward(log2_q: int, log2_latent: int) -> None:
    """MLA's tiled backward in fp16 and bf16 is finite exactly where predicted; the measured
    pass's gradients are the oracle's."""
    x = mla_samples.scaled(mla_samples.map_inputs(64, 0), log2_q, log2_latent)
    do = mla_backward.cotangent(x, 0)
    args = (x["q_nope"], x["q_pe"], x["cache"], x["w_uk"], x["w_uv"])
    q = mla_tiled.backward_overflow_quantities(*args, do=do, key_tile=16)
    for dtype in ("fp16", "bf16"):
        grads, events = mla_tiled.tiled_backward_traced(*args, do=do, tile=16, operand_dtype=dtype)
        assert mla_tiled.predict_backward(q, operand_dtype=dtype).finite == _finite(grads), (dtype, events[:1])
    if log2_q == log2_latent == 0:
        ref = mla_backward.oracle(registry.Case("map", dict(x, do=do), {}))
        for name, g in q.gradients.items():
            assert_fp64_agrees(g, ref[name], name)


@pytest.mark.parametrize("upstream", [0, 12, 18])
def test_attnres_backward_prediction_matches_the_two_phase_backward(upstream: int) -> None:
    """AttnRes's two-phase backward with a fp16, bf16 or fp32 stream is finite exactly where
    predicted, the upstream gradient ``dh`` scaled by ``2^upstream``: at the quick grid's largest
    logit scale (2^17) an fp16 stream's ``dsources`` passes 65504 from ``2^12`` on (it carries
    ``dℓ (w ⊙ γ) / r``), ``dh`` itself from ``2^16``; bf16 and fp32 streams stay finite."""
    x, _ = attnres_samples.map_inputs(attnres_samples.map_grid(True)[0][-1], 9, 0)
    dh = attnres_backward.cotangent(x, 0) * 2.0**upstream
    for stream in ("fp16", "bf16", "fp32"):
        q = attnres_tiled.backward_overflow_quantities(x["sources"], x["w"], x["gamma"], dh=dh, stream_dtype=stream)
        grads, events = attnres_tiled.aggregate_backward_traced(x["sources"], x["w"], x["gamma"], dh=dh,
                                                                stream_dtype=stream)
        predicted = attnres_tiled.predict_backward(q, stream_dtype=stream)
        assert predicted.finite == _finite(grads), (stream, predicted.explanation(), events[:1])
        assert predicted.finite == (stream != "fp16" or upstream == 0), (stream, upstream)
    ref = aggregate_backward(x["sources"], x["w"], x["gamma"], dh=dh)
    q = attnres_tiled.backward_overflow_quantities(x["sources"], x["w"], x["gamma"], dh=dh)
    for name, g in q.gradients.items():
        assert_fp64_agrees(g, ref[name], name)


def test_moe_backward_measured_pass_gives_the_oracles_gradients() -> None:
    """The measuring pass's gradients (the map's reference) are the oracle's, SiTU and SwiGLU."""
    for activation in ("situ", "swiglu"):
        x, _ = moe_samples.map_inputs("gaussian", 0, activation)
        dy = torch.randn(*x["x"].shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        indices = moe.routing_for(x["x"], x["weights"], x["config"], None, torch.float64).indices
        args = (x["x"], x["weights"], x["config"])
        q = moe_tiled.backward_overflow_quantities(*args, dy=dy, indices=indices)
        ref = autograd_backward(moe.recurrent, *args, dy=dy, indices=indices)
        for name, g in q.gradients.items():
            assert_fp64_agrees(g, ref[name], f"{activation}: {name}")


@pytest.mark.parametrize("module", ["moe_backward", "mla_backward", "attnres_backward"])
def test_each_backward_map_agrees_with_its_prediction_on_the_quick_grid(module: str) -> None:
    """Every cell of the quick map (MoE 144, MLA 64, AttnRes 90) agrees with its prediction, and
    some cell of it overflows (the map reaches the frontier)."""
    from k3verify.harness.overflow_map import MapOptions, sweep_map

    result = sweep_map(registry.get(module), MapOptions(quick=True))
    assert result.meta["agreement"]["all"]["agree"] == len(result.cells)
    assert any(not c["finite"] for c in result.cells) and any(c["finite"] for c in result.cells)
