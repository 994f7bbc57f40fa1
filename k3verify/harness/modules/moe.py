"""Registry entry for Stable LatentMoE: cases, oracle, baseline, implementations and the overflow map.

Routing is discontinuous: a form that picks another expert for a near-tied token is off by O(1)
on that token. Every form routes with SPEC's FP32 router on the layer input as given (operand
rounding never reaches it), so a low-precision row can differ from the fp64 oracle's choices
only where fp32 rounding of the logits crosses a top-k boundary; each case records the smallest
top-k gap of its biased scores and whether fp32 and fp64 choose alike (they do on every built-in
case). What bf16 logits would change is measured apart, as a changed-choice fraction
(``meta["routing_flips"]`` of the map).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ... import moe
from ...numerics import compare, dtype_name
from ..overflow_map import MapOptions, MapResult, MapSpec, agreement, mark_frontier
from ..registry import BASELINE_RULE, FP64_RULE, Case, Implementation, ModuleEntry, Prediction, register
from ..runner import one_thread as _one_thread

# The small layer with ρ = 2.827 (the public test's value) so that ρ is exercised.
CONFIG = moe.MoEConfig.small(routed_scaling_factor=2.827)
TOKENS = 64
CALIBRATION_TOKENS = 512
BALANCING_STEPS = 3
TILING = dict(tile_m=16, tile_k=16)
HOT_EXPERTS = 4  # the skewed case sends every token to these
HOT_BIAS = 8.0  # > the range of σ, so the bias alone decides
# Input scale of the "scaled" cases: SwiGLU's hidden g σ(g) u reaches ~1e6 > 65504 (fp16) while
# x and z (~1e3) still fit fp16 and SiTU's hidden stays within 100.
SCALED_EXPONENT = 8


def calibrated_weights(cfg: moe.MoEConfig, *, seed: int = 0, tokens: int = CALIBRATION_TOKENS,
                       steps: int = BALANCING_STEPS) -> moe.MoEWeights:
    """Random weights whose bias is trained by Quantile Balancing on ``steps`` fresh batches of
    unit-scale tokens (each step computed on one batch and applied to the next)."""
    w = moe.init_weights(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    bias = w.bias
    for _ in range(steps):
        x = torch.randn(tokens, cfg.hidden_size, generator=gen, dtype=torch.float64)
        scores = torch.sigmoid(moe.router_logits(x, w.w_router, cfg))
        bias = moe.quantile_balancing(scores, bias, cfg.top_k)
    return dataclasses.replace(w, bias=bias)


def _routing_params(x: torch.Tensor, w: moe.MoEWeights, cfg: moe.MoEConfig) -> dict[str, Any]:
    """How safe the case's routing is: smallest top-k gap, and fp32 vs fp64 choices."""
    r64 = moe.routing_for(x, w, cfg, None, torch.float64)
    r32 = moe.routing_for(x, w, cfg, None, torch.float32)
    gap = moe.topk_gap(r64.scores, w.bias, cfg.top_k)
    load = moe.expert_load(r64.indices, cfg.num_experts)
    return {
        "min_topk_gap": float(gap.min()) if gap.numel() else math.inf,
        "fp32_routing_equals_fp64": bool(torch.equal(r32.indices, r64.indices)),
        "idle_experts": int((load == 0).sum()),
        "load_imbalance": moe.imbalance(load),
    }


