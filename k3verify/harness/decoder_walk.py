"""``k3verify walk``: the K3 stack through the policy (docs/decoder.md).

Jobs, each independent of the others (run side by side in worker processes):

- ``walks``: one prefill of the prompt through all layers — the walk of the modules' fp64
  chunkwise forms against the walk of their recurrent definitions (fp64 agreement); the tiled
  low-precision walk against the fp64 walk with the naive same-dtype walk as baseline (the final
  hidden state's row); the depth-drift curves; attribution (one module type at a time in low
  precision) with MLA's fp8 latent cache as a variant; the routing flips of an unpinned walk;
- one job per serving scenario (:data:`~k3verify.decoder.scenarios.SCENARIOS`): its fp64 served
  path against its fp64 definition (fp64 agreement, or bit for bit), and its low-precision served
  path against the fp64 definition with the naive low-precision definition as baseline.

Each job returns plain data: report rows (:class:`~k3verify.harness.rows.Row` as JSON) and its
part of the study document ``decoder_walk.json`` (curves, attribution table, timings).
MoE choices of low-precision runs are pinned to the fp64 run's (docs/decoder.md says why).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path as FilePath
from typing import Any

import torch

from ..decoder import Decoder, DecoderConfig, Form, Plan, fp64_plan, kernel_plan, naive_plan, only, tiled_plan
from ..decoder.config import MODULES
from ..decoder.scenarios import SCENARIOS, Path, RouteBook, Scenario, ScenarioSizes, agreement, check, embeddings
from ..decoder.walks import (
    attribute,
    block_growth,
    first_divergence,
    growth_per_block,
    plant,
    reference_walk,
    rms_ratio,
    walk,
)
from ..numerics import cast_once, held_casts, resolve_dtype
from ..numerics.policy import BASELINE_RULE, FAIL, PASS, POLICY, Verdict
from . import registry
from .files import UsageError
from .guard import InputMutated
from .partial import append_piece, as_json, open_sink, piece_key, read_partial
from .registry import Case, Implementation
from .rows import Row, RowError

MODULE = "decoder"
STUDY_FILE = "decoder_walk.json"
JOBS = ("walks", "attribution", *SCENARIOS)
# Measured order of the jobs' lengths at the CPU configuration, for packing them on few workers.
LONGEST_FIRST = ("speculative", "mixed_batch", "prefill_decode", "page_placement", "walks", "attribution",
                 "chunked_prefill")


PLANS = ("tiled", "kernels")


@dataclass(frozen=True)
class WalkOptions:
    """What ``k3verify walk`` runs: the configuration (``cpu``: all 93 layers at d = 256;
    ``wide``: K3's widths with ``experts`` experts and a pool of ``distinct_layers`` weight sets
    per module type), prompt and decode sizes, the low-precision dtype and ``plan`` (our tiled
    forms, or our kernels), the device, the jobs, and an optional planted bug (``layer:module``)
    whose first divergence the walks job searches."""

    config: str = "cpu"
    prompt: int = 64
    decode: int = 8
    dtype: str = "bf16"
    seed: int = 0
    jobs: tuple[str, ...] = JOBS
    plant: tuple[int, str] | None = None
    num_layers: int | None = None
    plan: str = "tiled"
    device: str = "cpu"
    experts: int = 16
    distinct_layers: int = 2
    use: tuple[str, ...] = ()

    def decoder_config(self) -> DecoderConfig:
        if self.config == "cpu":
            cfg = DecoderConfig.cpu(seed=self.seed)
        elif self.config == "wide":
            cfg = DecoderConfig.wide(num_experts=self.experts, distinct_layers=self.distinct_layers, seed=self.seed)
        else:
            raise ValueError(f"unknown decoder configuration {self.config!r} (known: cpu, wide)")
        if self.plan not in PLANS:
            raise ValueError(f"unknown plan {self.plan!r} (known: {', '.join(PLANS)})")
        return cfg if self.num_layers is None else replace(cfg, num_layers=self.num_layers)

    def sizes(self) -> ScenarioSizes:
        return ScenarioSizes(prompt=self.prompt, decode=self.decode, seed=self.seed)

    def low(self) -> Plan:
        """The low-precision plan judged: our tiled forms or our kernels in ``dtype``, with the
        registered implementations of ``use`` in place of their modules' forms."""
        plan = tiled_plan(self.dtype) if self.plan == "tiled" else kernel_plan(self.dtype)
        if not self.use:
            return plan
        forms = dict(registered_form(label) for label in self.use)
        return plan.with_forms(f"{plan.label} + {', '.join(self.use)}", **forms)

    def decoder(self) -> Decoder:
        return Decoder(self.decoder_config(), device=self.device)


