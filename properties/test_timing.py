"""``k3verify run --time``: each kernel row's median time, and its time over its registered peer's.

Rules: structural. No test here asserts how fast anything is: the clock is replaced by a counter
where the median logic is checked, and the end-to-end checks read the report's structure (which
rows are timed, which peer each names, ratio = median / peer's median by arithmetic) and one
lower bound a sleep guarantees.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from plugin_site import install_plugin
from quick_forms import without_kernels

from k3verify import mla
from k3verify.cli import main
from k3verify.harness import registry, report, runner, timing
from k3verify.harness.registry import Peer

# Two plugins: a "kernel" that is MLA's recurrent form slowed by a sleep, with our fp32 recurrent
# form as its peer; one that names a peer this run has not got.
PLUGIN = """
import time
from k3verify import mla
from k3verify.harness.registry import Peer, implementation

def slow(*args, **kw):
    time.sleep(0.1)
    return mla.recurrent(*args, **kw)

def implementations():
    return [implementation("mla", slow, name="sleepy decode", form="kernel", dtype="fp32",
                           peer=Peer("k3verify", "recurrent")),
            implementation("mla", mla.recurrent, name="lonely decode", form="kernel", dtype="fp32",
                           peer=Peer("fla-core", "kernel:chunk_kda"))]
"""


class FakeClock:
    """``perf_counter`` that moves only when the timed call moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.parametrize(("steps", "repeats", "median"), [
    ((0.01,), timing.MAX_REPEATS, 0.01),  # fast calls: as many as the budget allows, up to the cap
    ((0.6, 0.2, 0.9), timing.MIN_REPEATS, 0.6),  # slow calls: the minimum count, past the budget
])  # fmt: skip
def test_the_cpu_clock_takes_the_median_of_its_calls(monkeypatch: pytest.MonkeyPatch, steps: tuple[float, ...],
                                                     repeats: int, median: float) -> None:
    clock = FakeClock()
    monkeypatch.setattr(timing, "time", clock)
    monkeypatch.setattr(timing, "clock", lambda: "cpu")
    calls = []

    def fn() -> None:
        clock.now += steps[len(calls) % len(steps)]
        calls.append(1)

    got = timing.measure(fn)
    assert got == {"median_s": pytest.approx(median), "repeats": repeats, "clock": "cpu"}
    assert len(calls) == repeats  # no untimed call: the verdict's own call was the warm-up


@pytest.mark.parametrize("bad", [
    None, [], {"median_s": float("nan"), "repeats": 3, "clock": "cpu"},
    {"median_s": -1.0, "repeats": 3, "clock": "cpu"},
    {"median_s": 1, "repeats": 3, "clock": "cpu"}, {"median_s": 1.0, "repeats": True, "clock": "cpu"},
    {"median_s": 1.0, "repeats": 0, "clock": "cpu"}, {"median_s": 1.0, "repeats": 3, "clock": "tpu"},
])  # fmt: skip
def test_a_timing_from_another_process_is_checked(bad: Any) -> None:
    with pytest.raises(ValueError, match="the timing of plug"):
        timing.checked(bad, "plug")
    assert timing.checked({"median_s": 0.5, "repeats": 3, "clock": "cuda", "x": 1}, "plug") == {
        "median_s": 0.5, "repeats": 3, "clock": "cuda"}


@pytest.fixture(scope="module")
def timed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, str, str]:
    """An MLA run (our kernels left out, for time) with the two plugins, under ``--time``."""
    out = tmp_path_factory.mktemp("timed")
    site = out / "site"
    site.mkdir()
    install_plugin(site, dist="timed-mla", module="timed_mla", source=PLUGIN, extends="mla")
    with pytest.MonkeyPatch.context() as mp:
        without_kernels(mp, "mla")
        mp.syspath_prepend(str(site))
        registry.reload_plugins()
        try:
            code = main(["run", "--modules", "mla", "--time", "--out", str(out / "r"), "--goldens", "none",
                         "--implementations", "sleepy decode,lonely decode,k3verify"])
        finally:
            mp.undo()
            registry.reload_plugins()
    assert code == 0
    r = out / "r"
    return report.load(r), (r / "report.md").read_text(), (r / "report.html").read_text(), str(r)


