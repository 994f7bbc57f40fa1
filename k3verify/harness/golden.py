"""Golden tensors: stored inputs and fp64 oracle outputs, and verification against them.

``generate`` writes, for every registered module, each case of
``ModuleEntry.cases_for_goldens(seed)`` as one safetensors file
``<dir>/<module>/<case>.safetensors`` plus ``<dir>/manifest.json``. ``check`` proves the folder
is what the generator wrote; ``verify_rows`` then judges every registered implementation on the
stored inputs against the stored oracle output through the same runner and policy as
``k3verify run``.

Tensor keys inside a file::

    oracle.<output>              each named output of the fp64 oracle (KDA: o, final_state)
    input.<name>                 a tensor input
    input.<name>.<field>         a tensor field of a dataclass input (MLA's LatentCache: pool,
                                 block_table, seq_lens, scales), recursively for nested ones

The manifest's ``inputs`` layout says how to rebuild the case's ``inputs`` dict from them:
``{"tensor": key}``, ``{"none": true}``, ``{"value": v}`` (a JSON scalar) or
``{"dataclass": "module:QualName", "fields": {field: layout}}``, where the class must be one a
registered module declares in ``ModuleEntry.input_types``: the manifest is data, never code.

Manifest (``manifest.json``, keys sorted, no timestamps so that it regenerates bit for bit)::

    {"format": "k3verify-golden", "manifest_version": 2, "generator_version": int, "seed": int,
     "platform": {math platform record, see below}, "reproducibility": str,
     "skipped": {"<module>/<case>": {"module", "case", "bytes", "reason"}},
     "files": {"<module>/<case>.safetensors": {
         "module", "case", "seed", "config" (the case's parameters), "generator_version",
         "torch", "sha256" (of the file), "bytes", "inputs" (layout above),
         "tensors": {key: {"sha256" (of the raw little-endian bytes), "dtype", "shape"}}}},
     "digests": {field path: sha256 of its canonical JSON}}

Trust: a golden folder may arrive in a pull request, so :func:`check` accepts it only when

- every path is a plain relative path inside the folder (no ``..``, no absolute path, no
  symlink), every size is checked before reading, and no file lies outside the manifest;
- every manifest field matches its digest (``digests``: each top-level field, and each field
  of each file record, so an edit is named by file and field);
- each file's sha256 and size match, and the record embedded in the file's own header
  (everything but ``sha256`` and ``bytes``) equals the manifest's, tensor by tensor;
- the generator, run again for the manifest's seed (in [0, 2**62)), makes exactly the listed
  cases with the same configuration and input layout, stored inputs agree with regenerated ones
  (fp64-agreement; integers exactly), and each skipped case really exceeds the size cap;
- each file holds exactly the named outputs today's oracle makes for its case, in its dtype
  and shape, non-finite nowhere the oracle is finite, and no other tensor.

The folder is read once (:func:`snapshot`: the manifest and every listed file, through one
descriptor of the folder); :func:`check` and :func:`verify_rows` judge those bytes, so a
``generate`` swapping the folder meanwhile cannot put unchecked files under the verdicts.

Reproducibility: generation runs with one intra-op thread, so the bits do not depend on the
core count. They still depend on the torch build, the CPU and the code paths its math libraries
choose on it (MKL dispatches by vendor and ISA: an Intel and an AMD CPU with the same ATen
capability give different fp64 bits, about 1e-14 apart). The ``platform`` record is
:func:`~k3verify.harness.environment.math_platform` with one thread; regeneration is bitwise
identical where that record is equal, and agrees to fp64 rounding (fp64-agreement) elsewhere.
Writing is atomic as a set (:func:`~k3verify.harness.files.staged_folder`): an interrupted
``generate`` leaves the previous goldens.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import math
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ..numerics import FAIL, FP64_AGREEMENT_REL, POLICY, Verdict
from . import registry, runner
from .environment import math_platform, one_thread, platform_differences
from .files import (
    StagingError,
    UsageError,
    check_relative,
    json_safe,
    parse_json,
    read_confined,
    read_json,
    staged_folder,
)
from .registry import FP64_RULE, Case, Implementation, ModuleEntry, Outputs, as_outputs
from .rows import Row, VerdictRecord

# Bump when what a golden file holds changes (case generation, key scheme, oracle choice).
GENERATOR_VERSION = 2  # 2: the oracle's named outputs (oracle.<name>) instead of one "oracle"
MANIFEST_VERSION = 2
MANIFEST = "manifest.json"
FILE_FORMAT = f"k3verify-golden/{MANIFEST_VERSION}"
# A case larger than this is not stored (the goldens are committed; a few MB in all). The
# manifest lists it under "skipped" and verification reports its rows as unavailable; a
# module whose cases are larger gives ``ModuleEntry.golden_cases`` smaller slices.
CASE_CAP_BYTES = 2_000_000
# A stored file is its tensors (at most the cap, plus the oracle) and a JSON header.
FILE_CAP_BYTES = 4 * CASE_CAP_BYTES
MANIFEST_CAP_BYTES = 4_000_000
# A golden set is read whole into memory before it is checked, so that the rows are judged on
# the very bytes the check saw: the listed files together stay within this.
SET_CAP_BYTES = 256_000_000
# A golden folder holds <module>/<case>.safetensors; the search for unlisted files stops deeper.
MAX_DEPTH = 16
# Seeds feed torch.Generator.manual_seed (64 bits) after small offsets per case, as ``--seed``.
SEED_LIMIT = 2**62
ORACLE_PREFIX = "oracle."
HEADER_KEY = "k3verify-golden"
INPUT_PREFIX = "input."
REPRODUCIBILITY = (
    "bitwise identical when regenerated where the platform record is equal (torch build, CPU, ATen "
    "capability, MKL and oneDNN code paths, one thread); elsewhere the inputs and oracle agree to fp64 "
    "rounding (fp64-agreement)"
)
_MODULE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_LAYOUT_DEPTH = 4
# The fields of a file record that its file's own header repeats (all but the file's hash and size).
EMBEDDED_FIELDS = ("case", "config", "generator_version", "inputs", "module", "seed", "tensors", "torch")
RECORD_FIELDS = (*EMBEDDED_FIELDS, "bytes", "sha256")
MANIFEST_FIELDS = ("digests", "files", "format", "generator_version", "manifest_version", "platform",
                   "reproducibility", "seed", "skipped")

Progress = Callable[[str], None]


class GoldenError(Exception):
    """A golden folder that cannot be used as it is (exit 1: the goldens do not check out)."""


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
        return {"dataclass": class_name(cls), "fields": fields}
    raise TypeError(f"cannot store input {key!r} of type {type(value).__name__} in a golden file")


def class_name(cls: type) -> str:
    """``module:QualName`` of a class, as the layout names it."""
    return f"{cls.__module__}:{cls.__qualname__}"


def input_classes() -> dict[str, type]:
    """The dataclasses a golden layout may rebuild: those the registered modules declare."""
    return {class_name(cls): cls for name in registry.module_names() for cls in registry.get(name).input_types}


def unflatten(
    layout: dict[str, Any], tensors: dict[str, torch.Tensor], allowed: dict[str, type] | None = None
) -> dict[str, Any]:
    """Rebuild a case's ``inputs`` from :func:`flatten`'s layout and the loaded tensors.

    ``GoldenError`` for anything the layout grammar does not allow: an unknown shape of spec, a
    class outside ``allowed`` (default :func:`input_classes`), fields that are not the class's,
    a tensor key the file does not hold, or nesting deeper than four levels.
    """
    if not isinstance(layout, dict):
        raise GoldenError(f"inputs layout is a {type(layout).__name__}, not an object")
    allowed = input_classes() if allowed is None else allowed
    return {name: _unflatten_value(spec, tensors, allowed, name, 0) for name, spec in layout.items()}


def _unflatten_value(spec: Any, tensors: dict[str, torch.Tensor], allowed: dict[str, type], where: str,
                     depth: int) -> Any:
    if not isinstance(spec, dict) or depth > _LAYOUT_DEPTH:
        raise GoldenError(f"input {where!r}: layout {str(spec)[:80]!r} is not a golden input layout")
    keys = set(spec)
    if keys == {"tensor"} and isinstance(spec["tensor"], str):
        if spec["tensor"] not in tensors:
            raise GoldenError(f"input {where!r}: tensor {spec['tensor']!r} is not in the file")
        return tensors[spec["tensor"]]
    if keys == {"none"} and spec["none"] is True:
        return None
    if keys == {"value"} and isinstance(spec["value"], (bool, int, float, str)):
        return spec["value"]
    if keys == {"dataclass", "fields"} and isinstance(spec["fields"], dict):
        cls = allowed.get(spec["dataclass"]) if isinstance(spec["dataclass"], str) else None
        if cls is None:
            raise GoldenError(
                f"input {where!r}: refusing to rebuild {str(spec['dataclass'])[:80]!r}: only the input classes the "
                f"registered modules declare are allowed ({', '.join(sorted(allowed)) or 'none'})"
            )
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        if set(spec["fields"]) != names:
            raise GoldenError(f"input {where!r}: {spec['dataclass']} has fields {sorted(names)}, "
                              f"the layout gives {sorted(spec['fields'])}")
        return cls(**{n: _unflatten_value(s, tensors, allowed, f"{where}.{n}", depth + 1)
                      for n, s in spec["fields"].items()})
    raise GoldenError(f"input {where!r}: layout {str(spec)[:80]!r} is not a golden input layout")


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (CPU, contiguous; the dtype and shape are recorded apart)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def digests(manifest: dict[str, Any]) -> dict[str, str]:
    """sha256 of every top-level field of ``manifest`` and of every field of every file record,
    keyed ``<field>`` and ``files/<file>/<field>``."""
    out = {key: _sha256(_canonical(value)) for key, value in manifest.items() if key != "digests"}
    for rel, record in (manifest.get("files") or {}).items():
        if isinstance(record, dict):
            out |= {f"files/{rel}/{field}": _sha256(_canonical(v)) for field, v in record.items()}
    return out


# --- generate -----------------------------------------------------------------------------


def generate(
    out_dir: Path, *, modules: list[str] | None = None, seed: int = 0, progress: Progress | None = None
) -> dict[str, Any]:
    """Write every selected module's golden cases and ``manifest.json`` into ``out_dir``.

    With ``modules``, the other modules' files and records are kept (the previous manifest must
    then be readable). The folders of the generated modules are written anew, so no stale file
    stays; nothing outside ``out_dir`` is touched, and the folder is replaced as a set. Returns
    the manifest.
    """
    entries = registry.select(modules)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise UsageError(f"golden seed {seed!r} is outside [0, 2**62)")
    out_dir = Path(out_dir)
    names = {e.name for e in entries}
    kept_files: dict[str, Any] = {}
    kept_skipped: dict[str, Any] = {}
    replaced = set(names)
    if modules is not None and (out_dir / MANIFEST).exists():
        try:
            previous = read_manifest(out_dir)
        except GoldenError as exc:
            raise UsageError(f"cannot keep the other modules' goldens: {exc}; regenerate every module") from None
        kept_files = {k: v for k, v in previous["files"].items() if v["module"] not in names}
        kept_skipped = {k: v for k, v in previous["skipped"].items() if v["module"] not in names}
        differences = platform_differences(previous["platform"], platform_record())
        if kept_files and differences:
            # One manifest records one platform, which the bitwise check trusts: files kept from
            # another platform beside files made here would claim bits they were not made with.
            raise UsageError("the goldens kept beside --modules were made on another platform ("
                             + "; ".join(differences)[:300] + "); a manifest records one platform: regenerate "
                             "every module (`k3verify golden generate` without --modules)")
        if kept_files and previous.get("seed") != seed:
            # One manifest records one seed, which verify regenerates every kept file's inputs from.
            raise UsageError(f"the goldens kept beside --modules were drawn with seed {previous.get('seed')!r}, not "
                             f"{seed}; a manifest records one seed: give --seed {previous.get('seed')!r}, or "
                             "regenerate every module (without --modules)")
    elif (out_dir / MANIFEST).exists():
        replaced |= _listed_modules(out_dir)
    files: dict[str, Any] = {}
    skipped: dict[str, Any] = {}
    with staged_folder(out_dir, carry=lambda name: name != MANIFEST and name not in replaced) as stage:
        # Multi-threaded CPU reductions split the reduced axis by thread count; one thread makes
        # the stored bits independent of how many cores the generating machine has.
        with one_thread():
            for entry in entries:
                written, too_large = _generate_module(entry, stage, seed, progress)
                files |= written
                skipped |= too_large
        manifest = {
            "format": "k3verify-golden",
            "manifest_version": MANIFEST_VERSION,
            "generator_version": GENERATOR_VERSION,
            "seed": seed,
            "platform": platform_record(),
            "reproducibility": REPRODUCIBILITY,
            "skipped": dict(sorted((kept_skipped | skipped).items())),
            "files": dict(sorted((kept_files | files).items())),
        }
        manifest = json.loads(json.dumps(json_safe(manifest)))
        manifest["digests"] = digests(manifest)
        _write_new(stage / MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
        _check_written(stage, manifest["files"])
    return manifest


def _write_new(path: Path, data: bytes) -> None:
    """Write ``data`` to the new file ``path``; a full disk, inode table or quota, or a file-size
    limit, is an ``OSError`` naming the path (the staged folder is then never swapped in)."""
    try:
        with open(path, "xb") as f:
            f.write(data)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None


def _check_written(stage: Path, files: dict[str, Any]) -> None:
    """Every file the manifest lists is in ``stage`` with its size: ``StagingError`` otherwise
    (another program removed or changed what was written, so the set must not be swapped in)."""
    for rel, record in files.items():
        try:
            info = os.lstat(stage / rel)
        except OSError:
            info = None
        if info is None or not stat.S_ISREG(info.st_mode) or info.st_size != record["bytes"]:
            raise StagingError(errno.ESTALE, f"{rel} is not what was written (removed or changed by another "
                               "program); the previous goldens are kept", str(stage / rel))


def _listed_modules(out_dir: Path) -> set[str]:
    """Module folders a previous manifest lists (plain names only), for a full regeneration to drop."""
    try:
        doc = read_json(out_dir / MANIFEST, what="golden manifest", max_bytes=MANIFEST_CAP_BYTES)
    except UsageError:
        return set()
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, dict):
        return set()
    return {str(r.get("module")) for r in files.values() if isinstance(r, dict)
            and _MODULE_NAME.match(str(r.get("module")))}


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
            skipped[f"{entry.name}/{name}"] = _skip_record(entry.name, name, size)
            continue
        oracle = as_outputs(entry.oracle(case), entry.outputs, f"the {entry.name} oracle")
        tensors |= {ORACLE_PREFIX + n: t.detach().to("cpu").contiguous() for n, t in oracle.items()}
        rel = f"{entry.name}/{name}.safetensors"
        record = {
            "module": entry.name,
            "case": name,
            "seed": seed,
            "config": json.loads(json.dumps(json_safe(case.params), default=str)),
            "generator_version": GENERATOR_VERSION,
            "torch": torch.__version__,
            "inputs": layout,
            "tensors": {
                k: {"sha256": tensor_sha256(t), "dtype": _dtype(t), "shape": list(t.shape)}
                for k, t in sorted(tensors.items())
            },
        }
        path = out_dir / rel
        path.parent.mkdir(exist_ok=True)  # never parents: a staging folder removed meanwhile is not remade
        # One metadata key: safetensors writes its metadata map in no fixed order.
        embedded = json.dumps({"format": FILE_FORMAT, "record": json_safe(record)}, sort_keys=True)
        # Serialised in memory and written here, so a full disk or a size limit is an OSError
        # naming the file (safetensors' own writer raises its SafetensorError instead).
        data = save_tensors(tensors, metadata={HEADER_KEY: embedded})
        _write_new(path, data)
        records[rel] = record | {"sha256": _sha256(data), "bytes": len(data)}
    return records, skipped


def _skip_record(module: str, case: str, size: int) -> dict[str, Any]:
    return {
        "module": module,
        "case": case,
        "bytes": size,
        "reason": f"inputs take {size / 1e6:.1f} MB > {CASE_CAP_BYTES / 1e6:.0f} MB per case; give the "
        f"{module} entry golden_cases with smaller slices",
    }


# --- the set, read once -------------------------------------------------------------------


@dataclasses.dataclass
class GoldenSet:
    """A golden folder as :func:`snapshot` read it: the manifest and the bytes of every listed
    file, read once. :func:`check` and :func:`verify_rows` judge these bytes and never read the
    folder again, so a ``golden generate`` swapping the folder meanwhile cannot slip unchecked
    files under the rows."""

    directory: Path
    manifest: dict[str, Any]
    files: dict[str, bytes]  # listed file -> its bytes
    unreadable: dict[str, str]  # listed file -> why it could not be read
    on_disk: list[str]  # every *.safetensors path below the folder, relative to it
    listing_problems: list[str]  # folders that could not be searched for unlisted files
    problems: list[str] | None = None  # what :func:`check` found, once it ran
    _opened: dict[str, tuple[dict[str, Any], dict[str, torch.Tensor], str | None]] = dataclasses.field(
        default_factory=dict, repr=False)

    def opened(self, rel: str) -> tuple[dict[str, Any], dict[str, torch.Tensor], str | None]:
        """``(embedded record, tensors, error)`` of listed file ``rel`` (parsed once)."""
        if rel not in self._opened:
            self._opened[rel] = _open(self.files[rel])
        return self._opened[rel]


def snapshot(golden_dir: Path) -> GoldenSet:
    """Read the golden folder once: the manifest (its shape validated, ``GoldenError``
    otherwise), every listed file (sizes checked before reading, the set within
    :data:`SET_CAP_BYTES`) and the names of the files on disk. Everything is read through one
    descriptor of the folder, so a folder swapped in under the same name meanwhile is not mixed in."""
    golden_dir = Path(golden_dir)
    try:
        fd = os.open(golden_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise GoldenError(f"{golden_dir / MANIFEST}: no golden manifest; run `k3verify golden generate`") from None
    except OSError as exc:
        raise GoldenError(f"{golden_dir}: golden folder cannot be read: {exc.strerror}") from None
    try:
        manifest = _read_manifest(golden_dir, fd)
        total = sum(record["bytes"] for record in manifest["files"].values())
        if total > SET_CAP_BYTES:
            raise GoldenError(f"{golden_dir / MANIFEST}: lists {total} bytes of files, more than the {SET_CAP_BYTES} "
                              "a golden set may hold")
        files, unreadable = {}, {}
        for rel in manifest["files"]:
            try:
                files[rel] = read_confined(golden_dir, rel, max_bytes=FILE_CAP_BYTES, what="golden file", dir_fd=fd)
            except UsageError as exc:
                unreadable[rel] = str(exc)
        on_disk, listing_problems = _stored_files(golden_dir, fd)
    finally:
        os.close(fd)
    return GoldenSet(golden_dir, manifest, files, unreadable, on_disk, listing_problems)


def _as_set(golden: Path | GoldenSet) -> GoldenSet:
    return golden if isinstance(golden, GoldenSet) else snapshot(golden)


def _stored_files(golden_dir: Path, fd: int) -> tuple[list[str], list[str]]:
    """Every ``*.safetensors`` entry below the folder open at ``fd`` (relative paths), without
    recursion or following symlinks, and a problem for each folder that could not be listed or
    lies deeper than :data:`MAX_DEPTH`."""
    found, problems = [], []
    pending = [""]
    while pending:
        rel = pending.pop()
        if rel.count("/") + 1 > MAX_DEPTH:
            problems.append(f"{golden_dir / rel}: folders nested deeper than {MAX_DEPTH} levels; a golden folder "
                            "holds <module>/<case>.safetensors")
            continue
        try:
            sub = os.open(rel, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd) if rel else fd
            try:
                with os.scandir(sub) as entries:
                    listed = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
            finally:
                if rel:
                    os.close(sub)
        except OSError as exc:
            problems.append(f"{golden_dir / rel}: cannot be listed: {exc.strerror}")
            continue
        for name, is_dir in sorted(listed):
            child = f"{rel}/{name}" if rel else name
            if is_dir:
                pending.append(child)
            elif name.endswith(".safetensors"):
                found.append(child)
    return sorted(found), problems


# --- check --------------------------------------------------------------------------------


def read_manifest(golden_dir: Path) -> dict[str, Any]:
    """The manifest, its shape validated (paths, names, types); ``GoldenError`` naming what is wrong."""
    return snapshot(golden_dir).manifest


def _read_manifest(golden_dir: Path, fd: int) -> dict[str, Any]:
    """The manifest in the folder open at ``fd``, its shape validated."""
    path = golden_dir / MANIFEST
    try:
        doc = parse_json(read_confined(golden_dir, MANIFEST, max_bytes=MANIFEST_CAP_BYTES, what="golden manifest",
                                       dir_fd=fd), path, "golden manifest")
    except UsageError as exc:
        if not os.path.lexists(path):
            raise GoldenError(f"{path}: no golden manifest; run `k3verify golden generate`") from None
        raise GoldenError(str(exc)) from None
    if not isinstance(doc, dict) or doc.get("format") != "k3verify-golden":
        raise GoldenError(f"{path}: not a k3verify golden manifest")
    if doc.get("manifest_version") != MANIFEST_VERSION:
        raise GoldenError(f"{path}: manifest version {str(doc.get('manifest_version'))[:40]!r}, this k3verify reads "
                          f"{MANIFEST_VERSION}; run `k3verify golden generate`")
    unknown = sorted(set(doc) - set(MANIFEST_FIELDS))
    if unknown:
        raise GoldenError(f"{path}: unknown field(s) {', '.join(map(repr, unknown))[:120]}")
    for key, kind in (("files", dict), ("skipped", dict), ("digests", dict), ("seed", int), ("platform", dict)):
        if not isinstance(doc.get(key), kind) or isinstance(doc.get(key), bool):
            raise GoldenError(f"{path}: field {key!r} is missing or not a {kind.__name__}")
    if not 0 <= doc["seed"] < SEED_LIMIT:
        raise GoldenError(f"{path}: field 'seed' is {str(doc['seed'])[:40]}, outside [0, 2**62)")
    for rel, record in doc["files"].items():
        _check_file_record(path, rel, record)
    for key, record in doc["skipped"].items():
        if not isinstance(record, dict) or set(record) != {"module", "case", "bytes", "reason"}:
            raise GoldenError(f"{path}: skipped entry {key!r} must hold exactly module, case, bytes and reason")
        if key != f"{record['module']}/{record['case']}" or not _MODULE_NAME.match(str(record["module"])):
            raise GoldenError(f"{path}: skipped entry {key!r} does not name its module and case")
    return doc


def _check_file_record(path: Path, rel: Any, record: Any) -> None:
    try:
        parts = check_relative(rel, "golden file").parts
    except UsageError as exc:
        raise GoldenError(f"{path}: {exc}") from None
    if not isinstance(record, dict) or set(record) != set(RECORD_FIELDS):
        have = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise GoldenError(f"{path}: record of {rel!r} has fields {have}; expected {sorted(RECORD_FIELDS)}")
    if len(parts) != 2 or not rel.endswith(".safetensors") or parts[0] != record["module"] \
            or rel != f"{record['module']}/{record['case']}.safetensors" or not _MODULE_NAME.match(parts[0]):
        raise GoldenError(f"{path}: file {rel!r} is not <module>/<case>.safetensors of its record")
    if not isinstance(record["bytes"], int) or isinstance(record["bytes"], bool) \
            or not 0 < record["bytes"] <= FILE_CAP_BYTES:
        raise GoldenError(f"{path}: {rel}: size {record['bytes']!r} is not a size up to {FILE_CAP_BYTES} bytes")
    if not isinstance(record["tensors"], dict) or not any(str(k).startswith(ORACLE_PREFIX) for k in record["tensors"]):
        raise GoldenError(f"{path}: {rel}: no {ORACLE_PREFIX}<output> tensor listed")


def check(golden: Path | GoldenSet) -> list[str]:
    """Problems with a golden folder (or a :func:`snapshot` of one), each naming its file and
    field; empty when it is exactly what the generator wrote (see the module docstring).
    ``GoldenError`` when the manifest itself cannot be used. A snapshot remembers the result."""
    goldens = _as_set(golden)
    if goldens.problems is None:
        goldens.problems = _problems(goldens)
    return list(goldens.problems)


def _problems(goldens: GoldenSet) -> list[str]:
    return _storage_problems(goldens) + _check_against_generator(goldens)


def _storage_problems(goldens: GoldenSet) -> list[str]:
    """What :func:`check` finds in the set as stored (digests, file hashes and headers, unlisted
    files), without regenerating its cases."""
    manifest, directory = goldens.manifest, goldens.directory
    path = directory / MANIFEST
    problems = [f"{path}: field {field!r} does not match its digest (edited by hand?)"
                for field in _changed_fields(manifest)]
    for field, expected in (("generator_version", GENERATOR_VERSION), ("reproducibility", REPRODUCIBILITY)):
        if manifest.get(field) != expected:
            problems.append(f"{path}: field {field!r} is {str(manifest.get(field))[:60]!r}; this k3verify writes "
                            f"{str(expected)[:60]!r}; run `k3verify golden generate`")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in manifest["platform"].items()):
        problems.append(f"{path}: field 'platform' is not a record of names and values")
    for rel, record in manifest["files"].items():
        problems += _check_file(goldens, rel, record)
    problems += goldens.listing_problems
    problems += [f"{directory / rel}: not listed in {MANIFEST}" for rel in goldens.on_disk
                 if rel not in manifest["files"]]
    return problems


def _changed_fields(manifest: dict[str, Any]) -> list[str]:
    stored, actual = manifest["digests"], digests(manifest)
    return sorted(k for k in set(stored) | set(actual) if stored.get(k) != actual.get(k))


def _check_file(goldens: GoldenSet, rel: str, record: dict[str, Any]) -> list[str]:
    """The file's hash, size, embedded record and tensors against the manifest's record."""
    path = goldens.directory / rel
    if rel in goldens.unreadable:
        return [goldens.unreadable[rel]]
    data = goldens.files[rel]
    problems = []
    if len(data) != record["bytes"]:
        problems.append(f"{path}: has {len(data)} bytes, {MANIFEST} says {record['bytes']}")
    embedded, tensors, error = goldens.opened(rel)
    if error:
        return [*problems, f"{path}: unreadable safetensors file ({error})"]
    for field in EMBEDDED_FIELDS:
        if embedded.get(field) != record[field]:
            problems.append(f"{path}: field {field!r} differs between {MANIFEST} and the file's own header")
    changed = [k for k, meta in record["tensors"].items()
               if not isinstance(meta, dict) or k not in tensors or _tensor_meta(tensors[k]) != meta]
    extra = sorted(set(tensors) - set(record["tensors"]))
    if changed or extra:
        problems.append(f"{path}: tensors differ from {MANIFEST}: {', '.join(changed + extra)}")
    if _sha256(data) != record["sha256"]:
        where = ("the file's bytes changed" if problems else
                 f"the file's tensors and header match every other field, so {MANIFEST}'s sha256 was edited")
        problems.append(f"{path}: sha256 mismatch: {MANIFEST} has {str(record['sha256'])[:16]}…, the file has "
                        f"{_sha256(data)[:16]}… ({where})")
    return problems


def _tensor_meta(t: torch.Tensor) -> dict[str, Any]:
    return {"sha256": tensor_sha256(t), "dtype": _dtype(t), "shape": list(t.shape)}


def _open(data: bytes) -> tuple[dict[str, Any], dict[str, torch.Tensor], str | None]:
    """``(embedded record, tensors, error)`` of a golden file's bytes."""
    try:
        tensors = load_tensors(data)
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + header_len])
    except (SafetensorError, ValueError, RuntimeError, OSError) as exc:
        return {}, {}, str(exc)[:200]
    try:
        meta = json.loads((header.get("__metadata__") or {}).get(HEADER_KEY, ""))
    except (ValueError, AttributeError):
        return {}, tensors, f"no {HEADER_KEY!r} record in its header"
    if not isinstance(meta, dict) or meta.get("format") != FILE_FORMAT:
        return {}, tensors, f"header format is not {FILE_FORMAT!r}"
    embedded = meta.get("record")
    return (embedded if isinstance(embedded, dict) else {}), tensors, None


