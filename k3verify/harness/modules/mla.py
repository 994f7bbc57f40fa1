"""Registry entry for Gated MLA: named outputs ``o`` and ``cache``, the implementations and the
overflow map, declared; inputs come from :mod:`k3verify.mla.samples`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from functools import lru_cache, partial, wraps
from typing import Any

import torch

from ... import mla
from ...adapters import tokenspeed, torch_flex, torch_sdpa
from ...mla import kernels, samples
from ...mla.samples import PAGE_SIZE
from ...numerics import dtype_name, is_float8, resolve_dtype, rule_for
from ..environment import one_thread
from ..guard import checked_call
from ..overflow_map import MapDefinition, MapOptions, MapSpec, SweptForm, agreement
from ..registry import (
    BASELINE_RULE,
    Case,
    Implementation,
    ModuleEntry,
    Outputs,
    Peer,
    Prediction,
    ShardedForm,
    cases_from,
    listed,
    register,
    unavailable_as,
)
from ..tp_rows import replicated

OUTPUTS = ("o", "cache")
CHUNK = 8
TILE = 16
SPLITS = 4
# The fp8 dtype of a row means the latent cache in fp8 e4m3 with per-token scales, every other
# tensor in bf16 (what fp8-cache MLA kernels do).
FP8_CACHE = "fp8_e4m3"
FP8_CACHE_OPERANDS = "bf16"


FORM_ARGS = ("q_nope", "q_pe", "cache", "w_uk", "w_uv")


def form_args(inputs: dict[str, Any], dtype: torch.dtype | str) -> tuple[Any, ...]:
    """``(q_nope, q_pe, cache, w_uk, w_uv)`` in ``dtype``: an fp8 ``dtype`` quantises the cache per
    token to it (a quantised cache stays as it is) and casts the rest to bf16. The cache is a
    copy, so a function that writes into it cannot change the case."""
    dt = resolve_dtype(dtype)
    cache: mla.LatentCache = inputs["cache"]
    if is_float8(dt):
        cache = cache if cache.quantized else mla.quantize(cache, dt)
        dt = resolve_dtype(FP8_CACHE_OPERANDS)
    else:
        cache = cache.to(dt)
    cache = cache.clone()
    x = {n: inputs[n].to(dt) for n in ("q_nope", "q_pe", "w_uk", "w_uv")}
    return x["q_nope"], x["q_pe"], cache, x["w_uk"], x["w_uv"]


def call(fn: Callable, case: Case, dtype: torch.dtype | str, **options: Any) -> Outputs:
    """``fn`` with the MLA forms' signature on the case's inputs in ``dtype`` (see :func:`form_args`):
    ``{"o": [B, T, H, Dv], "cache": [B, Lmax, R + Dr]}``. ``cache`` is the live contents of the
    cache ``fn`` leaves behind (:func:`k3verify.mla.live_entries`): the one it was given, written
    in place or not, or the :class:`~k3verify.mla.LatentCache` it returns as ``(o, cache)``."""
    args = form_args(case.inputs, dtype)
    # The cache is the one argument a kernel may write into (new entries) and hand back.
    result = checked_call(fn, args, FORM_ARGS, options, writable=("cache",))
    o, cache = result if isinstance(result, tuple) else (result, None)
    return {"o": o, "cache": mla.live_entries(args[2] if cache is None else cache)}


def oracle(case: Case) -> Outputs:
    """The expanded definition in fp64 and the case's fp64 cache entries."""
    return call(mla.expanded, case, torch.float64)


def _exact_args(case: Case, cache_storage: str | None = None) -> tuple[Any, ...]:
    """fp64 inputs, the cache quantised to ``cache_storage`` when given: what predictions read
    (the exact magnitudes a kernel meets, with the fp8 cache it stores)."""
    key = f"exact:{cache_storage}"
    if key not in case.cache:
        x = case.inputs
        cache = mla.quantize(x["cache"], cache_storage) if cache_storage else x["cache"]
        case.cache[key] = (x["q_nope"], x["q_pe"], cache, x["w_uk"], x["w_uv"])
    return case.cache[key]


