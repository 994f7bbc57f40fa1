"""The router (docs/model.md §4): tie rule, the bias acts on the selection only, invariance to b + c,
and what bf16 logits change.

Structural statements are checked exactly (equal selections, bit-equal weights), each where the
two sides are provably the same bits on any host: the same operations on the same tensors in one
process, or exact arithmetic (dyadic values, σ(0) = 1/2). Selections that two different
computations make (fp32 against fp64 logits, bf16 logits) are compared only on tokens whose
top-k gap exceeds a rounding bound derived from the dtypes, not from a measured number.
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st
from strategies.moe import one_thread, settled_choices  # noqa: F401  (one_thread: autouse)
from verdicts import assert_identical

from k3verify import moe
from k3verify.moe.samples import MoEProblem, make_problem
from k3verify.moe.samples import problems as moe_problems
from k3verify.numerics import facts

FORMS = {"recurrent": (moe.recurrent, {}), "chunkwise": (moe.chunkwise, {}),
         "tiled": (moe.tiled, {"operand_dtype": "bf16", "tile_m": 4, "tile_k": 8})}


def test_tie_rule_is_explicit_and_deterministic() -> None:
    """Structural: equal biased scores are ordered by expert index (lowest first by default,
    highest first with ``tie_break="highest_index"``); torch.topk orders them otherwise on CPU,
    which is why the rule is a stable sort and a config field."""
    scores = torch.tensor([[0.5, 0.7, 0.7, 0.1, 0.7, 0.7]], dtype=torch.float64)
    bias = torch.zeros(6, dtype=torch.float64)
    assert moe.select(scores, bias, 3, "lowest_index").tolist() == [[1, 2, 4]]
    assert moe.select(scores, bias, 3, "highest_index").tolist() == [[5, 4, 2]]
    assert moe.select(scores, bias, 5, "lowest_index").tolist() == [[1, 2, 4, 5, 0]]
    # The same decision through the router, from a config field. Logits 0 make the tied scores
    # σ(0) = 1/2 exactly in any implementation and at any tensor position, so the tie is a tie
    # on every host (σ(logit(0.7)) could round differently where a kernel's vector body and
    # scalar tail meet).
    cfg = moe.MoEConfig(hidden_size=1, num_experts=6, top_k=3, latent_size=1, expert_hidden=1,
                        tie_break="highest_index")
    logits = torch.tensor([[-1.0, 0.0, 0.0, -3.0, 0.0, 0.0]], dtype=torch.float64)
    r = moe.route(torch.ones(1, 1, dtype=torch.float64), logits, bias, cfg)
    assert r.indices.tolist() == [[5, 4, 2]]


@given(p=moe_problems(bias_scale=st.sampled_from((0.0, 0.1, 1.0))))
def test_weights_use_unbiased_scores_and_sum_to_rho(p: MoEProblem) -> None:
    """Exact: p = ρ s_I / Σ s_I with s = σ(x W_r) *without* the bias, I the biased top-k;
    and fp64-level: Σ_j p_j = ρ. Bitwise on any host: s is the router's own sequence of
    operations (x @ W_r, then σ) on the same tensors in one process, and ``+ renorm_eps`` (0)
    changes no positive sum."""
    r = moe.route(p.x, p.weights.w_router, p.weights.bias, p.cfg)
    s = torch.sigmoid(p.x @ p.weights.w_router)
    assert_identical(r.scores, s)
    picked = s.gather(-1, r.indices)
    assert_identical(r.weights, picked / picked.sum(-1, keepdim=True) * p.cfg.routed_scaling_factor)
    assert torch.allclose(r.weights.sum(-1), torch.full((p.T,), p.cfg.routed_scaling_factor, dtype=torch.float64),
                          rtol=1e-14, atol=0)
    assert_identical(r.indices, moe.select(s, p.weights.bias, p.cfg.top_k))


@given(p=moe_problems(), delta=st.floats(-1.0, 1.0), form=st.sampled_from(sorted(FORMS)))
def test_bias_changes_only_the_selection(p: MoEProblem, delta: float, form: str) -> None:
    """Exact equality: two biases that select the same experts give bit-identical outputs in every
    form (the bias never enters a weight); a bias that selects differently changes the output.
    The selections compared are the ones the form makes (its fp32 router for bf16 operands, the
    fp64 one otherwise); given equal selections both calls run the same operations on the same
    numbers in one process, so the bits agree on any host."""
    other = p.weights.bias + delta * torch.linspace(0, 1, p.E, dtype=torch.float64) * 1e-3
    q = p.with_weights(bias=other)
    fn, opts = FORMS[form]
    router_dtype = torch.float32 if form == "tiled" else torch.float64
    r_p = moe.routing_for(p.x, p.weights, p.cfg, None, router_dtype)
    r_q = moe.routing_for(q.x, q.weights, q.cfg, None, router_dtype)
    if torch.equal(r_p.indices, r_q.indices):
        assert_identical(r_p.weights, r_q.weights)
        assert_identical(fn(*p.args(), **opts), fn(*q.args(), **opts))


@given(p=moe_problems(max_k=3), forced=st.integers(0, 15))
def test_a_large_bias_forces_an_expert_without_boosting_its_weight(p: MoEProblem, forced: int) -> None:
    """Exact: bias +2 (> the range of σ) on one expert puts it first for every token, and its
    weight is still ρ s_j / Σ s_I from the unbiased score (bitwise on any host: s repeats the
    router's operations on the same tensors, then / and * are correctly rounded)."""
    j = forced % p.E
    bias = p.weights.bias.clone()
    bias[j] += 2.0
    r = moe.route(p.x, p.weights.w_router, bias, p.cfg)
    assert bool((r.indices[:, 0] == j).all())
    s = torch.sigmoid(p.x @ p.weights.w_router)
    picked = s.gather(-1, r.indices)
    assert_identical(r.weights[:, 0], (picked / picked.sum(-1, keepdim=True))[:, 0] * p.cfg.routed_scaling_factor)


# Dyadic values on a 2^-20 grid with |v| < 2^11: every sum below is exact in fp64.
dyadic = st.integers(-(2**20), 2**20).map(lambda n: n * 2.0**-20)


@given(T=st.integers(1, 6), E=st.sampled_from((4, 8, 16)), k=st.integers(1, 4), data=st.data(),
       c=st.integers(-(2**30), 2**30).map(lambda n: n * 2.0**-20))
@example(T=1, E=4, k=2, c=1.0, data=None)
def test_routing_is_invariant_to_a_constant_added_to_the_bias(T: int, E: int, k: int, data, c: float) -> None:
    """Exact: select(s, b + c) == select(s, b). Scores and biases are dyadic so that ``s + b + c``
    is computed without rounding: then the order, ties included, is unchanged. (With rounding a
    strict order can become a tie, which the tie rule may resolve differently.)"""
    k = min(k, E)
    if data is None:  # the pinned example: equal scores, ties broken the same way after the shift
        s = torch.full((T, E), 0.5, dtype=torch.float64)
        b = torch.zeros(E, dtype=torch.float64)
    else:
        s = torch.tensor(data.draw(st.lists(dyadic, min_size=T * E, max_size=T * E)), dtype=torch.float64).view(T, E)
        b = torch.tensor(data.draw(st.lists(dyadic, min_size=E, max_size=E)), dtype=torch.float64)
    assert_identical(moe.select(s, b + c, k), moe.select(s, b, k))
    assert_identical(moe.select(s, b + c, k, "highest_index"), moe.select(s, b, k, "highest_index"))


@given(p=moe_problems(max_T=24, bias_scale=st.sampled_from((0.0, 0.01, 0.1))),
       x_scale=st.sampled_from((0.25, 1.0, 4.0, 16.0)))
@example(p=make_problem(16, E=16, k=4, d=32, seed=3), x_scale=1.0)
def test_bf16_logits_change_only_near_tied_choices(p: MoEProblem, x_scale: float) -> None:
    """Rounding bound: bf16 logits move each logit by at most u|r| (u = 2^-9, round to nearest),
    hence each score by at most u|r|/4 (σ' <= 1/4), plus two fp32 roundings of σ and of s + b.
    A token whose fp32 top-k gap exceeds twice the largest such move keeps every choice; only
    the others may change. Selections compared as sets per token."""
    x = p.x * x_scale
    cfg32 = p.cfg
    cfg16 = dataclasses.replace(p.cfg, logits_dtype="bf16")
    w = p.weights.to(torch.float32)
    b = w.bias
    r32 = moe.route(x.float(), w.w_router, b, cfg32)
    r16 = moe.route(x.float(), w.w_router, b, cfg16)
    logits = moe.router_logits(x.float(), w.w_router, cfg32)
    u = facts("bf16").unit_roundoff
    eps32 = facts("fp32").eps
    move = (u * logits.abs() / 4 + 2 * eps32 * (1 + b.abs().max())).amax(-1)  # per token
    gap = moe.topk_gap(r32.scores, b, p.k)
    safe = gap > 2 * move
    same = (r32.indices.sort(-1).values == r16.indices.sort(-1).values).all(-1)
    assert bool(same[safe].all()), f"tokens {(~same & safe).nonzero().flatten().tolist()} changed despite a safe gap"


def test_bf16_logits_can_change_a_choice() -> None:
    """Structural (the previous property is not vacuous): two logits 1 and 1 + 2^-12 round to the
    same bf16 value, so the bf16 router sees a tie and the tie rule picks the lower index, while
    the fp32 router picks the larger logit."""
    E = 4
    w_router = torch.tensor([[0.0, 1.0, 1.0 + 2.0**-12, -1.0]])
    cfg = moe.MoEConfig(hidden_size=1, num_experts=E, top_k=1, latent_size=1, expert_hidden=1)
    x, b = torch.ones(1, 1), torch.zeros(E)
    assert moe.route(x, w_router, b, cfg).indices.tolist() == [[2]]
    bf16 = dataclasses.replace(cfg, logits_dtype="bf16")
    assert moe.route(x, w_router, b, bf16).indices.tolist() == [[1]]
    assert moe.changed_choices(torch.tensor([[2]]), torch.tensor([[1]])) == (1.0, 1.0)


@given(p=moe_problems(max_T=16))
def test_fp32_router_agrees_with_fp64_away_from_ties(p: MoEProblem) -> None:
    """Rounding bound: fp32 logits of fp64 inputs differ from fp64 logits by at most about
    (d + 2) eps32 Σ|x||w| (the standard dot-product bound); a token whose fp64 gap exceeds twice
    the resulting score move keeps its experts (compared as sets), and a token whose every
    adjacent gap of the top k + 1 does keeps their order too. This is why every form routes alike
    on the registry's cases (each records its smallest gap)."""
    r64 = moe.route(p.x, p.weights.w_router, p.weights.bias, p.cfg)
    r32 = moe.routing_for(p.x, p.weights, p.cfg, None, torch.float32)
    eps32 = facts("fp32").eps
    bound = (p.d + 2) * eps32 * (p.x.abs() @ p.weights.w_router.abs()).amax(-1) / 4 + 4 * eps32
    safe, ordered = settled_choices(r64.scores, p.weights.bias, p.k, bound)
    assume(bool(safe.any()))
    assert_identical(r32.indices.sort(-1).values[safe], r64.indices.sort(-1).values[safe])
    assert_identical(r32.indices[ordered], r64.indices[ordered])
