"""The contract between the harness and what it verifies: a case, an implementation, its
outputs, and the facts an implementation declares about itself (its peer, its prediction).

These are plain values with no registry behind them, so every layer that handles an
implementation (the guard that hands it a copy of a case, the sandbox that runs a plugin, the
timer) reads them here, and the registry (:mod:`k3verify.harness.registry`) builds on them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from ..numerics.frontier import OverflowPrediction
from ..numerics.policy import BASELINE_RULE, RULES

PLUGIN_GROUP = "k3verify.implementations"
BUILTIN_SOURCE = "k3verify"

Outputs = dict[str, torch.Tensor]


@dataclass
class Case:
    """Inputs of one verification problem, always fp64 on CPU, plus what generated them."""

    name: str
    inputs: dict[str, Any]
    params: dict[str, Any] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Prediction:
    """Whether the analytic frontier expects a finite output, and why. ``by_plugin``: the claim
    of a plugin's own ``predict`` (its process's), which excuses a non-finite output only where
    the harness's same-dtype baseline overflows too."""

    finite: bool
    explanation: str
    by_plugin: bool = False

    @classmethod
    def of(cls, p: OverflowPrediction) -> Prediction:
        """The row's prediction from a module's :class:`OverflowPrediction`."""
        return cls(p.finite, p.explanation())


def _available() -> tuple[bool, str]:
    return True, ""


