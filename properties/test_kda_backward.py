"""KDA's backward: the fp64 autograd oracle checked by finite differences, and the hand-written
chunkwise backward against it.

Rules: the oracle against central differences is ``torch.autograd.gradcheck``'s own (atol 1e-5,
rtol 1e-3 on fp64 perturbations of 1e-6); everything else is ``fp64-agreement`` (normwise
relative max error <= 1e-10) per gradient.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from verdicts import assert_fp64_agrees

from k3verify import kda
from k3verify.harness import selftest
from k3verify.kda.chunkwise import chunkwise_backward
from k3verify.kda.gate import InKernelGate
from k3verify.kda.recurrent import recurrent_backward
from k3verify.kda.samples import KDAProblem, cotangents, make_problem
from k3verify.kda.samples import problems as kda_problems
from k3verify.numerics import fp64_agreement


def _leaves(B: int, T: int, H: int, K: int, V: int, seed: int) -> dict[str, torch.Tensor]:
    """Small fp64 inputs for gradcheck: gates in [-3, -0.05] and beta in [0.1, 0.9], so a
    perturbation of 1e-6 keeps every input valid."""
    gen = torch.Generator().manual_seed(seed)

    def u(lo: float, hi: float, *size: int) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(*size, generator=gen, dtype=torch.float64)

    return dict(q=u(-1, 1, B, T, H, K), k=u(-1, 1, B, T, H, K), v=u(-1, 1, B, T, H, V), g=u(-3, -0.05, B, T, H, K),
                beta=u(0.1, 0.9, B, T, H), h0=u(-0.5, 0.5, B, H, K, V))


def _recurrent_outputs(q, k, v, g, beta, h0, gate: tuple | None = None):
    if gate is not None:
        g = InKernelGate(gate[0], gate[1], -5.0)(g)
    return kda.recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)


@pytest.mark.parametrize("shape", [(1, 3, 1, 3, 2), (2, 5, 2, 4, 3), (1, 9, 1, 2, 2)], ids=str)
def test_oracle_passes_gradcheck(shape: tuple[int, ...]) -> None:
    """Autograd through the fp64 recurrence matches central differences for every input,
    the initial state included."""
    x = _leaves(*shape, seed=sum(shape))
    args = tuple(t.requires_grad_() for t in x.values())
    assert torch.autograd.gradcheck(_recurrent_outputs, args)


def test_oracle_passes_gradcheck_with_the_gate_in_the_kernel() -> None:
    """``g = g_min * sigmoid(exp(A_log) * (z + dt_bias))`` inside the differentiated function:
    the logits, ``A_log`` and ``dt_bias`` get their gradients too."""
    x = _leaves(1, 4, 2, 3, 2, seed=7)
    z = torch.linspace(-2, 2, 24, dtype=torch.float64).reshape(1, 4, 2, 3)
    a_log, dt_bias = torch.tensor([0.3, -0.2], dtype=torch.float64), torch.linspace(-1, 1, 6, dtype=torch.float64)
    args = (x["q"], x["k"], x["v"], z, x["beta"], x["h0"])
    leaves = tuple(t.requires_grad_() for t in (*args, a_log, dt_bias))
    assert torch.autograd.gradcheck(lambda *a: _recurrent_outputs(*a[:6], gate=a[6:]), leaves)


def test_oracle_passes_gradgradcheck() -> None:
    """Second derivatives too, on the smallest shape (cheap there)."""
    x = _leaves(1, 2, 1, 2, 2, seed=3)
    assert torch.autograd.gradgradcheck(_recurrent_outputs, tuple(t.requires_grad_() for t in x.values()))


def _grads(p: KDAProblem, form, **kw) -> dict[str, torch.Tensor]:
    c = p.cotangents()
    return form(*p.args(), do=c["do"], dht=c["dht"], initial_state=p.state(), **kw)


def _assert_agree(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(ref), (sorted(got), sorted(ref))
    for name in ref:
        assert_fp64_agrees(got[name], ref[name], name)


@given(p=kda_problems(max_T=150, kinds=("random", "saturated")), chunk=st.sampled_from([1, 3, 16, 64, 100]))
@example(p=make_problem(1, 65, 1, 8, 4, seed=1), chunk=64)  # one token in the last chunk
@example(p=make_problem(1, 1, 1, 4, 4, seed=2), chunk=64)  # a single token
@example(p=make_problem(2, 128, 2, 8, 6, g_min=-8.0, seed=3, kind="saturated", initial_state=False), chunk=64)
def test_chunkwise_backward_matches_the_oracle(p: KDAProblem, chunk: int) -> None:
    """Every gradient (dq, dk, dv, dg, dbeta, dh0) of the hand-written chunkwise backward agrees
    with autograd through the recurrence, for any length, chunk size, gate and initial state."""
    _assert_agree(_grads(p, chunkwise_backward, chunk_size=chunk), _grads(p, recurrent_backward))


@given(p=kda_problems(max_T=140), c1=st.sampled_from([2, 8, 32, 64]), c2=st.sampled_from([5, 16, 48, 128]))
def test_chunk_size_does_not_change_the_gradients(p: KDAProblem, c1: int, c2: int) -> None:
    _assert_agree(_grads(p, chunkwise_backward, chunk_size=c1), _grads(p, chunkwise_backward, chunk_size=c2))


@st.composite
def _packed(draw) -> tuple[KDAProblem, torch.Tensor, InKernelGate | None]:
    """One packed batch (``B = 1``) of 1-4 sequences of 0-80 tokens, each from its own state; the
    gate in the kernel or not."""
    lengths = draw(st.lists(st.integers(0, 80), min_size=1, max_size=4))
    H, K, V = draw(st.sampled_from([(1, 8, 4), (2, 16, 8)]))
    seed = draw(st.integers(0, 2**16))
    p = make_problem(1, sum(lengths), H, K, V, seed=seed, initial_state=False)
    p.inputs["initial_state"] = 0.1 * torch.randn(len(lengths), H, K, V, dtype=torch.float64,
                                                  generator=torch.Generator().manual_seed(seed))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    gate = None
    if draw(st.booleans()):
        gen = torch.Generator().manual_seed(seed + 1)
        p.inputs["g"] = 3 * torch.randn(1, p.T, H, K, dtype=torch.float64, generator=gen)  # logits
        gate = InKernelGate(torch.randn(H, dtype=torch.float64, generator=gen),
                            torch.randn(H * K, dtype=torch.float64, generator=gen))
    return p, cu, gate


@given(packed=_packed(), chunk=st.sampled_from([16, 64]))
def test_packing_does_not_change_the_gradients(packed, chunk: int) -> None:
    """With ``cu_seqlens`` the chunkwise backward agrees with the oracle, and both with each
    sequence's gradients computed alone (the gate's parameters summed over the sequences)."""
    p, cu, gate = packed
    c = cotangents(1, p.T, p.H, p.K, p.V, seed=p.seed, states=len(cu) - 1)
    kw = dict(do=c["do"], dht=c["dht"], initial_state=p.state(), cu_seqlens=cu, gate=gate)
    ref = recurrent_backward(*p.args(), **kw)
    _assert_agree(chunkwise_backward(*p.args(), chunk_size=chunk, **kw), ref)
    alone = []
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        args = [t[:, a:b] for t in p.args()]
        alone.append(recurrent_backward(*args, do=c["do"][:, a:b], dht=c["dht"][i : i + 1],
                                        initial_state=p.state()[i : i + 1], gate=gate))
    for name, t in ref.items():
        if name in ("dA_log", "ddt_bias"):  # the gate's parameters are shared by every sequence
            joined = sum(g[name] for g in alone)
        else:
            joined = torch.cat([g[name] for g in alone], 0 if name == "dh0" else 1)
        assert_fp64_agrees(joined, t, f"{name} packed vs alone")


@given(p=kda_problems(min_T=2, max_T=150), data=st.data())
def test_dh0_of_a_split_sequence_is_the_gradient_between_its_halves(p: KDAProblem, data) -> None:
    """Run the second half from the state where the first ends: its ``dh0`` is the gradient that
    flows between the halves, so the first half's backward with that ``dht`` gives the whole
    sequence's gradients of the first half, and its ``dh0``."""
    cut = data.draw(st.integers(1, p.T - 1), label="cut")
    c = p.cotangents()
    q, k, v, g, beta = p.args()
    _, S_cut = kda.recurrent(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], initial_state=p.state(),
                             output_final_state=True)
    second = chunkwise_backward(*(t[:, cut:] for t in p.args()), do=c["do"][:, cut:], dht=c["dht"],
                                initial_state=S_cut)
    first = chunkwise_backward(*(t[:, :cut] for t in p.args()), do=c["do"][:, :cut], dht=second["dh0"],
                               initial_state=p.state())
    whole = recurrent_backward(*p.args(), do=c["do"], dht=c["dht"], initial_state=p.state())
    for name in ("dq", "dk", "dv", "dg", "dbeta"):
        assert_fp64_agrees(first[name], whole[name][:, :cut], f"{name} of the first half")
        assert_fp64_agrees(second[name], whole[name][:, cut:], f"{name} of the second half")
    if p.state() is not None:
        assert_fp64_agrees(first["dh0"], whole["dh0"], "dh0")


