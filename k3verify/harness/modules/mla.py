"""Registry entry for Gated MLA: cases, oracle, baseline, implementations and the overflow map."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ... import mla
from ...mla import layer
from ...numerics import compare, dtype_name
from ..overflow_map import MapOptions, MapResult, MapSpec, agreement, mark_frontier
from ..registry import BASELINE_RULE, FP64_RULE, Case, Implementation, ModuleEntry, Prediction, register
from ..runner import one_thread

CONFIG = layer.MLAConfig.small()  # K3's proportions (512:64, 128:64, v = 128), 4 heads
PAGE_SIZE = 16
CHUNK = 8
TILE = 16
SPLITS = 4
# A cache dtype: the latent cache in fp8 e4m3 with per-token scales, bf16 everywhere else.
FP8_CACHE = "fp8_e4m3"
FP8_CACHE_OPERANDS = "bf16"
# Query scale of the "hot" case: scores ~ N(0, 32^2); the largest (176) passes ln(max bf16) = 88.7.
HOT_QUERY_SCALE = 32.0

CASES = {
    # Chunked prefill: 24 new tokens after 37, 16 and 0 cached ones (the last request's first
    # chunk has an empty prefix), pages shuffled, dead slots NaN.
    "default": dict(lengths=(61, 40, 24), T=24),
    # Decode: one new token per request, lengths not multiples of the page size.
    "decode": dict(lengths=(77, 18, 33, 50, 5, 64, 29, 41), T=1),
}


def layer_inputs(
    cfg: layer.MLAConfig,
    lengths: tuple[int, ...],
    T: int,
    *,
    seed: int = 0,
    page_size: int = PAGE_SIZE,
    spare_pages: int = 2,
) -> dict[str, Any]:
    """fp64 form inputs as the layer makes them: random ``x`` -> latents of every token into a
    paged cache (shuffled pages, NaN in dead slots) and queries of the last ``T`` tokens."""
    w = layer.init_weights(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    B, L = len(lengths), max(lengths)
    x = torch.randn(B, L, cfg.hidden_size, generator=gen, dtype=torch.float64)
    cache = mla.build(layer.project_latent(x, w, cfg), lengths, page_size, generator=gen, spare_pages=spare_pages)
    last = torch.tensor(lengths)[:, None] - T + torch.arange(T)[None, :]
    q_nope, q_pe = layer.project_query(torch.gather(x, 1, last[..., None].expand(-1, -1, x.shape[-1])), w, cfg)
    return dict(q_nope=q_nope, q_pe=q_pe, cache=cache, w_uk=w.w_uk, w_uv=w.w_uv)


def make_cases(seed: int = 0) -> dict[str, Case]:
    """``default`` (chunked prefill), ``decode`` (one token per request) and ``hot`` (the
    default case with queries scaled so that scores pass ln(max bf16))."""
    dims = dict(heads=CONFIG.num_heads, R=CONFIG.kv_lora_rank, Dr=CONFIG.qk_rope_head_dim,
                Dn=CONFIG.qk_nope_head_dim, Dv=CONFIG.v_head_dim, page_size=PAGE_SIZE, seed=seed)
    cases = {}
    for name, spec in CASES.items():
        inputs = layer_inputs(CONFIG, spec["lengths"], spec["T"], seed=seed)
        cases[name] = Case(name, inputs, dict(dims, lengths=list(spec["lengths"]), T=spec["T"]))
    hot = dict(cases["default"].inputs)
    hot["q_nope"], hot["q_pe"] = hot["q_nope"] * HOT_QUERY_SCALE, hot["q_pe"] * HOT_QUERY_SCALE
    cases["hot"] = Case("hot", hot, dict(cases["default"].params, query_scale=HOT_QUERY_SCALE))
    return cases


# A production-shape slice for the goldens: K3's latent (512 + 64) and head dims (128 + 64,
# v 128), one head; the hidden size does not reach the forms' inputs, so it stays small. One
# chunked prefill (8 new tokens after 33 cached, across three pages) runs every form,
# absorbed and expanded; its weights alone take 1 MB in fp64, so there is no second slice.
PRODUCTION_SLICE = dataclasses.replace(layer.MLAConfig.production(), num_heads=1, hidden_size=1024)
GOLDEN_PRODUCTION_CASES = {"default.production": dict(lengths=(41,), T=8)}


def golden_cases(seed: int = 0) -> dict[str, Case]:
    """The default cases (small configuration) plus the production-shape slices."""
    cases = make_cases(seed)
    cfg = PRODUCTION_SLICE
    dims = dict(heads=cfg.num_heads, R=cfg.kv_lora_rank, Dr=cfg.qk_rope_head_dim, Dn=cfg.qk_nope_head_dim,
                Dv=cfg.v_head_dim, page_size=PAGE_SIZE, seed=seed, slice="production")
    for name, spec in GOLDEN_PRODUCTION_CASES.items():
        inputs = layer_inputs(cfg, spec["lengths"], spec["T"], seed=seed, spare_pages=1)
        cases[name] = Case(name, inputs, dict(dims, lengths=list(spec["lengths"]), T=spec["T"]))
    return cases


def _args(case: Case, dtype: torch.dtype, *, fp8_cache: bool = False) -> tuple[Any, ...]:
    x = case.inputs
    cache = mla.quantize(x["cache"], FP8_CACHE) if fp8_cache else x["cache"].to(dtype)
    return x["q_nope"].to(dtype), x["q_pe"].to(dtype), cache, x["w_uk"].to(dtype), x["w_uv"].to(dtype)


def oracle(case: Case) -> torch.Tensor:
    """The expanded definition in fp64 (cached on the case)."""
    if "oracle" not in case.cache:
        case.cache["oracle"] = mla.expanded(*_args(case, torch.float64))
    return case.cache["oracle"]


def baseline(case: Case, dtype: str, family: str = "recurrent") -> torch.Tensor:
    """The plain definition with every stored tensor in ``dtype`` (cached per dtype).

    MLA has one baseline family, the definition (``family`` is accepted for the registry's
    signature and must be ``"recurrent"``). For ``fp8_e4m3`` the baseline stores what an
    fp8-cache kernel stores: the latent cache quantised per token (the same quantiser), every
    other tensor in bf16.
    """
    if family != "recurrent":
        raise ValueError(f"MLA has a single baseline family 'recurrent' (the definition), got {family!r}")
    key = f"baseline:{dtype}"
    if key not in case.cache:
        if dtype_name(dtype) == FP8_CACHE:
            args = _args(case, torch.float64, fp8_cache=True)
            case.cache[key] = mla.naive_baseline(*args, dtype=FP8_CACHE_OPERANDS)
        else:
            case.cache[key] = mla.naive_baseline(*_args(case, torch.float64), dtype=dtype)
    return case.cache[key]


def _tiled_options(case: Case, tiling: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    opts = dict(tiling)
    fp8_cache = opts.pop("cache", None) == FP8_CACHE
    return _args(case, torch.float64, fp8_cache=fp8_cache), opts


def _tiled_predict(case: Case, **tiling: Any) -> Prediction:
    args, opts = _tiled_options(case, tiling)
    key = f"quantities:{tiling.get('cache')}:{opts.get('num_splits', 1)}"
    if key not in case.cache:
        case.cache[key] = mla.overflow_quantities(*args, num_splits=opts.get("num_splits", 1))
    q = case.cache[key]
    p = mla.predict(q, operand_dtype=opts["operand_dtype"], subtract_max=opts.get("subtract_max", True))
    return Prediction(p.finite, f"max score {q.max_score:.2f} (bound {q.score_bound:.2f}); {p.explanation()}")


def _tiled_explain(case: Case, **tiling: Any) -> list[str]:
    args, opts = _tiled_options(case, tiling)
    return [e.describe() for e in mla.explain_overflow(*args, **opts)[:3]]


def _tiled(dtype: str, cases: tuple[str, ...] = ("default", "decode"), **extra: Any) -> Implementation:
    """A tiled row; ``dtype`` is the comparison dtype (``fp8_e4m3`` = fp8 cache, bf16 operands)."""
    tiling = dict(tile=TILE) | extra
    if dtype == FP8_CACHE:
        tiling |= dict(operand_dtype=FP8_CACHE_OPERANDS, cache=FP8_CACHE)
    else:
        tiling |= dict(operand_dtype=dtype)

    def run(case: Case) -> torch.Tensor:
        args, opts = _tiled_options(case, tiling)
        return mla.tiled(*args, **opts)

    shown = {k: v for k, v in tiling.items() if k != "operand_dtype"}
    if dtype == FP8_CACHE:
        shown["operands"] = FP8_CACHE_OPERANDS
    exact = dtype == "fp64"
    return Implementation(
        module="mla",
        implementation="k3verify",
        form="tiled" if tiling.get("num_splits", 1) == 1 else "tiled:split-kv",
        dtype=dtype,
        params=shown,
        rule=FP64_RULE if exact else BASELINE_RULE,
        run=run,
        predict=None if exact else partial(_tiled_predict, **tiling),
        explain=partial(_tiled_explain, **tiling),
        cases=cases,
    )


def _reference_form(form: str, dtype: str, cases: tuple[str, ...] = ("default", "decode"), **kw: Any) -> Implementation:
    fn = getattr(mla, form)
    torch_dtype = {"fp64": torch.float64, "fp32": torch.float32}[dtype]
    return Implementation(
        module="mla",
        implementation="k3verify",
        form=form,
        dtype=dtype,
        params=kw,
        rule=FP64_RULE if dtype == "fp64" else BASELINE_RULE,
        run=lambda case: fn(*_args(case, torch_dtype), **kw),
        cases=cases,
    )


def implementations() -> list[Implementation]:
    """What ``k3verify run`` verifies for Gated MLA."""
    return [
        _reference_form("recurrent", "fp64"),
        _reference_form("chunkwise", "fp64", chunk_size=CHUNK),
        _tiled("fp64"),
        _tiled("fp64", num_splits=SPLITS, cases=("decode",)),
        _reference_form("recurrent", "fp32"),
        _reference_form("chunkwise", "fp32", chunk_size=CHUNK),
        _tiled("bf16", cases=("default", "decode", "hot")),
        _tiled("fp16"),
        _tiled(FP8_CACHE),
        _tiled("bf16", num_splits=SPLITS),
        # The known-bad softmax without max subtraction: fine at unit scores, predicted and
        # observed non-finite on the hot case (an expected-nonfinite row, not a failure).
        _tiled("bf16", subtract_max=False, cases=("default", "hot")),
    ]


# --- overflow map ---------------------------------------------------------------------

MAP_CONFIG = dataclasses.replace(CONFIG, num_heads=2)
MAP_DTYPES = ("bf16", "fp16", FP8_CACHE)
MAP_VARIANTS = ("subtract_max", "no_max")
MAP_SCALE_EXPONENTS = tuple(range(0, 19, 2))  # 2^0 .. 2^18: past fp16's 65504 for the operands
MAP_CONTEXTS = (16, 128, 512)
MAP_TILES = (16, 64, 256)
QUICK_SCALE_EXPONENTS = (0, 6, 12, 18)
QUICK_CONTEXTS = (16, 128)
QUICK_TILES = (16, 64)


def _map_inputs(context: int, seed: int) -> dict[str, Any]:
    """One request, a full prefill of ``context`` tokens, 2 heads of the small configuration."""
    return layer_inputs(MAP_CONFIG, (context,), context, seed=seed, spare_pages=1)


def _scaled(base: dict[str, Any], q_exp: float, latent_exp: float, fp8_cache: bool) -> tuple[Any, ...]:
    qs, ls = 2.0**q_exp, 2.0**latent_exp
    c = base["cache"]
    cache = mla.LatentCache(c.pool * ls, c.block_table, c.seq_lens)  # NaN poison stays NaN
    if fp8_cache:
        cache = mla.quantize(cache, FP8_CACHE)
    return base["q_nope"] * qs, base["q_pe"] * qs, cache, base["w_uk"], base["w_uv"]




def overflow_map(options: MapOptions, progress: Callable[[int, int], None] = lambda done, total: None) -> MapResult:
    """Sweep query scale x latent scale x context x operand dtype x tile x softmax variant.

    ``options.x_values`` overrides the query-scale exponents (log2). Every cell runs
    :func:`k3verify.mla.tiled` on one prefill whose queries are multiplied by ``2^q`` and
    whose cached entries by ``2^l``, and compares against the fp64 oracle; its prediction comes
    from :func:`k3verify.mla.predict` on the exact magnitudes of the same inputs.
    """
    # The map's tensors are small (at most 512 x 72), so a second thread gains nothing, and when
    # another process competes for the cores OpenMP's spin-waiting made the quick map 4x slower
    # (measured on two cores with one busy process: 11.6 s with two threads, 2.7 s with one).
    with one_thread():
        return _overflow_map(options, progress)


def _overflow_map(options: MapOptions, progress: Callable[[int, int], None]) -> MapResult:
    start = time.perf_counter()
    q_exps = list(options.x_values) if options.x_values is not None else list(
        QUICK_SCALE_EXPONENTS if options.quick else MAP_SCALE_EXPONENTS)
    l_exps = list(QUICK_SCALE_EXPONENTS if options.quick else MAP_SCALE_EXPONENTS)
    contexts = QUICK_CONTEXTS if options.quick else MAP_CONTEXTS
    tiles = QUICK_TILES if options.quick else MAP_TILES
    per_input = list(itertools.product(MAP_DTYPES, MAP_VARIANTS, tiles))
    total, done = len(contexts) * len(q_exps) * len(l_exps) * len(per_input), 0
    cells: list[dict[str, Any]] = []
    for context in contexts:
        base = _map_inputs(context, options.seed)
        for q_exp, l_exp in itertools.product(q_exps, l_exps):
            oracle_output = None
            for fp8_cache in (False, True):
                args = _scaled(base, q_exp, l_exp, fp8_cache)
                # An fp8 cell is predicted from the dequantised latents the kernel reads, but
                # judged against the oracle of the unquantised inputs (storage error included).
                quantities = mla.overflow_quantities(*args)
                oracle_output = quantities.output if oracle_output is None else oracle_output
                for dtype, variant, tile in per_input:
                    if (dtype == FP8_CACHE) != fp8_cache:
                        continue
                    cells.append(_map_cell(args, quantities, oracle_output, context, q_exp, l_exp, dtype, variant,
                                           tile))
                    done += 1
                    progress(done, total)
    axes = {"log2_q_scale": q_exps, "log2_latent_scale": l_exps, "context": list(contexts), "tile": list(tiles)}
    mark_frontier(cells, axes, fixed=("dtype", "variant"))
    spec = MapSpec(
        x="log2_q_scale",
        y="log2_latent_scale",
        panel_row="dtype",
        panel_col="context",
        figure="setting",
        x_label="log2 query scale",
        y_label="log2 latent scale",
        title="Gated MLA tiled (latent) form: overflow and error vs the fp64 oracle",
    )
    meta = {
        "config": dataclasses.asdict(MAP_CONFIG),
        "page_size": PAGE_SIZE,
        "log2_q_scale": q_exps,
        "log2_latent_scale": l_exps,
        "contexts": list(contexts),
        "tiles": list(tiles),
        "dtypes": {"bf16": "bf16 operands", "fp16": "fp16 operands",
                   FP8_CACHE: f"fp8 e4m3 latent cache (per-token amax/448 scales), {FP8_CACHE_OPERANDS} operands"},
        "variants": {"subtract_max": "online softmax with running max (FlashAttention)",
                     "no_max": "P = exp(s) without max subtraction (known bad)"},
        "inputs": "one request, prefill of `context` tokens from random x through the small layer; queries x 2^q, "
                  "cached entries [ĉ ; k^p] x 2^l",
        "prediction": "finite iff every stored tensor fits its dtype (ln|x| < ln max): inputs, q̃, latents, õ in the "
                      "operand dtype, o in the output dtype, scores in fp32; without max subtraction also "
                      "max score < ln max (P = e^s), max row log-sum-exp and ln Σ e^s|ĉ| < ln max fp32, and every "
                      "row max > ln(smallest fp32 subnormal / 2) (else l = 0 and 0/0). Magnitudes are the exact "
                      "(fp64) ones of the cell's inputs.",
        "score_bound": "|s| <= τ max‖[q̃;q^p]‖ max‖[ĉ;k^p]‖ (Cauchy–Schwarz), recorded per cell as score_bound",
        "agreement": {
            "all": agreement(cells),
            **{v: agreement(cells, only=lambda c, v=v: c["variant"] == v) for v in MAP_VARIANTS},
            **{d: agreement(cells, only=lambda c, d=d: c["dtype"] == d) for d in MAP_DTYPES},
        },
        "runtime_s": time.perf_counter() - start,
    }
    return MapResult("mla", cells, spec, meta)


def _map_cell(args: tuple[Any, ...], quantities: mla.OverflowQuantities, oracle_output: torch.Tensor, context: int,
              q_exp: float, l_exp: float, dtype: str, variant: str, tile: int) -> dict[str, Any]:
    operand = FP8_CACHE_OPERANDS if dtype == FP8_CACHE else dtype
    subtract_max = variant == "subtract_max"
    o, events = mla.tiled_traced(*args, tile=tile, operand_dtype=operand, subtract_max=subtract_max)
    m = compare(o, oracle_output, ulp_dtype=dtype_name(o.dtype))
    p = mla.predict(quantities, operand_dtype=operand, subtract_max=subtract_max)
    cell = {
        "module": "mla",
        "dtype": dtype,
        "operand_dtype": operand,
        "tile": tile,
        "context": context,
        "variant": variant,
        "setting": f"{variant}_tile{tile}",
        "log2_q_scale": q_exp,
        "log2_latent_scale": l_exp,
        "q_scale": 2.0**q_exp,
        "latent_scale": 2.0**l_exp,
        "finite": m.nonfinite == 0,
        "predicted_finite": p.finite,
        "rms_ratio": m.rms_ratio,
        "max_abs": m.max_abs,
        "nonfinite": m.nonfinite,
        "max_score": quantities.max_score,
        "score_bound": quantities.score_bound,
        "min_row_max": quantities.min_row_max,
        "max_lse": quantities.max_lse,
        "binding": p.binding,
        "headroom": p.headroom,
        "explanation": p.explanation(),
    }
    if m.nonfinite:
        cell["overflow"] = events[0].describe() if events else "non-finite output with no stored tensor overflowing"
    return cell


register(
    ModuleEntry(
        name="mla",
        title="Gated MLA",
        make_cases=make_cases,
        oracle=oracle,
        baseline=baseline,
        implementations=implementations,
        overflow_map=overflow_map,
        golden_cases=golden_cases,
        position_axis=1,  # o: [B, T, H, Dv]
        input_types=(mla.LatentCache,),
    )
)