def baseline(case: Case, dtype: str, family: str = "recurrent") -> Outputs:
    """The plain definition with every stored tensor in ``dtype`` and the cache such an
    implementation stores. For an fp8 ``dtype``: the cache quantised per
    token (the same quantiser), every other tensor in bf16.

    MLA has one baseline family, the definition (``family`` must be ``"recurrent"``).
    """
    if family != "recurrent":
        raise ValueError(f"MLA has a single baseline family 'recurrent' (the definition), got {family!r}")
    name = dtype_name(dtype)
    fp8 = is_float8(name)
    o = mla.naive_baseline(*_exact_args(case, name if fp8 else None), dtype=FP8_CACHE_OPERANDS if fp8 else name)
    return {"o": o, "cache": mla.live_entries(form_args(case.inputs, name)[2])}


def _quantities(case: Case, cache_storage: str | None, num_splits: int = 1) -> mla.OverflowQuantities:
    key = f"quantities:{cache_storage}:{num_splits}"
    if key not in case.cache:
        case.cache[key] = mla.overflow_quantities(*_exact_args(case, cache_storage), num_splits=num_splits)
    return case.cache[key]


def _predict(case: Case, dtype: str, **options: Any) -> Prediction:
    q = _quantities(case, dtype if is_float8(dtype) else None, options.get("num_splits", 1))
    p = mla.predict(q, **options)
    return Prediction(p.finite, f"max score {q.max_score:.2f} (bound {q.score_bound:.2f}); {p.explanation()}")


def _explain(case: Case, dtype: str, **options: Any) -> list[str]:
    return mla.explain_overflow(*form_args(case.inputs, dtype), **options)[:3]


def _form(form: str, dtype: str, cases: tuple[str, ...] = ("default", "decode"), **options: Any) -> Implementation:
    """One of our forms on the case's inputs in ``dtype``; ``tiled`` rounds its operands to
    ``dtype`` (bf16 with an fp8 cache), and splits the keys when ``num_splits`` is given."""
    fp8 = dtype == FP8_CACHE
    tiled = form == "tiled"
    shown = dict(options)
    if tiled:
        shown = dict(tile=TILE) | options | (dict(cache=FP8_CACHE, operands=FP8_CACHE_OPERANDS) if fp8 else {})
        options = dict(tile=TILE) | options | dict(operand_dtype=FP8_CACHE_OPERANDS if fp8 else dtype)
        form = "tiled" if options.get("num_splits", 1) == 1 else "tiled:split-kv"
    exact = dtype == "fp64"
    return Implementation(
        module="mla", implementation="k3verify", form=form, dtype=dtype, params=shown,
        rule=rule_for(dtype),
        run=partial(call, getattr(mla, "tiled" if tiled else form), dtype=dtype, **options),
        predict=partial(_predict, dtype=dtype, **options) if tiled and not exact else None,
        explain=partial(_explain, dtype=dtype, **options) if tiled else None,
        cases=cases,
    )


def _kernel_map_points(point: dict[str, Any]) -> bool:
    """Under Triton's interpreter a kernel has map cells at the smallest context only (a cell of
    128 tokens costs about a second there: the full map took 334 s against 56 s without them);
    on a GPU at every point."""
    return not kernels.interpreted() or point["context"] <= min(QUICK_CONTEXTS)


# Whose speed `run --time` sets our bf16 kernels' beside: torch's own attention on the same call
# (SDPA's efficient backend: its flash backend refuses K3's head widths, q/k 192 and v 128).
TORCH_PEERS = {"decode": Peer("torch flex_attention", "kernel:decode"),
               "prefill": Peer("torch sdpa", "kernel:prefill", {"backend": "efficient"})}