def test_a_saturated_gate_sigmoid_gives_finite_gradients() -> None:
    """Logits of +-1e4 (the gate's sigmoid at exactly 0 or 1 in fp64) give finite gradients equal
    to the oracle's, ``dA_log`` and ``ddt_bias`` included: the sigmoid's derivative there is 0,
    never ``0 * inf``."""
    p = make_problem(1, 70, 2, 8, 4, seed=5)
    z = torch.where(torch.arange(70 * 16).reshape(1, 70, 2, 8) % 3 == 0, 1e4, -1e4).to(torch.float64)
    gate = InKernelGate(torch.tensor([2.0, 0.0], dtype=torch.float64), torch.zeros(16, dtype=torch.float64))
    c = p.cotangents()
    kw = dict(do=c["do"], dht=c["dht"], initial_state=p.state(), gate=gate)
    args = (*p.args()[:3], z, p.args()[4])
    ref = recurrent_backward(*args, **kw)
    got = chunkwise_backward(*args, **kw)
    for name, t in got.items():
        assert torch.isfinite(t).all(), name
    _assert_agree(got, ref)


# --- planted bugs: each fails fp64-agreement on exactly the gradients it touches -----------------

# A mild gate bound: the state gradient carried over a chunk then still reaches dh0 by more than
# fp64 agreement's 1e-10 (at K3's -5 it is attenuated by up to exp(-320) over 64 tokens). T = 100
# spans the first chunk boundary of selftest's mutants (chunk 64).
P = make_problem(2, 100, 2, 16, 8, g_min=-0.5, seed=11)
TOUCHED = {
    "dg without the reverse cumulative sum": {"dg"},
    "dh0 dropped": {"dh0"},
    "dbeta with the wrong sign": {"dbeta"},
    # dq reads only do and the forward: a lost state gradient cannot reach it.
    "state gradient not carried across a chunk boundary": {"dk", "dv", "dg", "dbeta", "dh0"},
    "1 % error in dv only": {"dv"},
}