def _check_against_generator(goldens: GoldenSet) -> list[str]:
    """The listed and skipped cases are exactly what the generator makes for the manifest's seed,
    with the same parameters, layout and (to fp64 rounding) inputs, and each file holds exactly
    the oracle outputs today's oracle makes for its case."""
    problems = []
    manifest = goldens.manifest
    path = goldens.directory / MANIFEST
    seed = manifest["seed"]
    listed: dict[str, dict[str, tuple[str, Any]]] = {}
    for rel, record in manifest["files"].items():
        listed.setdefault(record["module"], {})[record["case"]] = ("file", rel)
    for key, record in manifest["skipped"].items():
        listed.setdefault(record["module"], {})[record["case"]] = ("skipped", key)
    for module, cases in sorted(listed.items()):
        if module not in registry.module_names():
            known = ", ".join(registry.module_names())
            problems.append(f"{path}: module {module!r} is not registered (known: {known})")
            continue
        made = registry.get(module).cases_for_goldens(seed)
        for name in sorted(set(made) - set(cases)):
            problems.append(f"{path}: case {module}/{name} is neither stored nor skipped; "
                            "run `k3verify golden generate`")
        for name, (kind, key) in sorted(cases.items()):
            if name not in made:
                problems.append(f"{path}: {key}: the generator makes no case {name!r} for {module}")
            elif kind == "skipped":
                problems += _check_skipped(path, key, manifest["skipped"][key], made[name])
            else:
                entry = registry.get(module)
                problems += _check_regenerated(goldens, key, manifest["files"][key], made[name], seed)
                problems += _check_outputs(goldens, key, entry, made[name])
    return problems


