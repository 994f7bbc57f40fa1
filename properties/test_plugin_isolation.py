"""Plugins cannot cheat or stop the run: each cheat a plugin package can try, installed for real
(entry points in a site folder), and what k3verify makes of it.

Plugins run in their own process (k3verify.harness.sandbox): one that exits, crashes or hangs
fails its own row, with its reason; one that patches k3verify, reads the case's cached oracle or
flips process-wide torch settings changes neither the verdict of a wrong kernel nor any other
row; one that mutates its inputs fails its row, naming the input, and changes no other row; an
identity registered twice cannot hide a failing row behind a passing twin. Each cheat is checked
against a wrong kernel (it must fail) and the correct one (it must pass), so the isolation is
what decides, not the kernel.

Rules: the correct plugin kernels by the baseline rule (fp32, chunkwise family); the rest
structural (statuses, reasons, exit codes).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from plugin_site import install_plugin

from k3verify.harness import registry, runner, sandbox
from k3verify.numerics import EXPECTED_NONFINITE, FAIL, PASS

ROOT = Path(__file__).resolve().parents[1]
# Seconds a plugin call may take here: a hang costs this much, a loaded CI machine must not.
TIMEOUT_S = 6.0

# Shared by every plugin below: a correct fp32 KDA kernel and a wrong one (a 3 % larger output).
COMMON = """
import os, sys, time
import torch
from k3verify import kda
from k3verify.harness.registry import implementation

def right(*args, **kw):
    return kda.chunkwise(*args, **kw)

def wrong(*args, **kw):
    o, s = kda.chunkwise(*args, **kw)
    return o * 1.03, s * 1.03

def make(name, fn):
    return implementation("kda", fn, name=name, form="chunkwise", dtype="fp32", baseline="chunkwise", chunk_size=64)
"""

PLUGINS = {
    # Loading stops the process: the entry point becomes an unavailable row with its reason.
    "exit_at_load": "def implementations():\n    sys.exit(0)",
    "print_at_load": "def implementations():\n    print('\\x1b[2J\\x1b]52;c;cHduZWQ=\\x07 loaded')\n"
                     "    print('y' * 1000000)\n    print('after')\n    return [make('printer', right)]",
    "exit_in_run": "def implementations():\n    def fn(*a, **k):\n        sys.exit(0)\n    return [make('exits', fn)]",
    "os_exit_in_run": "def implementations():\n    def fn(*a, **k):\n        os._exit(0)\n"
                      "    return [make('os_exits', fn)]",
    "hang_in_run": "def implementations():\n    def fn(*a, **k):\n        time.sleep(10**6)\n"
                   "    return [make('hangs', fn)]",
    # The wrong kernel, with the definition patched at load so that the oracle agrees with it.
    "patch_at_load": """
def implementations():
    def patched(q, k, v, g, beta, **kw):
        o, s = kda.chunkwise(q, k, v, g, beta, **kw)
        return o * 1.03, s * 1.03
    kda.recurrent = patched
    import k3verify.kda.recurrent as module
    module.recurrent = patched
    return [make('patched_at_load', wrong)]
""",
    # The same, patched on the first call (later cases' oracles would be made with the patch).
    "patch_on_call": """
def implementations():
    def fn(*a, **k):
        kda.recurrent = lambda *x, **y: wrong(*x, **y)
        return wrong(*a, **k)
    return [make('patched_on_call', fn)]
""",
    # Broken in the ways a kernel under development is: a dropped column, and parameters that
    # are no JSON (a dtype, a tensor), which the report stores as their repr.
    "misshapen": """
def implementations():
    def fn(*a, **k):
        o, s = right(*a, **k)
        return o[..., :-1], s
    def takes_odd_params(*a, acc=None, scale=None, **k):
        return right(*a, **k)
    return [make('misshapen', fn),
            implementation("kda", takes_odd_params, name="odd_params", form="chunkwise", dtype="fp32",
                           baseline="chunkwise", chunk_size=64, acc=torch.float32, scale=torch.ones(2))]
""",
    # Reads the oracle's outputs out of the case's cache instead of computing anything.
    "oracle_thief": """
