"""Third-party Stable LatentMoE kernels behind k3verify's signature: ``torch._grouped_mm`` for the
expert GEMMs, SiTU between them.

Its row is bf16 on a CUDA device (CUTLASS); here the adapter's own arithmetic (the sorted rows,
the group ends, the joined ``[W1 | W3]``, the activation between the GEMMs, the weights) is
checked in fp32 through the matrix-product loop torch runs where it has no grouped kernel. Rule
used: ``baseline`` (``y`` vs the fp64 definition <= 2 x the plain fp32 definition + noise floor,
same routing; problems have >= 1024 outputs).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from verdicts import assert_verdict

from k3verify import moe
from k3verify.adapters import torch_grouped_mm
from k3verify.harness import registry
from k3verify.moe import router
from k3verify.moe.inputs import MoEConfig
from k3verify.moe.layer import init_weights
from k3verify.numerics import baseline_rule, compare, noise_floor

REASON = torch_grouped_mm.unavailable_reason(torch.float32)


@pytest.mark.skipif(REASON is not None, reason=str(REASON))
@settings(max_examples=6, deadline=None)
@given(st.sampled_from(["situ", "swiglu"]), st.sampled_from([(8, 2), (16, 4)]), st.integers(16, 40),
       st.integers(0, 2**16))  # fmt: skip
def test_grouped_mm_adapter_arithmetic_within_policy(activation: str, ek, T: int, seed: int) -> None:
    """Rule baseline (fp32): experts with no rows among those with several."""
    E, k = ek
    cfg = MoEConfig(hidden_size=64, num_experts=E, top_k=k, latent_size=40, expert_hidden=24, activation=activation)
    w = init_weights(cfg, seed=seed)
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    r = router.route(x, w.w_router, w.bias, cfg)
    ref = moe.recurrent(x, w, cfg, routing=r)
    base = moe.naive_baseline(x, w, cfg, dtype="fp32", routing=r)
    got = torch_grouped_mm.grouped(x.float(), w.to(torch.float32), cfg, routing=r).cpu()
    verdict = baseline_rule(compare(got, ref, ulp_dtype=torch.float32), compare(base, ref, ulp_dtype=torch.float32),
                            noise_floor(ref, torch.float32))  # fmt: skip
    assert_verdict(verdict, got, ref, f"activation, (E, k), T, seed = {activation, ek, T, seed}")


def test_grouped_mm_row_is_registered_and_says_why_not() -> None:
    """Structural: one bf16 row; without CUDA it is unavailable with its reason."""
    rows = [i for i in registry.get("moe").implementations() if i.implementation == "torch _grouped_mm"]
    assert [(i.form, i.dtype) for i in rows] == [("kernel:grouped", "bf16")]
    if not torch.cuda.is_available():
        assert rows[0].is_available() == (False, torch_grouped_mm.unavailable_reason())
