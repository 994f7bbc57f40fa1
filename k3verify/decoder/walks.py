"""Precision walks through the stack: depth drift, attribution, and the first divergence.

A *walk* is one prefill of a prompt through all layers under a :class:`~k3verify.decoder.Plan`.
Against the fp64 walk (the reference, :func:`reference_walk`), a walk's error is read at every
sublayer call ``s``: the AttnRes output ``h_s`` the sublayer sees (the residual stream: the
depth-drift curve) and the sublayer's output ``y_s``, each as ``rms(x − ref) / rms(ref)``.

*Attribution* runs the stack in fp64 with one module type (or one layer of it) in low precision
and reads the final output's error: independent errors add in quadrature, so each module's share
of the all-low-precision error is ``e_m² / Σ e²``.

*First divergence* finds the first sublayer where one walk leaves the policy against another
(fp64 agreement, or the same-dtype baseline rule with a third, baseline walk), scanning forward
with one resumable snapshot every ``stride`` sublayers and bisecting inside the stride where it
first diverged: memory for one snapshot of the stream, not every layer's activations.

MoE expert choices are pinned to the reference walk's (``routes``) unless asked otherwise: a
top-k choice that rounding flips changes a token's output by O(1) and would bury the arithmetic
the walk measures; the flips are counted apart (:func:`routing_flips`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from ..numerics.dtypes import dtype_name
from ..numerics.policy import POLICY, Verdict, rule_for
from .config import ATTNRES, MODULES
from .model import Decoder, Form, Pass, Plan, only


def rms_ratio(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``rms(x − ref) / rms(ref)`` in fp64 (``inf`` for a non-finite ``x``; 0 for two zero tensors)."""
    x, ref = x.double(), ref.double()
    if not bool(torch.isfinite(x).all()):
        return math.inf
    den = float(ref.pow(2).mean().sqrt())
    num = float((x - ref).pow(2).mean().sqrt())
    return num / den if den else (0.0 if num == 0 else math.inf)


@dataclass
class Recording:
    """Every sublayer call's ``h_s`` and ``y_s`` of one walk (fp64 copies), its output and its
    MoE choices: what the other walks are compared with."""

    h: list[torch.Tensor] = field(default_factory=list)
    y: list[torch.Tensor] = field(default_factory=list)
    out: torch.Tensor | None = None
    routes: dict[int, torch.Tensor] = field(default_factory=dict)
    evaluations: int = 0


@dataclass(frozen=True)
class WalkResult:
    """A walk against the reference: ``h_err[s]``, ``y_err[s]`` per sublayer call, the final
    output's error ``out_err``, the output itself, the routing flips when not pinned."""

    label: str
    h_err: list[float]
    y_err: list[float]
    out_err: float
    out: torch.Tensor
    evaluations: int
    flips: float | None = None


def _run(decoder: Decoder, plan: Plan, tokens: torch.Tensor, *, routes: Mapping[int, torch.Tensor] | None,
         observe: Callable[[int, torch.Tensor, torch.Tensor], None] | None) -> tuple[Pass, torch.Tensor]:
    state = decoder.new_state(1, int(tokens.shape[0]), plan)
    run = decoder.start([tokens], state, plan, routes=routes)
    while not run.done:
        run.advance(observe=observe)
    out, _ = run.finish()
    return run, out[0]


def reference_walk(decoder: Decoder, plan: Plan, tokens: torch.Tensor) -> Recording:
    """Run ``plan`` (fp64) on ``tokens:[T, d]`` and keep every call's ``h`` and ``y``."""
    rec = Recording()
    run, out = _run(decoder, plan, tokens, routes=None,
                    observe=lambda s, h, y: (rec.h.append(h.double().clone()), rec.y.append(y.double().clone())))
    rec.out, rec.routes, rec.evaluations = out.double(), dict(run.routes_out), run.evaluations
    return rec


def walk(decoder: Decoder, plan: Plan, tokens: torch.Tensor, reference: Recording, *, pin: bool = True) -> WalkResult:
    """``plan`` on ``tokens`` compared with ``reference`` at every sublayer call; MoE choices
    pinned to the reference's when ``pin`` (else counted as flips)."""
    h_err, y_err = [], []

    def observe(s: int, h: torch.Tensor, y: torch.Tensor) -> None:
        h_err.append(rms_ratio(h, reference.h[s]))
        y_err.append(rms_ratio(y, reference.y[s]))

    run, out = _run(decoder, plan, tokens, routes=reference.routes if pin else None, observe=observe)
    flips = None if pin else routing_flips(run.routes_out, reference.routes)
    return WalkResult(plan.label, h_err, y_err, rms_ratio(out, reference.out), out, run.evaluations, flips)