def _check_skipped(path: Path, key: str, record: dict[str, Any], case: Case) -> list[str]:
    tensors, _ = flatten(case.inputs)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    if size <= CASE_CAP_BYTES:
        return [f"{path}: skipped {key}: its inputs take {size} bytes, within the {CASE_CAP_BYTES}-byte cap; "
                "it must be stored"]
    if record["bytes"] != size:
        return [f"{path}: skipped {key}: field 'bytes' says {record['bytes']}, the case takes {size}"]
    return []


def _check_regenerated(goldens: GoldenSet, rel: str, record: dict[str, Any], case: Case, seed: int) -> list[str]:
    path = goldens.directory / rel
    problems = []
    if record["seed"] != seed:
        problems.append(f"{path}: field 'seed' is {record['seed']!r}, the manifest's seed is {seed}")
    config = json.loads(json.dumps(json_safe(case.params), default=str))
    if not _same_config(record["config"], config):
        problems.append(f"{path}: field 'config' differs from what the generator makes for seed {seed}")
    tensors, layout = flatten(case.inputs)
    if record["inputs"] != layout:
        problems.append(f"{path}: field 'inputs' differs from what the generator makes for seed {seed}")
        return problems
    if rel in goldens.unreadable or goldens.opened(rel)[2]:
        return problems  # reported by the file check
    stored = goldens.opened(rel)[1]
    for key, fresh in tensors.items():
        ok, why = _inputs_agree(fresh, stored.get(key))
        if not ok:
            problems.append(f"{path}: stored {key} does not regenerate for seed {seed}: {why}")
    strays = sorted(k for k in stored if k not in tensors and not k.startswith(ORACLE_PREFIX))
    if strays:
        problems.append(f"{path}: tensor(s) {', '.join(strays)[:120]} are neither inputs the generator makes nor "
                        "oracle outputs")
    return problems