def _failing(fn) -> set[str]:
    """The gradients of ``fn`` on ``P`` that fail fp64-agreement with the oracle."""
    grads, ref = _grads(P, fn), _grads(P, recurrent_backward)
    return {name for name in ref if not fp64_agreement(grads[name], ref[name]).passed}


def test_the_correct_backward_fails_no_gradient() -> None:
    assert _failing(partial(chunkwise_backward, chunk_size=selftest.BACKWARD_CHUNK)) == set()


@pytest.mark.parametrize("name", list(TOUCHED))
def test_a_planted_backward_bug_fails_and_names_its_gradient(name: str) -> None:
    """selftest's backward mutants, in fp64: each fails exactly the gradients it touches."""
    assert _failing(selftest.mutant("kda_backward", name).fn) == TOUCHED[name]


def test_every_backward_mutant_is_pinned_here() -> None:
    assert {m.name for m in selftest.mutants(["kda_backward"])} == set(TOUCHED)


def test_the_oracle_is_not_the_form_under_test() -> None:
    """The oracle differentiates the recurrence by autograd; the chunkwise backward never calls
    autograd (it runs with gradients off and still returns every gradient)."""
    p = make_problem(1, 40, 1, 8, 4, seed=2)
    with torch.no_grad():
        got = _grads(p, chunkwise_backward, chunk_size=16)
    assert sorted(got) == ["dbeta", "dg", "dh0", "dk", "dq", "dv"]
    assert all(not t.requires_grad for t in got.values())


def test_a_rounding_under_autograd_stores_the_value_and_its_gradient_rounded() -> None:
    """The same-dtype baseline of a backward is autograd through the naive forms: a rounding
    there passes the value rounded (bitwise as without autograd) and the gradient rounded too,
    not rounding's zero derivative (rule: bitwise, one host)."""
    from k3verify.numerics import round_to, rounder

    rnd = rounder("bf16")
    x = torch.randn(64, dtype=torch.float32, generator=torch.Generator().manual_seed(1))
    cot = torch.randn(64, dtype=torch.float32, generator=torch.Generator().manual_seed(2))
    leaf = x.clone().requires_grad_()
    y = rnd(leaf)
    y.backward(cot)
    assert torch.equal(y.detach(), rnd(x)) and torch.equal(rnd(x), round_to(x, "bf16"))
    assert torch.equal(leaf.grad, round_to(cot, "bf16")) and not torch.equal(leaf.grad, cot)


class _ValueGradientOff(torch.autograd.Function):
    """The identity forward; its backward hands back 1.01 x the gradient (a kernel whose forward
    is right and whose dv is 1 % off)."""

    @staticmethod
    def forward(ctx, v: torch.Tensor) -> torch.Tensor:
        return v.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return 1.01 * grad


def test_the_testing_api_differentiates_a_forward_and_names_the_gradient_it_gets_wrong() -> None:
    """``assert_matches_oracle(..., direction="backward")`` on a differentiable forward (no ``do``
    argument) judges autograd's gradients through it: the chunkwise forward passes; a forward
    that is right but whose dv is 1 % off passes the forward check and fails the backward one
    naming ``dv`` (rule: baseline, bf16, the chunkwise family)."""
    from k3verify.testing import assert_matches_oracle

    def off(q, k, v, g, beta, **kw):
        return kda.chunkwise(q, k, _ValueGradientOff.apply(v), g, beta, **kw)

    assert_matches_oracle(kda.chunkwise, "kda", torch.bfloat16, direction="backward", baseline="chunkwise")
    assert_matches_oracle(off, "kda", torch.bfloat16, baseline="chunkwise")
    with pytest.raises(AssertionError, match="output 'dv'"):
        assert_matches_oracle(off, "kda", torch.bfloat16, direction="backward", baseline="chunkwise")
    with pytest.raises(ValueError, match="no backward pass registered"):
        assert_matches_oracle(off, "kda_layer", torch.bfloat16, direction="backward")