def _row(doc: dict[str, Any], implementation: str, form: str, dtype: str, case: str = "default") -> dict[str, Any]:
    (row,) = [r for r in doc["rows"] if (r["implementation"], r["form"], r["dtype"], r["case"])
              == (implementation, form, dtype, case)]
    return row


def test_a_plugin_kernel_is_timed_in_its_worker_beside_its_peer(timed_run: tuple) -> None:
    doc, *_ = timed_run
    mine, peer = _row(doc, "sleepy decode", "kernel", "fp32"), _row(doc, "k3verify", "recurrent", "fp32")
    assert mine["status"] == "pass" and mine["time"]["clock"] == timing.clock() == doc["config"]["time"]
    assert mine["time"]["repeats"] >= timing.MIN_REPEATS
    assert mine["time"]["median_s"] >= 0.1  # its sleep: a lower bound, whatever the machine
    # The peer is timed because it is named, though not a kernel; the ratio is the medians' quotient.
    assert mine["time"]["peer"] == report.row_heading(peer)
    assert mine["time"]["ratio"] == mine["time"]["median_s"] / peer["time"]["median_s"]
    assert "peer" not in peer["time"] and "ratio" not in peer["time"]


def test_only_kernels_and_named_peers_are_timed(timed_run: tuple) -> None:
    doc, *_ = timed_run
    timed = {(r["implementation"], r["form"], r["dtype"], r["case"]) for r in doc["rows"] if "time" in r}
    assert timed == {("sleepy decode", "kernel", "fp32", "default"), ("lonely decode", "kernel", "fp32", "default"),
                     ("k3verify", "recurrent", "fp32", "default")}, timed


def test_a_peer_not_in_the_run_is_said(timed_run: tuple) -> None:
    doc, *_ = timed_run
    lonely = _row(doc, "lonely decode", "kernel", "fp32")["time"]
    assert lonely["peer_note"] == "peer fla-core kernel:chunk_kda not in this run" and "ratio" not in lonely