def _check_outputs(goldens: GoldenSet, rel: str, entry: ModuleEntry, case: Case) -> list[str]:
    """Rule: structural. The file holds exactly the named outputs today's oracle makes for its
    (regenerated) case, each in that output's dtype (fp64 for floating outputs) and shape, and
    non-finite nowhere today's oracle is finite: a removed, renamed, emptied, narrowed or
    poisoned output is named by file and output before anything is judged against it."""
    path = goldens.directory / rel
    if rel in goldens.unreadable or goldens.opened(rel)[2]:
        return []  # reported by the file check
    have = {k.removeprefix(ORACLE_PREFIX): t for k, t in goldens.opened(rel)[1].items() if k.startswith(ORACLE_PREFIX)}
    today = {n: t.detach().cpu() for n, t in as_outputs(entry.oracle(case), entry.outputs,
                                                       f"the {entry.name} oracle").items()}
    problems = [f"{path}: oracle output {name!r} is missing; today's oracle makes {sorted(today)} for case "
                f"{case.name!r}" for name in sorted(set(today) - set(have))]
    problems += [f"{path}: oracle output {name[:60]!r} is not one today's oracle makes for case {case.name!r} "
                 f"({sorted(today)})" for name in sorted(set(have) - set(today))]
    for name in sorted(set(have) & set(today)):
        stored, made = have[name], today[name]
        if stored.dtype != made.dtype:
            problems.append(f"{path}: oracle output {name!r} is stored as {_dtype(stored)}; today's oracle makes "
                            f"{_dtype(made)}")
        elif stored.shape != made.shape:
            problems.append(f"{path}: oracle output {name!r} has shape {list(stored.shape)}; today's oracle makes "
                            f"{list(made.shape)}")
        elif stored.is_floating_point():
            poisoned = int((~torch.isfinite(stored) & torch.isfinite(made)).sum())
            if poisoned:
                problems.append(f"{path}: oracle output {name!r} has {poisoned} non-finite value(s) where today's "
                                "oracle is finite")
    return problems