@dataclass
class JobResult:
    """One job's rows (JSON), its part of the study document, and its wall time."""

    name: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    study: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def _verdict_json(v: Verdict) -> dict[str, Any]:
    """A verdict as a report stores it (non-finite numbers as ``None``, the status as its name)."""
    return {k: (None if isinstance(x, float) and not math.isfinite(x) else x) for k, x in v.as_dict().items()
            if k != "status"} | {"status": str(v.status)}


def _row(*, form: str, dtype: str, case: str, outputs: dict[str, Verdict], params: dict[str, Any],
         case_params: dict[str, Any], wall_s: float, explanation: list[str] | None = None) -> dict[str, Any]:
    """A report row judged on ``outputs`` (name → verdict), checked against the row schema; the
    binding output (repeated at the top) is the one with the least margin."""
    binding = min(outputs, key=lambda n: outputs[n].margin if not math.isnan(outputs[n].margin) else -math.inf)
    v = outputs[binding]
    row = {
        "module": MODULE, "implementation": "k3verify", "form": form, "dtype": dtype, "case": case,
        "status": str(PASS if all(o.passed for o in outputs.values()) else FAIL), "rule": v.rule,
        "params": params, "case_params": case_params, "source": "k3verify", "output": binding,
        "outputs": {n: {"status": str(o.status), "margin": _finite(o.margin), "verdict": _verdict_json(o)}
                    for n, o in outputs.items()},
        "verdict": _verdict_json(v), "margin": _finite(v.margin), "wall_s": wall_s,
    }
    if explanation:
        row["explanation"] = explanation
    return Row.from_json(row, where=f"decoder row {form}", strict=True).to_json()


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _baseline(out: torch.Tensor, ref: torch.Tensor, base: torch.Tensor, dtype: str) -> Verdict:
    """The baseline rule over a ``[tokens, d]`` output (a token's row shares its errors)."""
    tokens = int(ref.shape[0])
    return POLICY[BASELINE_RULE].judge(out, ref.double(), dtype=dtype, baseline=base, rms_n=tokens,
                                       bias_n=tokens).verdict


def run_walks(decoder: Decoder, options: WalkOptions) -> JobResult:
    """The walks job (see the module docstring)."""
    t0 = time.perf_counter()
    cfg, dt = decoder.config, options.dtype
    tokens = embeddings(decoder, options.prompt, seed=options.seed + 100)
    case = f"prefill {options.prompt}"
    case_params = {"tokens": options.prompt, "layers": cfg.num_layers, "hidden": cfg.hidden}
    definitions = reference_walk(decoder, fp64_plan("recurrent"), tokens)
    forms = reference_walk(decoder, fp64_plan("chunkwise"), tokens)
    rows = [_row(form="walk/fp64 forms", dtype="fp64", case=case,
                 outputs={"y": agreement(forms.out, definitions.out)},
                 params={"forms": "chunkwise", "definition": "recurrent"}, case_params=case_params,
                 wall_s=time.perf_counter() - t0)]
    worst_h = max(rms_ratio(h, r) for h, r in zip(forms.h, definitions.h))
    low, base = options.low(), naive_plan(dt)
    t1 = time.perf_counter()
    tested = walk(decoder, low, tokens, forms)
    baseline = walk(decoder, base, tokens, forms)
    rows.append(_row(form=f"walk/{low.label}", dtype=dt, case=case,
                     outputs={"y": _baseline(tested.out, forms.out, baseline.out, dt)},
                     params={"baseline": base.label, "routing": "pinned to fp64"}, case_params=case_params,
                     wall_s=time.perf_counter() - t1))
    blocks = cfg.schedule.block_sublayers
    curves = {low.label: tested.h_err, base.label: baseline.h_err}
    study = {
        "fp64": {"forms_vs_definitions": rows[0]["verdict"]["err"], "worst_h": worst_h},
        "depth_drift": {
            "sublayers": [cfg.module_of(s) for s in range(cfg.schedule.num_sublayers)],
            "block_sublayers": blocks,
            "curves": curves,
            "y_curves": {low.label: tested.y_err, base.label: baseline.y_err},
            "block_growth": {k: block_growth(v, blocks) for k, v in curves.items()},
            "growth_per_block": {k: growth_per_block(v, blocks) for k, v in curves.items()},
        },
    }
    if options.plant is not None:
        layer, module = options.plant
        planted = plant(fp64_plan("chunkwise"), layer, module)
        found = first_divergence(decoder, tokens, planted, fp64_plan("chunkwise"))
        study["first_divergence"] = {"planted": {"layer": layer, "module": module}, "found": found.found,
                                     "sublayer": found.sublayer, "layer": found.layer, "module": found.module,
                                     "evaluations": found.evaluations, "description": found.describe()}
    return JobResult("walks", rows, study, time.perf_counter() - t0)


