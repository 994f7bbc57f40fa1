"""Third-party Gated MLA kernels behind k3verify's signature: torch's SDPA (expanded prefill) and
flex_attention (absorbed decode).

Their rows run only on a CUDA device; here each adapter's own arithmetic (operands, joined or
absorbed heads, the causal mask per request) is checked through what runs anywhere: SDPA's math
backend, flex_attention eager. Rule used: ``baseline`` (error vs the fp64 definition <= 2 x the plain
definition storing the same dtype + noise floor).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from verdicts import assert_verdict

from k3verify import mla
from k3verify.adapters import torch_flex, torch_sdpa
from k3verify.harness import registry
from k3verify.mla import samples
from k3verify.numerics import baseline_rule, compare, noise_floor

ADAPTERS = {
    "sdpa math": lambda *args: torch_sdpa.prefill(*args, backend="math"),
    "flex eager": lambda *args: torch_flex.decode(*args, compiled=False),
}


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on purpose
@settings(max_examples=6, deadline=None)
@given(st.sampled_from([1, 3]), st.lists(st.integers(1, 60), min_size=1, max_size=3).map(tuple),
       st.sampled_from([1, 5, 16]), st.integers(0, 2**16))  # fmt: skip
def test_adapter_arithmetic_within_policy(adapter: str, heads: int, lengths: tuple[int, ...], T: int,
                                          seed: int) -> None:  # fmt: skip
    """Rule baseline (fp32): every request's own length, an empty prefix where every token is
    new, chunks of several tokens (causal inside the chunk)."""
    T = min(T, min(lengths))
    x = samples.layer_inputs(replace(samples.CONFIG, num_heads=heads), lengths, T, seed=seed)
    exact = (x["q_nope"], x["q_pe"], x["cache"], x["w_uk"], x["w_uv"])
    ref = mla.expanded(*exact)
    base = mla.naive_baseline(*exact, dtype="fp32")
    got = ADAPTERS[adapter](x["q_nope"].float(), x["q_pe"].float(), x["cache"].to(torch.float32), x["w_uk"].float(),
                            x["w_uv"].float()).cpu()  # fmt: skip
    verdict = baseline_rule(compare(got, ref, ulp_dtype=torch.float32), compare(base, ref, ulp_dtype=torch.float32),
                            noise_floor(ref, torch.float32))  # fmt: skip
    assert_verdict(verdict, got, ref, f"{adapter}: heads, lengths, T, seed = {heads, lengths, T, seed}")


def test_sdpa_rows_are_registered_and_say_why_not() -> None:
    """Structural: one bf16 prefill row per CUDA backend, each available exactly when the
    adapter finds no reason against it (without CUDA none is; with CUDA one that refuses K3's
    head widths), and an unknown backend is named."""
    rows = [i for i in registry.get("mla").implementations() if i.implementation == "torch sdpa"]
    assert sorted(i.params["backend"] for i in rows) == sorted(torch_sdpa.BACKENDS)
    # With CUDA, a backend that refuses K3's head widths says so instead of failing its rows.
    for i in rows:
        reason = torch_sdpa.unavailable_reason(i.params["backend"])
        assert i.is_available() == (reason is None, reason or "")
    if not torch.cuda.is_available():
        assert all(not i.is_available()[0] for i in rows)
    with pytest.raises(ValueError, match="unknown SDPA backend 'fa3'"):
        torch_sdpa.unavailable_reason("fa3")
    flex = [i for i in registry.get("mla").implementations() if i.implementation == "torch flex_attention"]
    assert [i.form for i in flex] == ["kernel:decode"]
    if not torch.cuda.is_available():
        assert flex[0].is_available() == (False, torch_flex.unavailable_reason())


def test_sdpa_refusal_keeps_torch_s_specific_reasons() -> None:
    """Structural: of the warnings torch gives when a backend refuses (torch 2.11's, as the H200
    printed them), the reason stays; source locations, headers and the other backends'
    "runtime disabled" go."""
    said = [
        "Memory Efficient attention has been runtime disabled. (Triggered internally at sdp_utils.cpp:539.)",
        "Flash attention kernel not used because: (Triggered internally at sdp_utils.cpp:988.)",
        "Flash attention requires q,k,v to have the same last dimension and to be less than or equal to 256. "
        "Got Query.size(-1): 192, Key.size(-1): 192, Value.size(-1): 128 instead. (Triggered internally at "
        "sdp_utils.cpp:180.)",
        "cuDNN attention has been runtime disabled. (Triggered internally at sdp_utils.cpp:706.)",
    ]
    assert torch_sdpa.specific_reasons(said) == [
        "Flash attention requires q,k,v to have the same last dimension and to be less than or equal to 256. "
        "Got Query.size(-1): 192, Key.size(-1): 192, Value.size(-1): 128 instead."
    ]
