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

import importlib.metadata
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..numerics.dtypes import resolve_dtype
from ..numerics.policy import BASELINE_RULE, FP64_RULE, RULES, rule_for  # noqa: F401 (plugins import the rule names here)

# The contract's values, re-exported: modules and plugins import them from the registry.
from .contract import (  # noqa: F401
    BUILTIN_SOURCE,
    GOLDEN_VARIANT_SEP,
    IMPLEMENTATION_DTYPES,
    PLUGIN_GROUP,
    Case,
    ErrorSamples,
    Implementation,
    Outputs,
    Peer,
    Prediction,
    ShardedForm,
    _available,
    as_outputs,
    cases_from,
    default_error_samples,
    golden_case_kind,
    identity,
    listed,
    memoized_on_case,
    placeholder,
    product_error_samples,
    unavailable_as,
    unique_identities,
)


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
class ModuleEntry:
    """Everything the harness needs to verify one module.

    ``oracle(case)`` and ``baseline(case, dtype, family)`` return named outputs, each computed
    once per case (the entry memoizes them in ``case.cache``: entries write no memo); ``outputs``
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
    # ``forward``, or ``backward`` for an entry whose outputs are gradients (its rows say so;
    # ``k3verify run --direction`` chooses).
    direction: str = "forward"
    # A backward entry: how a differentiable forward function (the forward module's signature)
    # becomes a function of this entry's signature, by autograd through it (the testing API).
    from_forward: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None
    # The keyword a backward takes its output's cotangent by (a function without it is a forward).
    cotangent: str = "do"
    # (output name, case, the oracle's outputs) -> the RMS of the terms an output is formed as a
    # difference of, or None. Where that output's oracle is all zero (KDA's dg on one token from
    # no state), the baseline rule allows it k roundings of such terms in the fp32 accumulator.
    term_scale: Callable[[str, Case, Mapping[str, Any]], float | None] | None = None
    # (output name, case, the oracle's outputs) -> for an output formed as a sum whose terms can
    # cancel far below their size (AttnRes's dw and dγ), the sum of its terms' absolute values per
    # element (fp64, the output's shape), or None: fp64 agreement is relative to it where larger,
    # and the baseline rule's floor is k roundings of it in the fp32 accumulator.
    term_sizes: Callable[[str, Case, Mapping[str, Any]], Any] | None = None

    def __post_init__(self) -> None:
        # The memo of the oracle and baselines is the harness's, not each entry's.
        object.__setattr__(self, "oracle", memoized_on_case("oracle", self.oracle))
        object.__setattr__(self, "baseline", memoized_on_case("baseline", self.baseline))

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


_REGISTRY: dict[str, ModuleEntry] = {}


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

            _PLUGINS = unique_identities(sandbox.load(found, outputs_of=_outputs_of, source_of=_source,
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


def _outputs_of(module: str) -> tuple[str, ...] | None:
    """The output names of registered ``module``; ``None`` when it is not registered."""
    return _REGISTRY[module].outputs if module in _REGISTRY else None


def _source(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else f"entry point {ep.value}"


