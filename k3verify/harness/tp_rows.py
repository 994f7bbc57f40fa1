"""The rows of ``k3verify run --tp N``: every module's layer sharded over ``N`` real ranks
(:mod:`k3verify.harness.tp`), judged against the unsharded layer like any other row.

Per module one launch runs three variants, each a row (implementation ``k3verify``, form
``sharded``; params ``tp``, ``backend``, ``reduce``, ``size``):

- ``fp64``, all-reduce in fp64: fp64-agreement with the unsharded fp64 layer (the oracle);
- ``bf16``, all-reduce in fp32 and in bf16: the baseline rule against the unsharded layer
  storing bf16 (what one device computes), so the two rows show what a bf16 reduction costs.

The rows' case ``layer`` is built by the module's ``make_call(size, seed, N)`` in the parent and
in every rank alike (only a recipe travels: K3-width weights are gigabytes). A rank that raises,
dies or hangs fails its module's three rows with the reason; the other modules still report.
"""

from __future__ import annotations

import dataclasses
import resource
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ..numerics import map_tensors, rule_for
from .registry import Case, Implementation, ModuleEntry, Outputs, ShardedForm
from .tp import RankFailure, resolve_target, run_calls

CASE = "layer"
SIZES = ("small", "k3")
BACKENDS = ("gloo", "nccl")
# (dtype, reduce dtype): the fp64 oracle row, then bf16 with an fp32 and a bf16 all-reduce.
VARIANTS = (("fp64", "fp64"), ("bf16", "fp32"), ("bf16", "bf16"))
# Each rank is a process of its own; K3 shards over 8. More than this is a typo, not a test.
MAX_WORLD_SIZE = 256
# Beyond a day a launch is hung, not slow (and gloo keeps its timeout in a C int of milliseconds).
MAX_TIMEOUT_S = 86_400.0
# What one rank process holds at its peak, measured on the CPU: the interpreter with torch and
# gloo, about 250 MB RSS at small widths; at K3's widths each rank also builds its module's
# whole fp64 call (KDA's 3.6 GB, 5.8 GB at the peak of building it). The parent holds as much.
RANK_BYTES = {"small": 256 * 2**20, "k3": 6 * 2**30}


@dataclass(frozen=True)
class TPOptions:
    """``world_size`` ranks over ``backend``, the module layers at ``size``; a launch that takes
    longer than ``timeout_s`` fails its rows."""

    world_size: int
    backend: str = "gloo"
    size: str = "small"
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"--tp must be a positive integer, got {self.world_size!r}")
        if self.world_size > MAX_WORLD_SIZE:
            raise ValueError(f"--tp {self.world_size} is more than the {MAX_WORLD_SIZE} ranks (processes) k3verify "
                             "starts")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"--tp-timeout must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], "
                             f"got {self.timeout_s!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.size not in SIZES:
            raise ValueError(f"size must be one of {SIZES}, got {self.size!r}")
        if self.backend == "nccl" and torch.cuda.device_count() < self.world_size:
            raise ValueError(f"nccl with {self.world_size} ranks needs {self.world_size} CUDA devices; "
                             f"this machine has {torch.cuda.device_count()} (use --tp-backend gloo)")  # fmt: skip