def _same_config(stored: Any, made: Any) -> bool:
    """Equal configurations: the same keys, strings, integers and flags exactly; floats to fp64
    agreement (rel 1e-10), since some parameters are measured on the inputs (MoE's smallest top-k
    gap) and another CPU's summation order moves them by a rounding."""
    if isinstance(stored, dict) and isinstance(made, dict):
        return stored.keys() == made.keys() and all(_same_config(stored[k], made[k]) for k in stored)
    if isinstance(stored, list) and isinstance(made, list):
        return len(stored) == len(made) and all(_same_config(a, b) for a, b in zip(stored, made))
    if isinstance(stored, float) and isinstance(made, float):
        return math.isclose(stored, made, rel_tol=FP64_AGREEMENT_REL, abs_tol=0.0)
    return type(stored) is type(made) and stored == made


def _inputs_agree(fresh: torch.Tensor, stored: torch.Tensor | None) -> tuple[bool, str]:
    """Rule: integers exactly; floating data to fp64-agreement, non-finite entries (the NaN poison
    of dead cache slots) in the same places and of the same kind."""
    if stored is None:
        return False, "missing"
    if stored.dtype != fresh.dtype or stored.shape != fresh.shape:
        return False, f"{stored.dtype} {list(stored.shape)} stored, {fresh.dtype} {list(fresh.shape)} generated"
    if not fresh.is_floating_point():
        return bool(torch.equal(fresh, stored)), "integer entries differ"
    x, y = fresh.double(), stored.double()
    finite = torch.isfinite(x)
    if not torch.equal(finite, torch.isfinite(y)) or not torch.equal(x[~finite].nan_to_num(), y[~finite].nan_to_num()):
        return False, "non-finite entries moved or changed"
    verdict = POLICY[FP64_RULE].judge(torch.where(finite, x, 0.0), torch.where(finite, y, 0.0)).verdict
    return verdict.passed, verdict.reason


