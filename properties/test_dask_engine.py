"""The Dask engine of ``k3verify overflow-map`` (:mod:`k3verify.harness.dask_engine`) and of
``k3verify run`` (:mod:`k3verify.harness.dask_run`) on a LocalCluster of two single-threaded
workers: the same cells as the local engine, in the same order; a worker killed mid-sweep; a
cell that aborts its process every time and one that hangs; an interrupted sweep resumed from
its partial file; a run's report equal to the local engine's row for row, and its aborting and
hanging rows.

The map is attnres_backward's quick map, the cheapest quick map (90 cells, about half a second
on the local engine); the fault and resume tests cut it to its first points. attnres_backward's
run is the cheapest too (10 rows, about a second). The run's tests share the file's cluster,
whose workers have imported k3verify by then (a fresh worker's first task takes seconds).
Skipped when dask is not installed (``pip install 'k3verify[dask]'``).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask_planted
import pytest
import torch
import worst_case
from hypothesis import settings

from k3verify import cli
from k3verify.harness import dask_engine, dask_run, registry, runner
from k3verify.harness.files import json_safe
from k3verify.harness.overflow_map import MapOptions, sweep_map
from k3verify.harness.partial import partial_path

pytest.importorskip("distributed", reason="dask is not installed: pip install 'k3verify[dask]'")
cloudpickle = pytest.importorskip("cloudpickle")

# nox -s tests runs this file alone, after the parallel pass (its workers are processes of
# their own; noxfile.py says why).
pytestmark = pytest.mark.dask_cluster

MODULE = "attnres_backward"
QUICK = MapOptions(quick=True)
# Planted entries reach the workers pickled by value, this helper module included.
cloudpickle.register_pickle_by_value(dask_planted)


@pytest.fixture(scope="module")
def cluster_client() -> Iterator[Any]:
    """A client of a LocalCluster of two single-threaded worker processes, for the whole file.
    This process computes with one intra-op thread too while the file runs: its local rows and
    cells are compared with the workers' bit for bit (a sum split over two threads rounds
    otherwise), whatever OMP_NUM_THREADS says. The workers start with Python's own SIGINT
    handler, as under a terminal, even where this process was started with SIGINT ignored (a
    background job of a script, as CI may run it): a process inherits an ignored signal."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with dask_engine.dask_client(dask_engine.DaskOptions(workers=2)) as c:
            yield c
    finally:
        signal.signal(signal.SIGINT, interrupt)
        torch.set_num_threads(threads)


@pytest.fixture
def client(cluster_client: Any) -> Any:
    """The file's client once both workers are registered: a worker that an earlier test killed
    comes back through its nanny, seconds later, and a test must not start with half a cluster."""
    dask_engine.revive(cluster_client)
    cluster_client.wait_for_workers(2, timeout=120)
    return cluster_client