def make_cases(seed: int = 0) -> dict[str, Case]:
    """``default`` (64 tokens), ``decode`` (one token), ``skewed`` (every token to the same 4
    experts, 12 idle), ``scaled`` / ``scaled_swiglu`` (inputs × 2^8, SiTU and SwiGLU)."""
    w = calibrated_weights(CONFIG, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(TOKENS, CONFIG.hidden_size, generator=gen, dtype=torch.float64)
    hot = w.bias.clone()
    hot[:HOT_EXPERTS] += HOT_BIAS
    swiglu = dataclasses.replace(CONFIG, activation="swiglu")
    scale = 2.0**SCALED_EXPONENT
    specs = {
        "default": (x, w, CONFIG, {}),
        "decode": (x[:1], w, CONFIG, {}),
        "skewed": (x, dataclasses.replace(w, bias=hot), CONFIG, {"hot_experts": HOT_EXPERTS}),
        "scaled": (x * scale, w, CONFIG, {"input_scale": scale}),
        "scaled_swiglu": (x * scale, w, swiglu, {"input_scale": scale}),
    }
    base = dict(E=CONFIG.num_experts, k=CONFIG.top_k, d=CONFIG.hidden_size, Dl=CONFIG.latent_size,
                H=CONFIG.expert_hidden, Hs=CONFIG.shared_hidden, rho=CONFIG.routed_scaling_factor, seed=seed,
                bias="Quantile Balancing, 3 steps of 512 tokens")
    cases = {}
    for name, (xc, wc, cfg, extra) in specs.items():
        params = base | {"T": xc.shape[0], "activation": cfg.activation} | extra | _routing_params(xc, wc, cfg)
        cases[name] = Case(name, {"x": xc, "weights": wc, "config": cfg}, params)
    return cases


def _call(form: Callable[..., Any], case: Case, input_dtype: torch.dtype, **kw: Any) -> Any:
    """``form(x, weights, config, **kw)`` on the case's inputs cast to ``input_dtype``."""
    x = case.inputs
    return form(x["x"].to(input_dtype), x["weights"].to(input_dtype), x["config"], **kw)


def oracle(case: Case) -> torch.Tensor:
    """The recurrent definition in fp64 (cached on the case)."""
    if "oracle" not in case.cache:
        case.cache["oracle"] = _call(moe.recurrent, case, torch.float64)
    return case.cache["oracle"]


def baseline(case: Case, dtype: str, family: str = "recurrent") -> torch.Tensor:
    """The definition with every stored tensor in ``dtype`` (cached per dtype and family).

    ``family`` is ``"recurrent"`` or, for fp8 rows, ``"recurrent/<fp8_scaling>"``: the baseline
    quantises its fp8 operands exactly as the row's kernel does (the same quantiser).
    """
    form, _, scaling = family.partition("/")
    if form != "recurrent":
        raise ValueError(f"MoE baselines are the recurrent definition, got family {family!r}")
    key = f"baseline:{family}:{dtype}"
    if key not in case.cache:
        case.cache[key] = _call(moe.naive_baseline, case, torch.float64, dtype=dtype,
                                fp8_scaling=scaling or "per_row")
    return case.cache[key]


def _quantities(case: Case) -> moe.OverflowQuantities:
    if "quantities" not in case.cache:
        case.cache["quantities"] = _call(moe.overflow_quantities, case, torch.float64)
    return case.cache["quantities"]


def _tiled_predict(case: Case, **tiling: Any) -> Prediction:
    q = _quantities(case)
    p = moe.predict(q, operand_dtype=tiling["operand_dtype"], fp8_scaling=tiling.get("fp8_scaling", "per_row"),
                    fp8_static_scale=tiling.get("fp8_static_scale", 1.0))
    return Prediction(p.finite, p.explanation())


def _tiled_explain(case: Case, **tiling: Any) -> list[str]:
    return [e.describe() for e in _call(moe.explain_overflow, case, torch.float64, **tiling)[:3]]


ALL_CASES = ("default", "decode", "skewed", "scaled", "scaled_swiglu")


def _tiled(dtype: str, cases: tuple[str, ...] = ALL_CASES, **extra: Any) -> Implementation:
    tiling = dict(TILING, operand_dtype=dtype) | extra
    exact = dtype == "fp64"
    scaling = tiling.get("fp8_scaling", "per_row")
    return Implementation(
        module="moe",
        implementation="k3verify",
        form="tiled",
        dtype=dtype,
        params={k: v for k, v in tiling.items() if k != "operand_dtype"},
        rule=FP64_RULE if exact else BASELINE_RULE,
        run=lambda case: _call(moe.tiled, case, torch.float64, **tiling),
        predict=None if exact else partial(_tiled_predict, **tiling),
        explain=partial(_tiled_explain, **tiling),
        cases=cases,
        baseline=f"recurrent/{scaling}" if dtype == "fp8_e4m3" else "recurrent",
    )


def _reference_form(form: str, dtype: str, cases: tuple[str, ...] = ALL_CASES) -> Implementation:
    fn = getattr(moe, form)
    torch_dtype = {"fp64": torch.float64, "fp32": torch.float32}[dtype]
    return Implementation(
        module="moe",
        implementation="k3verify",
        form=form,
        dtype=dtype,
        params={},
        rule=FP64_RULE if dtype == "fp64" else BASELINE_RULE,
        run=lambda case: _call(fn, case, torch_dtype),
        cases=cases,
    )


def implementations() -> list[Implementation]:
    """What ``k3verify run`` verifies for Stable LatentMoE."""
    return [
        _reference_form("chunkwise", "fp64"),
        _tiled("fp64"),
        _tiled("fp64", cases=("default", "skewed"), tile_m=1, tile_k=7),  # one-row tiles, a partial last K step
        _reference_form("recurrent", "fp32"),
        _reference_form("chunkwise", "fp32"),
        _tiled("bf16"),
        _tiled("fp16"),  # scaled_swiglu: SwiGLU's hidden passes 65504 — predicted and observed overflow
        _tiled("fp8_e4m3", cases=("default", "skewed", "scaled", "scaled_swiglu")),
        _tiled("fp8_e4m3", cases=("default",), fp8_scaling="per_tensor"),
        # A static activation scale of 1: fine at unit inputs; x × 2^8 passes 448 (expected overflow).
        _tiled("fp8_e4m3", cases=("default", "scaled"), fp8_scaling="static"),
    ]


# --- overflow map ---------------------------------------------------------------------

MAP_CONFIG = moe.MoEConfig.small()
MAP_TOKENS = 64
# (label, operand dtype, fp8 scaling); the label is the panel row.
MAP_SETTINGS = (
    ("fp16", "fp16", "per_row"),
    ("bf16", "bf16", "per_row"),
    ("fp8_e4m3 static", "fp8_e4m3", "static"),
    ("fp8_e4m3 per_row", "fp8_e4m3", "per_row"),
)
MAP_ACTIVATIONS = ("situ", "swiglu")
MAP_INPUTS = ("gaussian", "outlier")
OUTLIER_CHANNELS = 2
OUTLIER_SIZE = 32.0
MAP_EXPONENTS = (*range(0, 21), *range(24, 69, 4))  # fine where fp16/fp8 break, coarse up to fp32's
QUICK_EXPONENTS = (0, 4, 8, 12, 16, 24, 32, 48, 64)
# The changed-choice measurement uses the production router's sizes; only logits are needed.
FLIP_CONFIG = moe.MoEConfig.production()
FLIP_TOKENS, QUICK_FLIP_TOKENS = 1024, 256


def map_inputs(kind: str, seed: int) -> torch.Tensor:
    """Unit-scale tokens: ``gaussian``, or ``outlier`` (the same with 2 channels × 32, the
    activation outliers SiTU is meant to tame)."""
    gen = torch.Generator().manual_seed(seed + 7)
    x = torch.randn(MAP_TOKENS, MAP_CONFIG.hidden_size, generator=gen, dtype=torch.float64)
    if kind == "outlier":
        x[:, :OUTLIER_CHANNELS] *= OUTLIER_SIZE
    return x


def overflow_map(options: MapOptions, progress: Callable[[int, int], None] = lambda done, total: None) -> MapResult:
    """Sweep input scale (powers of two) × activation (SiTU, SwiGLU) × operand/hidden dtype
    (fp16, bf16, fp8 e4m3 static and dynamic per-row) × input (gaussian, outlier).

    ``options.x_values`` overrides the log2 input scales. Each cell runs :func:`k3verify.moe.tiled`
    with the fp64 oracle's routing (so the error measures the arithmetic, not a near-tie) and
    compares with the fp64 output; its prediction is :func:`k3verify.moe.predict` on the exact
    magnitudes of the same inputs. ``meta["routing_flips"]`` holds the changed-choice fractions.

    Runs with one intra-op thread (measured on two shared cores: about 8 ms per cell with one
    thread, 100 ms with two).
    """
    with _one_thread():
        return _overflow_map(options, progress)


def _overflow_map(options: MapOptions, progress: Callable[[int, int], None]) -> MapResult:
    start = time.perf_counter()
    exps = list(options.x_values) if options.x_values is not None else list(
        QUICK_EXPONENTS if options.quick else MAP_EXPONENTS)
    w = calibrated_weights(MAP_CONFIG, seed=options.seed)  # the router does not depend on the activation
    combos = list(itertools.product(MAP_INPUTS, exps, MAP_ACTIVATIONS))
    total, done = len(combos) * len(MAP_SETTINGS), 0
    cells: list[dict[str, Any]] = []
    for kind, e, act in combos:
        cfg = dataclasses.replace(MAP_CONFIG, activation=act)
        x = map_inputs(kind, options.seed) * 2.0**e
        routing = moe.routing_for(x, w, cfg, None, torch.float64)
        q = moe.overflow_quantities(x, w, cfg, routing=routing)
        for label, dtype, scaling in MAP_SETTINGS:
            cells.append(_map_cell(x, w, cfg, routing, q, kind, e, label, dtype, scaling))
            done += 1
            progress(done, total)
    mark_frontier(cells, {"log2_input_scale": exps}, fixed=("setting", "activation", "input"))
    spec = MapSpec(
        x="log2_input_scale",
        y="activation",
        panel_row="setting",
        panel_col="input",
        figure="module",
        x_label="log2 input scale",
        y_label="activation",
        title="Stable LatentMoE tiled form: overflow and error vs the fp64 oracle",
    )
    meta = {
        "config": dataclasses.asdict(MAP_CONFIG),
        "tokens": MAP_TOKENS,
        "tiling": TILING,
        "log2_input_scale": exps,
        "settings": {label: {"operand_dtype": d, "fp8_scaling": s if d.startswith("fp8") else None}
                     for label, d, s in MAP_SETTINGS},
        "inputs": {"gaussian": "x ~ N(0, 1) per entry, times 2^scale",
                   "outlier": f"the same with {OUTLIER_CHANNELS} channels x {OUTLIER_SIZE:g}, times 2^scale"},
        "routing": "every cell uses the fp64 oracle's routing at its own scale; bias from Quantile Balancing",
        "prediction": "finite iff every stored tensor fits its dtype (exact fp64 magnitudes): x, z, the hidden "
                      "act(g, u) and the normalised latent in the operand dtype (fp8 static: |x|/scale < 448; "
                      "fp8 dynamic scales cannot overflow), g, u and sums in fp32, expert outputs, u, y_r, y_s, y in "
                      "the output dtype. predicted_zeroed: some token's Σu² overflows fp32, so RMSNorm returns 0.",
        "situ": "|SiTU| <= 100 for every input: the hidden never overflows fp16, bf16 or fp8 e4m3 (448); each "
                "expert output is bounded by 100 max‖W2[:, c]‖₁ (situ_bound, ln units) whatever the input",
        "agreement": {
            "all": agreement(cells),
            **{a: agreement(cells, only=lambda c, a=a: c["activation"] == a) for a in MAP_ACTIVATIONS},
            **{s: agreement(cells, only=lambda c, s=s: c["setting"] == s) for s, _, _ in MAP_SETTINGS},
        },
        "frontier": frontier_summary(cells),
        "routing_flips": routing_flips(exps, seed=options.seed,
                                       tokens=QUICK_FLIP_TOKENS if options.quick else FLIP_TOKENS),
        "runtime_s": time.perf_counter() - start,
    }
    # Written beside the map as its own file (harness.overflow_map.write_map).
    meta["curves"] = {"moe_routing_flips.json": meta["routing_flips"]}
    return MapResult("moe", cells, spec, meta)


def _map_cell(x: torch.Tensor, w: moe.MoEWeights, cfg: moe.MoEConfig, routing: moe.Routing,
              q: moe.OverflowQuantities, kind: str, e: float, label: str, dtype: str, scaling: str) -> dict[str, Any]:
    o, events = moe.tiled_traced(x, w, cfg, routing=routing, operand_dtype=dtype, fp8_scaling=scaling, **TILING)
    m = compare(o, q.oracle, ulp_dtype=dtype_name(o.dtype))
    p = moe.predict(q, operand_dtype=dtype, fp8_scaling=scaling)
    cell = {
        "module": "moe",
        "dtype": dtype,
        "fp8_scaling": scaling if dtype.startswith("fp8") else None,
        "setting": label,
        "tile": TILING["tile_m"],
        "tile_k": TILING["tile_k"],
        "input": kind,
        "activation": cfg.activation,
        "log2_input_scale": e,
        "input_scale": 2.0**e,
        "finite": m.nonfinite == 0,
        "predicted_finite": p.finite,
        "predicted_zeroed": p.zeroed,
        "rms_ratio": m.rms_ratio,
        "max_abs": m.max_abs,
        "nonfinite": m.nonfinite,
        "binding": p.binding,
        "headroom": p.headroom,
        "explanation": p.explanation(),
        **{f"ln_{k}": v for k, v in q.as_dict().items() if k != "inputs"},
    }
    if m.nonfinite:
        cell["overflow"] = events[0].describe() if events else "non-finite output with no stored tensor overflowing"
    return cell


def frontier_summary(cells: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per (setting, input, activation): the smallest log2 scale whose output is non-finite
    (observed and predicted) and the smallest with a zeroed routed output (predicted); None if none."""
    out: dict[str, dict[str, Any]] = {}
    for c in sorted(cells, key=lambda c: c["log2_input_scale"]):
        key = f"{c['setting']} | {c['input']} | {c['activation']}"
        entry = out.setdefault(key, {"first_nonfinite": None, "first_predicted_nonfinite": None,
                                     "first_predicted_zeroed": None})
        for field, hit in (("first_nonfinite", not c["finite"]), ("first_predicted_nonfinite",
                                                                   not c["predicted_finite"]),
                           ("first_predicted_zeroed", c["predicted_zeroed"])):
            if hit and entry[field] is None:
                entry[field] = c["log2_input_scale"]
    return out


def routing_flips(exponents: list[float], *, seed: int = 0, tokens: int = FLIP_TOKENS) -> dict[str, Any]:
    """Changed expert choices of the production-size router (d 7168, 896 experts, top 16) at
    each input scale 2^e: bf16 logits vs the spec's fp32 logits, and each vs fp64.

    Logits of ``2^e x`` are ``2^e`` times those of ``x`` exactly in every dtype here (scaling by a
    power of two is exact and commutes with rounding), so one GEMM per dtype serves all scales.
    The bias is trained by Quantile Balancing on unit-scale tokens.
    """
    cfg = FLIP_CONFIG
    gen = torch.Generator().manual_seed(seed + 11)
    w_router = torch.randn(cfg.hidden_size, cfg.num_experts, generator=gen, dtype=torch.float64)
    w_router *= cfg.hidden_size**-0.5
    calib = torch.randn(tokens, cfg.hidden_size, generator=gen, dtype=torch.float64)
    bias = moe.quantile_balancing(torch.sigmoid(calib @ w_router), torch.zeros(cfg.num_experts,
                                                                                 dtype=torch.float64), cfg.top_k)
    x = torch.randn(tokens, cfg.hidden_size, generator=gen, dtype=torch.float64)
    l64 = moe.router_logits(x, w_router, cfg)
    l32 = moe.router_logits(x.float(), w_router.float(), cfg)
    bf16_cfg = dataclasses.replace(cfg, logits_dtype="bf16")
    lbf = moe.router_logits(x.float(), w_router.float(), bf16_cfg)
    rows = []
    for e in exponents:
        s = 2.0**e
        picks = {n: moe.select(torch.sigmoid(l * s), bias.to(l.dtype), cfg.top_k, cfg.tie_break)
                 for n, l in (("fp64", l64), ("fp32", l32), ("bf16", lbf))}
        row: dict[str, Any] = {"log2_input_scale": e}
        for a, b in (("bf16", "fp32"), ("bf16", "fp64"), ("fp32", "fp64")):
            pairs, toks = moe.changed_choices(picks[a], picks[b])
            row[f"{a}_vs_{b}"] = {"changed_pairs": pairs, "changed_tokens": toks}
        rows.append(row)
    return {
        "router": {"hidden_size": cfg.hidden_size, "num_experts": cfg.num_experts, "top_k": cfg.top_k,
                   "tokens": tokens, "tie_break": cfg.tie_break},
        "definition": "changed_pairs: fraction of selected (token, expert) pairs the other router did not select; "
                      "changed_tokens: fraction of tokens with any changed choice",
        "by_scale": rows,
    }


register(
    ModuleEntry(
        name="moe",
        title="Stable LatentMoE",
        make_cases=make_cases,
        oracle=oracle,
        baseline=baseline,
        implementations=implementations,
        overflow_map=overflow_map,
        position_axis=0,  # y:[T, d]; tokens are independent, so a routing flip shows as one bad position
        input_types=(moe.MoEConfig, moe.MoEWeights, moe.Routing),
    )
)
