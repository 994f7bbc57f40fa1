"""k3verify.testing, the API for users' own test suites, and its pytest plugin: a correct kernel
passes, a kernel 1 % off fails with a message that gives the rule, err, limit, margin, the worst
element and the mismatch fraction, and every named output is judged (a correct ``o`` with a
wrong ``final_state`` fails). Rules: the baseline rule (fp32, bf16) as ``k3verify run`` applies
it; the messages are checked structurally."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings

from k3verify import kda
from k3verify.harness import registry
from k3verify.numerics import FAIL, baseline_rule, compare, noise_floor
from k3verify.testing import assert_matches_oracle, cases, strategy


def test_a_correct_kernel_passes_through_the_plugin_fixture(k3verify_oracle) -> None:
    rows = k3verify_oracle.assert_matches(kda.chunkwise, module="kda", dtype=torch.bfloat16, baseline="chunkwise")
    assert [r["status"] for r in rows] == ["pass"]
    assert set(rows[0]["outputs"]) == {"o", "final_state"}


def _scaled(q, k, v, g, beta, *, o_gain: float = 1.0, state_gain: float = 1.0, **kw):
    o, S = kda.chunkwise(q, k, v, g, beta, **kw)
    return o * o_gain, S * state_gain


def test_a_kernel_one_percent_off_fails_with_a_readable_message() -> None:
    with pytest.raises(AssertionError) as info:
        assert_matches_oracle(partial(_scaled, o_gain=1.01), "kda", torch.float32, baseline="chunkwise")
    message = str(info.value)
    for part in ("output 'o'", "rule baseline", "err ", "limit ", "margin ", "worst element at [b=", ", t=",
                 ", h=", ", v=", "got ", "expected ", "mismatch fraction", "worst position "):
        assert part in message, (part, message)
    assert "output 'final_state'" not in message


def test_a_wrong_final_state_fails_even_with_a_correct_output() -> None:
    with pytest.raises(AssertionError, match="output 'final_state'") as info:
        assert_matches_oracle(partial(_scaled, state_gain=1.01), "kda", torch.float32, baseline="chunkwise")
    assert "output 'o'" not in str(info.value)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(case=strategy("kda"))
def test_a_property_test_in_three_lines(case) -> None:
    """Rule: baseline (fp32, chunkwise family), on drawn cases."""
    assert_matches_oracle(kda.chunkwise, "kda", torch.float32, cases=[case], baseline="chunkwise")


def test_unwritten_memory_reads_as_nan() -> None:
    """The autouse NaN-poisoned-memory fixture (properties/conftest.py): a k3verify function that
    leaves an allocated slot unwritten returns NaN there, so its test fails."""
    scope = {"__name__": "k3verify.example", "torch": torch}
    exec("def partial_copy(x):\n    out = torch.empty_like(x)\n    out[:-1] = x[:-1]\n    return out\n", scope)
    y = scope["partial_copy"](torch.ones(4))
    assert bool(torch.isnan(y[-1])) and not bool(torch.isnan(y[:-1]).any())


# --- what a kernel under test cannot do (rules: structural, and the baseline rule for the kernels) ---


def test_no_cases_is_an_error_not_a_pass() -> None:
    with pytest.raises(ValueError, match="no cases given"):
        assert_matches_oracle(lambda *a, **k: None, "kda", torch.float32, cases=[])


@pytest.mark.parametrize(("returned", "message"), [(None, "returned a NoneType"), ("list", "returned a list")])
def test_a_kernel_must_return_the_forms_outputs(returned: object, message: str) -> None:
    def fn(*args, **kw):
        return list(kda.chunkwise(*args, **kw)) if returned == "list" else returned

    with pytest.raises(AssertionError, match=message):
        assert_matches_oracle(fn, "kda", torch.float32, baseline="chunkwise")


BROKEN_OUTPUTS = {
    "wrong shape": (lambda o: o[..., :-1], r"output 'o': cannot compare shape \(2, 200, 2, 127\)"),
    "wrong dtype": (lambda o: o.to(torch.int32), r"output 'o': unsupported dtype torch.int32"),
    "meta tensor": (lambda o: o.to("meta"), r"output 'o': a meta tensor, which holds no values"),
}


@pytest.mark.parametrize("broken", list(BROKEN_OUTPUTS))
def test_a_broken_output_is_an_assertion_with_its_reason(broken: str) -> None:
    """Never a ValueError from the harness: the failure is the kernel's, and says what is wrong."""
    change, message = BROKEN_OUTPUTS[broken]

    def fn(*args, **kw):
        o, s = kda.chunkwise(*args, **kw)
        return change(o), s

    with pytest.raises(AssertionError, match=message):
        assert_matches_oracle(fn, "kda", torch.float32, baseline="chunkwise")