from k3verify.harness.registry import Implementation
def implementations():
    def run(case):
        return case.cache["oracle"]
    return [Implementation(module="kda", implementation="thief", form="chunkwise", dtype="fp32", params={},
                           rule="baseline", run=run, baseline="chunkwise")]
""",
    # Correct outputs, but flush-to-zero and the default dtype left changed for whoever runs next.
    "state_flipper": """
def implementations():
    def fn(*a, **k):
        out = right(*a, **k)
        torch.set_flush_denormal(True)
        torch.set_default_dtype(torch.float64)
        return out
    return [make('flips_state', fn)]
""",
    # Correct outputs computed first, then its inputs scaled in place.
    "mutator": """
def implementations():
    def fn(q, k, v, g, beta, **kw):
        out = right(q, k, v, g, beta, **kw)
        for t in (q, k, v, g, beta):
            t.mul_(3.0)
        return out
    return [make('mutates', fn)]
""",
    # Autocast and the newer per-backend fp32 precision left on: every later matmul of the
    # process would run in bf16.
    "precision_leaker": """
def implementations():
    def fn(*a, **k):
        out = right(*a, **k)
        torch.set_autocast_enabled("cpu", True)
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        return out
    return [make('leaks_precision', fn)]
""",
    # Patches, at load, the function its neighbours' kernels call (every plugin here computes
    # with kda.chunkwise): in a process shared with them, their outputs would move 3 %.
    "neighbour_patcher": """
def implementations():
    import k3verify.kda as module
    real = module.chunkwise
    module.chunkwise = lambda *a, **k: tuple(t * 1.03 for t in real(*a, **k))
    return [make('patches_neighbours', right)]
""",
    # NaN everywhere, with a predict of its own that calls it an expected overflow.
    "self_excuser": """
from k3verify.harness.contract import Prediction
def implementations():
    def fn(*a, **k):
        return tuple(torch.full_like(t, float("nan")) for t in right(*a, **k))
    return [implementation("kda", fn, name="excuses_itself", form="chunkwise", dtype="fp32", baseline="chunkwise",
                           chunk_size=64, predict=lambda case: Prediction(False, "trust me"))]
""",
    # One identity twice: the wrong kernel, then the right one under the same name.
    "twice": "def implementations():\n    return [make('twin', wrong), make('twin', right)]",
    # The golden oracle check's name and form: its rows would read as the oracle's.
    "impostor": """
def implementations():
    return [implementation("kda", right, name="oracle", form="definition", dtype="fp64", baseline="chunkwise")]
