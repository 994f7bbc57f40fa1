"""The registry: the only way the harness reaches implementations.

A module entry says how to build its verification cases, how to compute the fp64 oracle and
the same-dtype baseline, which implementations to verify, and how to sweep its overflow map.
Entries live in :mod:`k3verify.harness.modules`; module packages know nothing of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

FP64_RULE = "fp64-agreement"
BASELINE_RULE = "baseline"
RULES = (FP64_RULE, BASELINE_RULE)


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


@dataclass(frozen=True)
class Implementation:
    """One verifiable configuration: a form of a module at one dtype and parameter set.

    ``run(case)`` returns the output tensor to compare against the oracle.
    ``dtype`` is the comparison dtype (ULPs, noise floor and baseline are taken in it).
    ``predict(case)``, when given, is the analytic overflow prediction for this case.
    ``unavailable()`` returns a reason string when the implementation cannot run here
    (no GPU, optional package missing), else ``None``.
    ``explain(case)`` returns human-readable lines on an overflow (operand, tile, magnitude).
    ``baseline`` names the algorithm family of the same-dtype baseline the ``baseline`` rule
    compares against (``"recurrent"``: the definition; ``"chunkwise"``: the chunk-parallel
    form), so a chunked kernel is held to what a plain chunked implementation achieves.
    """

    module: str
    implementation: str
    form: str
    dtype: str
    params: Mapping[str, Any]
    rule: str
    run: Callable[[Case], torch.Tensor]
    predict: Callable[[Case], Prediction] | None = None
    explain: Callable[[Case], list[str]] | None = None
    unavailable: Callable[[], str | None] = lambda: None
    cases: tuple[str, ...] = ("default",)
    baseline: str = "recurrent"

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"unknown rule {self.rule!r}; choose one of {RULES}")

    @property
    def label(self) -> str:
        """Short unique label, e.g. ``kda/tiled[bf16 tile=16 anchor=tile_start]``."""
        params = " ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.module}/{self.implementation}:{self.form}[{self.dtype}{' ' + params if params else ''}]"


@dataclass(frozen=True)
class ModuleEntry:
    """Everything the harness needs to verify one module."""

    name: str
    title: str
    make_cases: Callable[[int], dict[str, Case]]
    oracle: Callable[[Case], torch.Tensor]
    baseline: Callable[[Case, str, str], torch.Tensor]  # (case, dtype, family)
    implementations: Callable[[], list[Implementation]]
    overflow_map: Callable[..., Any] | None = None
    # Cases stored as golden tensors (``k3verify golden generate``): small configurations and
    # production-shape slices, a few hundred kB each. ``None`` stores ``make_cases(seed)``.
    # A golden case named ``c`` or ``c.<variant>`` is used for every implementation that
    # runs on case ``c`` (so ``default.production`` checks the rows that run on ``default``).
    golden_cases: Callable[[int], dict[str, Case]] | None = None
    # The axis of the oracle's output that indexes token position (KDA, MLA: 1 in
    # ``[B, T, H, V]``); when set, each row records its error at every position.
    position_axis: int | None = None
    # Dataclasses among the cases' inputs (MLA's LatentCache). Goldens store them field by
    # field and rebuild only these classes: a manifest is data and never names code to run.
    input_types: tuple[type, ...] = ()

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


def module_names() -> list[str]:
    """Names of every registered module, in registration order."""
    _load()
    return list(_REGISTRY)


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
        return list(_REGISTRY.values())
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