def run_attribution(decoder: Decoder, options: WalkOptions) -> JobResult:
    """The attribution table (one module type at a time in low precision, the rest fp64; MLA
    with an fp8 latent cache as a variant) and the routing flips of an unpinned walk."""
    t0 = time.perf_counter()
    tokens = embeddings(decoder, options.prompt, seed=options.seed + 100)
    base = fp64_plan("chunkwise")
    reference = reference_walk(decoder, base, tokens)
    low = options.low()
    fp8 = replace(low, label=f"{low.label}, fp8 e4m3 latent cache", kv_storage="fp8_e4m3")
    table = attribute(decoder, tokens, low, base, reference, extra={"mla fp8 cache": only("mla", fp8, base)},
                      modules=MODULES)
    unpinned = walk(decoder, low, tokens, reference, pin=False)
    study = {
        "attribution": [{"module": a.module, "label": a.label, "out_err": a.out_err,
                         "share": None if math.isnan(a.share) else a.share} for a in table],
        "routing_flips": {"label": low.label, "fraction": unpinned.flips, "out_err": unpinned.out_err},
    }
    return JobResult("attribution", [], study, time.perf_counter() - t0)


def run_scenario(decoder: Decoder, scenario: Scenario, options: WalkOptions) -> JobResult:
    """One serving scenario's two rows (fp64 and low precision) and its study part."""
    t0 = time.perf_counter()
    sizes, dt = options.sizes(), options.dtype
    checked = check(scenario, decoder, sizes)
    served, definition = checked.served, checked.definition
    case_params = {"detail": scenario.detail(sizes), "layers": decoder.config.num_layers}
    explanation = [f"first token beyond the rule: {checked.where}"] if checked.where else None
    rows = [_row(form=f"serving/{scenario.name}", dtype="fp64", case=scenario.name,
                 outputs={"y": checked.y, "state": checked.state},
                 params={"plan": "fp64 chunkwise", "bitwise": scenario.bitwise},
                 case_params=case_params, wall_s=time.perf_counter() - t0, explanation=explanation)]
    t1 = time.perf_counter()
    pinned = RouteBook(record=False, routes=checked.book.routes)
    low = scenario.served(decoder, options.low(), pinned, sizes)
    base = scenario.definition(decoder, naive_plan(dt), pinned, sizes)
    rows.append(_row(form=f"serving/{scenario.name}", dtype=dt, case=scenario.name,
                     outputs={"y": _baseline(low.out, definition.out, base.out, dt)},
                     params={"plan": options.low().label, "baseline": naive_plan(dt).label,
                             "routing": "pinned to fp64"},
                     case_params=case_params, wall_s=time.perf_counter() - t1))
    study: dict[str, Any] = {"evaluations": served.evaluations + definition.evaluations + low.evaluations
                             + base.evaluations}
    if scenario.name == "prefill_decode":
        study["decode_steps"] = _decode_curve(low, base, definition, options)
    return JobResult(scenario.name, rows, study, time.perf_counter() - t0)


def _decode_curve(low: Path, base: Path, definition: Path, options: WalkOptions) -> dict[str, Any]:
    """Error per token of the served low-precision path (prefill then decode steps) and of the
    baseline, against the fp64 definition: the decode-step curve."""
    per = lambda out: [rms_ratio(out[i], definition.out[i]) for i in range(out.shape[0])]  # noqa: E731
    return {"positions": list(range(options.prompt + options.decode)), "prompt": options.prompt,
            "served": per(low.out), "baseline": per(base.out)}


