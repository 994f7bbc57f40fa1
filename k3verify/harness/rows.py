"""A report row as a type: every key a row of ``report.json`` may hold, declared once.

:class:`Row` is one verified configuration; :class:`JudgedOutput` one of its named outputs under
its rule. A row's JSON form (what the runner yields, what ``report.json`` stores, what readers
index) is :meth:`Row.to_json`; :meth:`Row.from_json` reads and checks one, naming the row and
the key that is wrong. The schema that ``report.load`` enforces is derived from these classes
(:func:`schema`), so a key added here is known to every check, and a key a writer adds without
declaring it here fails the writer's own check (``strict``).

Every optional value may be ``None``: JSON's spelling of a non-finite number. A nested record
(verdict, metrics, timing, ...) holds only what its writer knew: each of its fields is optional.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Union

from ..numerics.metrics import Metrics
from ..numerics.policy import STATUSES, VERDICT_STATUSES, Verdict


class RowError(ValueError):
    """A row (or one of its records) that does not have the declared keys and types."""


# --- records nested in a row ------------------------------------------------------------------


@dataclass(frozen=True)
class VerdictRecord:
    """A :class:`~k3verify.numerics.policy.Verdict` as stored (its fields, each optional)."""

    status: str | None = None
    rule: str | None = None
    metric: str | None = None
    err: float | None = None
    limit: float | None = None
    margin: float | None = None
    reason: str | None = None
    baseline_err: float | None = None
    floor: float | None = None
    k: float | None = None
    bias: float | None = None
    bias_limit: float | None = None


@dataclass(frozen=True)
class MetricsRecord:
    """:class:`~k3verify.numerics.metrics.Metrics` as stored, or a discrete output's
    ``mismatch`` (the fraction of rows that differ), ``n`` and ``nonfinite``."""

    n: int | None = None
    max_abs: float | None = None
    rms_ratio: float | None = None
    one_minus_cos: float | None = None
    sqnr_db: float | None = None
    ulp_max: float | None = None
    ulp_mean: float | None = None
    ulp_p99: float | None = None
    nonfinite: int | None = None
    ulp_dtype: str | None = None
    bias: float | None = None
    rms: float | None = None
    mismatch: float | None = None


@dataclass(frozen=True)
class WorstRecord:
    """Where an output's error is largest (``numerics.worst_element``)."""

    index: list[int] | None = None
    axes: list[str] | None = None
    got: float | None = None
    expected: float | None = None
    abs_diff: float | None = None


@dataclass(frozen=True)
class PredictionRecord:
    """The analytic frontier's prediction for the row's case."""

    finite: bool | None = None
    explanation: str | None = None


@dataclass(frozen=True)
class UlpHistogram:
    """Counts of the primary output's errors per ULP band (``runner.ulp_histogram``)."""

    dtype: str | None = None
    edges: list[float | None] | None = None  # the last edge is inf: null
    counts: list[int] | None = None


@dataclass(frozen=True)
class TimingRecord:
    """What ``run --time`` measured (:mod:`k3verify.harness.timing`), or why it could not."""

    median_s: float | None = None
    repeats: int | None = None
    clock: str | None = None
    ratio: float | None = None
    peer: str | None = None
    peer_note: str | None = None
    error: str | None = None


# --- the row ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class JudgedOutput:
    """One named output under its rule: a verdict's status, margin, the verdict and the metrics
    (the baseline's too under the baseline rule), and where its worst element is."""

    status: str
    margin: float | None = None
    verdict: VerdictRecord | None = None
    metrics: MetricsRecord | None = None
    baseline_metrics: MetricsRecord | None = None
    worst: WorstRecord | None = None


