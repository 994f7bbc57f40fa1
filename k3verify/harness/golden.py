"""Golden tensors: stored inputs and fp64 oracle outputs, and verification against them.

``generate`` writes, for every registered module, each case of
``ModuleEntry.cases_for_goldens(seed)`` as one safetensors file
``<dir>/<module>/<case>.safetensors`` plus ``<dir>/manifest.json``. ``verify`` checks every
file's sha256 against the manifest, then judges every registered implementation on the stored
inputs against the stored oracle output through the same runner and policy as ``k3verify run``.

Tensor keys inside a file::

    oracle                       the fp64 oracle output
    input.<name>                 a tensor input
    input.<name>.<field>         a tensor field of a dataclass input (MLA's LatentCache: pool,
                                 block_table, seq_lens, scales), recursively for nested ones

The manifest's ``inputs`` layout says how to rebuild the case's ``inputs`` dict from them:
``{"tensor": key}``, ``{"none": true}``, ``{"value": v}`` (a JSON scalar) or
``{"dataclass": "module:QualName", "fields": {field: layout}}`` (only ``k3verify.*`` classes).

Manifest (``manifest.json``, keys sorted, no timestamps so that it regenerates bit for bit)::

    {"format": "k3verify-golden", "manifest_version": 1, "generator_version": int, "seed": int,
     "platform": {math platform record, see below}, "reproducibility": str,
     "skipped": {"<module>/<case>": {"bytes", "reason"}},
     "files": {"<module>/<case>.safetensors": {
         "module", "case", "seed", "config" (the case's parameters), "generator_version",
         "torch", "sha256" (of the file), "bytes", "inputs" (layout above),
         "tensors": {key: {"sha256" (of the raw little-endian bytes), "dtype", "shape"}}}}}

Reproducibility: generation runs with one intra-op thread, so the bits do not depend on the
core count. They still depend on the torch build, the CPU and the code paths its math libraries
choose on it (MKL dispatches by vendor and ISA: an Intel and an AMD CPU with the same ATen
capability give different fp64 bits, about 1e-14 apart). The ``platform`` record is
:func:`~k3verify.harness.environment.math_platform` with one thread; regeneration is bitwise
identical where that record is equal, and agrees to fp64 rounding (fp64-agreement) elsewhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..numerics import FAIL, fp64_agreement
from . import registry, runner
from .environment import math_platform
from .registry import FP64_RULE, Case, Implementation, ModuleEntry
from .report import json_safe

# Bump when what a golden file holds changes (case generation, key scheme, oracle choice).
GENERATOR_VERSION = 1
MANIFEST_VERSION = 1
MANIFEST = "manifest.json"
# A case larger than this is not stored (the goldens are committed; a few MB in all). The
# manifest lists it under "skipped" and verification reports its rows as unavailable; a
# module whose cases are larger gives ``ModuleEntry.golden_cases`` smaller slices.
CASE_CAP_BYTES = 2_000_000
ORACLE_KEY = "oracle"
INPUT_PREFIX = "input."
REPRODUCIBILITY = (
    "bitwise identical when regenerated where the platform record is equal (torch build, CPU, ATen "
    "capability, MKL and oneDNN code paths, one thread); elsewhere the inputs and oracle agree to fp64 "
    "rounding (fp64-agreement)"
)

Progress = Callable[[str], None]


class GoldenError(Exception):
    """A golden directory that cannot be used: missing manifest, changed or missing files."""


def platform_record() -> dict[str, str]:
    """What bitwise reproducibility of the goldens depends on (they are generated with one thread)."""
    return math_platform(threads=1)


# --- (de)serialisation of case inputs ---------------------------------------------------


def flatten(inputs: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split a case's ``inputs`` into safetensors-ready tensors and a JSON layout to rebuild them."""
    tensors: dict[str, torch.Tensor] = {}
    layout = {name: _flatten_value(value, INPUT_PREFIX + name, tensors) for name, value in inputs.items()}
    return tensors, layout