def routing_flips(routes: Mapping[int, torch.Tensor], reference: Mapping[int, torch.Tensor]) -> float:
    """The fraction of (token, MoE layer) pairs whose expert set differs from the reference's."""
    changed = total = 0
    for layer, ref in reference.items():
        got = routes[layer]
        same = (got.sort(-1).values == ref.sort(-1).values).all(-1)
        changed += int((~same).sum())
        total += int(same.numel())
    return changed / total if total else 0.0


def block_growth(errors: Sequence[float], block_sublayers: int) -> list[float]:
    """The depth-drift curve per AttnRes block: the error at each block's last call over the
    error at its first (growth within the block; ``nan`` where the first is 0)."""
    out = []
    for a in range(0, len(errors), block_sublayers):
        b = min(a + block_sublayers, len(errors)) - 1
        out.append(errors[b] / errors[a] if errors[a] > 0 else math.nan)
    return out


def growth_per_block(errors: Sequence[float], block_sublayers: int) -> float:
    """One number for the curve's shape: the geometric mean growth per block from the end of
    the first block to the last call (``nan`` if undefined)."""
    first = errors[min(block_sublayers, len(errors)) - 1]
    blocks = (len(errors) - block_sublayers) / block_sublayers
    if first <= 0 or blocks <= 0 or not math.isfinite(errors[-1]):
        return math.nan
    return (errors[-1] / first) ** (1 / blocks)


@dataclass(frozen=True)
class Attribution:
    """The final error with every module type in fp64 but ``module`` (``"all"``: every module in
    low precision); ``share`` of the quadrature sum over the single-module runs."""

    module: str
    label: str
    out_err: float
    share: float
    h_err: list[float]


def attribute(decoder: Decoder, tokens: torch.Tensor, low: Plan, base: Plan, reference: Recording, *,
              modules: Sequence[str] = MODULES, extra: Mapping[str, Plan] | None = None) -> list[Attribution]:
    """One walk per module type in ``low``'s form (the rest in ``base``), one with all of them,
    and ``extra`` named plans (a variant such as MLA with an fp8 cache) — each against ``reference``."""
    results = {m: walk(decoder, only(m, low, base), tokens, reference) for m in modules}
    total = sum(r.out_err**2 for r in results.values())
    rows = [Attribution(m, r.label, r.out_err, r.out_err**2 / total if total else math.nan, r.h_err)
            for m, r in results.items()]
    everything = walk(decoder, low, tokens, reference)
    rows.append(Attribution("all", low.label, everything.out_err, math.nan, everything.h_err))
    for name, plan in (extra or {}).items():
        r = walk(decoder, plan, tokens, reference)
        rows.append(Attribution(name, plan.label, r.out_err, math.nan, r.h_err))
    return rows


def plant(plan: Plan, layer: int, module: str, *, scale: float = 1.001, label: str | None = None) -> Plan:
    """``plan`` with sublayer ``module`` of ``layer`` scaling its output by ``scale`` (a planted
    bug for the first-divergence search; ``module`` must be the one that layer runs there)."""
    form = plan.form(layer, module)

    def tap(s: int, y: torch.Tensor) -> torch.Tensor:
        return y * scale

    bad = replace(form, label=f"{form.label} (output × {scale:g})", tap=tap)
    return replace(plan, label=label or f"{plan.label}, bug at layer {layer} {module}",
                   overrides={**plan.overrides, (layer, module): bad})


@dataclass(frozen=True)
class Divergence:
    """Where a walk first left the policy: ``sublayer`` (call ``s``: layer ``s // 2``, its
    ``module``), the verdict there, and the sublayer evaluations the search took (all walks)."""

    sublayer: int | None
    layer: int | None
    module: str | None
    verdict: Verdict | None
    evaluations: int
    checked: list[int]

    @property
    def found(self) -> bool:
        return self.sublayer is not None

    def describe(self) -> str:
        if not self.found:
            return f"no divergence ({self.evaluations} sublayer evaluations)"
        side = "token mixer" if self.sublayer % 2 == 0 else "channel mixer"
        return (f"first divergence at sublayer {self.sublayer}: layer {self.layer} {side} ({self.module}); "
                f"{self.verdict.reason} ({self.evaluations} sublayer evaluations)")


