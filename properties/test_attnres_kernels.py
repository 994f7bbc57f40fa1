"""Our Block AttnRes Triton kernels (``k3verify.attnres.kernels``) against the fp64 oracle.

Where no CUDA device is visible these run under Triton's interpreter with an fp32 stream, the
one dtype it computes faithfully (docs/model.md §5); the bf16 tests need a CUDA device and are skipped
with that reason otherwise. Rules used:

- ``baseline``: error vs the fp64 definition <= 2 x the plain definition storing the same
  dtype + noise floor (``numerics.policy``). Problems have >= 1024 outputs.
- ``structural``: what no rounding can change: an empty stored set (``m = -inf, Z = 0, N = 0``),
  one source returned as it is, bad arguments named.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from interpreted import few
from verdicts import assert_verdict

from k3verify import attnres
from k3verify.attnres import kernels, samples
from k3verify.attnres.schedule import Schedule
from k3verify.numerics import baseline_rule, compare, noise_floor

FP32_REASON = kernels.unavailable_reason(torch.float32)
BF16_REASON = kernels.unavailable_reason(torch.bfloat16)
needs_fp32 = pytest.mark.skipif(FP32_REASON is not None, reason=str(FP32_REASON))
needs_bf16 = pytest.mark.skipif(BF16_REASON is not None, reason=str(BF16_REASON))
FEW = few(deadline=None)  # a few examples under the interpreter (interpreted.py)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _verdict_aggregate(N: int, T: int, d: int, scale: float, seed: int, dtype: str):
    inputs, _ = samples.aggregation_sample(N, T, d, logit_scale=scale, seed=seed)
    v, w, g = inputs["sources"], inputs["w"], inputs["gamma"]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = DTYPES[dtype]
    got = kernels.aggregate(v.to(dev, dt), w.to(dev, dt), g.to(dev, dt)).cpu()
    ref = attnres.aggregate(v, w, g)
    base = attnres.naive_baseline(v, w, g, dtype=dtype)
    return baseline_rule(compare(got, ref, ulp_dtype=dtype), compare(base, ref, ulp_dtype=dtype),
                         noise_floor(ref, dt)), got, ref  # fmt: skip


aggregations = st.tuples(
    st.integers(1, 9),  # sources: one (no stored set) up to K3's nine
    st.integers(1, 40),  # tokens: rarely a tile multiple
    st.sampled_from([64, 100, 256, 1030]),  # widths: partial width tiles
    st.sampled_from([1.0, 8.0, 32.0, 96.0]),  # largest logit per token
    st.integers(0, 2**16),
).filter(lambda p: p[1] * p[2] >= 1024)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@FEW
@given(aggregations)
def test_aggregate_within_policy(dtype: str, p) -> None:
    """Rule baseline: one call over N sources, fp32 stream (anywhere Triton runs) and bf16 (GPU)."""
    reason = FP32_REASON if dtype == "fp32" else BF16_REASON
    if reason is not None:
        pytest.skip(reason)
    verdict, got, ref = _verdict_aggregate(*p, dtype)
    assert_verdict(verdict, got, ref, f"N, T, d, scale, seed = {p}")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_walk_within_policy(dtype: str) -> None:
    """Rule baseline: a 9-layer walk in blocks of 2 layers (two-phase at every block start),
    on both outputs (the final AttnRes and the stored blocks)."""
    reason = FP32_REASON if dtype == "fp32" else BF16_REASON
    if reason is not None:
        pytest.skip(reason)
    schedule = Schedule.layers(block_size=2, num_layers=9)
    inputs, _ = samples.walk_sample(schedule, T=16, d=64, logit_scale=16.0, seed=5)
    e, w, sub = inputs["embedding"], inputs["weights"], inputs["sublayers"]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = DTYPES[dtype]
    got = kernels.walk(e.to(dev, dt), w.to(dt), sub, schedule=schedule)
    ref = attnres.recurrent(e, w, sub, schedule=schedule)
    base = attnres.naive_walk(e, w, sub, schedule=schedule, dtype=dtype)
    for name in ("output", "blocks"):
        x, r, b = getattr(got, name).cpu(), getattr(ref, name), getattr(base, name)
        verdict = baseline_rule(compare(x, r, ulp_dtype=dtype), compare(b, r, ulp_dtype=dtype), noise_floor(r, dt))
        assert_verdict(verdict, x, r, f"walk {name}")


@needs_fp32
def test_an_empty_stored_set_contributes_nothing() -> None:
    """Structural: no stored blocks give ``m = -inf, Z = 0, N = 0``; one source comes back as it is."""
    v = torch.randn(1, 5, 70, dtype=torch.float32)
    w, g = torch.randn(3, 70), torch.ones(3, 70)
    stats = kernels.phase1(v[:0], w, g)
    assert bool((stats.m == float("-inf")).all()) and not stats.Z.any() and not stats.N.any()
    h = kernels.aggregate(v, w[0], g[0])
    assert torch.equal(h.cpu(), v[0])  # weight e^{r - r} / (0 + 1) = 1 exactly


@needs_bf16
def test_query_parts_in_one_launch_are_the_torch_split() -> None:
    """Structural: the bf16 phase 1's parts of ``w ⊙ γ``, made in one launch, are bit for bit
    :func:`kernels._split_bf16` of the fp32 product (subnormal products and padded columns
    included): the same roundings in the same order, so no tolerance."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(24, 1030, generator=gen, device="cuda")
    gamma = 1 + 0.1 * torch.randn(24, 1030, generator=gen, device="cuda")
    w[0, :8], gamma[0, :8] = 1e-20, 1e-20  # products of 1e-40, below fp32's normal range
    got = kernels._queries(w, gamma, 1030, w.device, 32, split=True)
    want = kernels._split_bf16(kernels._queries(w, gamma, 1030, w.device, 32))
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_token_major_buffer_gives_the_same_bits(dtype: str) -> None:
    """Structural: phase 1 over the token-major block buffer ``[T, n, d]`` seen as ``[n, T, d]``
    (rows addressed by its strides, no copy) gives bit for bit what it gives over the same
    blocks stacked contiguously: the same roundings in the same order, so no tolerance."""
    reason = FP32_REASON if dtype == "fp32" else BF16_REASON
    if reason is not None:
        pytest.skip(reason)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(3)
    buffer = torch.randn(37, 5, 200, generator=gen).to(dev, DTYPES[dtype])  # [T, n, d], 37 tokens
    w, g = torch.randn(6, 200, generator=gen), 1 + 0.1 * torch.randn(6, 200, generator=gen)
    view = buffer.transpose(0, 1)
    assert view.stride(-1) == 1 and not view.is_contiguous()
    got, want = kernels.phase1(view, w, g), kernels.phase1(view.contiguous(), w, g)
    for name in ("m", "Z", "N"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@needs_fp32
def test_bad_arguments_are_named() -> None:
    """Structural: a dtype the kernels do not take, a wrong shape and a NaN are named."""
    v = torch.randn(3, 4, 32)
    w, g = torch.randn(32), torch.ones(32)
    with pytest.raises(RuntimeError, match="AttnRes kernels take bf16, fp16 or fp32 operands, not fp64"):
        kernels.aggregate(v.double(), w, g)
    with pytest.raises(ValueError, match=r"w \[1, 31\] and gamma \[1, 31\] must both be \[Q, d\] with d = 32"):
        kernels.aggregate(v, w[:31], g[:31])
    bad = v.clone()
    bad[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="sources"):
        kernels.aggregate(bad, w, g)
