"""The tolerance policy: how a comparison becomes a verdict with a margin.

Two rules, and every test or report row names the one it uses:

``fp64-agreement``
    Two fp64 forms of the same math must agree to ``rel <= 1e-10`` (normwise relative
    max error). Used for recurrent vs chunkwise vs tiled-in-fp64. An output that a module
    declares a sum whose terms can cancel far below their size (``term_sizes``: Block AttnRes's
    ``dw`` and ``dγ``) has each element's error relative to the larger of ``max|ref|`` and the sum
    of its terms' absolute values: any fp64 form keeps the terms' rounding.

``baseline``
    ``err(impl) <= k * err(baseline) + floor`` on one metric (``rms_ratio`` by default),
    where both errors are measured against the fp64 oracle, ``baseline`` is the naive form
    run with every stored tensor in the implementation's dtype, and ``floor`` is the noise
    floor: the error of merely rounding the oracle's output to that dtype (for a declared sum, at
    least ``k`` roundings of its terms in the fp32 accumulator, :func:`term_floor`). ``k = 2``
    follows FlashAttention's rule. An absolute tolerance alone is never used, so an all-zero output
    (``rms_ratio = 1``) fails wherever the limit is below 1: on every output of 52 elements
    or more in every dtype verified here (fp8's baseline error is a few percent).

    On a small output the two RMS errors are estimates from a handful of elements: a correct
    implementation can land above twice a baseline that rounded luckily (a drawn MLA case with an
    8-element output: 3.56x). There ``k`` becomes :func:`small_output_k` (``n``), the factor
    that the ratio of two RMS of ``n`` independent equal-variance normal errors exceeds with
    probability ``1e-6``: 8.7 at 8 elements, 3.9 at 16, 2.05 at 48, and 2 from 52 elements on.
    At 3 elements and fewer that factor is over 100: the rule then catches gross errors only.

    The same rule holds the error's projection on the oracle, ``bias = <x - r, r> / <r, r>``
    (:class:`~k3verify.numerics.metrics.Metrics`), to the baseline's:
    ``|bias| <= k * |bias(baseline)| + z(n) * rms_ratio / sqrt(n) + k * 2^-24``. A systematic
    error such as a softmax scale 1 % off is coherent with the output: its RMS hides under bf16's rounding
    noise, its projection does not. Noise of RMS ratio ``rho`` over ``n`` independent errors
    projects to about ``rho / sqrt(n)``; ``z(n)`` (:func:`bias_z`) is what that projection
    exceeds with probability ``1e-6`` (4.89 for large ``n``; at most ``sqrt(n)``, which allows any
    projection, so a handful of errors judge nothing). ``n`` is the number of independent errors
    of the output, which its module declares (``ModuleEntry.error_samples``): by default the rows
    (a row shares scalars such as a softmax's ``1/l`` or an RMSNorm's ``1/rms``), a Block AttnRes
    call's tokens, a walk's tokens, the (batch, head) pairs for KDA, whose state carries a rounding
    along every later position. The small-output factor of the RMS term counts independent errors
    too: every element, but a walk's tokens and KDA's rows. The last term is the bias's floor: a
    correct kernel may round a scalar once in its fp32 accumulator (a folded constant, a row's
    normaliser), which scales a whole row coherently.

The rules are values: :data:`POLICY` maps each name to an object whose ``judge`` turns one output
into a :class:`Judgement` (the runner, goldens and the testing API all judge through it);
:func:`rule_for` names the rule of a dtype.

The margin is the fraction of the allowance left: ``1 - err / limit``; 1 when exact, 0 at
the limit, negative when failing.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from types import MappingProxyType
from typing import Any, ClassVar, Protocol

import torch

from .dtypes import finer
from .metrics import Metrics, compare, mismatch_fraction, relative_max_error
from .rounding import round_to

FP64_AGREEMENT_REL = 1e-10
BASELINE_K = 2.0
# The probability that a correct output of n elements fails the baseline rule on rounding
# noise alone, where its error and the baseline's are n independent normal errors of one scale.
SMALL_OUTPUT_ALPHA = 1e-6
# The bias no correct kernel can be held below: one rounding of a scalar in its fp32 accumulator
# (a folded constant such as the softmax scale times log2(e), a row's 1/l) scales a whole row by
# up to fp32's unit roundoff, coherently. Our Triton MLA kernels in fp32 measured 2.0e-8 and 4.1e-8
# on an H100 (docs/sensitivity.md); the floor is k such roundings.
ACCUMULATOR_ROUNDOFF = 2.0**-24



class Status(str, enum.Enum):
    """Every status of the project, once: a judged output is one of :data:`VERDICT_STATUSES`; a
    row is one of :data:`STATUSES` (``unavailable``: it could not run here, so nothing was judged).
    A status is its string (``Status.PASS == "pass"``), in JSON and in every text."""

    PASS = "pass"
    FAIL = "fail"
    EXPECTED_NONFINITE = "expected-nonfinite"
    UNAVAILABLE = "unavailable"

    def __str__(self) -> str:
        return self.value


PASS, FAIL, EXPECTED_NONFINITE, UNAVAILABLE = Status
VERDICT_STATUSES = (PASS, FAIL, EXPECTED_NONFINITE)
STATUSES = tuple(Status)

# Rule names, once: a row is held to FP64_RULE or BASELINE_RULE (rule_for; the rules themselves are
# the table POLICY, at the end); FRONTIER_RULE judges an output where overflow was predicted.
FP64_RULE = "fp64-agreement"
BASELINE_RULE = "baseline"
FRONTIER_RULE = "frontier"


def rule_for(dtype: str) -> str:
    """The name of the rule a row computed in ``dtype`` (a dtype name: ``fp64``, ``bf16``, ...) is
    held to: fp64-agreement for fp64, the baseline rule for every lower precision (``POLICY[name]``
    is the rule)."""
    return FP64_RULE if dtype == "fp64" else BASELINE_RULE


@dataclass(frozen=True)
class Verdict:
    """Outcome of one comparison under one rule."""

    status: Status  # PASS, FAIL or EXPECTED_NONFINITE
    rule: str
    metric: str
    err: float
    limit: float
    margin: float
    reason: str
    baseline_err: float | None = None
    floor: float | None = None
    k: float | None = None
    bias: float | None = None
    bias_limit: float | None = None

    @property
    def passed(self) -> bool:
        """True unless the verdict is a failure (a predicted overflow is not a failure)."""
        return self.status != FAIL

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _margin(err: float, limit: float) -> float:
    if math.isnan(err) or math.isinf(err):
        return -math.inf
    if limit <= 0:
        return 1.0 if err == 0 else -math.inf
    return 1.0 - err / limit


def fp64_agreement(x: torch.Tensor, ref: torch.Tensor, *, rel: float = FP64_AGREEMENT_REL,
                   term_sizes: torch.Tensor | None = None) -> Verdict:
    """Verdict of the ``fp64-agreement`` rule for ``x`` against ``ref`` (both fp64).

    ``term_sizes`` (``ref``'s shape, fp64) holds, for an output formed as a sum, the sum of its
    terms' absolute values per element: each element's error is then relative to the larger of
    ``max|ref|`` and its terms' size (:func:`~k3verify.numerics.metrics.relative_max_error`), as
    a sum that cancels far below its terms keeps their rounding in any fp64 form."""
    for name, t in (("x", x), ("ref", ref)):
        if t.dtype != torch.float64:
            raise TypeError(f"fp64-agreement needs fp64 tensors; {name} is {t.dtype}")
    err = relative_max_error(x, ref, term_sizes)
    ok = err <= rel
    of = " (of max|ref| or its terms' size)" if term_sizes is not None else ""
    return Verdict(
        status=PASS if ok else FAIL,
        rule=FP64_RULE,
        metric="rel_max",
        err=err,
        limit=rel,
        margin=_margin(err, rel),
        reason=f"rel_max{of} {err:.3e} {'<=' if ok else '>'} {rel:.0e}",
    )


def _incomplete_beta(x: float, a: float, b: float) -> float:
    """The regularised incomplete beta function ``I_x(a, b)``. The integral is taken after
    ``t = x u^(1/a)``, which leaves the smooth integrand ``(1 - x u^(1/a))^(b-1)`` on ``[0, 1]``
    (Simpson's rule, 2048 panels, fp64); ``x`` must stay away from 1 where ``b < 1``."""
    u = torch.linspace(0.0, 1.0, 2049, dtype=torch.float64)
    f = torch.pow(1.0 - x * torch.pow(u, 1.0 / a), b - 1.0)
    weights = torch.ones_like(u)
    weights[1:-1:2], weights[2:-1:2] = 4.0, 2.0
    integral = float((weights * f).sum()) / (3.0 * 2048)
    log_beta = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    return math.exp(a * math.log(x) - math.log(a) - log_beta) * integral


def _ratio_tail(n: int, c: float) -> float:
    """``P(rms(e1) / rms(e2) > c)`` for ``e1, e2`` of ``n`` iid standard normals each: with
    ``F = chi2_n / chi2_n``, ``P(F > c^2) = I_x(n/2, n/2)`` at ``x = 1 / (1 + c^2)``."""
    return _incomplete_beta(1.0 / (1.0 + c * c), n / 2.0, n / 2.0)


def _projection_tail(n: int, z: float) -> float:
    """``P(sqrt(n) |cos(e, r)| > z)`` for ``e`` of ``n`` iid normals and any fixed ``r``: the
    squared cosine of a random direction is ``Beta(1/2, (n-1)/2)``, so the tail is
    ``I_x((n-1)/2, 1/2)`` at ``x = 1 - z^2 / n`` (0 from ``z = sqrt(n)`` on)."""
    if z * z >= n:
        return 0.0
    return _incomplete_beta(1.0 - z * z / n, (n - 1) / 2.0, 0.5)


def _upper_quantile(tail: Callable[[float], float], alpha: float, lo: float) -> float:
    """The ``c >= lo`` where the decreasing ``tail(c)`` falls to ``alpha`` (bisection on
    ``log c`` to 1e-9 relative); ``lo`` itself when ``tail(lo) <= alpha``."""
    if tail(lo) <= alpha:
        return lo
    a, b = math.log(lo), math.log(1e12)
    while b - a > 1e-9:
        mid = 0.5 * (a + b)
        a, b = (mid, b) if tail(math.exp(mid)) > alpha else (a, mid)
    return math.exp(b)


@functools.cache
def small_output_k(n: int, k: float = BASELINE_K, alpha: float = SMALL_OUTPUT_ALPHA) -> float:
    """The baseline factor for an output of ``n`` elements: ``max(k, c)`` where
    ``P(rms(e1) / rms(e2) > c) = alpha`` for two sets of ``n`` iid normal errors of one scale."""
    if n <= 0:
        return k
    return _upper_quantile(lambda c: _ratio_tail(n, c), alpha, k)


@functools.cache
def bias_z(n: int, alpha: float = SMALL_OUTPUT_ALPHA) -> float:
    """The allowance on the bias, in units of ``rms_ratio / sqrt(n)``, over ``n`` independent
    errors. ``bias / (rms_ratio / sqrt(n))`` is ``sqrt(n) cos(e, r)``; the returned ``z`` is the
    value its magnitude exceeds with probability ``alpha`` for iid normal errors (4.89 for large
    ``n``, as a normal's two-sided tail; ``sqrt(n)``, which no error can exceed, below 2)."""
    if n < 2:
        return math.sqrt(max(n, 0))
    if _projection_tail(n, 1.0) <= alpha:
        return 1.0
    lo, hi = 1.0, math.sqrt(n)
    while hi - lo > 1e-9 * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _projection_tail(n, mid) > alpha else (lo, mid)
    return hi


def _differences(ref: torch.Tensor, outs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """``out - ref`` in fp64 on the CPU for each of ``outs``, non-finite entries as 0."""
    r = ref.detach().to("cpu", torch.float64)
    diffs = [o.detach().to("cpu", torch.float64) - r for o in outs]
    return [torch.where(torch.isfinite(d), d, 0.0) for d in diffs]


def _kish(energies: torch.Tensor, size: int, pooled: int) -> float:
    """Kish's effective number ``(ΣE)² / ΣE²`` of error energies ``E``, each the sum of ``size``
    squared errors, per form of the ``pooled`` ones they came from; 0 when every ``E`` is 0. ``E``
    of ``size`` equal-scale normal errors is a scaled chi-square with ``E[E²] = (1 + 2/size) E[E]²``,
    hence that factor (3 for single elements)."""
    second = float((energies * energies).sum())
    return 0.0 if second == 0.0 else (1.0 + 2.0 / size) * float(energies.sum()) ** 2 / second / pooled


def _count(worth: float, most: float) -> int:
    """A count of errors from Kish's number: at most ``most``; at least 1 where there is any error
    (a count of 0 would read as 'no count', the plain factor k), 0 where there is none."""
    return min(most, max(1, int(worth))) if worth > 0.0 else 0


def effective_errors(ref: torch.Tensor, *outs: torch.Tensor) -> int:
    """How many equal-scale independent errors each of ``outs - ref`` is worth, the scales pooled
    over ``outs`` (two forms of one output share where the rounding is amplified): Kish's
    effective number ``(Σσ²)² / Σσ⁴``, each ``σ_i²`` estimated by the ``e_i²`` of every out (for a
    normal error ``E[e⁴] = 3σ⁴``, hence ``3 (Σe²)² / Σe⁴``), divided by the number of outs; at most
    the number of elements, at least 1; 0 for no error. Equal scales give about the element
    count; a few dominant errors, about their number."""
    if not outs:
        return 0
    squares = torch.cat([d.reshape(-1).square() for d in _differences(ref, outs)])
    return _count(_kish(squares, 1, len(outs)), ref.numel())


def effective_slices(ref: torch.Tensor, *outs: torch.Tensor, axis: int | tuple[int, ...] = 0) -> int:
    """How many equal-scale independent errors each of ``outs - ref`` is worth where its errors
    come in slices along ``axis`` (a token's channels share its errors; a tuple of axes makes each
    combination of their indices one slice, an attention's ``(batch, token, head)`` query row):
    Kish's effective number of slices over the slices' error energies ``E = Σ e²``, pooled over
    ``outs`` as :func:`effective_errors` pools elements (:func:`_kish`). At most the number of
    slices, at least 1; 0 for no error."""
    if not outs or ref.numel() == 0:
        return 0
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    slices = math.prod(ref.shape[a] for a in axes)
    front = tuple(range(len(axes)))
    energies = torch.cat([d.movedim(axes, front).reshape(slices, -1).square().sum(1)
                          for d in _differences(ref, outs)])
    return _count(_kish(energies, ref.numel() // slices, len(outs)), slices)


def effective_products(ref: torch.Tensor, *outs: torch.Tensor) -> int:
    """How many independent errors a stack of summed outer products is worth (``ref:[..., n, m]``,
    each matrix ``Σ_r a_r ⊗ b_r``, a grouped GEMM's weight gradient per expert): each product's
    error ``δa ⊗ b + a ⊗ δb`` holds about as many errors as its factors have entries, weighted
    by their sizes, so a matrix of rank ``ρ`` (its number of products, read from the oracle's
    numerical rank) is worth at most ``ρ`` times Kish's number of its error's rows plus that of
    its columns (:func:`_kish`, pooled over ``outs``), where Kish's number over the elements
    (:func:`effective_errors`) multiplies the two. Summed over the matrices; at least 1 where
    there is any error, 0 for none. The element count caps nothing here: take the smaller of this
    and :func:`effective_errors`."""
    if ref.dim() < 2 or not outs:
        return 0
    n, m = ref.shape[-2:]
    mats = ref.detach().to("cpu", torch.float64).reshape(-1, n, m)
    errs = [d.reshape(-1, n, m) for d in _differences(ref, outs)]
    total = 0.0
    for i in range(mats.shape[0]):
        e = [x[i] for x in errs]
        if not any(bool(x.any()) for x in e):
            continue
        rank = int(torch.linalg.matrix_rank(mats[i], rtol=1e-10)) if bool(mats[i].any()) else min(n, m)
        rows = _kish(torch.cat([x.square().sum(1) for x in e]), m, len(outs))
        cols = _kish(torch.cat([x.square().sum(0) for x in e]), n, len(outs))
        total += max(rank, 1) * (rows + cols)
    return _count(total, math.inf)


def noise_floor(ref: torch.Tensor, dtype: torch.dtype | str, *, metric: str = "rms_ratio") -> float:
    """Error of the oracle's own output rounded to ``dtype``: what no implementation beats."""
    r64 = ref.detach().to("cpu", torch.float64)
    return float(getattr(compare(round_to(r64, dtype), r64, ulp_dtype=dtype), metric))


def term_floor(ref: torch.Tensor, term_sizes: torch.Tensor | None, *, k: float = BASELINE_K) -> float:
    """The ``rms_ratio`` no form of a sum can be held below: ``k`` roundings in the fp32
    accumulator of its terms, ``k 2^-24 rms(S) / rms(ref)`` with ``S`` the sum of the terms'
    absolute values per element (``term_sizes``, ``ref``'s shape). Where the sum cancels far below
    its terms (a saturated softmax's ``Σ dℓ k``: 1e-20 from terms of 0.5) two correct orders of the
    same additions differ by that much, however small the sum. 0 without ``term_sizes``."""
    if term_sizes is None:
        return 0.0
    r = ref.detach().to("cpu", torch.float64)
    size = float(term_sizes.detach().to("cpu", torch.float64).expand_as(r).square().mean().sqrt())
    scale = float(r.square().mean().sqrt())
    if size == 0.0:
        return 0.0
    return math.inf if scale == 0.0 else k * ACCUMULATOR_ROUNDOFF * size / scale


def baseline_rule(
    impl: Metrics,
    baseline: Metrics,
    floor: float,
    *,
    k: float = BASELINE_K,
    metric: str = "rms_ratio",
    rms_n: int | None = None,
    bias_n: int | None = None,
) -> Verdict:
    """Verdict of the ``baseline`` rule: ``err(impl) <= k * err(baseline) + floor``, ``k``
    widened on a small output (:func:`small_output_k` of its ``rms_n`` independent errors, every
    element by default); then, with ``bias_n``
    independent errors, ``|bias| <= k * |bias(baseline)| + bias_z(bias_n) * rms_ratio / sqrt(bias_n)``
    (:func:`bias_limit`). The verdict names the statistic that failed; ``None`` leaves the bias
    unjudged."""
    err = float(getattr(impl, metric))
    base = float(getattr(baseline, metric))
    k = small_output_k(impl.n if rms_n is None else rms_n, k)
    if impl.nonfinite:
        return Verdict(FAIL, BASELINE_RULE, metric, err, math.nan, -math.inf, f"{impl.nonfinite} non-finite outputs",
                       base, floor, k)
    base_finite = not baseline.nonfinite and math.isfinite(base)
    if base_finite:
        base_term, note = k * base, ""
    else:
        # A baseline that overflowed grants no allowance; only the floor remains.
        base_term, note = 0.0, " (baseline non-finite: floor only)"
    limit = base_term + floor
    ok = err <= limit
    reason = f"{metric} {err:.3e} {'<=' if ok else '>'} {k:.3g}x{base:.3e} + {floor:.3e}{note}"
    verdict = Verdict(PASS if ok else FAIL, BASELINE_RULE, metric, err, limit, _margin(err, limit), reason, base,
                      floor, k)
    if bias_n is None:
        return verdict
    b_limit, b_reason = bias_limit(impl, baseline if base_finite else None, bias_n, k=BASELINE_K)
    verdict = replace(verdict, bias=impl.bias, bias_limit=b_limit)
    if not ok or abs(impl.bias) <= b_limit:
        return verdict
    return replace(verdict, status=FAIL, metric="bias", err=abs(impl.bias), limit=b_limit,
                   margin=_margin(abs(impl.bias), b_limit), reason=b_reason, baseline_err=abs(baseline.bias))


def bias_limit(impl: Metrics, baseline: Metrics | None, n: int, *, k: float = BASELINE_K) -> tuple[float, str]:
    """The allowance on ``|impl.bias|`` and the sentence a failure reads: ``k`` times the
    baseline's ``|bias|`` (nothing when the baseline overflowed: ``None``), plus the projection of
    ``impl``'s own noise, ``bias_z(n) * rms_ratio / sqrt(n)`` over ``n`` independent errors, plus
    ``k`` scalar roundings in the fp32 accumulator (:data:`ACCUMULATOR_ROUNDOFF`)."""
    base = 0.0 if baseline is None else abs(baseline.bias)
    z = bias_z(n)
    noise = impl.rms_ratio / math.sqrt(n) if n > 0 else math.inf
    floor = k * ACCUMULATOR_ROUNDOFF
    limit = k * base + z * noise + floor
    reason = (f"bias {impl.bias:+.3e}: |bias| {abs(impl.bias):.3e} > {k:g}x{base:.3e} + "
              f"{z:.3g}x{noise:.3e} + {floor:.3e} (rms_ratio {impl.rms_ratio:.3e} over {n} independent errors)")
    return limit, reason


def expected_nonfinite(impl: Metrics, *, predicted_finite: bool, explanation: str) -> Verdict | None:
    """Verdict for an output the analytic frontier predicts to overflow.

    Returns ``EXPECTED_NONFINITE`` when the prediction and the output agree that it
    overflowed, ``FAIL`` when they disagree either way, and ``None`` when both say finite
    (then a precision rule decides).
    """
    observed_finite = impl.nonfinite == 0
    if predicted_finite and observed_finite:
        return None
    if not predicted_finite and not observed_finite:
        return Verdict(
            EXPECTED_NONFINITE,
            FRONTIER_RULE,
            "nonfinite",
            float(impl.nonfinite),
            math.nan,
            math.nan,
            f"overflow predicted and observed: {explanation}",
        )
    what = (
        "finite output where overflow was predicted"
        if observed_finite
        else (f"{impl.nonfinite} non-finite outputs where the frontier predicts finite")
    )
    return Verdict(FAIL, FRONTIER_RULE, "nonfinite", float(impl.nonfinite), math.nan, -math.inf,
                   f"{what}: {explanation}")


def mismatch_rule(err: float, baseline_err: float | None, *, k: float = BASELINE_K) -> Verdict:
    """Verdict for a discrete output (which experts a token chose): ``err`` is the fraction of rows
    that differ from the oracle's. Without a baseline (``exact``) it must be 0; with one
    (``baseline``) at most ``k`` times the same-dtype baseline's fraction (no floor: the oracle's
    choices are exact)."""
    if baseline_err is None:
        ok = err == 0
        return Verdict(PASS if ok else FAIL, "exact", "mismatch", err, 0.0, 1.0 if ok else -math.inf,
                       f"mismatch {err:.3g} {'==' if ok else '>'} 0")
    limit = k * baseline_err
    ok = err <= limit
    return Verdict(PASS if ok else FAIL, BASELINE_RULE, "mismatch", err, limit, _margin(err, limit),
                   f"mismatch {err:.3g} {'<=' if ok else '>'} {k:g}x{baseline_err:.3g}", baseline_err, 0.0, k)



# --- the policy as a value -------------------------------------------------------------------


@dataclass(frozen=True)
class Judgement:
    """One output judged by a rule: its verdict, its metrics and, under the baseline rule, the
    baseline's metrics (as a report stores them)."""

    verdict: Verdict
    metrics: dict[str, Any]
    baseline_metrics: dict[str, Any] | None = None


class Rule(Protocol):
    """A rule judges one output against its fp64 oracle and returns a :class:`Judgement`.

    ``out`` and ``ref`` have one shape (``ref`` fp64 for floating outputs, integers for a discrete
    output such as MoE's expert sets); ``dtype`` names the precision the output was computed in
    (ULPs and the noise floor are taken there); ``baseline`` is the same-dtype baseline's output
    where the rule ``uses_baseline``; ``metrics`` may pass ``compare(out, ref)`` already computed;
    ``rms_n`` and ``bias_n`` count the output's independent errors (:func:`baseline_rule`);
    ``zero_floor`` is the absolute error allowed an output whose oracle is all zero
    (:meth:`SameDtypeBaseline.judge`); ``term_sizes`` the size of the terms of an output formed
    as a sum, per element (:func:`fp64_agreement`, :func:`term_floor`)."""

    name: str
    uses_baseline: bool

    def judge(self, out: torch.Tensor, ref: torch.Tensor, *, dtype: str, baseline: torch.Tensor | None = None,
              metrics: Metrics | None = None, rms_n: int | None = None, bias_n: int | None = None,
              zero_floor: float = 0.0, term_sizes: torch.Tensor | None = None) -> Judgement:
        ...


def _discrete_metrics(err: float, ref: torch.Tensor) -> dict[str, Any]:
    return {"mismatch": err, "n": int(ref.shape[0]) if ref.dim() else 1, "nonfinite": 0}


@dataclass(frozen=True)
class Fp64Agreement:
    """``fp64-agreement``: an fp64 output within ``rel`` (normwise relative max error) of the
    oracle; a discrete output equal to it on every row. A lower-precision output is refused:
    fp64 must stay fp64."""

    rel: float = FP64_AGREEMENT_REL
    name: ClassVar[str] = FP64_RULE
    uses_baseline: ClassVar[bool] = False

    def judge(self, out: torch.Tensor, ref: torch.Tensor, *, dtype: str = "fp64", baseline: torch.Tensor | None = None,
              metrics: Metrics | None = None, rms_n: int | None = None, bias_n: int | None = None,
              zero_floor: float = 0.0, term_sizes: torch.Tensor | None = None) -> Judgement:
        if not ref.is_floating_point():
            err = mismatch_fraction(out, ref)
            return Judgement(mismatch_rule(err, None), _discrete_metrics(err, ref))
        if out.dtype != torch.float64:
            raise TypeError(f"judged by {self.name} but computed in {out.dtype}; fp64 must stay fp64")
        m = compare(out, ref, ulp_dtype=dtype) if metrics is None else metrics
        return Judgement(fp64_agreement(out, ref, rel=self.rel, term_sizes=term_sizes), m.as_dict())


@dataclass(frozen=True)
class SameDtypeBaseline:
    """``baseline``: an output's error against the oracle within ``k`` times the same-dtype
    baseline's plus the noise floor, its bias within the baseline's (:func:`baseline_rule`); a
    discrete output's mismatched rows within ``k`` times the baseline's (:func:`mismatch_rule`)."""

    k: float = BASELINE_K
    name: ClassVar[str] = BASELINE_RULE
    uses_baseline: ClassVar[bool] = True

    def judge(self, out: torch.Tensor, ref: torch.Tensor, *, dtype: str, baseline: torch.Tensor | None = None,
              metrics: Metrics | None = None, rms_n: int | None = None, bias_n: int | None = None,
              zero_floor: float = 0.0, term_sizes: torch.Tensor | None = None) -> Judgement:
        if baseline is None:
            raise ValueError(f"the {self.name} rule needs the same-dtype baseline's output")
        if not ref.is_floating_point():
            err = mismatch_fraction(out, ref)
            verdict = mismatch_rule(err, mismatch_fraction(baseline, ref), k=self.k)
            return Judgement(verdict, _discrete_metrics(err, ref))
        m = compare(out, ref, ulp_dtype=dtype) if metrics is None else metrics
        base = compare(baseline, ref, ulp_dtype=dtype)
        if m.n and not bool(ref.detach().any()):
            # An oracle of zeros has no relative error (KDA's dg on one token from no state: the
            # gate decays a zero state). A form that computes it as a difference of equal terms
            # leaves a residue; the rule compares absolute RMS errors, with ``zero_floor`` (the
            # module's: k roundings of those terms in the fp32 accumulator) as the floor.
            verdict = baseline_rule(m, base, zero_floor, k=self.k, metric="rms", rms_n=rms_n)
            return Judgement(verdict, m.as_dict(), base.as_dict())
        floor = max(noise_floor(ref, _floor_dtype(out.dtype, dtype)), term_floor(ref, term_sizes, k=self.k))
        verdict = baseline_rule(m, base, floor, k=self.k, rms_n=rms_n, bias_n=bias_n)
        return Judgement(verdict, m.as_dict(), base.as_dict())


def _floor_dtype(stored: torch.dtype, declared: str) -> torch.dtype:
    """The dtype whose rounding of the oracle floors a row: the finer of the one its output is
    stored in and the one the row declares. An fp8 run that writes bf16 is floored at bf16, not
    fp8; an output stored coarser than its row's dtype (fp8 codes for an fp32 row) is not floored
    at its own coarse rounding: the kernel picks its output's dtype, the row's dtype is the claim
    being judged. A declared name outside the floating formats leaves the stored dtype."""
    try:
        return finer(declared, stored)
    except ValueError:
        return stored


# The policy: every rule a row can name, by name. Rows store the name; judging goes through here.
POLICY: Mapping[str, Rule] = MappingProxyType({rule.name: rule for rule in (Fp64Agreement(), SameDtypeBaseline())})
RULES = tuple(POLICY)