# --- verify ---------------------------------------------------------------------------------


def load_cases(golden: Path | GoldenSet, module: str) -> list[tuple[str, Case, Outputs]]:
    """``(file, case, stored oracle outputs)`` for every golden file of ``module`` (run :func:`check` first)."""
    goldens = _as_set(golden)
    allowed = input_classes()
    out = []
    for rel, record in goldens.manifest["files"].items():
        if record["module"] != module:
            continue
        if rel in goldens.unreadable:
            raise GoldenError(goldens.unreadable[rel])
        _, tensors, error = goldens.opened(rel)
        if error:
            raise GoldenError(f"{goldens.directory / rel}: unreadable safetensors file ({error})")
        inputs = unflatten(record["inputs"], tensors, allowed)
        if not isinstance(record["config"], dict):
            raise GoldenError(f"{goldens.directory / rel}: field 'config' is not an object")
        stored = {k.removeprefix(ORACLE_PREFIX): t for k, t in tensors.items() if k.startswith(ORACLE_PREFIX)}
        out.append((rel, Case(record["case"], inputs, dict(record["config"])), stored))
    return out


def verify_rows(
    golden: Path | GoldenSet, *, modules: list[str] | None = None, progress: Progress | None = None
) -> list[dict[str, Any]]:
    """Rows judging every registered implementation on the goldens: a folder, read once, or the
    :func:`snapshot` that :func:`check` judged. A set with problems is refused (``GoldenError``):
    nothing is judged against files the check did not pass.

    Per golden file: one ``oracle`` row (today's fp64 oracle on the stored inputs against the
    stored output, rule fp64-agreement: the definition has not drifted), then one row per
    implementation whose cases include the file's case, judged against the stored output.
    A registered module without goldens, or an implementation case no golden stands in for,
    is a failed row that says to regenerate.
    """
    goldens = _checked(golden)
    rows = []
    skipped = goldens.manifest["skipped"]
    for entry in registry.select(modules):
        cases = load_cases(goldens, entry.name)
        if not cases and not any(s["module"] == entry.name for s in skipped.values()):
            rows.append(_missing_row(entry.name, "-", f"no goldens for module {entry.name!r} in {goldens.directory}"))
            continue
        rows += _oracle_rows(entry, cases, progress)
        for impl in entry.implementations():
            for wanted in impl.cases:
                matching = [(rel, c, o) for rel, c, o in cases if registry.golden_case_kind(c.name) == wanted]
                too_large = skipped.get(f"{entry.name}/{wanted}")
                if too_large:
                    rows.append(_unstored_row(impl, wanted, too_large["reason"], entry.direction))
                elif not matching:
                    rows.append(runner.row_header(impl, Case(wanted, {}), entry.direction) | _missing(
                        f"{impl.label}: no golden case for {wanted!r}"))
                for rel, case, stored in matching:
                    if progress:
                        progress(f"{impl.label} on {rel}")
                    rows.append(runner.verify(entry, impl, case, oracle=stored) | {"golden": rel})
    return rows


