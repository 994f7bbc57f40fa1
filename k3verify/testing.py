"""Assertions for your own test suite, in the spirit of ``torch.testing.assert_close``: judge a
kernel against k3verify's fp64 oracle under the same policy as ``k3verify run``.

    import torch
    from k3verify.testing import assert_matches_oracle

    def test_my_kda_kernel():
        assert_matches_oracle(my_kda, module="kda", dtype=torch.bfloat16)

``fn`` takes the module forms' signature (KDA: ``fn(q, k, v, g, beta, *, scale=None,
initial_state=None, output_final_state=False, **options) -> (o, final_state)``; see
``docs/modules/<module>.md``). Every named output is judged (KDA's ``o`` and ``final_state``):
by the ``baseline`` rule against the naive same-dtype form for narrow dtypes, by
fp64-agreement for fp64. A failure raises ``AssertionError`` naming the case, the output, the
rule, err, limit and margin, the worst element (index, got, expected) and the mismatch
fraction (elements off by more than the allowed RMS error). ``strategy(module)`` gives a
Hypothesis strategy of cases, and the pytest plugin (installed with k3verify) a fixture:

    from hypothesis import given
    from k3verify.testing import assert_matches_oracle, strategy

    @given(case=strategy("kda"))
    def test_my_kda_kernel_on_any_case(case):
        assert_matches_oracle(my_kda, module="kda", dtype=torch.bfloat16, cases=[case])
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .harness import registry, report, runner
from .harness.registry import BASELINE_RULE, Case, Implementation, as_outputs
from .numerics import FAIL, POLICY, compare, dtype_name, resolve_dtype, rule_for, where_text, worst_element

__all__ = ["assert_matches_oracle", "cases", "strategy"]

# Seconds one call of a user's function may take before its case fails (``timeout=``).
DEFAULT_TIMEOUT_S = 600.0


def cases(module: str, names: Sequence[str] | None = None, *, seed: int = 0) -> list[Case]:
    """The module's built-in cases (all of them, or those named), as ``k3verify run`` makes them."""
    made = registry.get(module).make_cases(seed)
    if names is None:
        return list(made.values())
    unknown = [n for n in names if n not in made]
    if unknown:
        raise KeyError(f"{module} has no case {', '.join(map(repr, unknown))}; its cases: {', '.join(made)}")
    return [made[n] for n in names]


def strategy(module: str) -> Any:
    """A Hypothesis strategy of ``module``'s cases (sizes shrink toward the smallest; needs
    ``hypothesis``)."""
    entry = registry.get(module)
    if entry.strategy is None:
        raise NotImplementedError(f"module {module!r} has no case strategy")
    try:
        drawn = entry.strategy()
    except ModuleNotFoundError as exc:
        if exc.name != "hypothesis":
            raise
        raise ModuleNotFoundError("k3verify.testing.strategy draws cases with Hypothesis, which the test extra "
                                  "installs: pip install 'k3verify[test]'", name="hypothesis") from exc
    return drawn.map(lambda sample: Case("drawn", sample[0], dict(sample[1])))


def _as_cases(module: str, given: Iterable[Case | str | tuple] | None, seed: int) -> list[Case]:
    if given is None:
        made = registry.get(module).make_cases(seed)
        return [made["default"]] if "default" in made else [next(iter(made.values()))]
    out = []
    for c in given:
        if isinstance(c, Case):
            out.append(c)
        elif isinstance(c, str):
            out += cases(module, [c], seed=seed)
        elif isinstance(c, tuple) and len(c) == 2:
            out.append(Case("given", c[0], dict(c[1])))
        else:
            kind = type(c).__name__
            raise TypeError(f"a case is a k3verify Case, a case name or an (inputs, params) pair; got {kind}")
    return out


def _takes_cotangents(fn: Callable[..., Any], cotangent: str = "do") -> bool:
    """Whether ``fn`` is a backward (it takes the ``cotangent`` keyword, ``do`` for KDA and MLA), not
    a forward to differentiate."""
    try:
        return cotangent in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: take it as a backward, as called
        return True


def _directed(module: str, direction: str) -> str:
    """The registry name of ``module``'s ``direction`` pass (``kda`` backward: ``kda_backward``)."""
    if direction == "forward":
        return module
    if direction != "backward":
        raise ValueError(f"direction is 'forward' or 'backward', not {direction!r}")
    name = module if module.endswith("_backward") else f"{module}_backward"
    if name not in registry.module_names(opt_in=True):
        raise ValueError(f"module {module!r} has no backward pass registered (modules with one: "
                         f"{', '.join(n for n in registry.module_names(opt_in=True) if n.endswith('_backward'))})")
    return name