def run_job(name: str, options: WalkOptions, decoder: Decoder | None = None) -> JobResult:
    """Run job ``name`` (``walks`` or a scenario's name) with a decoder made here if not given."""
    decoder = decoder or _worker_decoder(options)
    # held casts: the weights' casts inside the MoE layers (to the operand dtype, to the device)
    # are made once per job, not at each of its hundreds of calls, and checked once at its end
    with torch.inference_mode(False), held_casts() as casts:
        if name == "walks":
            result = run_walks(decoder, options)
        elif name == "attribution":
            result = run_attribution(decoder, options)
        else:
            result = run_scenario(decoder, SCENARIOS[name], options)
        written = casts.changed()
    if written:
        who = f"--use {', '.join(repr(u) for u in options.use)}" if options.use else "the plan's forms"
        raise UsageError(f"{name}: {who} wrote into weights given to them, behind torch's back (no in-place "
                         f"operation recorded), so later calls computed with other weights: {'; '.join(written)}")
    return result


# The decoder a worker process made, by configuration and device: its weights are drawn once
# per process (3 s at the CPU configuration), not once per job.
_DECODERS: dict[tuple[DecoderConfig, str], Decoder] = {}


def _worker_decoder(options: WalkOptions) -> Decoder:
    key = (options.decoder_config(), options.device)
    if key not in _DECODERS:
        _DECODERS.clear()  # one stack per process: a wide one holds tens of GB
        _DECODERS[key] = options.decoder()
    return _DECODERS[key]


def study_document(options: WalkOptions, config: DecoderConfig, results: Sequence[JobResult]) -> dict[str, Any]:
    """The ``decoder_walk.json`` document from every job's part."""
    doc: dict[str, Any] = {"title": "Decoder walk", "config": config.describe(),
                           "prompt": options.prompt, "decode": options.decode, "dtype": options.dtype,
                           "seconds": {r.name: r.seconds for r in results}, "scenarios": {}}
    for r in results:
        if r.name in ("walks", "attribution"):
            doc.update(r.study)
        else:
            doc["scenarios"][r.name] = {k: v for k, v in r.study.items() if k != "decode_steps"}
            if "decode_steps" in r.study:
                doc["decode_steps"] = r.study["decode_steps"]
    return doc


Progress = Callable[[str], None]


def job_key(options: WalkOptions, name: str, commit: str | None) -> str:
    """The key job ``name``'s result is kept under in a partial file: every option but the job
    list, the job, and the code's version (``commit``)."""
    return piece_key({"options": asdict(replace(options, jobs=())), "job": name, "commit": commit})


def run_all(options: WalkOptions, *, workers: int = 1, progress: Progress | None = None,
            partial: FilePath | None = None, commit: str | None = None,
            doing: Progress | None = None) -> list[JobResult]:
    """Every job of ``options``: in this process (``workers`` 1) or in worker processes; results
    in job order whatever the completion order. With a ``partial`` file (see
    :mod:`~k3verify.harness.partial`), each finished job is appended to it and a job it already
    holds for these options and this code (``commit``) is read back instead of run: a walk cut
    off at width keeps the jobs it finished. In this process, ``doing`` hears what runs now (the
    weights being drawn, then the job, plan and sublayer before every sublayer call); worker
    processes keep that to themselves."""
    say = progress or (lambda _: None)
    names = [j for j in JOBS if j in options.jobs]
    keys = {job_key(options, n, commit): i for i, n in enumerate(names)}
    found = {names[i]: _resumed(piece, names[i]) for i, piece in read_partial(partial, keys).items()}
    done = {name: result for name, result in found.items() if result is not None}
    for name in done:
        say(f"decoder walk: {len(done)}/{len(names)} jobs done ({name}, from the partial file)")
    sink = open_sink(partial)

    def finished(name: str, result: JobResult) -> None:
        done[name] = JobResult(**as_json(asdict(result)))
        append_piece(sink, job_key(options, name, commit), names.index(name), asdict(done[name]))
        say(f"decoder walk: {len(done)}/{len(names)} jobs done ({name}, {result.seconds:.1f} s)")

    todo = [n for n in names if n not in done]
    try:
        if workers <= 1:
            _in_this_process(options, todo, finished, doing)
        else:
            _run_in_workers(options, todo, workers, finished)
    finally:
        if sink is not None:
            sink.close()
    return [done[n] for n in names]