# The dtypes implementation() casts inputs to (a float8 row needs its scaling: build the Implementation).
IMPLEMENTATION_DTYPES = ("fp64", "fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Peer:
    """Whom ``k3verify run --time`` compares a kernel's speed with: the row of the same module,
    case and dtype whose implementation is ``implementation`` (a package name matches any
    version: ``fla-core`` matches ``fla-core 0.6.0``), whose form is ``form`` and whose
    parameters include ``params``."""

    implementation: str
    form: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Implementation:
    """One verifiable configuration: a form of a module at one dtype and parameter set.

    ``run(case)`` returns the module's named outputs (``{"o": ..., "final_state": ...}`` for
    KDA; see ``ModuleEntry.outputs``), or one tensor, taken as the primary output.
    ``dtype`` is the comparison dtype (ULPs, noise floor and baseline are taken in it).
    ``predict(case)``, when given, is the analytic overflow prediction for this case.
    ``is_available()`` returns ``(ok, reason)``: whether it can run here (no GPU, an optional
    package missing), as fla-core's backends say it.
    ``explain(case)`` returns human-readable lines on an overflow (operand, tile, magnitude).
    ``baseline`` names the algorithm family of the same-dtype baseline the ``baseline`` rule
    compares against (``"recurrent"``: the definition; ``"chunkwise"``: the chunk-parallel
    form), so a chunked kernel is held to what a plain chunked implementation achieves.
    ``source`` says where it comes from (``k3verify``, an adapter, or a plugin's package and
    version); ``in_map`` puts it in its module's overflow map, on the map's inputs, at every
    point ``map_points`` accepts (default: all; an implementation that refuses some inputs by
    design, such as a kernel that needs a stored block, names them here rather than crashing
    there). ``peer`` names the row whose speed ``run --time`` sets a kernel's beside; ``time``,
    when given, times ``run`` on a case itself (a plugin's proxy: in its own process; see
    :mod:`k3verify.harness.timing`).
    """

    module: str
    implementation: str
    form: str
    dtype: str
    params: Mapping[str, Any]
    rule: str
    run: Callable[[Case], Outputs | torch.Tensor]
    predict: Callable[[Case], Prediction] | None = None
    explain: Callable[[Case], list[str]] | None = None
    is_available: Callable[[], tuple[bool, str]] = _available
    cases: tuple[str, ...] = ("default",)
    baseline: str = "recurrent"
    source: str = BUILTIN_SOURCE
    in_map: bool = False
    map_points: Callable[[Mapping[str, Any]], bool] | None = None
    peer: Peer | None = None
    time: Callable[[Case], dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"unknown rule {self.rule!r}; choose one of {RULES}")

    @property
    def label(self) -> str:
        """Short unique label, e.g. ``kda/k3verify:tiled[bf16 tile=16 anchor=tile_start]``."""
        params = " ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.module}/{self.implementation}:{self.form}[{self.dtype}{' ' + params if params else ''}]"

    def unavailable(self) -> str | None:
        """The reason it cannot run here, or ``None``."""
        try:
            ok, reason = self.is_available()
        except Exception as exc:  # an availability probe that crashes is a reason, not a crash
            return f"is_available() raised {type(exc).__name__}: {exc}"
        return None if ok else (reason or "not available")


@dataclass(frozen=True)
class ShardedForm:
    """How a module runs over tensor-parallel ranks (``k3verify run --tp N``).

    ``package`` names the module's sharded form (``"k3verify.kda.sharded"``), which defines
    ``make_call(size, seed, world_size)`` (the fp64 inputs, built alike in every rank and in
    the parent; ``size`` is ``small`` or ``k3``), ``rank_forward(rank, world_size, call)`` (one
    rank's forward with the collectives; ``call`` carries ``dtype`` and ``reduce_dtype``) and
    ``unsharded(call)`` (the same layer on one process: the fp64 oracle, or the same-dtype
    baseline). ``gather(ranks)`` turns what the ranks returned into the named ``outputs``;
    ``position_axis`` as :attr:`ModuleEntry.position_axis` for those outputs.
    """

    package: str
    outputs: tuple[str, ...]
    gather: Callable[[list[dict[str, torch.Tensor]]], Outputs]
    position_axis: int | None = None


def unavailable_as(reason: Callable[[], str | None]) -> Callable[[], tuple[bool, str]]:
    """An ``is_available`` from a function returning a reason or ``None``."""

    def probe() -> tuple[bool, str]:
        why = reason()
        return why is None, why or ""

    return probe


def listed(module: str, implementation: str, form: str, dtype: str, reason: Callable[[], str],
           cases: tuple[str, ...], *, params: Mapping[str, Any] | None = None, rule: str = BASELINE_RULE,
           baseline: str = "recurrent") -> Implementation:
    """A row for a kernel k3verify knows of but does not call (a production wheel built for
    another GPU or torch, or with no adapter yet): always ``unavailable``, ``reason()`` saying
    why, so a report shows the gap instead of leaving it out. ``run`` raises with that reason."""

    def not_called(case: Case) -> Outputs:
        raise NotImplementedError(reason())

    return Implementation(
        module=module, implementation=implementation, form=form, dtype=dtype, params=dict(params or {}),
        rule=rule, run=not_called, cases=cases, baseline=baseline,
        source=f"{implementation} (listed: k3verify does not call it)", is_available=lambda: (False, reason()),
    )


@dataclass(frozen=True)
class ErrorSamples:
    """How many independent rounding errors an output holds, for each statistic of the baseline
    rule (``numerics.policy``): ``rms`` sets the small-output factor of the RMS term, ``bias`` the
    noise of the projection on the oracle. They differ where errors are carried along an axis:
    KDA's state sums many independent roundings into every position's RMS, but projects them
    coherently, so its bias has the (batch, head) pairs only.

    ``spread``: the errors' scales differ from element to element (a weight's gradient summing a
    few rows of very different sizes), so fewer of them count than there are: ``rms`` is capped by
    the effective number of the same-dtype baseline's own errors
    (:func:`k3verify.numerics.policy.effective_errors`).

    ``spread_over``: ``(output, axis)``, where the errors come in slices of very different sizes
    that only one output shows apart (a walk's tokens, seen in its embedding gradient): ``rms`` and
    ``bias`` are capped by the effective number of the same-dtype baseline's slices of that output
    along ``axis``, an axis or a tuple of them (:func:`k3verify.numerics.policy.effective_slices`;
    the baseline's alone, so that a form cannot lower its own count by an error on one slice), for
    every output of the row:
    ``bias`` by that number, ``rms`` by it times ``slice_errors``, the independent errors one slice
    can hold (1 where the count is of slices; a token's latent width where every error of a token
    enters through one vector of that width).

    ``products``: the output is a stack of summed outer products (``[..., n, m]``, a grouped
    GEMM's weight gradient per expert): ``rms`` and ``bias`` are capped too by what its products'
    factors are worth (:func:`k3verify.numerics.policy.effective_products`), fewer than Kish's
    number over the elements where an expert has one or two products."""

    rms: int
    bias: int
    spread: bool = False
    spread_over: tuple[str, int | tuple[int, ...]] | None = None
    products: bool = False
    slice_errors: int = 1


def default_error_samples(shape: tuple[int, ...]) -> ErrorSamples:
    """Every element for the RMS term, the rows along the last axis for the bias: a row often
    shares one scalar rounding (a softmax's ``1/l``, an RMSNorm's ``1/rms``, a mixture's
    normaliser), which moves it coherently (docs/sensitivity.md)."""
    n = math.prod(shape)
    return ErrorSamples(n, n // shape[-1] if shape and shape[-1] else n)


def product_error_samples(rows: int, shape: tuple[int, ...], exact: str | None = None) -> ErrorSamples:
    """The independent errors of a weight's gradient ``Aᵀ B`` summed over ``rows`` contributing
    rows (``A:[rows, n]``, ``B:[rows, m]``; ``shape`` is ``[..., n, m]``, leading axes stacking
    such products, a grouped GEMM's experts): its error ``δAᵀ B + Aᵀ δB`` is spanned by the
    ``rows (n + m)`` roundings of the factors, so it holds at most that many independent errors
    however many elements it has; ``exact`` (``"left"`` or ``"right"``) names a factor that is an
    input every form reads alike (rounded alike, so no error of its own between two forms),
    leaving ``rows m`` or ``rows n``. The bias counts at most ``rows`` (each row moves its outer
    product coherently). The errors' scales differ from row to row (``spread``)."""
    if exact not in (None, "left", "right"):
        raise ValueError(f"exact is None, 'left' or 'right'; got {exact!r}")
    default = default_error_samples(shape)
    n, m = shape[-2], shape[-1]
    carried = (0 if exact == "left" else n) + (0 if exact == "right" else m)
    return ErrorSamples(min(default.rms, rows * carried), min(default.bias, rows), spread=True)


def cases_from(samples: Mapping[str, tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Case]:
    """Cases from a module's samples (``name -> (inputs, params)``, see ``<module>/samples.py``)."""
    return {name: Case(name, inputs, dict(params)) for name, (inputs, params) in samples.items()}


def as_outputs(value: Outputs | torch.Tensor | tuple, names: tuple[str, ...], who: str) -> Outputs:
    """Named outputs from what an implementation returned: a dict keyed by ``names``, a tuple in
    ``names``' order, or one tensor (the primary output). ``TypeError`` naming ``who`` otherwise."""
    if isinstance(value, torch.Tensor):
        return {names[0]: value}
    if isinstance(value, tuple) and all(isinstance(v, torch.Tensor) or v is None for v in value):
        return {n: v for n, v in zip(names, value) if v is not None}
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise TypeError(f"{who} returned outputs {unknown}; this module's outputs are {list(names)}")
        bad = [n for n, v in value.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(f"{who} returned non-tensor outputs {bad}")
        return dict(value)
    raise TypeError(f"{who} returned a {type(value).__name__}; expected a tensor, a tuple or a dict of {list(names)}")


GOLDEN_VARIANT_SEP = "."


def golden_case_kind(name: str) -> str:
    """The case an implementation asks for that golden case ``name`` stands in for
    (``"default.production"`` -> ``"default"``)."""
    return name.split(GOLDEN_VARIANT_SEP, 1)[0]


def placeholder(name: str, source: str, reason: str) -> Implementation:
    """An unavailable row standing for plugin entry point ``name`` that cannot be used."""
    # Entry points are named after the module they extend; a broken one is shown under that name.
    def cannot_run(case: Case) -> Outputs:
        raise RuntimeError(reason)

    return Implementation(module=name, implementation=source, form=f"plugin:{name}", dtype="-", params={},
                          rule=BASELINE_RULE, run=cannot_run, is_available=lambda: (False, reason), source=source)


def identity(impl: Implementation) -> tuple[str, ...]:
    """What names an implementation's rows in a report (their case aside)."""
    params = json.dumps({str(k): str(v) for k, v in impl.params.items()}, sort_keys=True)
    return (impl.module, impl.implementation, impl.form, impl.dtype, params)


# Implementation names of the harness's own rows, which no registered implementation may take:
# a report would show its rows as those (the golden oracle check's, ``golden._oracle_row``).
RESERVED_NAMES: Mapping[str, str] = MappingProxyType({"oracle": "the golden oracle check"})


def unique_identities(impls: list[Implementation]) -> list[Implementation]:
    """``impls`` with every implementation after the first of an identity replaced by a failing
    one named ``<name> (registered again, #n)``: two rows of one identity would let a report hold
    a failing row beside a passing twin, and a compare match either. One that takes a name of
    :data:`RESERVED_NAMES` fails as ``<name> (reserved)``."""
    seen: dict[tuple[str, ...], int] = {}
    out = []
    for impl in impls:
        if impl.implementation in RESERVED_NAMES:
            out.append(_refused(impl, f"{impl.implementation} (reserved)",
                                f"{impl.label} takes the name of {RESERVED_NAMES[impl.implementation]}'s rows, "
                                "which no registered implementation may use"))
            continue
        key = identity(impl)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] == 1:
            out.append(impl)
            continue
        out.append(_refused(impl, f"{impl.implementation} (registered again, #{seen[key]})",
                            f"{impl.label} is registered {seen[key]} times; each identity may be registered once"))
    return out


def _refused(impl: Implementation, name: str, reason: str) -> Implementation:
    """``impl`` renamed ``name``, every row of it failing with ``reason``."""
    def refuse(case: Case) -> Outputs:
        raise ValueError(reason)

    return dataclasses.replace(impl, implementation=name, run=refuse, is_available=_available, predict=None,
                               explain=None)


def memoized_on_case(kind: str, fn: Callable[..., Outputs]) -> Callable[..., Outputs]:
    """``fn(case, *args)`` computed once per case and arguments, and kept in ``case.cache`` under
    ``kind`` and the arguments (``"oracle"``, ``"baseline:bf16:chunkwise"``): a module's oracle and
    baselines are asked for by every row of a case, by maps and by goldens, and each is costly.
    The cache lives on the harness's case only; an implementation gets a copy without it."""
    if getattr(fn, "memoized_on_case", False):
        return fn

    @functools.wraps(fn)
    def memo(case: Case, *args: Any, **kwargs: Any) -> Outputs:
        key = ":".join([kind, *map(str, args), *(f"{k}={v}" for k, v in sorted(kwargs.items()))])
        if key not in case.cache:
            case.cache[key] = fn(case, *args, **kwargs)
        return case.cache[key]

    memo.memoized_on_case = True  # type: ignore[attr-defined]
    return memo