def _flatten_value(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        tensors[key] = value.detach().to("cpu").contiguous().clone()
        return {"tensor": key}
    if value is None:
        return {"none": True}
    if isinstance(value, (bool, int, float, str)):
        return {"value": value}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        fields = {f.name: _flatten_value(getattr(value, f.name), f"{key}.{f.name}", tensors)
                  for f in dataclasses.fields(value)}
        return {"dataclass": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
    raise TypeError(f"cannot store input {key!r} of type {type(value).__name__} in a golden file")


def unflatten(layout: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Rebuild a case's ``inputs`` from :func:`flatten`'s layout and the loaded tensors."""
    return {name: _unflatten_value(spec, tensors) for name, spec in layout.items()}


def _unflatten_value(spec: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
    if "tensor" in spec:
        return tensors[spec["tensor"]]
    if spec.get("none"):
        return None
    if "value" in spec:
        return spec["value"]
    module_name, qualname = spec["dataclass"].split(":")
    if not module_name.startswith("k3verify."):
        raise GoldenError(f"refusing to rebuild {spec['dataclass']}: only k3verify classes are allowed")
    cls: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    return cls(**{name: _unflatten_value(s, tensors) for name, s in spec["fields"].items()})


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (CPU, contiguous; the dtype and shape are recorded apart)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


# --- generate -----------------------------------------------------------------------------


def generate(
    out_dir: Path, *, modules: list[str] | None = None, seed: int = 0, progress: Progress | None = None
) -> dict[str, Any]:
    """Write every selected module's golden cases and ``manifest.json`` into ``out_dir``.

    With ``modules``, the other modules' files and records are kept. Other ``*.safetensors``
    files in the folders of the generated modules and of the modules the previous manifest
    listed are removed (nothing outside them), so the directory matches the manifest. Returns
    the manifest.
    """
    entries = registry.select(modules)
    out_dir.mkdir(parents=True, exist_ok=True)
    previous = _read_manifest(out_dir) if (out_dir / MANIFEST).exists() else {"files": {}}
    folders = {e.name for e in entries} | {v["module"] for v in previous["files"].values()}
    files: dict[str, Any] = {}
    skipped: dict[str, Any] = {}
    # Multi-threaded CPU reductions split the reduced axis by thread count; one thread makes
    # the stored bits independent of how many cores the generating machine has.
    with runner.one_thread():
        for entry in entries:
            written, too_large = _generate_module(entry, out_dir, seed, progress)
            files |= written
            skipped |= too_large
    if modules is not None:  # keep the other modules' records from the previous manifest
        names = {e.name for e in entries}
        files = {k: v for k, v in previous["files"].items() if v["module"] not in names} | files
        skipped = {k: v for k, v in previous.get("skipped", {}).items() if v["module"] not in names} | skipped
    for stale in sorted(p for folder in folders for p in (out_dir / folder).glob("*.safetensors")):
        if stale.relative_to(out_dir).as_posix() not in files:
            stale.unlink()
    manifest = {
        "format": "k3verify-golden",
        "manifest_version": MANIFEST_VERSION,
        "generator_version": GENERATOR_VERSION,
        "seed": seed,
        "platform": platform_record(),
        "reproducibility": REPRODUCIBILITY,
        "skipped": dict(sorted(skipped.items())),
        "files": dict(sorted(files.items())),
    }
    (out_dir / MANIFEST).write_text(json.dumps(json_safe(manifest), indent=1, sort_keys=True) + "\n")
    return manifest


def _generate_module(
    entry: ModuleEntry, out_dir: Path, seed: int, progress: Progress | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(file records, skipped cases)`` of one module."""
    records, skipped = {}, {}
    for name, case in entry.cases_for_goldens(seed).items():
        if progress:
            progress(f"{entry.name}/{name}")
        tensors, layout = flatten(case.inputs)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if size > CASE_CAP_BYTES:
            skipped[f"{entry.name}/{name}"] = {
                "module": entry.name,
                "case": name,
                "bytes": size,
                "reason": f"inputs take {size / 1e6:.1f} MB > {CASE_CAP_BYTES / 1e6:.0f} MB per case; give the "
                f"{entry.name} entry golden_cases with smaller slices",
            }
            continue
        oracle = entry.oracle(case).detach().to("cpu", torch.float64).contiguous()
        tensors[ORACLE_KEY] = oracle
        rel = f"{entry.name}/{name}.safetensors"
        path = out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata={"format": f"k3verify-golden/{GENERATOR_VERSION}"})
        records[rel] = {
            "module": entry.name,
            "case": name,
            "seed": seed,
            "config": json.loads(json.dumps(json_safe(case.params), default=str)),
            "generator_version": GENERATOR_VERSION,
            "torch": torch.__version__,
            "sha256": file_sha256(path),
            "bytes": path.stat().st_size,
            "inputs": layout,
            "tensors": {
                k: {"sha256": tensor_sha256(t), "dtype": _dtype(t), "shape": list(t.shape)}
                for k, t in sorted(tensors.items())
            },
        }
    return records, skipped


# --- verify ---------------------------------------------------------------------------------


def _read_manifest(golden_dir: Path) -> dict[str, Any]:
    path = golden_dir / MANIFEST
    if not path.exists():
        raise GoldenError(f"{path}: no golden manifest; run `k3verify golden generate`")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != "k3verify-golden" or manifest.get("manifest_version") != MANIFEST_VERSION:
        raise GoldenError(f"{path}: not a k3verify golden manifest of version {MANIFEST_VERSION}")
    return manifest


def check_hashes(golden_dir: Path) -> list[str]:
    """Problems with the stored files, each naming its file; empty when every hash matches.

    A file whose sha256 differs from the manifest is reported with the tensors that changed
    when it still loads, or as unreadable when its header was damaged.
    """
    manifest = _read_manifest(golden_dir)
    problems = []
    for rel, record in manifest["files"].items():
        path = golden_dir / rel
        if not path.exists():
            problems.append(f"{path}: missing (listed in {MANIFEST})")
            continue
        digest = file_sha256(path)
        if digest == record["sha256"]:
            continue
        problems.append(
            f"{path}: sha256 mismatch: {MANIFEST} has {record['sha256'][:16]}…, the file has {digest[:16]}… "
            f"({_what_changed(path, record)})"
        )
    listed = {golden_dir / rel for rel in manifest["files"]}
    problems += [f"{p}: not listed in {MANIFEST}" for p in sorted(golden_dir.rglob("*.safetensors")) if p not in listed]
    return problems


def _what_changed(path: Path, record: dict[str, Any]) -> str:
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        return f"unreadable: {exc}"
    changed = [
        k for k, meta in record["tensors"].items() if k not in tensors or tensor_sha256(tensors[k]) != meta["sha256"]
    ]
    return f"changed tensors: {', '.join(changed)}" if changed else "tensor bytes intact, header changed"


def load_cases(golden_dir: Path, module: str) -> list[tuple[str, Case, torch.Tensor]]:
    """``(file, case, stored oracle)`` for every golden file of ``module`` (hashes not checked)."""
    manifest = _read_manifest(golden_dir)
    out = []
    for rel, record in manifest["files"].items():
        if record["module"] != module:
            continue
        tensors = load_file(str(golden_dir / rel))
        case = Case(record["case"], unflatten(record["inputs"], tensors), dict(record["config"]))
        out.append((rel, case, tensors[ORACLE_KEY]))
    return out


def verify_rows(
    golden_dir: Path, *, modules: list[str] | None = None, progress: Progress | None = None
) -> list[dict[str, Any]]:
    """Rows judging every registered implementation on the goldens (call :func:`check_hashes` first).

    Per golden file: one ``oracle`` row (today's fp64 oracle on the stored inputs against the
    stored output, rule fp64-agreement: the definition has not drifted), then one row per
    implementation whose cases include the file's case, judged against the stored output.
    A registered module without goldens, or an implementation case no golden stands in for,
    is a failed row that says to regenerate.
    """
    rows = []
    skipped = _read_manifest(golden_dir).get("skipped", {})
    for entry in registry.select(modules):
        goldens = load_cases(golden_dir, entry.name)
        if not goldens and not any(s["module"] == entry.name for s in skipped.values()):
            rows.append(_missing_row(entry.name, "-", f"no goldens for module {entry.name!r} in {golden_dir}"))
            continue
        for rel, case, stored in goldens:
            if progress:
                progress(f"{entry.name} oracle on {rel}")
            rows.append(_oracle_row(entry, case, stored, rel))
        for impl in entry.implementations():
            for wanted in impl.cases:
                matching = [(rel, c, o) for rel, c, o in goldens if registry.golden_case_kind(c.name) == wanted]
                too_large = skipped.get(f"{entry.name}/{wanted}")
                if too_large:
                    rows.append(_unstored_row(impl, wanted, too_large["reason"]))
                elif not matching:
                    rows.append(_missing_row(entry.name, wanted, f"{impl.label}: no golden case for {wanted!r}"))
                for rel, case, stored in matching:
                    if progress:
                        progress(f"{impl.label} on {rel}")
                    rows.append(runner.verify(entry, impl, case, oracle=stored) | {"golden": rel})
    return rows


def _oracle_row(entry: ModuleEntry, case: Case, stored: torch.Tensor, rel: str) -> dict[str, Any]:
    verdict = fp64_agreement(entry.oracle(case).detach().to("cpu", torch.float64), stored)
    return {
        "module": entry.name,
        "implementation": "oracle",
        "form": "definition",
        "dtype": "fp64",
        "params": {},
        "case": case.name,
        "case_params": dict(case.params),
        "rule": FP64_RULE,
        "golden": rel,
        "status": verdict.status,
        "verdict": verdict.as_dict(),
        "margin": verdict.margin,
    }


def _unstored_row(impl: Implementation, case: str, reason: str) -> dict[str, Any]:
    return {
        "module": impl.module,
        "implementation": impl.implementation,
        "form": impl.form,
        "dtype": impl.dtype,
        "params": dict(impl.params),
        "case": case,
        "rule": impl.rule,
        "status": runner.UNAVAILABLE,
        "reason": f"golden case not stored: {reason}",
    }


def _missing_row(module: str, case: str, reason: str) -> dict[str, Any]:
    return {
        "module": module,
        "implementation": "-",
        "form": "-",
        "dtype": "-",
        "params": {},
        "case": case,
        "rule": "-",
        "status": FAIL,
        "reason": f"{reason}; run `k3verify golden generate`",
    }