def _kernel(dtype: str, cases: tuple[str, ...] = ("default", "decode", "hot"), kind: str = "decode",
            **options: Any) -> Implementation:  # fmt: skip
    """One of our kernels (``kind``: the absorbed paged decode or the expanded chunked prefill):
    fp32 and fp16 wherever Triton runs (the interpreter is faithful there), bf16 and the fp8
    cache (bf16 operands) on a CUDA device only; held to the plain definition storing the same
    dtype (an fp8 row: the fp8-cache baseline)."""
    fp8 = dtype == FP8_CACHE
    # The decode kernel stores what the tiled form stores (q̃, the latents and o in the operand
    # dtype; its latent output stays fp32, a convex combination of latents that fit), so its
    # map cells take the tiled form's prediction. (The prefill kernel also stores the expanded
    # k^n and v, which that prediction does not model: no map cells yet.)
    in_map = kind == "decode" and dtype != "fp32"
    return Implementation(
        module="mla", implementation="k3verify", form=f"kernel:{kind}", dtype=dtype,
        params=dict(options) | (dict(cache=FP8_CACHE, operands=FP8_CACHE_OPERANDS) if fp8 else {}),
        rule=BASELINE_RULE, run=partial(call, getattr(kernels, kind), dtype=dtype, **options), cases=cases,
        predict=partial(_predict, dtype=dtype, operand_dtype=FP8_CACHE_OPERANDS if fp8 else dtype, **options)
        if in_map else None, in_map=in_map, map_points=_kernel_map_points if in_map else None,
        is_available=unavailable_as(partial(kernels.unavailable_reason, FP8_CACHE_OPERANDS if fp8 else dtype)),
        peer=TORCH_PEERS[kind] if dtype == "bf16" else None,
    )  # fmt: skip


def _sdpa(backend: str) -> Implementation:
    """torch's SDPA on one CUDA backend, the expanded prefill in bf16
    (:mod:`k3verify.adapters.torch_sdpa` says what it computes); a backend that refuses K3's
    head widths fails with its own message."""
    return Implementation(
        module="mla", implementation="torch sdpa", form="kernel:prefill", dtype="bf16", params=dict(backend=backend),
        source=f"adapter: torch {torch.__version__}", rule=BASELINE_RULE,
        run=partial(call, partial(torch_sdpa.prefill, backend=backend), dtype="bf16"),
        cases=("default", "hot"), is_available=unavailable_as(partial(torch_sdpa.unavailable_reason, backend)),
    )  # fmt: skip


def _flex() -> Implementation:
    """torch's compiled flex_attention on the absorbed decode in bf16
    (:mod:`k3verify.adapters.torch_flex` says what it computes)."""
    return Implementation(
        module="mla", implementation="torch flex_attention", form="kernel:decode", dtype="bf16", params={},
        source=f"adapter: torch {torch.__version__}", rule=BASELINE_RULE,
        run=partial(call, torch_flex.decode, dtype="bf16"), cases=("default", "decode", "hot"),
        is_available=unavailable_as(torch_flex.unavailable_reason),
    )  # fmt: skip


# The production MLA kernels of TokenSpeed's wheels, listed so a report shows why they do not run here
# (k3verify.adapters.tokenspeed): each distribution and the form it would fill.
PRODUCTION = (("tokenspeed-flashmla", "kernel:decode", ("default", "decode", "hot")),
              ("tokenspeed-mla", "kernel:decode", ("default", "decode", "hot")),
              ("tokenspeed-fa3", "kernel:prefill", ("default", "hot")))


def _production(distribution: str, form: str, cases: tuple[str, ...]) -> Implementation:
    """A production kernel's row, always ``unavailable`` with the reason (not installed, no GPU it
    is built for, another torch, or no adapter yet): k3verify does not call these kernels."""
    return listed("mla", tokenspeed.WHEELS[distribution].name, form, "bf16",
                  partial(tokenspeed.unavailable_reason, distribution), cases)