@dataclass(frozen=True)
class Row:
    """One verified configuration: what identifies it, its status and, when it was judged, the
    binding output's verdict repeated at the top level (``output`` names it) beside every
    output's own (``outputs``)."""

    module: str
    implementation: str
    form: str
    dtype: str
    case: str
    status: str
    rule: str
    params: dict[str, Any] = field(default_factory=dict)
    case_params: dict[str, Any] | None = None
    source: str | None = None
    output: str | None = None
    outputs: dict[str, JudgedOutput] | None = None
    verdict: VerdictRecord | None = None
    margin: float | None = None
    metrics: MetricsRecord | None = None
    baseline_metrics: MetricsRecord | None = None
    baseline_form: str | None = None
    prediction: PredictionRecord | None = None
    overflow: list[str] | None = None
    explanation: list[str] | None = None
    reason: str | None = None
    traceback: str | None = None
    wall_s: float | None = None
    ulp_histogram: UlpHistogram | None = None
    error_by_position: list[float | None] | None = None
    baseline_error_by_position: list[float | None] | None = None
    golden: str | None = None
    time: TimingRecord | None = None
    direction: str | None = None  # "backward" for a row of gradients; absent: forward

    @classmethod
    def from_json(cls, value: Any, *, where: str = "row", strict: bool = False) -> Row:
        """The row of a JSON object; :class:`RowError` naming ``where`` and the key that is
        missing or of the wrong type, or holds an unknown status. Keys this version does not
        know are ignored (a newer writer's), unless ``strict`` (a writer checking itself)."""
        row = _record(cls, value, where, strict)
        if row.status not in STATUSES:
            raise RowError(f"{where} has status {str(row.status)[:40]!r}; known: {', '.join(STATUSES)}")
        for name, judged in (row.outputs or {}).items():
            if judged.status not in VERDICT_STATUSES:
                raise RowError(f"{where}'s output {str(name)[:40]!r} has status {str(judged.status)[:40]!r}; "
                               f"known: {', '.join(VERDICT_STATUSES)}")
        return row

    def to_json(self) -> dict[str, Any]:
        """The row as ``report.json`` stores it: every key whose value is not ``None``."""
        return _plain(self)


# --- reading and writing ----------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A record's JSON form, ``None`` fields dropped, recursively."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(v) for f in dataclasses.fields(value) if (v := getattr(value, f.name)) is not None}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, bool, Any, tuple[tuple[type, ...], bool, str] | None], ...]:
    """Per field of dataclass ``cls``: ``(name, required, hint, scalar)`` (:func:`_scalar` of the
    hint), worked out once: a report's rows are read field by field, hundreds of thousands of them."""
    return tuple((f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                  _hints(cls)[f.name], _scalar(_hints(cls)[f.name])) for f in dataclasses.fields(cls))


def _record(cls: type, value: Any, where: str, strict: bool) -> Any:
    """An instance of dataclass ``cls`` from JSON object ``value``, each field checked."""
    if not isinstance(value, dict):
        raise RowError(f"{where} is a {type(value).__name__}, not an object")
    fields = _fields(cls)
    if strict:
        known = {name for name, *_ in fields}
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise RowError(f"{where} has keys no reader knows: {', '.join(unknown)[:200]} (declare them in "
                           f"k3verify/harness/rows.py)")
    kwargs = {}
    for name, required, hint, scalar in fields:
        if name not in value:
            if required:
                raise RowError(f"{where} has no {name!r}")
            continue
        item = value[name]
        if scalar is not None and _fits(item, scalar):  # most fields; the place is named only on error
            kwargs[name] = item
        else:
            kwargs[name] = _typed(item, hint, f"{where}'s {name}" if cls is Row else f"{where}.{name}", strict)
        if required and kwargs[name] is None:
            raise RowError(f"{where} has a null {name!r}")
    return cls(**kwargs)


@functools.cache
def _shape(hint: Any) -> tuple[Any, ...]:
    """What :func:`_typed` checks for ``hint``, unpacked once per hint."""
    if hint is Any:
        return ("any",)
    scalar = _scalar(hint)
    if scalar is not None:
        return ("scalar", scalar)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return ("union", type(None) in args, inner[0] if len(inner) == 1 else None)
    if dataclasses.is_dataclass(hint):
        return ("record",)
    if origin is list:
        item = _scalar(args[0])
        exact = None if item is None else frozenset(k for k in item[0] + ((type(None),) if item[1] else ()))
        return ("list", args[0], item, exact)
    if origin is dict:
        return ("dict", args[1])
    return ("unknown",)


