"""The registry: the only way the harness reaches implementations.

A module entry says how to build its verification cases, how to compute the fp64 oracle and
the same-dtype baseline (both as *named outputs*), which implementations to verify, and how to
sweep its overflow map. Entries live in :mod:`k3verify.harness.modules` (every module there is
loaded; there is no list to edit); module packages know nothing of them.

Outside packages add implementations through the entry-point group ``k3verify.implementations``:
an entry point names a callable that returns :class:`Implementation` objects (for one or several
registered modules). They join the module's own implementations everywhere — runs, maps,
goldens, ``k3verify list`` — with their package and version as their ``source``. Plugins are
loaded and run in a process of their own (:mod:`k3verify.harness.sandbox`), never in the
harness's: they see copies of a case's inputs, never its oracle. A plugin that fails to import,
raises, exits or hangs while registering, returns something else or names an unknown module
becomes an ``unavailable`` placeholder carrying the reason; it never stops a run or hides
other rows. See ``docs/extending.md``.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..numerics.dtypes import resolve_dtype
from ..numerics.frontier import OverflowPrediction
from ..numerics.policy import BASELINE_RULE, FP64_RULE, RULES, rule_for  # noqa: F401 (plugins import the rule names here)

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
    """Whether the analytic frontier expects a finite output, and why."""

    finite: bool
    explanation: str

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


def implementation(
    module: str,
    fn: Callable[..., Any],
    *,
    name: str,
    form: str = "kernel",
    dtype: str = "bf16",
    cases: tuple[str, ...] = ("default",),
    baseline: str = "recurrent",
    in_map: bool = False,
    predict: Callable[[Case], Prediction] | None = None,
    is_available: Callable[[], tuple[bool, str]] = _available,
    peer: Peer | None = None,
    **options: Any,
) -> Implementation:
    """An implementation from a function with the module forms' signature (the way plugins and
    users' tests bring their kernels): inputs are cast to ``dtype`` and ``options`` passed on;
    the rule is fp64-agreement for ``fp64``, the baseline rule otherwise; ``peer`` names the row
    ``run --time`` compares its speed with (see docs/extending.md)."""
    if dtype not in IMPLEMENTATION_DTYPES:  # an fp8 dtype needs its own Implementation (docs/extending.md)
        raise ValueError(f"implementation() takes dtype {', '.join(IMPLEMENTATION_DTYPES)}, not {dtype!r}")
    torch_dtype = resolve_dtype(dtype)

    def run(case: Case) -> Outputs:
        entry = get(module)
        if entry.call is None:
            raise NotImplementedError(f"module {module!r} has no calling convention for functions")
        return entry.call(fn, case, torch_dtype, **options)

    return Implementation(module=module, implementation=name, form=form, dtype=dtype, params=dict(options),
                          rule=rule_for(dtype), run=run, predict=predict,
                          is_available=is_available, cases=cases, baseline=baseline, in_map=in_map, peer=peer)


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


@dataclass(frozen=True)
class ErrorSamples:
    """How many independent rounding errors an output holds, for each statistic of the baseline
    rule (``numerics.policy``): ``rms`` sets the small-output factor of the RMS term, ``bias`` the
    noise of the projection on the oracle. They differ where errors are carried along an axis:
    KDA's state sums many independent roundings into every position's RMS, but projects them
    coherently, so its bias has the (batch, head) pairs only."""

    rms: int
    bias: int


def default_error_samples(shape: tuple[int, ...]) -> ErrorSamples:
    """Every element for the RMS term, the rows along the last axis for the bias: a row often
    shares one scalar rounding (a softmax's ``1/l``, an RMSNorm's ``1/rms``, a mixture's
    normaliser), which moves it coherently (docs/sensitivity.md)."""
    n = math.prod(shape)
    return ErrorSamples(n, n // shape[-1] if shape and shape[-1] else n)


@dataclass(frozen=True)
class ModuleEntry:
    """Everything the harness needs to verify one module.

    ``oracle(case)`` and ``baseline(case, dtype, family)`` return named outputs; ``outputs``
    lists the names, the primary one first (the one overflow predictions, positions and ULP
    histograms refer to). ``call(fn, case, dtype, **options)`` runs a function with the module
    forms' signature on a case's inputs cast to ``dtype`` and returns its named outputs: what
    turns a user's kernel into an implementation (``k3verify.testing``, plugins).
    """

    name: str
    title: str
    make_cases: Callable[[int], dict[str, Case]]
    oracle: Callable[[Case], Outputs]
    baseline: Callable[[Case, str, str], Outputs]  # (case, dtype, family)
    own_implementations: Callable[[], list[Implementation]]
    # The baseline families ``baseline`` knows, and how an implementation's family and params
    # name the baseline it is judged by (KDA: a chunked form by the chunkwise baseline at its
    # own chunk size).
    baseline_families: tuple[str, ...] = ("recurrent",)
    baseline_for: Callable[[str, Mapping[str, Any]], str] | None = None
    outputs: tuple[str, ...] = ("out",)
    call: Callable[..., Outputs] | None = None
    overflow_map: Any = None  # a harness.sweep.MapDefinition
    # Cases stored as golden tensors (``k3verify golden generate``): small configurations and
    # production-shape slices, a few hundred kB each. ``None`` stores ``make_cases(seed)``.
    # A golden case named ``c`` or ``c.<variant>`` is used for every implementation that
    # runs on case ``c`` (so ``default.production`` checks the rows that run on ``default``).
    golden_cases: Callable[[int], dict[str, Case]] | None = None
    # The axis of the primary output that indexes token position (KDA, MLA: 1 in
    # ``[B, T, H, V]``); when set, each row records its error at every position.
    position_axis: int | None = None
    # Dataclasses among the cases' inputs (MLA's LatentCache). Goldens store them field by
    # field and rebuild only these classes: a manifest is data and never names code to run.
    input_types: tuple[type, ...] = ()
    # Module-specific studies, written beside the overflow map: file name -> function(seed, quick)
    # -> JSON document (``quick``: the cheap version a quick map asks for).
    studies: Mapping[str, Callable[[int, bool], dict[str, Any]]] = field(default_factory=dict)
    # A Hypothesis strategy of (inputs, params) samples for users' property tests (k3verify.testing).
    strategy: Callable[[], Any] | None = None
    # The layer sharded over tensor-parallel ranks (``k3verify run --tp N``).
    sharded: ShardedForm | None = None
    # How many independent rounding errors an output holds, for the baseline rule's statistics:
    # (output name, shape, case params) -> ErrorSamples; ``None``: default_error_samples.
    error_samples: Callable[[str, tuple[int, ...], Mapping[str, Any]], ErrorSamples] | None = None
    # The axis names of each output (KDA's ``o``: ``("b", "t", "h", "v")``), which failure
    # messages use to say where the worst element sits.
    output_axes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Whether a run without ``--modules`` (and every module-wide command) includes it; an opt-in
    # entry (a whole layer) runs when named.
    default: bool = True

    def baseline_family(self, impl: Implementation) -> str:
        """The baseline family that judges ``impl`` (its ``baseline``, refined by ``baseline_for``)."""
        return impl.baseline if self.baseline_for is None else self.baseline_for(impl.baseline, impl.params)

    def samples_of(self, output: str, shape: Sequence[int], params: Mapping[str, Any]) -> ErrorSamples:
        """The independent rounding errors in ``output`` of ``shape`` on a case with ``params``
        (``error_samples``, else :func:`default_error_samples`)."""
        if self.error_samples is None:
            return default_error_samples(tuple(shape))
        return self.error_samples(output, tuple(shape), params)

    @property
    def primary(self) -> str:
        """The name of the output that predictions, positions and ULP histograms refer to."""
        return self.outputs[0]

    def implementations(self) -> list[Implementation]:
        """The module's own implementations, then those plugins add (placeholders for broken ones);
        an identity registered twice fails from its second registration on (:func:`unique_identities`)."""
        return unique_identities([*self.own_implementations(), *plugin_implementations(self.name)])

    def cases_for_goldens(self, seed: int) -> dict[str, Case]:
        """The cases ``k3verify golden generate`` stores for this module: ``golden_cases``, plus
        ``make_cases``' own case for every case an implementation asks for that no golden case
        stands in for (so a newly added case kind is stored until it gets a golden slice)."""
        if self.golden_cases is None:
            return self.make_cases(seed)
        cases = self.golden_cases(seed)
        covered = {golden_case_kind(name) for name in cases}
        missing = sorted({c for impl in self.implementations() for c in impl.cases} - covered)
        if missing:
            made = self.make_cases(seed)
            cases |= {name: made[name] for name in missing if name in made}
        return cases


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


_REGISTRY: dict[str, ModuleEntry] = {}


GOLDEN_VARIANT_SEP = "."


def golden_case_kind(name: str) -> str:
    """The case an implementation asks for that golden case ``name`` stands in for
    (``"default.production"`` -> ``"default"``)."""
    return name.split(GOLDEN_VARIANT_SEP, 1)[0]


def register(entry: ModuleEntry) -> ModuleEntry:
    """Add ``entry``; registering a name twice is an error (it would hide one of them)."""
    if entry.name in _REGISTRY:
        raise ValueError(f"module {entry.name!r} is already registered")
    _REGISTRY[entry.name] = entry
    return entry


def _load() -> None:
    # Importing the entries registers them; done lazily so `import k3verify` stays light.
    from . import modules  # noqa: F401


def module_names(*, opt_in: bool = False) -> list[str]:
    """Names of the registered modules a run includes by default, in registration order; with
    ``opt_in`` the opt-in entries too (``ModuleEntry.default``)."""
    _load()
    return [name for name, entry in _REGISTRY.items() if opt_in or entry.default]


def get(name: str) -> ModuleEntry:
    """The entry for ``name``; ``KeyError`` listing the known names otherwise."""
    _load()
    if name not in _REGISTRY:
        raise UnknownModuleError(name, list(_REGISTRY))
    return _REGISTRY[name]


def select(names: Iterable[str] | None) -> list[ModuleEntry]:
    """Entries for ``names`` (all when ``None``), checking every name before returning any."""
    _load()
    if names is None:
        return [entry for entry in _REGISTRY.values() if entry.default]
    wanted = [n.strip() for n in names if n.strip()]
    if not wanted:
        raise UnknownModuleError("", list(_REGISTRY))
    unknown = [n for n in wanted if n not in _REGISTRY]
    if unknown:
        raise UnknownModuleError(", ".join(unknown), list(_REGISTRY))
    return [_REGISTRY[n] for n in dict.fromkeys(wanted)]


class UnknownModuleError(KeyError):
    """A module name that is not registered."""

    def __init__(self, name: str, known: list[str]):
        super().__init__(name)
        self.name = name
        self.known = known

    def __str__(self) -> str:
        if not self.name:
            return f"no module name given; known modules: {', '.join(self.known)}"
        return f"unknown module {self.name!r}; known modules: {', '.join(self.known)}"


# --- plugins ---------------------------------------------------------------------------------

_PLUGINS: list[Implementation] | None = None


def plugins() -> list[Implementation]:
    """Every implementation the installed plugins register, discovered once per process.

    k3verify never imports a plugin: the entry points are loaded and run in a process of their
    own (:mod:`k3verify.harness.sandbox`), and each implementation is a proxy of what that
    process described. A broken plugin (import error, exception, ``sys.exit``, a hang, a wrong
    return, an unknown module) gives a placeholder whose ``is_available()`` says why."""
    global _PLUGINS
    if _PLUGINS is None:
        _load()
        found = list(importlib.metadata.entry_points(group=PLUGIN_GROUP))
        _PLUGINS = []
        if found:
            from . import sandbox

            _PLUGINS = unique_identities(sandbox.load(found, known=lambda m: m in _REGISTRY, source_of=_source,
                                                      placeholder=placeholder))
    return _PLUGINS


def reload_plugins() -> list[Implementation]:
    """Discover the plugins again (after installing one in a running process)."""
    global _PLUGINS
    _PLUGINS = None
    importlib.invalidate_caches()
    return plugins()


def plugin_implementations(module: str) -> list[Implementation]:
    """The plugins' implementations of ``module``."""
    return [impl for impl in plugins() if impl.module == module]


def orphan_implementations() -> list[Implementation]:
    """Placeholders of plugins that name no registered module (shown in full runs and lists)."""
    return [impl for impl in plugins() if impl.module not in _REGISTRY]


def _source(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else f"entry point {ep.value}"


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


def unique_identities(impls: list[Implementation]) -> list[Implementation]:
    """``impls`` with every implementation after the first of an identity replaced by a failing
    one named ``<name> (registered again, #n)``: two rows of one identity would let a report hold
    a failing row beside a passing twin, and a compare match either."""
    seen: dict[tuple[str, ...], int] = {}
    out = []
    for impl in impls:
        key = identity(impl)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] == 1:
            out.append(impl)
            continue
        reason = f"{impl.label} is registered {seen[key]} times; each identity may be registered once"

        def refuse(case: Case, reason: str = reason) -> Outputs:
            raise ValueError(reason)

        out.append(dataclasses.replace(impl, implementation=f"{impl.implementation} (registered again, #{seen[key]})",
                                       run=refuse, is_available=_available, predict=None, explain=None))
    return out