def oracle_rows(golden: Path | GoldenSet, *, modules: list[str] | None = None,
                progress: Progress | None = None) -> list[dict[str, Any]]:
    """One ``oracle`` row per golden file of the selected modules: today's fp64 oracle on the
    stored inputs against the stored outputs (fp64-agreement, every named output), once the set
    is intact as stored (digests, hashes, headers; a problem is a ``GoldenError``; regenerating
    the cases is ``golden verify``'s work). ``k3verify run`` starts with these: every verdict it
    gives rests on an oracle that still computes what was committed."""
    goldens = _checked(golden, _storage_problems)
    return [row for entry in registry.select(modules)
            for row in _oracle_rows(entry, load_cases(goldens, entry.name), progress)]


def _checked(golden: Path | GoldenSet,
             find: Callable[[GoldenSet], list[str]] = check) -> GoldenSet:
    """The set, read once, if ``find`` (default :func:`check`) finds nothing wrong with it;
    ``GoldenError`` otherwise."""
    goldens = _as_set(golden)
    problems = find(goldens)
    if problems:
        raise GoldenError(f"{problems[0]} (and {len(problems) - 1} more problem(s)); the goldens do not check out")
    return goldens


def _oracle_rows(entry: ModuleEntry, cases: list[tuple[str, Case, Outputs]],
                 progress: Progress | None) -> list[dict[str, Any]]:
    rows = []
    for rel, case, stored in cases:
        if progress:
            progress(f"{entry.name} oracle on {rel}")
        rows.append(_oracle_row(entry, case, stored, rel))
    return rows


