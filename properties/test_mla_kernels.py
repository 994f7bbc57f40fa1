"""Our Gated MLA Triton kernels (``k3verify.mla.kernels.decode`` and ``prefill``) against the
fp64 oracle.

Where no CUDA device is visible it runs under Triton's interpreter in fp32 and fp16, which the
interpreter computes faithfully for this kernel (docs/model.md §5: fp32 and fp16 products are exact
there, and its fp16 conversions round to nearest even); bf16 and the fp8 cache need a CUDA
device and are skipped with that reason otherwise. Rules used:

- ``baseline``: error vs the fp64 definition <= 2 x the plain definition storing the same dtype
  (the fp8 cache: dequantised from the same codes) + noise floor. Problems have >= 1024 outputs.
- ``bitwise``: two launches doing the same arithmetic on the same numbers, in one process on one
  host: every query's program reads the same cache tiles in the same order whether it is one
  of a chunk or alone, and a masked load returns 0 whatever the memory holds.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from interpreted import few
from verdicts import assert_identical, assert_verdict

from k3verify import mla
from k3verify.mla import kernels, layer, samples
from k3verify.mla.cache import LatentCache, live_slots
from k3verify.numerics import baseline_rule, compare, is_float8, noise_floor

REASONS = {d: kernels.unavailable_reason(d) for d in ("fp32", "fp16", "bf16")}
FEW = few(deadline=None)  # a few examples under the interpreter (interpreted.py)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _problem(heads: int, lengths: tuple[int, ...], T: int, seed: int) -> dict:
    cfg = replace(samples.CONFIG, num_heads=heads)
    return samples.layer_inputs(cfg, lengths, T, seed=seed)


def _on(x: dict, dtype: str) -> tuple:
    """The form arguments in ``dtype`` on the kernels' device (an fp8 dtype: the cache quantised
    per token, the rest in bf16)."""
    cache = x["cache"]
    if is_float8(dtype):
        cache, dtype = mla.quantize(cache, dtype), "bf16"
    dt = getattr(torch, {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[dtype])
    cache = LatentCache(cache.pool.to(DEVICE) if cache.quantized else cache.pool.to(DEVICE, dt),
                        cache.block_table.to(DEVICE), cache.seq_lens.to(DEVICE),
                        None if cache.scales is None else cache.scales.to(DEVICE))  # fmt: skip
    return (x["q_nope"].to(DEVICE, dt), x["q_pe"].to(DEVICE, dt), cache, x["w_uk"].to(DEVICE, dt),
            x["w_uv"].to(DEVICE, dt))  # fmt: skip


def _verdict(x: dict, dtype: str, num_splits: int, kind: str = "decode", launch: kernels.DecodeLaunch | None = None):
    ref = mla.expanded(x["q_nope"], x["q_pe"], x["cache"], x["w_uk"], x["w_uv"])
    exact = (x["q_nope"], x["q_pe"], mla.quantize(x["cache"], dtype) if is_float8(dtype) else x["cache"],
             x["w_uk"], x["w_uv"])  # fmt: skip
    base = mla.naive_baseline(*exact, dtype="bf16" if is_float8(dtype) else dtype)
    options = dict(num_splits=num_splits, launch=launch) if kind == "decode" else {}
    got = getattr(kernels, kind)(*_on(x, dtype), **options).cpu()
    out_dtype = got.dtype
    return baseline_rule(compare(got, ref, ulp_dtype=out_dtype), compare(base, ref, ulp_dtype=out_dtype),
                         noise_floor(ref, out_dtype)), got, ref  # fmt: skip


MIN_OUTPUTS = 1024  # the baseline rule's smallest problem: requests x T x heads x Dv outputs


def _sized(heads_and_tokens: list[tuple[int, int]], length: tuple[int, int], splits: list[int] | None = None):
    """Problems ``(heads, lengths, T[, splits], seed)`` of at least ``MIN_OUTPUTS`` outputs,
    every request at least ``T`` long, built so (no filter: a filtered draw starves the search):
    the pair ``(heads, T)`` is drawn first, then enough requests (1 to 3) of lengths in
    ``length`` to reach the size."""

    @st.composite
    def draw(draw_one):
        heads, T = draw_one(st.sampled_from(heads_and_tokens))
        per = heads * T * samples.CONFIG.v_head_dim
        fewest = -(-MIN_OUTPUTS // per)
        lengths = tuple(draw_one(st.lists(st.integers(max(T, length[0]), length[1]), min_size=fewest, max_size=3)))
        extra = () if splits is None else (draw_one(st.sampled_from(splits)),)
        return (heads, lengths, T, *extra, draw_one(st.integers(0, 2**16)))

    return draw()


def _pairs(heads: tuple[int, ...], tokens: tuple[int, ...]) -> list[tuple[int, int]]:
    """The (heads, T) pairs that three requests can bring to ``MIN_OUTPUTS`` outputs."""
    return [(h, t) for h in heads for t in tokens if 3 * h * t * samples.CONFIG.v_head_dim >= MIN_OUTPUTS]


# heads: one, and not a multiple of the 16-head block; query tokens per request: decode, a
# short chunk; key splits more than some requests' keys; variable context lengths.
problems = _sized(_pairs((1, 5, 17), (1, 3)), (3, 45), splits=[1, 2, 5])


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "fp8_e4m3"])
@FEW
@given(problems)
def test_decode_within_policy(dtype: str, p) -> None:
    """Rule baseline: every head count, context lengths in one batch, chunks and splits."""
    reason = REASONS["bf16" if is_float8(dtype) else dtype]
    if reason is not None:
        pytest.skip(reason)
    heads, lengths, T, splits, seed = p
    verdict, got, ref = _verdict(_problem(heads, lengths, T, seed), dtype, splits)
    assert_verdict(verdict, got, ref, f"heads, lengths, T, splits, seed = {p}")


# heads: one block of 32 and a partial second; two blocks of 64 and a partial third of 32.
wide_head_problems = _sized(_pairs((33, 65), (1, 3)), (3, 45), splits=[1, 2, 5])
# The launch shapes besides the default. Under the interpreter warps and stages are not modelled:
# there, one shape per (head block, key tile) other than the default's; on a GPU every shape.
def _other_shapes() -> list[kernels.DecodeLaunch]:
    shapes, sides = [], {(kernels.DECODE_LAUNCH.heads, kernels.DECODE_LAUNCH.keys)}
    for s in kernels.DECODE_SHAPES:
        if s == kernels.DECODE_LAUNCH or (kernels.interpreted() and (s.heads, s.keys) in sides):
            continue
        sides.add((s.heads, s.keys))
        shapes.append(s)
    return shapes


OTHER_SHAPES = _other_shapes()


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8_e4m3"])
@pytest.mark.parametrize("launch", OTHER_SHAPES, ids=str)
@FEW
@given(wide_head_problems)
def test_decode_launch_shapes_within_policy(launch: kernels.DecodeLaunch, dtype: str, p) -> None:
    """Rule baseline: every launch shape the benchmark sweeps (a program carrying 32 or 64 heads,
    fewer programs sharing each cache tile, with the masked rows of a last, partial block; 32-key
    tiles; 8 warps; 3 stages) meets the policy as the default does. On a GPU the bf16 and fp8
    rows are the ones a 64-head block takes through warpgroup (wgmma) products; fp32 takes IEEE
    products there."""
    reason = REASONS["bf16" if is_float8(dtype) else dtype]
    if reason is not None:
        pytest.skip(reason)
    heads, lengths, T, splits, seed = p
    verdict, got, ref = _verdict(_problem(heads, lengths, T, seed), dtype, splits, launch=launch)
    assert_verdict(verdict, got, ref, f"launch {launch}; heads, lengths, T, splits, seed = {p}")


# new tokens: one, under, at and over a query block; context lengths in one batch.
prefill_problems = _sized(_pairs((1, 3, 17), (1, 7, 16, 40)), (1, 90))


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "fp8_e4m3"])
@FEW
@given(prefill_problems)
def test_prefill_within_policy(dtype: str, p) -> None:
    """Rule baseline: the expanded chunked prefill, with and without earlier context (a request
    whose every token is new has an empty prefix), several requests of different lengths."""
    reason = REASONS["bf16" if is_float8(dtype) else dtype]
    if reason is not None:
        pytest.skip(reason)
    heads, lengths, T, seed = p
    verdict, got, ref = _verdict(_problem(heads, lengths, T, seed), dtype, 1, kind="prefill")
    assert_verdict(verdict, got, ref, f"heads, lengths, T, seed = {p}")


@pytest.mark.skipif(REASONS["fp32"] is not None, reason=str(REASONS["fp32"]))
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_dead_slots_are_never_read(kind: str) -> None:
    """Bitwise: every dead slot (other requests' tails, spare pages) NaN or zero gives the same
    output, and a finite one (a read would make NaN)."""
    x = _problem(5, (21, 7, 40), 3, seed=4)
    args = list(_on(x, "fp32"))
    cache = args[2]
    live = live_slots(cache).to(cache.pool.device)
    outs = []
    for fill in (float("nan"), 0.0):
        pool = cache.pool.clone()
        pool[~live] = fill
        args[2] = replace(cache, pool=pool)
        outs.append(kernels.decode(*args, num_splits=5) if kind == "decode" else kernels.prefill(*args))
    assert bool(torch.isfinite(outs[0]).all())
    assert_identical(outs[0], outs[1], "dead slots NaN vs zero")


@pytest.mark.skipif(REASONS["fp32"] is not None, reason=str(REASONS["fp32"]))
def test_a_chunk_is_its_tokens_one_by_one() -> None:
    """Bitwise: the kernel's latent output for the last T tokens as one chunk equals T calls of
    one token each (the cache's lengths cut at each token), query by query. (The host's
    projections around it are GEMMs of another height, which may round differently.)"""
    x = _problem(5, (30, 19), 4, seed=6)
    q_nope, q_pe, cache, w_uk, _ = _on(x, "fp32")
    q_lat = torch.einsum("bthn,hrn->bthr", q_nope, w_uk)
    chunk = kernels.latent_attention(q_lat, q_pe, cache, scale=0.1)
    for t in range(4):
        lens = cache.seq_lens - 3 + t
        one = kernels.latent_attention(q_lat[:, t : t + 1].contiguous(), q_pe[:, t : t + 1].contiguous(),
                                       replace(cache, seq_lens=lens), scale=0.1)  # fmt: skip
        assert_identical(one[:, 0], chunk[:, t], f"token {t} alone vs in the chunk")


@pytest.mark.skipif(REASONS["fp32"] is not None, reason=str(REASONS["fp32"]))
@pytest.mark.parametrize("prefill", ["decode", "prefill"])
def test_prefill_then_decode_steps_is_one_longer_prefill(prefill: str) -> None:
    """Rule baseline, through the layer: prefill of T tokens (by the decode kernel over a chunk,
    or by the prefill kernel) then k decode steps with the decode kernel (writing the cache as it
    goes) against one prefill of T + k tokens by the fp64 definition."""
    cfg = replace(samples.CONFIG, num_heads=3)
    w = layer.init_weights(cfg, seed=2)
    T, k = 20, 4
    x = torch.randn(2, T + k, cfg.hidden_size, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    cache64 = mla.allocate(2, T + k, samples.PAGE_SIZE, cfg.cache_width, generator=torch.Generator().manual_seed(4))
    ref = layer.forward(x, w, cfg, cache64, form=mla.expanded).y
    wf = layer.MLAWeights(**{n: getattr(w, n).float() for n in w.__dataclass_fields__})
    cache = cache64.to(torch.float32)
    first = dict(form=kernels.decode, num_splits=2) if prefill == "decode" else dict(form=kernels.prefill)
    out = layer.forward(x[:, :T].float(), wf, cfg, cache, **first)
    ys, cache = [out.y], out.cache
    for step in range(k):
        out = layer.forward(x[:, T + step : T + step + 1].float(), wf, cfg, cache, form=kernels.decode, num_splits=2)
        ys.append(out.y)
        cache = out.cache
    got = torch.cat(ys, 1)
    base = layer.forward(x.float(), wf, cfg, cache64.to(torch.float32),
                         form=lambda *a, **kw: mla.naive_baseline(*a, dtype="fp32", **kw)).y  # fmt: skip
    verdict = baseline_rule(compare(got, ref, ulp_dtype="fp32"), compare(base, ref, ulp_dtype="fp32"),
                            noise_floor(ref, torch.float32))  # fmt: skip
    assert_verdict(verdict, got, ref, "prefill(T) + k decode steps vs prefill(T + k)")


def test_the_default_launch_follows_the_heads_and_the_cache() -> None:
    """Structural: up to 32 heads the 16-head shape; more heads take the shapes timed fastest at
    96 (a bf16 cache 32-head blocks on 4 warps, an fp8 cache 64-head blocks on 8), and every
    default is one of the shapes the benchmark sweeps."""
    for heads in (1, 12, 16, 32):
        assert kernels.decode_launch(heads) == kernels.decode_launch(heads, True) == kernels.DECODE_LAUNCH
    for heads in (33, 96, 128):
        assert kernels.decode_launch(heads) == kernels.DecodeLaunch(32, warps=4)
        assert kernels.decode_launch(heads, True) == kernels.DecodeLaunch(64, warps=8)
    assert {kernels.decode_launch(h, q) for h in (12, 96) for q in (False, True)} <= set(kernels.DECODE_SHAPES)


@pytest.mark.skipif(REASONS["fp32"] is not None, reason=str(REASONS["fp32"]))
@pytest.mark.parametrize("dtype", ["fp32", "fp8_e4m3"])
def test_a_call_without_a_launch_takes_the_default_for_its_heads_and_cache(dtype: str, monkeypatch) -> None:
    """Structural: the kernel asks :func:`kernels.decode_launch` for its shape with the query's
    head count and whether the cache holds fp8 codes, and runs the shape it gets."""
    if is_float8(dtype) and REASONS["bf16"] is not None:
        pytest.skip(REASONS["bf16"])
    asked = []

    def chosen(heads: int, quantized: bool = False) -> kernels.DecodeLaunch:
        asked.append((heads, quantized))
        return kernels.DecodeLaunch(32, keys=32)

    monkeypatch.setattr(kernels, "decode_launch", chosen)
    seen = []
    real = kernels._decode_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **options):
                seen.append((options["BH"], options["BN"]))
                return real[grid](*args, **options)

            return launch

    monkeypatch.setattr(kernels, "_decode_kernel", Spy())
    kernels.decode(*_on(_problem(40, (20,), 1, seed=3), dtype))
    assert asked == [(40, is_float8(dtype))] and seen == [(32, 32)]


@pytest.mark.skipif(REASONS["fp32"] is not None, reason=str(REASONS["fp32"]))
def test_bad_arguments_are_named() -> None:
    """Structural: a dtype the kernel does not take and a split count that is not positive are
    named; the common checks (shapes, NaN queries) come from the forms' validation."""
    args = _on(_problem(2, (9,), 1, seed=1), "fp32")
    with pytest.raises(RuntimeError, match="MLA kernels take bf16, fp16 or fp32 operands, not fp64"):
        kernels.decode(*(a.double() if isinstance(a, torch.Tensor) else a for a in args[:2]), args[2].to(torch.float64),
                       args[3].double(), args[4].double())  # fmt: skip
    with pytest.raises(RuntimeError, match="MLA kernels take bf16, fp16 or fp32 operands, not fp64"):
        kernels.prefill(*(a.double() if isinstance(a, torch.Tensor) else a for a in args[:2]),
                        args[2].to(torch.float64), args[3].double(), args[4].double())  # fmt: skip
    with pytest.raises(ValueError, match="num_splits"):
        kernels.decode(*args, num_splits=0)
    for block in (8, 48, 16.0, True):
        with pytest.raises(ValueError, match=r"DecodeLaunch\.heads must be one of"):
            kernels.DecodeLaunch(heads=block)
    for bad, match in ((dict(keys=24), "keys must be a power of two"), (dict(warps=3), "warps must be"),
                       (dict(warps=4.0), "warps must be"), (dict(stages=0), "stages must be 1 to 6")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"DecodeLaunch\.{match}"):
            kernels.DecodeLaunch(**bad)
    with pytest.raises(TypeError, match="launch must be a DecodeLaunch, got int"):
        kernels.decode(*args, launch=32)
    bad = args[0].clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="q_nope"):
        kernels.decode(bad, *args[1:])