def _typed(value: Any, hint: Any, where: str, strict: bool) -> Any:
    """``value`` checked against type ``hint`` (a scalar, ``list[X]``, ``dict[str, X]``, a record,
    ``X | None``); ``None`` passes wherever the hint allows it. A bool is never a number."""
    shape = _shape(hint)
    kind = shape[0]
    if kind == "any":
        return value
    if kind == "scalar":  # a number, a text or a flag, checked without unpacking the hint
        if not _fits(value, shape[1]):
            raise RowError(f"{where} is a {type(value).__name__}, not a {shape[1][2]}")
        return value
    if kind == "union":
        if value is None and shape[1]:
            return None
        if shape[2] is None:
            raise ValueError(f"rows.py declares {where} as {hint!r}, a union of several types")
        return _typed(value, shape[2], where, strict)
    if kind == "record":
        return _record(hint, value, where, strict)
    if kind == "list":
        if not isinstance(value, list):
            raise RowError(f"{where} is a {type(value).__name__}, not a list")
        _, item_hint, item, exact = shape
        if item is not None:  # a long list of numbers (errors by position): one pass, no recursion
            # exact builtin types first (what JSON gives); anything else (a bool, a subclass) by the rule
            bad = next((i for i, v in enumerate(value) if type(v) not in exact and not _fits(v, item)), None)
            if bad is not None:
                raise RowError(f"{where}[{bad}] is a {type(value[bad]).__name__}, not a {item[2]}")
            return list(value)
        return [_typed(v, item_hint, f"{where}[{i}]", strict) for i, v in enumerate(value)]
    if kind == "dict":
        if not isinstance(value, dict):
            raise RowError(f"{where} is a {type(value).__name__}, not an object")
        return {k: _typed(v, shape[1], f"{where}[{str(k)[:40]!r}]", strict) for k, v in value.items()}
    raise TypeError(f"rows.py declares {where} as {hint!r}, a type it cannot check")


@functools.cache
def _scalar(hint: Any) -> tuple[tuple[type, ...], bool, str] | None:
    """``(types, nullable, name)`` for a number, text or flag hint (``float | None``, ``int``,
    ``str``, ``bool | None``); ``None`` for anything else."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    inner = [a for a in args if a is not type(None)]
    if len(inner) != 1 or inner[0] not in (float, int, str, bool):
        return None
    kinds = (int, float) if inner[0] is float else (inner[0],)
    return kinds, len(inner) < len(args), "number" if inner[0] is float else inner[0].__name__


def _fits(value: Any, scalar: tuple[tuple[type, ...], bool, str]) -> bool:
    """``value`` is of the scalar's types (``None`` where it is nullable; a bool only as a bool)."""
    kinds, nullable, _ = scalar
    if value is None:
        return nullable
    return isinstance(value, kinds) and (not isinstance(value, bool) or bool in kinds)


def schema(cls: type = Row) -> dict[str, Any]:
    """The keys of ``cls`` and their types as text (records nested), derived from the classes:
    what docs/report.md and ``report.load`` rely on."""
    out = {}
    for f in dataclasses.fields(cls):
        hint = _hints(cls)[f.name]
        inner = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        target = inner[0]
        if dataclasses.is_dataclass(target):
            out[f.name] = schema(target)
        elif typing.get_origin(target) is dict and dataclasses.is_dataclass(typing.get_args(target)[1]):
            out[f.name] = {"<name>": schema(typing.get_args(target)[1])}
        else:
            out[f.name] = str(hint).replace("typing.", "")
    return out


# The records mirror the numerics' own dataclasses: the same field names (a test holds them).
MIRRORS = ((VerdictRecord, Verdict), (MetricsRecord, Metrics))