def test_a_kernel_that_raises_is_an_assertion_with_its_exception() -> None:
    def fn(*args, **kw):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(AssertionError, match="RuntimeError: CUDA error: an illegal memory access"):
        assert_matches_oracle(fn, "kda", torch.float32, baseline="chunkwise")


def test_a_hung_kernel_fails_its_case_after_the_timeout() -> None:
    release = threading.Event()

    def hung(*args, **kw):
        release.wait(60)
        return kda.chunkwise(*args, **kw)

    start = time.perf_counter()
    try:
        with pytest.raises(AssertionError, match=r"did not return within 0\.5 s"):
            assert_matches_oracle(hung, "kda", torch.float32, baseline="chunkwise", timeout=0.5)
    finally:
        release.set()
    assert time.perf_counter() - start < 30


def test_sys_exit_in_a_kernel_fails_its_case() -> None:
    def exits(*args, **kw):
        sys.exit(0)

    with pytest.raises(AssertionError, match=r"called sys.exit\(0\)"):
        assert_matches_oracle(exits, "kda", torch.float32, baseline="chunkwise", timeout=None)


@pytest.mark.parametrize("timeout", [None, 60.0], ids=["calling thread", "worker thread"])
def test_a_kernel_that_flips_global_torch_state_fails_and_the_state_is_restored(timeout: float | None) -> None:
    """Flush-to-zero is per thread (a worker thread's flip dies with it); the default dtype is
    per process and is caught either way."""
    def flips(*args, **kw):
        out = kda.chunkwise(*args, **kw)
        torch.set_flush_denormal(True)
        torch.set_default_dtype(torch.float64)
        return out

    with pytest.raises(AssertionError, match="changed process-wide torch settings") as info:
        assert_matches_oracle(flips, "kda", torch.float32, baseline="chunkwise", timeout=timeout)
    assert "default dtype: torch.float32 -> torch.float64" in str(info.value)
    assert ("flush denormals: False -> True" in str(info.value)) == (timeout is None)
    assert torch.get_default_dtype() == torch.float32
    assert (torch.tensor(1e-40, dtype=torch.float32) * 1.0).item() != 0.0


def test_patching_the_definition_on_the_first_call_cannot_make_a_wrong_kernel_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def wrong_everywhere(*args, **kw):
        monkeypatch.setattr(kda, "recurrent", partial(_scaled, o_gain=1.05))
        return _scaled(*args, o_gain=1.05, **kw)

    with pytest.raises(AssertionError, match="case 'small', output 'o'"):
        assert_matches_oracle(wrong_everywhere, "kda", torch.float32, cases=["default", "small"], baseline="chunkwise")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_a_kernel_that_writes_into_its_inputs_fails_and_changes_no_case(dtype: torch.dtype) -> None:
    """Correct outputs, then q written in place: at fp64 (no cast between the case and the kernel)
    and at the cast dtypes alike the call fails naming q, the case keeps its inputs, and the
    correct kernel after it passes on the same case."""
    (case,) = cases("kda", ["default"])
    q = case.inputs["q"].clone()

    def writes(q_, k, v, g, beta, **kw):
        out = kda.chunkwise(q_, k, v, g, beta, **kw)
        q_[0, 3].mul_(2.0)
        return out

    with pytest.raises(AssertionError, match=r"modified its input q in place \(\d+ of \d+ elements changed\)"):
        assert_matches_oracle(writes, "kda", dtype, cases=[case], baseline="chunkwise")
    assert torch.equal(case.inputs["q"], q)
    assert_matches_oracle(kda.chunkwise, "kda", dtype, cases=[case], baseline="chunkwise")


