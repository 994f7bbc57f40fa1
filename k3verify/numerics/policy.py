"""The tolerance policy: how a comparison becomes a verdict with a margin.

Two rules, and every test or report row names the one it uses:

``fp64-agreement``
    Two fp64 forms of the same math must agree to ``rel <= 1e-10`` (normwise relative
    max error). Used for recurrent vs chunkwise vs tiled-in-fp64.

``baseline``
    ``err(impl) <= k * err(baseline) + floor`` on one metric (``rms_ratio`` by default),
    where both errors are measured against the fp64 oracle, ``baseline`` is the naive form
    run with every stored tensor in the implementation's dtype, and ``floor`` is the noise
    floor: the error of merely rounding the oracle's output to that dtype. ``k = 2`` follows
    FlashAttention's rule. An absolute tolerance alone is never used, so an all-zero output
    (``rms_ratio = 1``) fails wherever the limit is below 1: on every output of 52 elements
    or more in every dtype verified here (fp8's baseline error is a few percent).

    On a small output the two RMS errors are estimates from a handful of elements: a correct
    implementation can land above twice a baseline that rounded luckily (a drawn MLA case with an
    8-element output: 3.56x). There ``k`` becomes :func:`small_output_k` (``n``), the factor
    that the ratio of two RMS of ``n`` independent equal-variance normal errors exceeds with
    probability ``1e-6``: 8.7 at 8 elements, 3.9 at 16, 2.05 at 48, and 2 from 52 elements on.
    At 3 elements and fewer that factor is over 100: the rule then catches gross errors only.

The margin is the fraction of the allowance left: ``1 - err / limit``; 1 when exact, 0 at
the limit, negative when failing.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import torch

from .metrics import Metrics, compare, relative_max_error
from .rounding import round_to

FP64_AGREEMENT_REL = 1e-10
BASELINE_K = 2.0
# The probability that a correct output of n elements fails the baseline rule on rounding
# noise alone, where its error and the baseline's are n independent normal errors of one scale.
SMALL_OUTPUT_ALPHA = 1e-6

PASS = "pass"
FAIL = "fail"
EXPECTED_NONFINITE = "expected-nonfinite"


@dataclass(frozen=True)
class Verdict:
    """Outcome of one comparison under one rule."""

    status: str  # PASS, FAIL or EXPECTED_NONFINITE
    rule: str
    metric: str
    err: float
    limit: float
    margin: float
    reason: str
    baseline_err: float | None = None
    floor: float | None = None
    k: float | None = None

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


def fp64_agreement(x: torch.Tensor, ref: torch.Tensor, *, rel: float = FP64_AGREEMENT_REL) -> Verdict:
    """Verdict of the ``fp64-agreement`` rule for ``x`` against ``ref`` (both fp64)."""
    for name, t in (("x", x), ("ref", ref)):
        if t.dtype != torch.float64:
            raise TypeError(f"fp64-agreement needs fp64 tensors; {name} is {t.dtype}")
    err = relative_max_error(x, ref)
    ok = err <= rel
    return Verdict(
        status=PASS if ok else FAIL,
        rule="fp64-agreement",
        metric="rel_max",
        err=err,
        limit=rel,
        margin=_margin(err, rel),
        reason=f"rel_max {err:.3e} {'<=' if ok else '>'} {rel:.0e}",
    )


def _ratio_tail(n: int, c: float) -> float:
    """``P(rms(e1) / rms(e2) > c)`` for ``e1, e2`` of ``n`` iid standard normals each: with
    ``F = chi2_n / chi2_n``, ``P(F > c^2) = I_x(n/2, n/2)`` at ``x = 1 / (1 + c^2)``. The
    incomplete beta integral is taken after ``t = x u^(1/a)``, which leaves the smooth integrand
    ``(1 - x u^(1/a))^(a-1)`` on ``[0, 1]`` (Simpson's rule, 2048 panels, fp64)."""
    a = n / 2.0
    x = 1.0 / (1.0 + c * c)
    u = torch.linspace(0.0, 1.0, 2049, dtype=torch.float64)
    f = torch.pow(1.0 - x * torch.pow(u, 1.0 / a), a - 1.0)
    weights = torch.ones_like(u)
    weights[1:-1:2], weights[2:-1:2] = 4.0, 2.0
    integral = float((weights * f).sum()) / (3.0 * 2048)
    log_beta = 2.0 * math.lgamma(a) - math.lgamma(2.0 * a)
    return math.exp(a * math.log(x) - math.log(a) - log_beta) * integral


@functools.cache
def small_output_k(n: int, k: float = BASELINE_K, alpha: float = SMALL_OUTPUT_ALPHA) -> float:
    """The baseline factor for an output of ``n`` elements: ``max(k, c)`` where
    ``P(rms(e1) / rms(e2) > c) = alpha`` for two sets of ``n`` iid normal errors of one scale
    (bisection on ``log c``, to 1e-9 relative)."""
    if n <= 0:
        return k
    if _ratio_tail(n, k) <= alpha:
        return k
    lo, hi = math.log(k), math.log(1e12)
    while hi - lo > 1e-9:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _ratio_tail(n, math.exp(mid)) > alpha else (lo, mid)
    return math.exp(hi)


def noise_floor(ref: torch.Tensor, dtype: torch.dtype | str, *, metric: str = "rms_ratio") -> float:
    """Error of the oracle's own output rounded to ``dtype``: what no implementation beats."""
    r64 = ref.detach().to("cpu", torch.float64)
    return float(getattr(compare(round_to(r64, dtype), r64, ulp_dtype=dtype), metric))


def baseline_rule(
    impl: Metrics,
    baseline: Metrics,
    floor: float,
    *,
    k: float = BASELINE_K,
    metric: str = "rms_ratio",
) -> Verdict:
    """Verdict of the ``baseline`` rule: ``err(impl) <= k * err(baseline) + floor``, ``k``
    widened on a small output (:func:`small_output_k` of ``impl.n``)."""
    err = float(getattr(impl, metric))
    base = float(getattr(baseline, metric))
    k = small_output_k(impl.n, k)
    if impl.nonfinite:
        return Verdict(
            FAIL, "baseline", metric, err, math.nan, -math.inf, f"{impl.nonfinite} non-finite outputs", base, floor, k
        )
    if baseline.nonfinite or not math.isfinite(base):
        # A baseline that overflowed grants no allowance; only the floor remains.
        base_term, note = 0.0, " (baseline non-finite: floor only)"
    else:
        base_term, note = k * base, ""
    limit = base_term + floor
    ok = err <= limit
    reason = f"{metric} {err:.3e} {'<=' if ok else '>'} {k:.3g}x{base:.3e} + {floor:.3e}{note}"
    return Verdict(PASS if ok else FAIL, "baseline", metric, err, limit, _margin(err, limit), reason, base, floor, k)


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
            "frontier",
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
    return Verdict(FAIL, "frontier", "nonfinite", float(impl.nonfinite), math.nan, -math.inf, f"{what}: {explanation}")


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
    return Verdict(PASS if ok else FAIL, "baseline", "mismatch", err, limit, _margin(err, limit),
                   f"mismatch {err:.3g} {'<=' if ok else '>'} {k:g}x{baseline_err:.3g}", baseline_err, 0.0, k)