def _in_this_process(options: WalkOptions, names: list[str], finished: Callable[[str, JobResult], None],
                     doing: Progress | None) -> None:
    """Jobs ``names`` one after another on this process's decoder, ``doing`` told what runs."""
    if not names:
        return
    if doing is not None:
        doing(f"drawing the weights ({options.device})")
    decoder = _worker_decoder(options)
    try:
        for name in names:
            if doing is not None:
                decoder.doing = lambda what, job=name: doing(f"{job}, {what}")
            finished(name, run_job(name, options, decoder))
    finally:
        decoder.doing = None  # the decoder outlives the command (:data:`_DECODERS`)


def _resumed(piece: dict[str, Any], name: str) -> JobResult | None:
    """Job ``name``'s result as a partial file holds it, or ``None`` (the job runs again) when the
    line under its key is not one: other fields, or a row the report schema refuses."""
    if set(piece) != {f.name for f in fields(JobResult)} or piece["name"] != name \
            or not isinstance(piece["rows"], list) or not isinstance(piece["study"], dict) \
            or isinstance(piece["seconds"], bool) or not isinstance(piece["seconds"], (int, float)):
        return None
    try:
        rows = [Row.from_json(row, where=f"resumed row of {name}", strict=True).to_json() for row in piece["rows"]]
    except RowError:
        return None
    return JobResult(name, rows, piece["study"], float(piece["seconds"]))


def _run_in_workers(options: WalkOptions, names: list[str], workers: int,
                    finished: Callable[[str, JobResult], None]) -> None:
    """Jobs ``names`` in ``workers`` spawned processes, ``finished`` called as each one ends."""
    import concurrent.futures
    import multiprocessing

    # The longest jobs first: the walks, then the scenarios with the most steps.
    order = sorted(names, key=lambda n: LONGEST_FIRST.index(n) if n in LONGEST_FIRST else len(LONGEST_FIRST))
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, initializer=_one_thread) as pool:
        futures = {pool.submit(run_job, n, options): n for n in order}
        for f in concurrent.futures.as_completed(futures):
            finished(futures[f], f.result())


def _one_thread() -> None:
    torch.set_num_threads(1)


__all__ = ["JOBS", "STUDY_FILE", "JobResult", "WalkOptions", "run_all", "run_job", "study_document"]


# --- registered implementations in a plan ------------------------------------------------------

BRIDGED = ("kda", "mla", "moe")


def registered_form(label: str) -> tuple[str, Form]:
    """``(module, Form)`` running the registered implementation ``label`` (as ``k3verify list``
    prints it: ``kda/<implementation>:<form>[<dtype> ...]``; plugins included, in their own
    process) wherever the stack runs that module. Each call becomes a case of the module's
    entry (fp64 copies of the inputs on the CPU, as every case is) and the implementation's
    outputs come back in the form's dtype on the stack's device: KDA's ``(o, final_state)``,
    MLA's ``o`` (the layer writes the cache itself), MoE's ``y`` (routed by the entry's router
    on the input it is given, as the implementation's rows are)."""
    module = label.split("/", 1)[0]
    if module not in BRIDGED:
        raise ValueError(f"--use {label!r}: a plan takes registered kda, mla or moe implementations")
    found = [i for i in registry.get(module).implementations() if i.label == label]
    if not found:
        known = ", ".join(i.label for i in registry.get(module).implementations())
        raise ValueError(f"--use {label!r}: no such implementation of {module}; known: {known}")
    impl = found[0]
    reason = impl.unavailable()
    if reason:
        raise ValueError(f"--use {label!r} is unavailable here: {reason}")
    dtype = resolve_dtype(impl.dtype)
    if module == "kda":
        bridge = _kda_bridge(impl)
        # one-token decode steps too: the implementation runs every KDA call of the stack
        return module, Form(label, dtype, bridge, decode=bridge, fp32_state=True)
    if module == "mla":
        return module, Form(label, dtype, _mla_bridge(impl))
    return module, Form(label, dtype, _moe_bridge(impl))