def check_machine(options: TPOptions, available_bytes: int | None = None) -> None:
    """``ValueError`` naming the limit when this machine cannot hold ``options.world_size``
    ranks and this process (:data:`RANK_BYTES` each at ``options.size``) in the memory it has
    available (``available_bytes``, default MemAvailable of ``/proc/meminfo``; unknown: no
    check), or may not start that many processes (``RLIMIT_NPROC``). Checked before any rank
    starts: ranks that do not fit would be killed one by one, or swap the machine to a halt."""
    available = _mem_available() if available_bytes is None else available_bytes
    per_rank = RANK_BYTES[options.size]
    needed = (options.world_size + 1) * per_rank
    if available is not None and needed > available:
        fits = max(0, available // per_rank - 1)
        raise ValueError(f"--tp {options.world_size} at {options.size} widths needs about {needed / 2**30:.1f} GiB "
                         f"({options.world_size} ranks and this process at {per_rank / 2**30:.2g} GiB each); this "
                         f"machine has {available / 2**30:.1f} GiB available, enough for --tp {fits} at most")
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and options.world_size >= soft:
        raise ValueError(f"--tp {options.world_size} ranks exceed this user's process limit (ulimit -u {soft})")


def _mem_available() -> int | None:
    """MemAvailable of ``/proc/meminfo`` in bytes; ``None`` where the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def default_backend(world_size: int) -> str:
    """NCCL when this machine has a CUDA device per rank, else gloo."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


@dataclass(frozen=True)
class Recipe:
    """What travels to a rank: the module's sharded package, how to build its call, and the variant."""

    package: str
    size: str
    seed: int
    dtype: str
    reduce_dtype: str


def plan(entries: list[ModuleEntry], options: TPOptions) -> list[tuple[ModuleEntry, Implementation, str]]:
    """Every (sharded entry, implementation, case) of a ``--tp`` run: three rows per module that
    has a sharded form, in the entries' order."""
    planned = []
    for entry in entries:
        if entry.sharded is not None:
            tp_entry, impls = _sharded_entry(entry, entry.sharded, options)
            planned += [(tp_entry, impl, CASE) for impl in impls]
    return planned


def _sharded_entry(entry: ModuleEntry, form: ShardedForm,
                   options: TPOptions) -> tuple[ModuleEntry, list[Implementation]]:  # fmt: skip
    """An entry whose case, oracle and baseline are the unsharded layer's, and its rows."""
    make_call = resolve_target(f"{form.package}:make_call")
    unsharded = resolve_target(f"{form.package}:unsharded")

    def make_cases(seed: int) -> dict[str, Case]:
        params = {"size": options.size, "world_size": options.world_size, "seed": seed}
        return {CASE: Case(CASE, {"call": make_call(options.size, seed, options.world_size)}, params)}

    def layer_at(case: Case, dtype: str) -> Outputs:
        key = f"unsharded:{dtype}"
        if key not in case.cache:
            case.cache[key] = unsharded(dataclasses.replace(case.inputs["call"], dtype=dtype))
        return case.cache[key]

    impls = [
        Implementation(
            module=entry.name, implementation="k3verify", form="sharded", dtype=dtype,
            params={"tp": options.world_size, "backend": options.backend, "reduce": reduce, "size": options.size},
            rule=rule_for(dtype),
            run=partial(_variant, form, options, i), cases=(CASE,),
        )
        for i, (dtype, reduce) in enumerate(VARIANTS)
    ]  # fmt: skip
    tp_entry = dataclasses.replace(
        entry, make_cases=make_cases, oracle=lambda case: layer_at(case, "fp64"),
        baseline=lambda case, dtype, family="recurrent": layer_at(case, dtype),
        own_implementations=lambda: impls, outputs=form.outputs, position_axis=form.position_axis, call=None,
        overflow_map=None, golden_cases=None, studies={}, strategy=None, sharded=None,
    )  # fmt: skip
    return tp_entry, impls


def _variant(form: ShardedForm, options: TPOptions, index: int, case: Case) -> Outputs:
    """Variant ``index``'s outputs, from the module's one launch (made by the first row asked)."""
    if "ranks" not in case.cache:
        recipes = [Recipe(form.package, options.size, case.params["seed"], d, r) for d, r in VARIANTS]
        try:
            case.cache["ranks"] = run_calls("k3verify.harness.tp_rows:rank_main", options.world_size, recipes,
                                            backend=options.backend, timeout_s=options.timeout_s)  # fmt: skip
        except RankFailure as exc:  # kept, so the module's other rows fail with it instead of relaunching
            case.cache["ranks"] = exc
    ranks = case.cache["ranks"]
    if isinstance(ranks, Exception):
        raise ranks
    return form.gather(ranks[index])


def replicated(ranks: list[dict[str, torch.Tensor]], name: str) -> torch.Tensor:
    """Rank 0's ``name`` after checking every rank holds the same bits: after an all-reduce each
    rank has the collective's one result and repeats the same arithmetic on it. ``ValueError``
    naming the first rank that differs."""
    first = ranks[0][name]
    for r, got in enumerate(ranks[1:], start=1):
        if not torch.equal(got[name], first):
            diff = (got[name].double() - first.double()).abs().max().item()
            raise ValueError(f"rank {r} holds a different {name!r} than rank 0 (max difference {diff:.3e}): "
                             "the ranks did not compute one result")  # fmt: skip
    return first


_BUILT: dict[tuple, Any] = {}


def rank_main(rank: int, world_size: int, recipe: Recipe) -> dict[str, torch.Tensor]:
    """What a rank runs: build the call (once per process for every variant), move it to this
    rank's GPU under NCCL, run the module's ``rank_forward``; the results on the CPU."""
    key = (recipe.package, recipe.size, recipe.seed)
    if key not in _BUILT:
        _BUILT.clear()  # one module's inputs at a time: K3-width weights are large
        call = resolve_target(f"{recipe.package}:make_call")(recipe.size, recipe.seed, world_size)
        if dist.get_backend() == "nccl":  # moved once, for every variant
            device = torch.device("cuda", torch.cuda.current_device())
            call = map_tensors(call, lambda t: t.to(device))
        _BUILT[key] = call
    call = dataclasses.replace(_BUILT[key], dtype=recipe.dtype, reduce_dtype=recipe.reduce_dtype)
    out = resolve_target(f"{recipe.package}:rank_forward")(rank, world_size, call)
    return map_tensors(out, lambda t: t.detach().cpu())