def assert_matches_oracle(
    fn: Callable[..., Any],
    module: str,
    dtype: torch.dtype | str = torch.bfloat16,
    cases: Iterable[Case | str | tuple] | None = None,
    *,
    baseline: str = "recurrent",
    seed: int = 0,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    direction: str = "forward",
    **options: Any,
) -> list[dict[str, Any]]:
    """Run ``fn`` on each case with inputs in ``dtype`` and judge every named output against the
    fp64 oracle; raise ``AssertionError`` describing every failing output, else return the rows.

    ``direction="backward"`` judges a backward instead (module ``<module>_backward``), against
    autograd through the fp64 definition: either ``fn`` takes the forward's arguments and the
    cotangents as keywords (``do``, ``dht`` for KDA) and returns the gradients by name (``dq``,
    ``dk``, ...), or, when it takes no ``do``, it is a differentiable forward (the forward
    module's signature and outputs) whose gradients autograd computes.

    ``baseline`` names the algorithm family of the same-dtype baseline (``"chunkwise"`` holds a
    chunked kernel to what a plain chunked implementation achieves); ``options`` go to ``fn``.

    ``fn`` gets copies of each case's inputs, after every oracle and baseline has been computed;
    a call that raises (``SystemExit`` included), returns something other than the module's
    outputs, leaves a process-wide torch setting changed (put back, and named) or takes longer
    than ``timeout`` seconds (``None``: no limit, and ``fn`` runs in the calling thread) fails its
    case. An empty ``cases`` is a ``ValueError``: nothing would be judged.
    """
    __tracebackhide__ = True  # pytest shows the caller's line, not this function's source
    module = _directed(module, direction)
    entry = registry.get(module)
    if entry.from_forward is not None and not _takes_cotangents(fn, entry.cotangent):
        fn = entry.from_forward(fn)
    if entry.call is None:
        raise NotImplementedError(f"module {module!r} has no calling convention for user functions")
    if timeout is not None and not (isinstance(timeout, (int, float)) and 0 < timeout < math.inf):
        raise ValueError(f"timeout is a positive number of seconds or None, not {timeout!r}")
    torch_dtype = resolve_dtype(dtype)
    name = dtype_name(torch_dtype)
    chosen = _as_cases(module, cases, seed)
    if not chosen:
        raise ValueError("no cases given: nothing would be judged (leave cases out for the module's default case)")
    rule = rule_for(name)
    seen: dict[str, torch.Tensor] = {}  # what fn returned for the case being judged

    def run(case: Case) -> dict[str, torch.Tensor]:
        out = as_outputs(_within(timeout, lambda: entry.call(fn, case, torch_dtype, **options), _name(fn)),
                         entry.outputs, _name(fn))
        seen.update({k: v.detach() if v.is_meta else v.detach().cpu() for k, v in out.items()})
        return out

    impl = Implementation(module=module, implementation=_name(fn), form="user", dtype=name, params=dict(options),
                          rule=rule, run=run, baseline=baseline, source="user function")
    family = entry.baseline_family(impl)
    # Every oracle and baseline is computed before fn first runs: whatever fn changes in this
    # process (k3verify's own functions patched, say) cannot reach the references it is judged by.
    others = [f for f in entry.baseline_families if f != baseline] if rule == BASELINE_RULE else []
    for case in chosen:
        entry.oracle(case)
        for f in [family, *others] if rule == BASELINE_RULE else []:
            entry.baseline(case, name, entry.baseline_family(dataclasses.replace(impl, baseline=f)))
    rows, returned = [], []
    for case in chosen:
        seen.clear()
        rows.append(runner.verify(entry, impl, case))
        returned.append(dict(seen))
    problems = []
    for case, row, got in zip(chosen, rows, returned):
        if row["status"] != FAIL:
            continue
        if "outputs" not in row:  # it raised, or returned the wrong outputs
            problems.append(f"case {case.name!r}: {row.get('reason')}")
            continue
        ref = as_outputs(entry.oracle(case), entry.outputs, "the oracle")
        for out_name, judged in row["outputs"].items():
            if judged["status"] == FAIL:
                problems.append(_describe(case, out_name, judged, got.get(out_name), ref[out_name],
                                          tuple(entry.output_axes.get(out_name, ())))
                                + (report.worst_position(row) if out_name == entry.primary else "")
                                + _other_families(entry, impl, case, out_name, judged, got.get(out_name), others))
    if problems:
        judged_by = f" (judged by the {family!r} baseline)" if rule == BASELINE_RULE else ""
        raise AssertionError(f"{_name(fn)} does not match the {module} oracle in {name}{judged_by}:\n"
                             + "\n".join(problems))
    return rows


