"""Structure-preserving maps over the tensors inside a value: dataclasses (weights, configs,
caches), tuples, lists and dicts, as the sharded forms send them between processes and
devices. Non-tensor leaves are returned as they are."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def map_tensors(value: T, fn: Callable[[torch.Tensor], torch.Tensor]) -> T:
    """``value`` with ``fn`` applied to every tensor in it (dataclass fields that are set in
    ``__init__``, tuple/list items, dict values), rebuilt with the same types."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: map_tensors(getattr(value, f.name), fn) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    if isinstance(value, dict):
        return type(value)({k: map_tensors(v, fn) for k, v in value.items()})
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(map_tensors(v, fn) for v in value)
    return value


def cast_floats(value: T, dtype: torch.dtype) -> T:
    """``value`` with every floating-point tensor cast to ``dtype`` (integer tensors kept)."""
    return map_tensors(value, lambda t: t.to(dtype) if t.is_floating_point() else t)


def named_tensors(value: Any, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside ``value`` with its path from ``name`` (``cache.pool``, ``weights[2]``,
    ``x['a']``): the containers :func:`map_tensors` walks, every dataclass field and namedtuples too."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from named_tensors(getattr(value, f.name, None), f"{name}.{f.name}")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from named_tensors(v, f"{name}[{k!r}]")
    elif isinstance(value, tuple) and hasattr(value, "_fields"):
        for field, v in zip(value._fields, value):
            yield from named_tensors(v, f"{name}.{field}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from named_tensors(v, f"{name}[{i}]")