def own_implementations() -> list[Implementation]:
    """What ``k3verify run`` verifies for Gated MLA."""
    return [
        _form("recurrent", "fp64"),
        _form("chunkwise", "fp64", chunk_size=CHUNK),
        _form("tiled", "fp64"),
        _form("tiled", "fp64", ("decode",), num_splits=SPLITS),
        _form("recurrent", "fp32"),
        _form("chunkwise", "fp32", chunk_size=CHUNK),
        _form("tiled", "bf16", ("default", "decode", "hot")),
        _form("tiled", "fp16"),
        _form("tiled", FP8_CACHE),
        _form("tiled", "bf16", num_splits=SPLITS),
        # The known-bad softmax without max subtraction: fine at unit scores, predicted and
        # observed non-finite on the hot case (an expected-nonfinite row, not a failure).
        _form("tiled", "bf16", ("default", "hot"), subtract_max=False),
        _kernel("fp32"),
        _kernel("fp32", ("decode",), num_splits=SPLITS),
        _kernel("fp16", ("decode", "hot"), num_splits=SPLITS),
        _kernel("bf16"),
        _kernel("bf16", num_splits=SPLITS),
        _kernel(FP8_CACHE, num_splits=SPLITS),
        _kernel("fp32", kind="prefill"),
        _kernel("fp16", ("default", "hot"), kind="prefill"),
        _kernel("bf16", kind="prefill"),
        _kernel(FP8_CACHE, ("default",), kind="prefill"),
        *(_sdpa(backend) for backend in torch_sdpa.BACKENDS),
        _flex(),
        *(_production(*row) for row in PRODUCTION),
    ]


# --- overflow map ---------------------------------------------------------------------

MAP_DTYPES = ("bf16", "fp16", FP8_CACHE)
MAP_VARIANTS = ("subtract_max", "no_max")
MAP_SCALE_EXPONENTS = tuple(range(0, 19, 2))  # 2^0 .. 2^18: past fp16's 65504 for the operands
MAP_CONTEXTS = (16, 128, 512)
MAP_TILES = (16, 64, 256)
QUICK_SCALE_EXPONENTS = (0, 6, 12, 18)
QUICK_CONTEXTS = (16, 128)
QUICK_TILES = (16, 64)
MAP_FORM = "k3verify tiled"
NO_OVERFLOW_EVENT = "non-finite output with no stored tensor overflowing"


def _single_threaded(fn: Callable) -> Callable:
    # The map's tensors are small (at most 512 x 72), so a second thread gains nothing, and when
    # another process competes for the cores OpenMP's spin-waiting made the quick map 4x slower
    # (measured on two cores with one busy process: 11.6 s with two threads, 2.7 s with one).
    @wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with one_thread():
            return fn(*args, **kwargs)

    return run


def _map_points(options: MapOptions) -> list[dict[str, Any]]:
    """Every (context, query scale, latent scale); ``options.x_values`` overrides the query
    scale exponents (log2)."""
    q_exps = list(options.x_values) if options.x_values is not None else list(
        QUICK_SCALE_EXPONENTS if options.quick else MAP_SCALE_EXPONENTS)
    l_exps = QUICK_SCALE_EXPONENTS if options.quick else MAP_SCALE_EXPONENTS
    contexts = QUICK_CONTEXTS if options.quick else MAP_CONTEXTS
    return [{"context": c, "log2_q_scale": q, "log2_latent_scale": la, "q_scale": 2.0**q, "latent_scale": 2.0**la}
            for c in contexts for q, la in itertools.product(q_exps, l_exps)]


@lru_cache(maxsize=2)
def _map_base(context: int, seed: int) -> dict[str, Any]:
    return samples.map_inputs(context, seed)


@_single_threaded
def _map_case(point: dict[str, Any], seed: int) -> Case:
    inputs = samples.scaled(_map_base(point["context"], seed), point["log2_q_scale"], point["log2_latent_scale"])
    return Case("map", inputs, dict(point, seed=seed))


@_single_threaded
def _map_reference(case: Case) -> torch.Tensor:
    # An fp8 cell is predicted from the dequantised latents the kernel reads, but judged against
    # the oracle of the unquantised inputs (storage error included).
    return _quantities(case, None).output