""",
    "control": "def implementations():\n    return [make('control', right), make('control_wrong', wrong)]",
}


def _install(site: Path, plugins: dict[str, str]) -> None:
    """Each plugin as an importable module with a dist-info folder naming its entry point."""
    for name, body in plugins.items():
        install_plugin(site, dist=f"iso-{name}", module=f"iso_{name}", source=COMMON + textwrap.dedent(body),
                       extends="kda")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("isolation-site")
    # Each plugin package loads in a process of its own: the two that only the command-line
    # tests read (each installs its own site) stay out.
    _install(folder, {k: v for k, v in PLUGINS.items() if k not in ("print_at_load", "misshapen")})
    return folder


@pytest.fixture(scope="module")
def plugged(site: Path) -> Iterator[dict[str, Any]]:
    """The plugins discovered with the site on sys.path, by name; forgotten afterwards."""
    sys.path.insert(0, str(site))
    sandbox.set_timeout(TIMEOUT_S)
    try:
        registry.reload_plugins()
        yield {i.implementation: i for i in registry.plugin_implementations("kda")} | {
            i.form: i for i in registry.plugins() if i.form.startswith("plugin:")}
    finally:
        sys.path.remove(str(site))
        sandbox.set_timeout(sandbox.DEFAULT_TIMEOUT_S)
        registry.reload_plugins()


@pytest.fixture(scope="module")
def entry() -> Any:
    return registry.get("kda")


@pytest.fixture(scope="module")
def case(entry: Any) -> Any:
    return entry.make_cases(0)["default"]


def _row(entry: Any, impl: Any, case: Any) -> dict[str, Any]:
    return runner.verify(entry, impl, case)


def test_the_control_pair_shows_the_kernels_are_told_apart(plugged: dict, entry: Any, case: Any) -> None:
    assert _row(entry, plugged["control"], case)["status"] == PASS
    assert _row(entry, plugged["control_wrong"], case)["status"] == FAIL


def test_exiting_while_loading_is_an_unavailable_row_with_its_reason(plugged: dict) -> None:
    placeholder = next(i for i in registry.plugins() if i.source.startswith("iso-exit_at_load "))
    assert "sys.exit(0)" in (placeholder.unavailable() or "")


@pytest.mark.parametrize(("name", "reason"), [("exits", "sys.exit(0)"), ("os_exits", "exit status 0"),
                                              ("hangs", f"did not finish within {TIMEOUT_S:g} s")])
def test_exits_crashes_and_hangs_fail_their_own_row(plugged: dict, entry: Any, case: Any, name: str,
                                                    reason: str) -> None:
    start = time.perf_counter()
    row = _row(entry, plugged[name], case)
    assert row["status"] == FAIL and reason in row["reason"], row.get("reason")
    assert time.perf_counter() - start < 60
    # The next plugin row runs in a fresh process and is judged as usual.
    assert _row(entry, plugged["control"], case)["status"] == PASS


@pytest.mark.parametrize("name", ["patched_at_load", "patched_on_call"])
def test_patching_k3verify_cannot_make_a_wrong_kernel_pass(plugged: dict, entry: Any, case: Any, name: str) -> None:
    assert _row(entry, plugged[name], case)["status"] == FAIL
    assert _row(entry, plugged[name], entry.make_cases(0)["default"])["status"] == FAIL  # a later, fresh case too
    from k3verify import kda

    assert kda.recurrent.__module__ == "k3verify.kda.recurrent"


def test_the_cached_oracle_is_out_of_reach(plugged: dict, entry: Any, case: Any) -> None:
    entry.oracle(case)  # cached on this process's case
    row = _row(entry, plugged["thief"], case)
    assert row["status"] == FAIL and "KeyError" in row["reason"] and "oracle" in row["reason"]


def test_a_global_state_flip_fails_its_row_and_moves_no_other(plugged: dict, entry: Any, case: Any) -> None:
    before = _row(entry, plugged["control"], case)
    row = _row(entry, plugged["flips_state"], case)
    assert row["status"] == FAIL and "flush denormals" in row["reason"] and "default dtype" in row["reason"]
    after = _row(entry, plugged["control"], case)
    assert after["metrics"] == before["metrics"]
    assert torch.get_default_dtype() == torch.float32


def test_autocast_and_backend_precision_left_on_fail_the_row_and_move_no_other(plugged: dict, entry: Any,
                                                                              case: Any) -> None:
    """Structural: the settings the guard restores include autocast and torch's per-backend
    fp32 precision (a plugin that left them on once passed, and the next row in its process ran
    its matmuls in bf16)."""
    before = _row(entry, plugged["control"], case)
    row = _row(entry, plugged["leaks_precision"], case)
    assert row["status"] == FAIL and "autocast cpu" in row["reason"], row.get("reason")
    if hasattr(torch.backends.mkldnn, "matmul"):  # torch 2.9 and later
        assert "backends.mkldnn.matmul.fp32_precision" in row["reason"], row["reason"]
    assert _row(entry, plugged["control"], case)["metrics"] == before["metrics"]


def test_a_plugin_that_patches_its_neighbours_reaches_its_own_rows_only(plugged: dict, entry: Any,
                                                                        case: Any) -> None:
    """Structural: each plugin distribution has a process of its own. One that patches, at load,
    the function every plugin here computes with moves its own row (it fails) and no other: the
    control kernel still passes and its wrong twin still fails. In one shared process the control
    failed."""
    assert _row(entry, plugged["patches_neighbours"], case)["status"] == FAIL
    assert _row(entry, plugged["control"], case)["status"] == PASS
    assert _row(entry, plugged["control_wrong"], case)["status"] == FAIL


def test_a_plugins_own_prediction_does_not_excuse_its_overflow(plugged: dict, entry: Any, case: Any) -> None:
    """Frontier rule, for a plugin: all-NaN outputs with a ``predict`` of the plugin's own that
    says "overflow" fail where the same-dtype baseline is finite (once they were an expected
    overflow, exit status 0); the claim is recorded and quoted."""
    row = _row(entry, plugged["excuses_itself"], case)
    reason = row["verdict"]["reason"]
    assert row["status"] == FAIL, reason
    assert "the same-dtype baseline is finite" in reason and "trust me" in reason, reason
    assert row["prediction"] == {"finite": False, "explanation": "trust me"}


@pytest.mark.parametrize(("module", "case_name", "dtype", "status"),
                         [("moe", "scaled_swiglu", "fp16", EXPECTED_NONFINITE), ("kda", "default", "fp16", FAIL)])
def test_a_plugins_prediction_stands_where_the_baseline_overflows_too(module: str, case_name: str, dtype: str,
                                                                      status: str) -> None:
    """Frontier rule, the other side: our own tiled form, whose overflow our frontier predicts
    (an expected overflow as a built-in row), handed the same prediction as a plugin's claim.
    Where the same-dtype baseline overflows too (MoE's fp16 SwiGLU at a large scale) the claim
    stands, and says so; where the baseline is finite (KDA's fp16 split exponentials, a tiling's
    own overflow) it fails."""
    import dataclasses

    entry = registry.get(module)
    case = entry.make_cases(0)[case_name]
    ours = next(i for i in entry.implementations() if i.form == "tiled" and i.dtype == dtype and case_name in i.cases)
    assert runner.verify(entry, ours, case)["status"] == EXPECTED_NONFINITE
    claimed = dataclasses.replace(ours, predict=lambda c: dataclasses.replace(ours.predict(c), by_plugin=True))
    row = runner.verify(entry, claimed, case)
    assert row["status"] == status, row["verdict"]["reason"]
    told = "overflows too" if status == EXPECTED_NONFINITE else "the same-dtype baseline is finite"
    assert told in row["verdict"]["reason"], row["verdict"]["reason"]


def test_mutated_inputs_fail_the_row_and_stay_in_the_plugin_process(plugged: dict, entry: Any, case: Any) -> None:
    q = case.inputs["q"].clone()
    row = _row(entry, plugged["mutates"], case)
    assert row["status"] == FAIL and "modified its input q in place" in row["reason"], row.get("reason")
    assert torch.equal(case.inputs["q"], q)
    assert _row(entry, plugged["control"], case)["status"] == PASS


def test_an_identity_registered_twice_fails_from_its_second_registration(plugged: dict, entry: Any,
                                                                         case: Any) -> None:
    twins = [i for i in entry.implementations() if i.implementation.startswith("twin")]
    assert [i.implementation for i in twins] == ["twin", "twin (registered again, #2)"]
    rows = [_row(entry, i, case) for i in twins]
    assert [r["status"] for r in rows] == [FAIL, FAIL]
    assert "registered 2 times" in rows[1]["reason"]


def test_the_oracle_checks_name_is_refused(plugged: dict, entry: Any, case: Any) -> None:
    """Structural: a plugin registering ``oracle``, ``definition``, fp64 (the identity of the
    golden oracle check's rows, which once gave a report two such rows and broke its compare)
    fails every row as ``oracle (reserved)``."""
    named = [i for i in entry.implementations() if i.implementation.startswith("oracle")]
    assert [i.implementation for i in named] == ["oracle (reserved)"]
    row = _row(entry, named[0], case)
    assert row["status"] == FAIL and "no registered implementation may use" in row["reason"], row.get("reason")


def test_what_a_plugin_prints_reaches_stderr_without_control_characters(tmp_path: Path) -> None:
    # Its own site of the two plugins it reads: each plugin package starts a process of its own.
    site = tmp_path / "site"
    site.mkdir()
    _install(site, {k: PLUGINS[k] for k in ("print_at_load", "control")})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    done = subprocess.run([sys.executable, "-m", "k3verify", "list", "--json", "--modules", "kda"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loaded" in done.stderr and "\x1b" not in done.stderr + done.stdout and "\\x1b[2J" in done.stderr
    # A line of a million bytes is shown cut, and the next line whole.
    long = [line for line in done.stderr.splitlines() if "yyyy" in line]
    assert long == [f"plugin: {'y' * sandbox.MAX_LINE_BYTES} [line cut at {sandbox.MAX_LINE_BYTES} bytes]"]
    assert "plugin: after" in done.stderr.splitlines()
    listed = {i["implementation"]: i for i in json.loads(done.stdout)}
    assert listed["control"]["available"] and listed["control"]["source"] == "iso-control 0.1 (plugin)"


def test_run_ends_an_exiting_and_a_hanging_plugin_as_failed_rows(tmp_path: Path) -> None:
    """The acceptance case, end to end: ``k3verify run --timeout`` with a plugin that calls
    sys.exit(0) and one that hangs writes a complete report, both rows failed with their reasons,
    and exits 1 (a failed verdict), not 0 and not a crash."""
    site = tmp_path / "site"
    site.mkdir()
    _install(site, {k: PLUGINS[k] for k in ("exit_at_load", "exit_in_run", "hang_in_run", "misshapen", "control")})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "k3verify", "run", "--modules", "kda", "--timeout", "5", "--out",
                           str(out), "--quiet", "--implementations", "exits,hangs,misshapen,odd_params,control,"
                           "control_wrong"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((out / "report.json").read_text())
    rows = {r["implementation"]: r for r in doc["rows"]}
    assert doc["summary"]["rows"] == len(doc["rows"]) == 6  # the six named, one case each
    assert doc["config"]["implementations"] == ["control", "control_wrong", "exits", "hangs", "misshapen",
                                                "odd_params"]
    assert rows["exits"]["status"] == FAIL and "sys.exit(0)" in rows["exits"]["reason"]
    assert rows["misshapen"]["status"] == FAIL and "output 'o': cannot compare shape" in rows["misshapen"]["reason"]
    assert rows["odd_params"]["status"] == PASS
    assert rows["odd_params"]["params"] == {"chunk_size": 64, "acc": "torch.float32", "scale": "tensor([1., 1.])"}
    assert rows["hangs"]["status"] == FAIL and "did not finish within 5 s" in rows["hangs"]["reason"]
    assert rows["control"]["status"] == PASS
    assert {r["implementation"] for r in doc["rows"] if r["status"] == FAIL} == {"exits", "hangs", "misshapen",
                                                                                "control_wrong"}
    assert "FAIL kda exits" in done.stdout and "FAIL kda hangs" in done.stdout


def _frames(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every frame the harness sends to the plugin process from now on."""
    sizes: list[int] = []
    real = sandbox._write_frame

    def recorded(fd: int, payload: bytes) -> None:
        sizes.append(len(payload))
        real(fd, payload)

    monkeypatch.setattr(sandbox, "_write_frame", recorded)
    return sizes


def _fresh(case: Any) -> Any:
    """A case of its own (new tensor objects), as a walk's next step would hold."""
    return type(case)(case.name, {n: t.clone() for n, t in case.inputs.items()}, dict(case.params))


def _outputs(impl: Any, case: Any) -> dict[str, torch.Tensor]:
    return impl.run(case)


def test_inputs_sent_again_cross_once_and_give_the_same_outputs(plugged: dict, case: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Structural (transfer): a walk hands a plugin the same weights call after call. The second
    message asks the plugin process to keep them, the third only names them: it carries none of
    the inputs' bytes. The outputs are the same bits at every call, and the same as a run that
    keeps nothing (every input sent each time)."""
    monkeypatch.setattr(sandbox, "KEEP_MIN_BYTES", 0)
    mine = _fresh(case)
    sizes = _frames(monkeypatch)
    outs = [_outputs(plugged["control"], mine) for _ in range(3)]
    data = sum(t.untyped_storage().nbytes() for t in mine.inputs.values())
    assert sizes[0] > data and sizes[1] > data and sizes[2] < data / 4, (sizes, data)
    monkeypatch.setattr(sandbox, "KEEP_MIN_BYTES", 1 << 62)
    unkept = _outputs(plugged["control"], _fresh(case))
    for out in outs:
        assert out.keys() == unkept.keys() and all(torch.equal(out[n], unkept[n]) for n in out)


def test_an_input_changed_in_place_is_sent_again(plugged: dict, case: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Structural (transfer): an input written in place after it was kept is another input: the
    plugin computes on the new values (as a run on a fresh copy of them does)."""
    monkeypatch.setattr(sandbox, "KEEP_MIN_BYTES", 0)
    mine = _fresh(case)
    for _ in range(3):
        before = _outputs(plugged["control"], mine)
    mine.inputs["v"].mul_(2.0)
    after = _outputs(plugged["control"], mine)
    want = _outputs(plugged["control"], _fresh(mine))
    assert not torch.equal(after["o"], before["o"]) and torch.equal(after["o"], want["o"])


@pytest.mark.parametrize("limit", [1, sandbox.KEEP_MAX_BYTES])
def test_kept_inputs_survive_a_mutating_plugin_a_crash_and_eviction(
        plugged: dict, case: Any, limit: int, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Structural (transfer): a plugin that writes into its inputs works on its own copy and
    fails its call (which makes both sides forget what was kept), a plugin that exits ends the
    process (a new one keeps nothing), and a limit of 1 byte drops every kept tensor the next
    message does not name, never one it names (the third message still carries no input): the
    plugin's outputs for the same inputs never change."""
    monkeypatch.setattr(sandbox, "KEEP_MIN_BYTES", 0)
    monkeypatch.setattr(sandbox, "KEEP_MAX_BYTES", limit)
    mine = _fresh(case)
    sizes = _frames(monkeypatch)
    outs = [_outputs(plugged["control"], mine) for _ in range(3)]
    first = outs[0]
    assert sizes[2] < sum(t.untyped_storage().nbytes() for t in mine.inputs.values()) / 4, sizes
    with pytest.raises(sandbox.PluginError, match="modified its input q in place"):
        for _ in range(3):
            _outputs(plugged["mutates"], mine)
    assert torch.equal(_outputs(plugged["control"], mine)["o"], first["o"])
    with pytest.raises(sandbox.PluginError, match="exit status 0"):
        _outputs(plugged["os_exits"], mine)
    for _ in range(3):
        assert torch.equal(_outputs(plugged["control"], mine)["o"], first["o"])


def test_an_inference_tensor_is_sent_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Structural (transfer, the harness's side alone): a tensor made in inference mode has no
    version counter, so it cannot be told unchanged: it crosses in every message and is never
    kept, where a plain tensor is kept from its second message on."""
    monkeypatch.setattr(sandbox, "KEEP_MIN_BYTES", 0)
    with torch.inference_mode():
        frozen = torch.ones(1 << 10)
    plain = torch.ones(1 << 10)
    kept = sandbox._Kept()
    envelopes = [pickle.loads(sandbox._envelope({"ep": 0, "arg": [frozen, plain]}, kept)) for _ in range(3)]
    assert [list(e["keep"]) for e in envelopes] == [[], [0], []]
    assert all(frozen.untyped_storage().nbytes() < len(e["msg"]) for e in envelopes)


def test_the_record_of_kept_tensors_goes_with_its_holder_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Structural: the harness's record of what a plugin's worker keeps is freed when the last
    reference to it goes, not when the cyclic collector next runs (its stamps' callbacks hold it
    weakly), and a tensor that dies still leaves the record it belongs to."""
    import gc
    import weakref

    monkeypatch.setattr(sandbox, "KEEP_MIN_BYTES", 0)
    t, u = torch.ones(1 << 10), torch.ones(1 << 10)
    kept = sandbox._Kept()
    for _ in range(2):
        sandbox._envelope({"ep": 0, "arg": [t, u]}, kept)
    assert len(kept.seen) == 2 and kept.total > 0
    del u
    assert len(kept.seen) == 1 and kept.drop, "a dead tensor stayed in the record"
    record = weakref.ref(kept)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del kept
        assert record() is None, "the record waits for the cyclic collector"
    finally:
        if enabled:
            gc.enable()
    del t  # its stamp's callback finds no record and does nothing