def test_the_pages_show_verdict_and_speed_in_one_table_labelled_cpu(timed_run: tuple) -> None:
    doc, md, page, _ = timed_run
    speed = md.split("## Speed", 1)[1].split("\n## ", 1)[0]
    assert ("Taken on the CPU" in speed and "interpreter" in speed) == (timing.clock() == "cpu")
    line = next(x for x in speed.splitlines() if x.startswith("| mla sleepy decode"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "pass" and cells[4] == timing.clock() and cells[5] == f"{_ratio(doc):.2f}"
    assert cells[6] == "mla k3verify recurrent fp32 (default)"
    assert "<h2 id='speed'>Speed</h2>" in page and "mla sleepy decode kernel fp32 (default) [o]" in page


def _ratio(doc: dict[str, Any]) -> float:
    return _row(doc, "sleepy decode", "kernel", "fp32")["time"]["ratio"]


def test_a_run_without_time_has_no_times(monkeypatch: pytest.MonkeyPatch) -> None:
    without_kernels(monkeypatch, "mla")
    rows = list(runner.run([registry.get("mla")], names={"k3verify"}))
    assert rows and not [r for r in rows if "time" in r]
    assert "## Speed" not in report.markdown(report.build(rows, environment={}, config={}, command=[]))


def test_a_timing_that_raises_leaves_the_verdict_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def once(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("out of device memory on the second call")
        return mla.recurrent(*args, **kw)

    entry = registry.get("mla")
    flaky = registry.implementation("mla", once, name="flaky", form="kernel", dtype="fp32")
    monkeypatch.setitem(registry._REGISTRY, "mla", dataclasses.replace(entry, own_implementations=lambda: [flaky]))
    (row,) = runner.run([registry.get("mla")], time_kernels=True)
    assert row["status"] == "pass"
    assert row["time"] == {"error": "RuntimeError: out of device memory on the second call"}
    cells = report.speed_rows([row])[0]
    assert cells[3] == "-" and cells[6].startswith("not timed: RuntimeError")


def test_the_time_key_is_checked_when_a_report_is_read(timed_run: tuple, tmp_path: Path) -> None:
    *_, folder = timed_run
    doc = json.loads((Path(folder) / "report.json").read_text())
    row = next(r for r in doc["rows"] if "time" in r)
    row["time"]["median_s"] = "fast"
    (tmp_path / "report.json").write_text(json.dumps(doc))
    with pytest.raises(report.UsageError, match=r"'s time\.median_s is a str"):
        report.load(tmp_path)


def test_peers_registered_by_our_kernels_name_rows_that_exist() -> None:
    """Every peer one of our kernels names is a registered implementation of its module with the
    same dtype and a shared case (on a GPU its row runs beside ours)."""
    named = 0
    for module in registry.module_names():
        impls = registry.get(module).implementations()
        for impl in impls:
            if impl.peer is None or impl.source != registry.BUILTIN_SOURCE:
                continue
            named += 1
            spec = dataclasses.asdict(impl.peer)
            matches = [p for p in impls if p.dtype == impl.dtype and set(p.cases) & set(impl.cases)
                       and timing._matches(runner.row_header(p, registry.Case("x", {})), spec)]
            assert matches, f"{impl.label} names {impl.peer}, which no {module} implementation is"
    assert named >= 8
    assert Peer("fla-core", "kernel:chunk_kda").params == {}


def test_a_peer_that_did_not_run_is_named_with_the_first_line_of_its_reason() -> None:
    """A compiler's many-line error as the peer's reason: the note keeps its first line."""
    base = {"module": "mla", "case": "default", "dtype": "bf16", "params": {}, "status": "pass", "margin": 0.5}
    mine = base | {"implementation": "k3verify", "form": "kernel:prefill", "time": {
        "median_s": 0.002, "repeats": 5, "clock": "cuda",
        "peer_of": {"implementation": "torch sdpa", "form": "kernel:prefill", "params": {"backend": "efficient"}}}}
    peer = base | {"implementation": "torch sdpa", "form": "kernel:prefill", "params": {"backend": "efficient"},
                   "status": "fail", "reason": "CompilationError: at 18:23:\n    x = tl.arange(0, 7)\n" + "^" * 500}
    other = peer | {"params": {"backend": "flash"}, "reason": "not this one"}
    timing.with_peer_ratios([mine, other, peer])
    assert mine["time"] == {"median_s": 0.002, "repeats": 5, "clock": "cuda",
                            "peer_note": "peer torch sdpa kernel:prefill not timed: CompilationError: at 18:23:"}


def test_the_cuda_clock_stretches_do_benchs_window_for_a_long_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """do_bench repeats a call as often as its window holds it; a 0.5 s call gets a window of
    MIN_REPEATS calls and a half (the device and do_bench replaced: the arithmetic is checked)."""
    import triton.testing

    clock = FakeClock()
    seen = {}

    def do_bench(fn: Any, warmup: float, rep: float, return_mode: str) -> list[float]:
        seen.update(warmup=warmup, rep=rep, return_mode=return_mode)
        return [3.0, 1.0, 2.0]

    monkeypatch.setattr(timing, "time", clock)
    monkeypatch.setattr(timing, "clock", lambda: "cuda")
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(triton.testing, "do_bench", do_bench)

    def call() -> None:
        clock.now += 0.5

    assert timing.measure(call) == {"median_s": 0.002, "repeats": 3, "clock": "cuda"}
    assert seen == {"warmup": timing.CUDA_WARMUP_MS, "rep": 1.5 * timing.MIN_REPEATS * 500, "return_mode": "all"}
    timing.measure(lambda: None)  # a short call keeps the usual window
    assert seen["rep"] == timing.CUDA_REP_MS