def as_json(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Cells as the map's JSON holds them."""
    return json.loads(json.dumps(json_safe(cells)))


def identity_of(cell: dict[str, Any]) -> str:
    """What tells two cells of a map apart: every sweep key (the metrics and verdicts left out)."""
    measured = {"finite", "rms_ratio", "max_abs", "nonfinite", "overflow", "error", "frontier_adjacent"}
    return json.dumps({k: v for k, v in cell.items() if k not in measured}, sort_keys=True)


def test_the_dask_map_equals_the_local_map_cell_for_cell(client: Any) -> None:
    entry = registry.get(MODULE)
    local = sweep_map(entry, QUICK)
    # What a LocalCluster on a CUDA machine registers (here a worker plugin that finds no device).
    client.register_plugin(dask_engine.OneDevice())
    result = dask_engine.run_sweep(entry, QUICK, client)
    assert len(result.cells) == len(local.cells) == 90
    assert result.cells == as_json(local.cells)
    assert result.meta["agreement"] == local.meta["agreement"]
    engine = result.meta["engine"]
    assert (engine["computed"], engine["failed"], engine["retried"]) == (90, 0, 0)
    # A point's case is built once per worker that runs one of its cells, never once per cell.
    points = len(entry.overflow_map.points(QUICK))
    assert points <= engine["case_builds"] <= 2 * points


def test_a_worker_killed_mid_sweep_loses_no_cell(client: Any, tmp_path: Path) -> None:
    """A cell that kills its worker (SIGKILL) the first time it runs is run again on another and
    computed; every cell is there once, and equal to the local engine's."""
    plants = {"killer": (dask_planted.die_once(tmp_path / "killed"), 2)}
    result = dask_engine.run_sweep(dask_planted.planted_entry(registry.get(MODULE), 6, plants), QUICK, client)
    local = as_json(sweep_map(dask_planted.planted_entry(registry.get(MODULE), 6), QUICK).cells)
    assert (tmp_path / "killed").exists()
    assert result.meta["engine"]["retried"] >= 1 and result.meta["engine"]["failed"] == 0
    assert len(result.cells) == len(local) + 6
    assert len({identity_of(c) for c in result.cells}) == len(result.cells)
    planted = [c for c in result.cells if c["implementation"] == "planted killer"]
    assert [c for c in result.cells if c not in planted] == local
    # The killer computes its form's cell once it lets its worker live, at its target point too.
    first_form = [c for c in local if c["implementation"] == local[0]["implementation"]
                  and c.get("stream_dtype") == local[0].get("stream_dtype")]
    assert [c | {"implementation": "-"} for c in planted] == [c | {"implementation": "-"} for c in first_form]


def test_a_worker_whose_nanny_gave_up_is_started_again(client: Any) -> None:
    """A nanny closes when its worker dies while starting (it restarts only a running one); for a
    LocalCluster it made, the engine starts a worker again under that name (a GPU worker's
    device follows its name), and the sweep ends with both workers there."""
    cluster = client.cluster
    name = sorted(cluster.workers)[0]
    cluster.sync(cluster.workers[name].close)
    deadline = time.monotonic() + 30
    while len(client.nthreads()) > 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(client.nthreads()) == 1
    entry = dask_planted.planted_entry(registry.get(MODULE), 6)
    result = dask_engine.run_sweep(entry, QUICK, client)
    assert result.meta["engine"]["failed"] == 0 and len(result.cells) == len(dask_engine.plan(entry, QUICK, None))
    client.wait_for_workers(2, timeout=60)
    names = sorted(w["name"] for w in client.scheduler_info()["workers"].values())
    assert names == sorted(cluster.worker_spec)


def test_an_aborting_cell_and_a_hanging_cell_fail_with_their_reasons(client: Any) -> None:
    """A cell that aborts its worker every time fails after retries + 1 deaths; one that hangs
    fails at the cell timeout and its worker is restarted; the sweep goes on and every other
    cell equals the local engine's."""
    plants = {"abort": (dask_planted.BEHAVIOURS["abort"], 1), "hang": (dask_planted.BEHAVIOURS["hang"], 3)}
    result = dask_engine.run_sweep(dask_planted.planted_entry(registry.get(MODULE), 5, plants), QUICK, client,
                                   retries=1, cell_timeout=3.0)
    local = as_json(sweep_map(dask_planted.planted_entry(registry.get(MODULE), 5), QUICK).cells)
    failed = {c["implementation"]: c for c in result.cells if "error" in c}
    assert set(failed) == {"planted abort", "planted hang"}
    assert failed["planted abort"]["error"] == "worker died 2 times running this cell"
    assert failed["planted hang"]["error"] == "ran past the cell timeout of 3 s"
    assert not any(c["finite"] for c in failed.values())
    assert [c for c in result.cells if not c["implementation"].startswith("planted")] == local
    assert len(result.cells) == len(local) + 2 * 5
    assert result.meta["engine"]["failed"] == 2


def test_an_interrupted_sweep_resumes_with_the_missing_cells_only(client: Any, tmp_path: Path) -> None:
    entry = dask_planted.planted_entry(registry.get(MODULE), 10)
    partial = partial_path(tmp_path, MODULE)
    total = len(entry.overflow_map.points(QUICK)) * len(entry.overflow_map.forms(QUICK))

    def interrupt_halfway(status: dask_engine.SweepStatus) -> None:
        if status.done >= status.total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        dask_engine.run_sweep(entry, QUICK, client, partial=partial, commit="test", status=interrupt_halfway)
    lines = partial.read_text().splitlines()
    kept = len(lines)
    assert total // 2 <= kept < total
    # Two cells edited into the wrong types (the file is anyone's to edit): computed again, where
    # they once reached the figures and ended every rerun with a TypeError.
    for i, edit in ((0, {"rms_ratio": "x"}), (1, {"finite": "yes"})):
        record = json.loads(lines[i])
        lines[i] = json.dumps(record | {"cell": record["cell"] | edit})
    partial.write_text("\n".join(lines) + "\n")
    result = dask_engine.run_sweep(entry, QUICK, client, partial=partial, commit="test")
    engine = result.meta["engine"]
    assert (engine["resumed"], engine["computed"]) == (kept - 2, total - kept + 2)
    assert result.cells == as_json(sweep_map(entry, QUICK).cells)
    # Another commit's cells are never taken.
    again = dask_engine.run_sweep(entry, QUICK, client, partial=tmp_path / "other.jsonl", commit="another")
    assert again.meta["engine"]["resumed"] == 0



def test_the_workers_leave_ctrl_c_to_the_client(client: Any) -> None:
    """Structural: every worker of the LocalCluster, those its nanny started again after the
    kills above among them, ignores SIGINT, so a Ctrl-C in the terminal (sent to the whole
    process group) ends the sweep through the client alone; before, each worker printed its own
    KeyboardInterrupt traceback. The workers started with Python's own handler (the fixture), so
    without the plugin the probe is False in each."""

    def ignores() -> bool:
        import signal

        return signal.getsignal(signal.SIGINT) is signal.SIG_IGN

    assert client.run(ignores) == {w: True for w in client.scheduler_info()["workers"]}


def test_the_command_line_writes_the_map_and_drops_its_partial_file(client: Any, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``overflow-map --engine dask --scheduler ADDRESS`` (the file's cluster) writes the local
    engine's map and removes the partial file."""
    out = tmp_path / "maps"
    assert cli.main(["overflow-map", "--module", MODULE, "--quick", "--out", str(out), "--engine", "dask",
                     "--scheduler", client.scheduler.address]) == 0
    doc = json.loads((out / f"{MODULE}_overflow_map.json").read_text())
    assert doc["cells"] == as_json(sweep_map(registry.get(MODULE), QUICK).cells)
    assert doc["meta"]["engine"]["workers"] == 2
    assert not (out / ".partial").exists()
    assert "90 cells" in capsys.readouterr().out


def test_a_dask_maps_log_names_a_long_study_after_its_cells(client: Any, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Rule: structural. With ``--engine dask`` the module's studies run after the cells, here,
    and a log names one that takes long in its "still running" line, after the cells' last
    count (the AttnRes depth drift compiles its kernels: two minutes with no cell ending). The
    study's curve is written beside the map. Without ``doing`` the line names nothing."""
    entry = dask_planted.slow_study_entry(registry.get(MODULE), 2, "slow_study.json")
    cells = len(dask_engine.plan(entry, QUICK, None))
    monkeypatch.setattr(registry, "select", lambda names: [entry])
    monkeypatch.setattr(cli, "_progress", lambda console: cli.LineProgress(console, quiet_s=0.2))
    assert cli.main(["overflow-map", "--module", MODULE, "--quick", "--out", str(tmp_path), "--engine", "dask",
                     "--scheduler", client.scheduler.address]) == 0
    lines = capsys.readouterr().err.splitlines()
    study = [line for line in lines if line.endswith("still running: study slow_study.json")]
    assert study and all(f"overflow map: {cells}/{cells} " in line for line in study), lines
    assert json.loads((tmp_path / "slow_study.json").read_text())["title"] == "slow"


def test_dask_options_need_the_dask_engine_and_dask(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    args = ["overflow-map", "--module", MODULE, "--quick", "--out", str(tmp_path / "maps")]
    assert cli.main([*args, "--workers", "2"]) == 2
    assert "--workers: only with --engine dask" in capsys.readouterr().err
    assert cli.main([*args, "--engine", "dask", "--workers", "2", "--scheduler", "tcp://127.0.0.1:1"]) == 2
    assert "not both" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "distributed", None)  # as if it were not installed
    assert cli.main([*args, "--engine", "dask"]) == 2
    assert "pip install 'k3verify[dask]'" in capsys.readouterr().err
    assert not (tmp_path / "maps").exists()


def test_the_resume_key_changes_with_any_source_file(tmp_path: Path) -> None:
    """Cells are reused only by the same code: the source digest in the key moves when a file of
    the package changes, is added or is renamed, whatever the commit says."""
    from k3verify.harness.environment import code_version, source_digest

    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "a.py").write_text("x = 1\n")
    (package / "sub" / "b.py").write_text("y = 2\n")
    seen = {source_digest(package)}
    (package / "a.py").write_text("x = 2\n")
    seen.add(source_digest(package))
    (package / "c.py").write_text("")
    seen.add(source_digest(package))
    (package / "sub" / "b.py").rename(package / "sub" / "d.py")
    seen.add(source_digest(package))
    assert len(seen) == 4
    assert code_version().endswith(source_digest(Path(dask_engine.__file__).resolve().parents[1]))


# --- k3verify run --engine dask ---------------------------------------------------------------


def comparable(rows: list[dict[str, Any]]) -> list[str]:
    """Rows as JSON text without the seconds an implementation ran (NaN equal to NaN)."""
    return [json.dumps(json_safe({k: v for k, v in row.items() if k != "wall_s"}), sort_keys=True) for row in rows]


def test_the_dask_run_writes_the_local_report_row_for_row(client: Any, tmp_path: Path) -> None:
    """The same command on both engines (the oracle's golden check included, in the client)."""
    goldens = Path(__file__).resolve().parents[1] / "golden"
    args = ["run", "--modules", MODULE, "--goldens", str(goldens), "--quiet", "--format", "json"]
    assert cli.main([*args, "--out", str(tmp_path / "local")]) == 0
    assert cli.main([*args, "--out", str(tmp_path / "dask"), "--engine", "dask",
                     "--scheduler", client.scheduler.address]) == 0
    local, dask = (json.loads((tmp_path / name / "report.json").read_text()) for name in ("local", "dask"))
    golden_files = int(local["config"]["oracle_check"].split()[0])  # "2 golden files of DIR": a row each
    assert len(dask["rows"]) == len(local["rows"]) == 10 + golden_files
    assert comparable(dask["rows"]) == comparable(local["rows"])
    assert dask["summary"] == local["summary"]
    assert dask["config"]["oracle_check"] == local["config"]["oracle_check"]
    engine = dask["config"]["engine"]
    assert (engine["workers"], engine["computed"], engine["failed"], engine["retried"]) == (2, 10, 0, 0)


def test_an_aborting_row_and_a_hanging_row_fail_with_their_reasons(client: Any) -> None:
    """A row that aborts its worker every time fails after retries + 1 deaths; one that hangs
    fails at the row timeout and its worker is restarted; every other row equals the local one."""
    plants = {"abort": dask_planted.BEHAVIOURS["abort"], "hang": dask_planted.BEHAVIOURS["hang"]}
    entry = dask_planted.planted_rows_entry(registry.get(MODULE), plants)
    rows, engine = dask_run.run_rows(runner.plan([entry]), client, retries=1, row_timeout=3.0)
    failed = {row["implementation"]: row for row in rows if row["implementation"].startswith("planted")}
    assert failed["planted abort"]["reason"] == "worker died 2 times running this row"
    assert failed["planted hang"]["reason"] == "ran past the row timeout of 3 s"
    assert {row["status"] for row in failed.values()} == {"fail"}
    local = list(runner.run([registry.get(MODULE)]))
    assert comparable([row for row in rows if row not in failed.values()]) == comparable(local)
    assert len(rows) == len(local) + 2
    assert (engine["failed"], engine["computed"]) == (2, len(local))


def test_the_engine_options_of_run_and_what_dask_does_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report"
    args = ["run", "--modules", MODULE, "--out", str(out)]
    for extra, message in (
        (["--workers", "2"], "--workers: only with --engine dask"),
        (["--row-timeout", "5"], "--row-timeout: only with --engine dask"),
        (["--engine", "dask", "--workers", "2", "--scheduler", "tcp://127.0.0.1:1"], "not both"),
        (["--engine", "dask", "--time"], "--time: not with --engine dask"),
        (["--engine", "dask", "--tp", "2"], "--tp: not with --engine dask"),
    ):
        assert cli.main([*args, *extra]) == 2, extra
        assert message in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "distributed", None)  # as if it were not installed
    assert cli.main([*args, "--engine", "dask"]) == 2
    assert "pip install 'k3verify[dask]'" in capsys.readouterr().err
    assert not out.exists()


def test_the_worst_case_search_on_dask_equals_the_local_search(client: Any) -> None:
    """``nox -s nightly -- --nightly-engine dask``: a module's search as a Dask task draws the
    same examples and finds the same maxima as in this process (rule: bitwise, one host, one
    intra-op thread on both sides); a search that fails comes back with its reason as text."""
    futures = worst_case.submit_searches(client, ["kda", "no_such_module"], budget_s=60, run_seed=0,
                                         profile=settings.default, max_examples=2)
    local = worst_case.search("kda", budget_s=60, run_seed=0, max_examples=2)  # while the workers search
    remote = futures["kda"].result()
    assert remote["error"] is None
    assert {k: v for k, v in remote["result"].items() if k != "wall_s"} == {
        k: v for k, v in local.items() if k != "wall_s"}
    assert remote["result"]["examples"] == 2 and remote["result"]["worst"] is not None
    failed = futures["no_such_module"].result()
    assert failed["error"].startswith("UnknownModuleError: unknown module 'no_such_module'")