def test_a_kernel_that_returns_its_input_fails() -> None:
    """An output in an input's memory (here the initial state handed back as the final state,
    right only when nothing happened): named, a failure."""
    (case,) = cases("kda", ["default"])

    def hands_back(q, k, v, g, beta, initial_state=None, **kw):
        o, _ = kda.chunkwise(q, k, v, g, beta, initial_state=initial_state, **kw)
        return o, initial_state

    with pytest.raises(AssertionError, match=r"returned result\[1\] in the memory of its input initial_state"):
        assert_matches_oracle(hands_back, "kda", torch.float64, cases=[case])


@pytest.mark.parametrize("chunk", [50, 100])
def test_a_chunked_kernel_is_judged_by_the_chunkwise_baseline_at_its_chunk_size(chunk: int) -> None:
    """Rule: baseline (fp32, the chunkwise family at the kernel's own chunk size). A correct
    chunked form at chunk 50 or 100 fails final_state against the chunk-64 baseline on the
    default case (its fp32 cancellation in G_r - G_c is not chunk 64's); against the baseline at
    its own chunk size it passes, and its row says which baseline judged it."""
    (row,) = assert_matches_oracle(kda.chunkwise, "kda", torch.float32, baseline="chunkwise", chunk_size=chunk)
    assert row["baseline_form"] == f"chunkwise/{chunk}"
    entry = registry.get("kda")
    (case,) = cases("kda", ["default"])
    x = {n: t.float() for n, t in case.inputs.items()}
    _, state = kda.chunkwise(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                             output_final_state=True, chunk_size=chunk)
    ref = entry.oracle(case)["final_state"]
    at_64 = compare(entry.baseline(case, "fp32", "chunkwise")["final_state"], ref, ulp_dtype="fp32")
    assert baseline_rule(compare(state, ref, ulp_dtype="fp32"), at_64, noise_floor(ref, torch.float32)).status == FAIL


def test_a_failure_says_which_baseline_judged_it_and_what_the_other_says() -> None:
    """The chunkwise form judged by the default (recurrent) baseline fails at fp32; the message
    names that baseline and says that baseline="chunkwise" would pass."""
    with pytest.raises(AssertionError) as info:
        assert_matches_oracle(kda.chunkwise, "kda", torch.float32)
    message = str(info.value)
    assert "(judged by the 'recurrent' baseline)" in message
    assert "against baseline='chunkwise' it would pass" in message


def test_a_missing_hypothesis_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Hypothesis, ``strategy`` says which extra installs it instead of a bare import error."""
    from k3verify import testing

    for name in [m for m in sys.modules if m == "hypothesis" or m.startswith("hypothesis.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "hypothesis", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'k3verify\[test\]'"):
        testing.strategy("mla")


def test_pytest_shows_the_callers_line_not_the_librarys(tmp_path: Path) -> None:
    """A failing ``assert_matches_oracle`` in a user's test: pytest's traceback ends at the
    user's call (the library frames are hidden), with the failure message."""
    test = tmp_path / "test_user.py"
    test.write_text(
        "import torch\n"
        "from k3verify import kda\n"
        "from k3verify.testing import assert_matches_oracle\n\n"
        "def off(q, k, v, g, beta, **kw):\n"
        "    o, s = kda.chunkwise(q, k, v, g, beta, **kw)\n"
        "    return o * 1.01, s\n\n"
        "def test_mine():\n"
        "    assert_matches_oracle(off, 'kda', torch.float32, baseline='chunkwise', timeout=None)\n"
    )
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 1, done.stdout[-2000:]
    assert "assert_matches_oracle(off, 'kda'" in done.stdout and "does not match the kda oracle" in done.stdout
    assert "def assert_matches_oracle(" not in done.stdout and "__tracebackhide__" not in done.stdout


def test_the_pytest_fixture_judges_a_backward(k3verify_oracle) -> None:
    """The ``k3verify_oracle`` fixture passes ``direction`` on: KDA's tiled backward in bf16 is
    judged on the packed case's gradients (rule: baseline, the chunkwise family)."""
    from k3verify.kda.tiled import tiled_backward as kda_tiled_backward

    rows = k3verify_oracle.assert_matches(kda_tiled_backward, module="kda", direction="backward", baseline="chunkwise",
                                          cases=["packed"], timeout=None)
    assert [r["case"] for r in rows] == ["packed"] and rows[0]["direction"] == "backward"
    assert set(rows[0]["outputs"]) == {"dq", "dk", "dv", "dg", "dbeta", "dh0"}
