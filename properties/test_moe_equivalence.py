"""Every fp64 form of Stable LatentMoE computes the definition (docs/model.md §4), and what must not
change it: token order, the tiling, the load (idle experts), ρ while the latent is not tiny.

Agreement between forms is the ``fp64-agreement`` rule (normwise relative error <= 1e-10). An
independent oracle — every expert on every token, mixed by a dense [T, E] weight matrix —
checks the recurrent definition itself.
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import example, given
from hypothesis import strategies as st
from strategies.moe import fp64_score_spread, one_thread, settled_choices  # noqa: F401  (one_thread: autouse)
from verdicts import assert_fp64_agrees, assert_identical

from k3verify import moe
from k3verify.moe import layer
from k3verify.moe.samples import MoEProblem, make_problem
from k3verify.moe.samples import problems as moe_problems

activations = st.sampled_from(("situ", "swiglu"))
biases = st.sampled_from((0.0, 0.1, 3.0))  # 3.0: a few experts win every token, the rest idle



def dense_latent(p: MoEProblem, rho: float | None = None) -> torch.Tensor:
    """``u:[T, Dl]`` computed densely: every expert on every token, mixed by a [T, E] matrix that
    holds ρ s_j / Σ_I s for the selected experts and 0 elsewhere (no loop, no dispatch)."""
    x, w, cfg = p.args()
    s = torch.sigmoid(x @ w.w_router)
    chosen = torch.sort(s + w.bias, dim=-1, descending=True, stable=True).indices[:, : cfg.top_k]
    mask = torch.zeros_like(s).scatter(-1, chosen, 1.0)
    mix = mask * s / (mask * s).sum(-1, keepdim=True) * (cfg.routed_scaling_factor if rho is None else rho)
    z = x @ w.w_latent_down
    g, u = torch.einsum("tl,elh->eth", z, w.w1), torch.einsum("tl,elh->eth", z, w.w3)
    h = moe.situ(g, u, beta1=cfg.beta1, beta2=cfg.beta2) if cfg.activation == "situ" else moe.swiglu(g, u)
    return torch.einsum("te,etl->tl", mix, h @ w.w2)


@given(p=moe_problems(activation=activations, bias_scale=biases, rho=st.sampled_from((1.0, 2.827))))
@example(p=make_problem(1, E=4, k=4, d=8, H=4))  # one token, every expert selected
@example(p=make_problem(9, E=16, k=1, d=8, H=4, bias_scale=3.0))  # top-1, most experts idle
def test_recurrent_equals_the_dense_definition(p: MoEProblem) -> None:
    """fp64-agreement: the per-token loop == a dense mixture of all experts (independent oracle)."""
    x, w, cfg = p.args()
    dense = layer.latent_output(dense_latent(p), w, cfg) + layer.shared_output(x, w, cfg)
    assert_fp64_agrees(moe.recurrent(*p.args()), dense)


@given(p=moe_problems(activation=activations, bias_scale=biases), tile_m=st.integers(1, 20),
       tile_k=st.integers(1, 40))
@example(p=make_problem(12, E=8, k=2, d=16, H=8, bias_scale=3.0), tile_m=5, tile_k=3)  # idle experts, partial tiles
@example(p=make_problem(1, E=4, k=1, d=8, H=4), tile_m=16, tile_k=64)  # decode: one row in one padded tile
def test_every_fp64_form_equals_the_recurrent_definition(p: MoEProblem, tile_m: int, tile_k: int) -> None:
    """fp64-agreement: chunkwise (permute, grouped matmuls, un-permute), tiled with fp64 operands
    at any tile sizes (padded tiles, partial K steps) and the naive baseline in fp64 all equal the
    recurrent definition; with idle experts too (one code path for any load)."""
    ref = moe.recurrent(*p.args())
    assert_fp64_agrees(moe.chunkwise(*p.args()), ref)
    assert_fp64_agrees(moe.tiled(*p.args(), operand_dtype="fp64", tile_m=tile_m, tile_k=tile_k), ref)
    assert_fp64_agrees(moe.naive_baseline(*p.args(), dtype="fp64"), ref)


@given(p=moe_problems(min_T=2, bias_scale=biases), seed=st.integers(0, 1000),
       form=st.sampled_from(("recurrent", "chunkwise", "tiled")))
def test_permuting_tokens_permutes_outputs(p: MoEProblem, seed: int, form: str) -> None:
    """Tokens are independent, so the layer commutes with any permutation of them; not bit for
    bit: a row's dot products may be summed differently at another row position of a BLAS call
    (MKL's AVX2 path does), so the scores may move by a rounding.

    Routing: the same experts per token as a set wherever the k-th minus the (k+1)-th biased
    score exceeds twice the largest difference two fp64 router runs can have (a rounding bound,
    ``fp64_score_spread``), and in the same order where every adjacent gap of the top k + 1 does;
    only a token that close to a tie may pick otherwise. Outputs: fp64-agreement over the tokens
    whose experts are settled so."""
    perm = torch.randperm(p.T, generator=torch.Generator().manual_seed(seed))
    x, w, cfg = p.args()
    r = moe.route(x, w.w_router, w.bias, cfg)
    moved = moe.route(x[perm], w.w_router, w.bias, cfg)
    same_set, same_order = (m[perm] for m in settled_choices(r.scores, w.bias, cfg.top_k,
                                                              2 * fp64_score_spread(x, w)))
    assert_identical(moved.indices.sort(-1).values[same_set], r.indices[perm].sort(-1).values[same_set])
    assert_identical(moved.indices[same_order], r.indices[perm][same_order])
    opts = {"operand_dtype": "fp64", "tile_m": 3} if form == "tiled" else {}
    fn = getattr(moe, form)
    if bool(same_set.any()):
        assert_fp64_agrees(fn(x[perm], w, cfg, **opts)[same_set], fn(x, w, cfg, **opts)[perm][same_set])


@given(p=moe_problems(bias_scale=biases), form=st.sampled_from(("recurrent", "chunkwise", "tiled")))
def test_given_routing_is_used_as_is(p: MoEProblem, form: str) -> None:
    """Exact: passing the router's own Routing gives the same bits as routing inside the form;
    a Routing with other experts gives another output. Bitwise on any host: the Routing is made
    by the call the form makes itself (the fp32 router for bf16 operands, the fp64 one for fp64
    forms), on the same tensors in one process, so every later operation sees the same numbers."""
    x, w, cfg = p.args()
    fn = getattr(moe, form)
    opts = {"operand_dtype": "bf16"} if form == "tiled" else {}
    r = moe.routing_for(x, w, cfg, None, torch.float32 if form == "tiled" else torch.float64)
    assert_identical(fn(x, w, cfg, routing=r, **opts), fn(x, w, cfg, **opts))
    if cfg.top_k < cfg.num_experts:
        shifted = moe.Routing((r.indices + 1) % cfg.num_experts, r.weights)
        assert not torch.equal(fn(x, w, cfg, routing=shifted, **opts), fn(x, w, cfg, **opts))


def test_no_tokens_and_leading_axes() -> None:
    """Structural: T = 0 gives an empty [0, d] output in every form; layer.forward flattens
    leading axes ([B, T, d] -> the same rows as the flat call, fp64-agreement)."""
    p = make_problem(6, E=8, k=2, d=16, H=8, seed=4)
    x, w, cfg = p.args()
    for fn in (moe.recurrent, moe.chunkwise, moe.tiled):
        assert fn(x[:0], w, cfg).shape == (0, cfg.hidden_size)
    y = layer.forward(x.reshape(2, 3, -1), w, cfg, form=moe.chunkwise)
    assert y.shape == (2, 3, cfg.hidden_size)
    assert_fp64_agrees(y.reshape(6, -1), moe.recurrent(x, w, cfg))


@given(p=moe_problems(), rhos=st.tuples(st.floats(0.25, 4.0), st.floats(0.25, 4.0)),
       regime=st.sampled_from(("large", "tiny")))
@example(p=make_problem(8, E=8, k=2, d=16, H=8), rhos=(1.0, 2.827), regime="large")
@example(p=make_problem(8, E=8, k=2, d=16, H=8), rhos=(1.0, 2.827), regime="tiny")
def test_rmsnorm_makes_rho_irrelevant_only_when_the_latent_is_not_tiny(
    p: MoEProblem, rhos: tuple[float, float], regime: str
) -> None:
    """Analytic identity + both regimes, per token t (shared path removed so y = y_r):

    - fp64-agreement with the identity RMSNorm(ρu) = γ u / sqrt(ms(u) + ε/ρ²);
    - ``large`` (W2 × 1e2, so rms(u_t) ρ_min >= 30 sqrt(ε)): changing ρ moves y_t by at most
      a/2 (1 + a) relative, a = ε |1/ρ1² − 1/ρ2²| / ms(u_t) (<= 1/900): ρ is irrelevant;
    - ``tiny`` (W2 × 1e-6, so rms(u_t) ρ_max <= sqrt(ε)/30): |y_t| scales like ρ, within a
      relative b/2 (1 + b), b = ms(u_t) ρ_max² / ε (<= 1/900), of ρ2/ρ1: ρ matters.
    (|sqrt(1 ± x) − 1| <= x/2 (1 + x) for 0 <= x <= 1.)"""
    zero = {n: torch.zeros_like(getattr(p.weights, n)) for n in ("shared_w1", "shared_w3", "shared_w2")}
    q = p.with_weights(**zero, w2=p.weights.w2 * (1e2 if regime == "large" else 1e-6))
    eps = q.cfg.rms_norm_eps
    u1 = dense_latent(q, rho=1.0)
    ms = (u1 * u1).mean(-1)
    ys = []
    for rho in rhos:
        y = moe.recurrent(*q.with_config(routed_scaling_factor=rho).args())
        expected = (u1 / torch.sqrt(ms[:, None] + eps / rho**2) * q.weights.latent_norm) @ q.weights.w_latent_up
        assert_fp64_agrees(y, expected)
        ys.append(y)
    lo, hi = min(rhos), max(rhos)
    if regime == "large":
        assert bool((ms * lo**2 >= 900 * eps).all()), "the large regime must be reached"
        rel = (ys[1] - ys[0]).norm(dim=-1) / ys[0].norm(dim=-1)
        a = eps * abs(rhos[0] ** -2 - rhos[1] ** -2) / ms
        assert bool((rel <= a / 2 * (1 + a) + 1e-12).all())
    else:
        assert bool((ms * hi**2 <= eps / 900).all()), "the tiny regime must be reached"
        ratio = ys[1].norm(dim=-1) / ys[0].norm(dim=-1)
        b = ms * hi**2 / eps
        assert bool(((ratio / (rhos[1] / rhos[0]) - 1).abs() <= b / 2 * (1 + b) + 1e-12).all())


def test_production_sizes() -> None:
    """Structural, on the meta device (no arithmetic): K3's shapes and parameter counts derived
    from the config — 896 experts of 3 × 3584 × 3072, a 7168 → 3584 latent (dispatch moves half
    the width), the shared MLP 2 × 3072 = 6144 wide, |SiTU| <= 4 × 25 = 100."""
    cfg = moe.MoEConfig.production()
    w = moe.init_weights(cfg, device="meta")
    assert w.w_router.shape == (7168, 896) and w.bias.shape == (896,)
    assert w.w1.shape == w.w3.shape == (896, 3584, 3072) and w.w2.shape == (896, 3072, 3584)
    assert w.w_latent_down.shape == (7168, 3584) and w.w_latent_up.shape == (3584, 7168)
    assert w.shared_w1.shape == (7168, 6144) and w.shared_w2.shape == (6144, 7168)
    assert cfg.latent_size * 2 == cfg.hidden_size and cfg.top_k == 16
    counts = moe.parameter_counts(cfg)
    assert counts["routed_experts"] == 896 * 3 * 3584 * 3072
    assert counts["shared"] == 3 * 7168 * 6144
    assert sum(counts.values()) == sum(t.numel() for t in w.tensors().values())
    active = moe.active_parameters(cfg)
    assert active == counts["router"] + counts["latent_projections"] + 16 * 3 * 3584 * 3072 + counts["shared"]
    assert dataclasses.replace(cfg, beta1=4.0, beta2=25.0) == cfg
    assert moe.situ(torch.tensor([1e30]), torch.tensor([1e30])).item() == cfg.beta1 * cfg.beta2


@given(p=moe_problems(bias_scale=biases), n=st.integers(1, 24), seed=st.integers(0, 2**16))
def test_token_sums_add_in_a_fixed_order_without_atomics(p: MoEProblem, n: int, seed: int) -> None:
    """Rule: bitwise (the same IEEE additions in the same order, equal on any host). The
    un-permute sums each token's rows in dispatch order with the very bits ``index_add_`` gives
    on the host, and never
    through an accumulating scatter: on a CUDA device ``index_add_`` adds with atomics whose order
    changes between runs, and the fp64 definition must give the same bits every run (the
    ``page_placement`` serving check compares two walks bit for bit)."""
    from k3verify.moe.chunkwise import dispatch, token_sums

    x, w, cfg = p.args()
    d = dispatch(moe.route(x, w.w_router, w.bias, cfg).indices, cfg.num_experts)
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(d.token.numel(), n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(
        -8, 9, (d.token.numel(), 1), generator=g)
    T = x.shape[0]
    assert_identical(token_sums(rows, d, T), torch.zeros(T, n, dtype=torch.float64).index_add_(0, d.token, rows))


def test_the_fp64_forms_use_no_accumulating_scatter(monkeypatch) -> None:
    """Rule: structural. The chunkwise forward and backward run with ``index_add_`` and
    ``scatter_add_`` refused (both add with atomics on a CUDA device)."""
    from k3verify.moe.chunkwise import chunkwise_backward

    p = make_problem(12, E=8, k=3, d=16, H=8)
    x, w, cfg = p.args()
    expected = moe.chunkwise(x, w, cfg)
    indices = moe.route(x, w.w_router, w.bias, cfg).indices

    def refused(*args, **kwargs):
        raise AssertionError("an accumulating scatter: its order on a CUDA device changes between runs")

    monkeypatch.setattr(torch.Tensor, "index_add_", refused)
    monkeypatch.setattr(torch.Tensor, "scatter_add_", refused)
    assert_identical(moe.chunkwise(x, w, cfg), expected)
    chunkwise_backward(x, w, cfg, dy=torch.ones_like(expected), indices=indices)