def _map_forms(options: MapOptions) -> list[SweptForm]:
    """The tiled form on fp64 inputs (so an input that overflows its operand dtype is traced as
    such), the cache quantised first for the fp8 rows."""
    tiles = QUICK_TILES if options.quick else MAP_TILES
    forms = []
    for dtype, variant, tile in itertools.product(MAP_DTYPES, MAP_VARIANTS, tiles):
        storage = dtype if is_float8(dtype) else None
        tiling = dict(tile=tile, operand_dtype=FP8_CACHE_OPERANDS if storage else dtype,
                      subtract_max=variant == "subtract_max")

        @_single_threaded
        def run(case: Case, storage: str | None = storage, tiling: dict[str, Any] = tiling) -> tuple[Any, list[str]]:
            o, events = mla.tiled_traced(*_exact_args(case, storage), **tiling)
            lines = [e.describe() for e in events[:1]] or ([] if bool(o.isfinite().all()) else [NO_OVERFLOW_EVENT])
            return o, lines

        params = {"dtype": dtype, "operand_dtype": tiling["operand_dtype"], "tile": tile, "variant": variant,
                  "setting": f"{variant}_tile{tile}"}
        forms.append(SweptForm(MAP_FORM, params, tiling["operand_dtype"], run=run,
                               predict=_single_threaded(lambda case, s=storage, t=tiling: mla.predict(
                                   _quantities(case, s), **t))))
    return forms


def _grid(cells: list[dict[str, Any]], key: str) -> list[Any]:
    # Numbers in order, then any label a registered implementation's cell carries on that axis.
    return sorted({c[key] for c in cells}, key=lambda v: (isinstance(v, str), v))


def _map_meta(cells: list[dict[str, Any]], options: MapOptions) -> dict[str, Any]:
    own = [c for c in cells if c["implementation"] == MAP_FORM]
    return {
        "config": dataclasses.asdict(samples.MAP_CONFIG),
        "page_size": PAGE_SIZE,
        "log2_q_scale": _grid(own, "log2_q_scale"),
        "log2_latent_scale": _grid(own, "log2_latent_scale"),
        "contexts": _grid(own, "context"),
        "tiles": _grid(own, "tile"),
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
            **{v: agreement(cells, only=lambda c, v=v: c["variant"] == v) for v in MAP_VARIANTS},
            **{d: agreement(cells, only=lambda c, d=d: c["dtype"] == d) for d in MAP_DTYPES},
        },
    }


MAP = MapDefinition(
    points=_map_points,
    make_case=_map_case,
    reference=_map_reference,
    forms=_map_forms,
    spec=MapSpec(
        x="log2_q_scale",
        y="log2_latent_scale",
        panel_row="dtype",
        panel_col="context",
        figure="setting",
        x_label="log2 query scale",
        y_label="log2 latent scale",
        title="Gated MLA tiled (latent) form: overflow and error vs the fp64 oracle",
        operating_point=(("log2_q_scale", 0), ("log2_latent_scale", 0)),
        operating_label="K3 (queries and latents at the layer's own scale)",
    ),
    frontier_axes=lambda cells: {k: _grid(cells, k) for k in ("log2_q_scale", "log2_latent_scale", "context", "tile")},
    fixed=("implementation", "dtype", "variant"),
    meta=_map_meta,
    registered_keys=lambda impl: {"tile": impl.params.get("tile", TILE),
                                  "variant": "subtract_max" if impl.params.get("subtract_max", True) else "no_max"},
)


register(
    ModuleEntry(
        name="mla",
        title="Gated MLA",
        make_cases=lambda seed: cases_from(samples.make_cases(seed)),
        oracle=oracle,
        baseline=baseline,
        own_implementations=own_implementations,
        outputs=OUTPUTS,
        output_axes={"o": ("b", "t", "h", "v"), "cache": ("b", "l", "w")},
        call=call,
        overflow_map=MAP,
        golden_cases=lambda seed: cases_from(samples.golden_cases(seed)),
        position_axis=1,  # o: [B, T, H, Dv]
        input_types=(mla.LatentCache,),
        strategy=samples.strategy,
        sharded=ShardedForm(
            "k3verify.mla.sharded", ("y", "cache"), position_axis=1,
            gather=lambda ranks: {"y": replicated(ranks, "y"), "cache": replicated(ranks, "entries")},
        ),
    )
)