Judge = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], Verdict]


def judge_for(plan: Plan, decoder: Decoder
              ) -> Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor | None], Verdict]:
    """How sublayer outputs of ``plan`` are judged against the reference: fp64 agreement when the
    sublayer runs in fp64, else the same-dtype baseline rule (the baseline walk's output given),
    over the tokens as independent errors."""
    def judge(s: int, y: torch.Tensor, ref: torch.Tensor, base: torch.Tensor | None) -> Verdict:
        form: Form = plan.form(s // 2, decoder.config.module_of(s))
        name = dtype_name(form.dtype)
        rule = POLICY[rule_for(name)]
        tokens = int(ref.shape[0])
        out = y.to(form.dtype).double() if name != "fp64" else y.double()
        j = rule.judge(out, ref.double(), dtype=name, baseline=None if base is None else base.double(),
                       rms_n=tokens, bias_n=tokens)
        return j.verdict
    return judge


def first_divergence(decoder: Decoder, tokens: torch.Tensor, test: Plan, reference: Plan, *,
                     baseline: Plan | None = None, stride: int = 1,
                     routes: Mapping[int, torch.Tensor] | None = None) -> Divergence:
    """The first sublayer call where ``test``'s output leaves the policy against ``reference``'s
    (fp64) on a prefill of ``tokens``; ``baseline`` (the same-dtype baseline plan) is needed when
    ``test`` runs some sublayer below fp64.

    The walks advance in lockstep and nothing is stored but their streams. With ``stride`` 1 every
    sublayer's output is judged as it is made (the first failure is the answer, no sublayer is
    computed twice). With a larger ``stride`` only every ``stride``-th is judged, as when a walk
    can only be observed at checkpoints: the search keeps one snapshot per walk at the last
    agreeing checkpoint and bisects between it and the first diverging one, which presumes an
    error that, once made, stays beyond the rule (a wrong fp64 sublayer; not a low-precision walk,
    whose propagated error a baseline walk's own can hide)."""
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    judge = judge_for(test, decoder)
    plans = [test, reference] + ([baseline] if baseline is not None else [])
    runs = [decoder.start([tokens], decoder.new_state(1, int(tokens.shape[0]), p), p, routes=routes) for p in plans]
    total = decoder.config.schedule.num_sublayers
    checked: list[int] = []

    def advance_to(group: list[Pass], position: int) -> Verdict:
        for r in group:
            r.run_to(position)
        checked.append(position - 1)
        return judge(position - 1, group[0].last, group[1].last, group[2].last if len(group) > 2 else None)

    def spent(*groups: list[Pass]) -> int:
        return sum(r.evaluations for g in groups for r in g)

    if stride == 1:
        for position in range(1, total + 1):
            v = advance_to(runs, position)
            if not v.passed:
                s = position - 1
                return Divergence(s, s // 2, decoder.config.module_of(s), v, spent(runs), checked)
        return Divergence(None, None, None, None, spent(runs), checked)
    good = [r.snapshot() for r in runs]  # the last agreeing point (nothing run yet)
    used = 0

    def probe(position: int) -> tuple[list[Pass], Verdict]:
        """Copies of the walks at the last agreeing point, advanced to ``position`` and judged."""
        nonlocal used
        trial = [r.snapshot() for r in good]
        before = spent(trial)
        verdict = advance_to(trial, position)
        used += spent(trial) - before
        return trial, verdict

    lo, hi, bad_verdict, position = 0, None, None, 0
    while position < total:
        position = min(position + stride, total)
        trial, v = probe(position)
        if v.passed:
            good, lo = trial, position
        else:
            hi, bad_verdict = position, v
            break
    if hi is None:
        return Divergence(None, None, None, None, used, checked)
    while hi - lo > 1:  # the first position p whose last sublayer (p - 1) diverged is in (lo, hi]
        mid = (lo + hi) // 2
        trial, v = probe(mid)
        if v.passed:
            good, lo = trial, mid
        else:
            hi, bad_verdict = mid, v
    s = hi - 1
    return Divergence(s, s // 2, decoder.config.module_of(s), bad_verdict, used, checked)


__all__ = [
    "ATTNRES",
    "Attribution",
    "Divergence",
    "Recording",
    "WalkResult",
    "attribute",
    "block_growth",
    "first_divergence",
    "growth_per_block",
    "plant",
    "reference_walk",
    "rms_ratio",
    "routing_flips",
    "walk",
]
