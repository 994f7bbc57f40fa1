"""Registry entries without their Triton kernel rows, for tests about what surrounds the rows
(reports, goldens' folders, the nightly search): under Triton's CPU interpreter a kernel row
costs up to seconds, and the rows themselves are judged by the registry tests, by
``k3verify golden verify`` and by the full ``k3verify run`` that the CI session makes."""

from __future__ import annotations

import dataclasses

import pytest

from k3verify.harness import registry


def without_kernels(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Until ``monkeypatch`` is undone, the ``modules``' own implementations are their forms
    whose name does not start with ``kernel``."""
    for name in modules:
        entry = registry.get(name)
        quick = [i for i in entry.own_implementations() if not i.form.startswith("kernel")]
        monkeypatch.setitem(registry._REGISTRY, name, dataclasses.replace(entry, own_implementations=lambda q=quick: q))