def _call(impl: Implementation, inputs: dict[str, Any]) -> Any:
    """``impl.run`` on one call of the stack; an input it refuses (``ValueError``/``TypeError``,
    the adapters' way of naming a shape, dtype or value they do not compute) ends the walk as a
    usage error naming the implementation and the call, not as k3verify's own failure."""
    try:
        return impl.run(Case("decoder", inputs))
    except (ValueError, TypeError) as exc:
        shapes = ", ".join(f"{n} {list(t.shape)}" for n, t in inputs.items() if isinstance(t, torch.Tensor))
        raise UsageError(f"--use {impl.label!r} refused a call of the stack ({shapes}): {exc}") from exc
    except InputMutated as exc:  # the implementation's failure, not k3verify's
        raise UsageError(f"--use {impl.label!r} {exc}") from exc


def _fp64_cpu(t: Any) -> Any:
    return t.detach().to("cpu", torch.float64) if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def _kda_bridge(impl: Implementation) -> Callable[..., Any]:
    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
           initial_state: torch.Tensor, output_final_state: bool = True, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = {n: _fp64_cpu(t) for n, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                                               ("initial_state", initial_state))}
        out = _call(impl, inputs)
        return out["o"].to(q.device, q.dtype), out["final_state"].to(q.device, torch.float32)
    return fn


def _held(t: torch.Tensor) -> torch.Tensor:
    """A weight ``t`` as an fp64 CPU copy made once per job (:func:`~k3verify.numerics.cast_once`
    inside the job's :func:`~k3verify.numerics.held_casts`): the stack hands the same weights to
    every call, and a wide MoE layer's are 3.6 GB in fp64, which copied at every one of a
    scenario's hundreds of MoE calls kept a walk on the host for tens of minutes. Kept by the job,
    not by the plan, the copy lives to the job's end, where it and every cast made from it are
    checked for writes no in-place operation recorded: copies kept by a plan would die with it,
    before that check, and the casts made from them would go unchecked. Outside a job (a plan
    used on its own) every call gets a fresh copy."""
    return cast_once(t, torch.float64, "cpu", copy=True) if t.is_floating_point() else t


def _mla_bridge(impl: Implementation) -> Callable[..., Any]:
    def fn(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: Any, w_uk: torch.Tensor, w_uv: torch.Tensor,
           **_: Any) -> torch.Tensor:
        cpu = cache.to(torch.float64) if not cache.quantized else cache
        cpu = type(cache)(*(None if t is None else t.to("cpu") for t in (cpu.pool, cpu.block_table, cpu.seq_lens,
                                                                         cpu.scales)))
        inputs = {"q_nope": _fp64_cpu(q_nope), "q_pe": _fp64_cpu(q_pe), "cache": cpu, "w_uk": _held(w_uk),
                  "w_uv": _held(w_uv)}
        return _call(impl, inputs)["o"].to(q_nope.device, q_nope.dtype)
    return fn


def _moe_bridge(impl: Implementation) -> Callable[..., Any]:
    """The stack's MoE call as a case that carries the stack's ``routing`` (pinned to the fp64
    run's choices in every low-precision run): without it the implementation's entry would route
    again on the low-precision input, and the tokens whose choices flip (O(1) each, compounding
    down the stack) would be charged to the implementation's arithmetic. One that routes itself
    and meets other experts cannot stand in a pinned walk: a usage error says so."""
    def fn(x: torch.Tensor, weights: Any, config: Any, *, routing: Any, **_: Any) -> torch.Tensor:
        fp64 = type(weights)(**{n: _held(t) for n, t in weights.tensors().items()})
        pinned = type(routing)(routing.indices.cpu(), *(_fp64_cpu(t) for t in (routing.weights, routing.scores)))
        out = _call(impl, {"x": _fp64_cpu(x), "weights": fp64, "config": config, "routing": pinned})
        # the experts it reports (the module's entry always does; an implementation of one's own may not)
        chosen = out.get("experts", pinned.indices).sort(-1).values
        flipped = int((chosen != pinned.indices.sort(-1).values).any(-1).sum())
        if flipped:
            raise UsageError(f"--use {impl.label!r} chose its own experts for {flipped} of {x.shape[0]} tokens of a "
                             "call: a walk pins every run's expert choices to the fp64 run's (docs/decoder.md), "
                             "so an implementation that routes itself cannot stand in it")
        return out["y"].to(x.device, x.dtype)
    return fn