def _oracle_row(entry: ModuleEntry, case: Case, stored: Outputs, rel: str) -> dict[str, Any]:
    """Today's oracle against the stored one, output by output (fp64-agreement; integer outputs
    such as expert sets exactly); the row reports the worst. An output only one side has fails."""
    today = as_outputs(entry.oracle(case), entry.outputs, f"the {entry.name} oracle")
    names = [n for n in entry.outputs if n in today or n in stored]
    verdicts = [_agree(name, today.get(name), stored.get(name)) for name in names]
    verdict = max(verdicts, key=lambda v: (v.status == FAIL, v.err))
    return Row(module=entry.name, implementation="oracle", form="definition", dtype="fp64", case=case.name,
               status=verdict.status, rule=FP64_RULE, case_params=dict(case.params), golden=rel,
               verdict=VerdictRecord(**verdict.as_dict()), margin=verdict.margin,
               direction=None if entry.direction == "forward" else entry.direction).to_json()


def _agree(name: str, today: torch.Tensor | None, stored: torch.Tensor | None) -> Verdict:
    if today is None:
        return Verdict(FAIL, FP64_RULE, "rel_max", math.inf, 0.0, -math.inf, f"the oracle no longer makes {name!r}")
    if stored is None:
        return Verdict(FAIL, FP64_RULE, "rel_max", math.inf, 0.0, -math.inf, f"the golden file has no {name!r}")
    today = today.detach().cpu()
    if today.is_floating_point():
        today = today.to(torch.float64)
    return POLICY[FP64_RULE].judge(today, stored).verdict


def _unstored_row(impl: Implementation, case: str, reason: str, direction: str = "forward") -> dict[str, Any]:
    return runner.row_header(impl, Case(case, {}), direction) | {"status": runner.UNAVAILABLE,
                                                                  "reason": f"golden case not stored: {reason}"}


def _missing(reason: str) -> dict[str, Any]:
    return {"status": FAIL, "reason": f"{reason}; run `k3verify golden generate`"}


def _missing_row(module: str, case: str, reason: str) -> dict[str, Any]:
    return Row(module=module, implementation="-", form="-", dtype="-", case=case, rule="-",
               **_missing(reason)).to_json()