def _other_families(entry: Any, impl: Implementation, case: Case, output: str, judged: dict[str, Any],
                    got: torch.Tensor | None, others: list[str]) -> str:
    """What the baseline rule says of a failing output against each other baseline family
    (``baseline="chunkwise"`` for a chunked kernel judged by the recurrent baseline, say)."""
    verdict = judged["verdict"]
    if got is None or verdict["rule"] != BASELINE_RULE or not others:
        return ""
    ref = as_outputs(entry.oracle(case), entry.outputs, "the oracle")[output]
    if got.shape != ref.shape or not ref.is_floating_point():
        return ""
    metrics = compare(got, ref, ulp_dtype=impl.dtype)
    samples = entry.samples_of(output, ref.shape, case.params)
    said = []
    for f in others:
        family = entry.baseline_family(dataclasses.replace(impl, baseline=f))
        base = as_outputs(entry.baseline(case, impl.dtype, family), entry.outputs, "the baseline")[output]
        v = POLICY[BASELINE_RULE].judge(got, ref, dtype=impl.dtype, baseline=base, metrics=metrics, rms_n=samples.rms,
                                        bias_n=samples.bias).verdict
        said.append(f"against baseline={f!r} it would {'pass' if v.passed else 'fail'} ({v.reason})")
    return "; " + "; ".join(said)


def _within(timeout: float | None, call: Callable[[], Any], who: str) -> Any:
    """``call()``; with a ``timeout``, in a worker thread that may take that long (a hung kernel
    becomes a ``TimeoutError`` of its case; the thread cannot be stopped and is left behind).
    The thread inherits the caller's grad mode, CUDA device and stream, which torch keeps per
    thread."""
    if timeout is None:
        return call()
    result: dict[str, Any] = {}
    grad = torch.is_grad_enabled()
    stream = torch.cuda.current_stream() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def work() -> None:
        try:
            with torch.set_grad_enabled(grad), contextlib.ExitStack() as scope:
                if stream is not None:  # the caller's device and stream, which torch keeps per thread
                    torch.cuda.set_device(stream.device)
                    scope.enter_context(torch.cuda.stream(stream))
                result["value"] = call()
        except BaseException as exc:  # handed to the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=work, name=f"k3verify: {who}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{who} did not return within {timeout:g} s (timeout=)")
    if "error" in result:
        raise result["error"]
    return result["value"]


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _describe(case: Case, output: str, judged: dict[str, Any], got: torch.Tensor | None, ref: torch.Tensor,
              axes: tuple[str, ...] = ()) -> str:
    """One failing output: rule, err, limit, margin, worst element, mismatch fraction."""
    v = judged["verdict"]
    head = (f"case {case.name!r}, output {output!r}: rule {v['rule']}: {v['reason']} "
            f"(err {_f(v['err'])}, limit {_f(v['limit'])}, margin {_f(v['margin'])})")
    if got is None or got.shape != ref.shape:
        return head + f"; shape {None if got is None else list(got.shape)} vs expected {list(ref.shape)}"
    x, r = got.to(torch.float64), ref.to(torch.float64)
    diff = (x - r).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    allowed = (v["limit"] if isinstance(v.get("limit"), float) and math.isfinite(v["limit"]) else 0.0) * \
        float(r.pow(2).mean().sqrt()) if r.is_floating_point() and r.numel() else 0.0
    fraction = float((diff > allowed).double().mean()) if diff.numel() else 0.0
    w = judged.get("worst") or worst_element(x, r, axes)
    worst = (f"; worst element at {where_text(w['index'], w['axes'])}: got {_f(w['got'])}, expected "
             f"{_f(w['expected'])} (|diff| {_f(w['abs_diff'])})") if r.numel() else ""
    return head + worst + f"; mismatch fraction {fraction:.3%} (elements off by more than limit x rms(oracle))"


def _f(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, (int, float)) and x is not None else str(x)
