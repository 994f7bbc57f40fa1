"""The plugin workers' zygote (:mod:`k3verify.harness.zygote`): a worker forked from it starts as a
fresh process would, whatever changed in the harness since the zygote started; a worker that a
signal ends is named with its signal; a zygote that dies is started again; and it ends with the
harness. Rule: structural (what a process sees and how it ends; no numbers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from k3verify.harness import sandbox, zygote

WORKER = "k3verify.harness.sandbox:_worker_main"

# A plugin "entry point" whose loading reports what its process sees, in the error it raises.
_PROBE = textwrap.dedent("""
    import json, os, random, signal, sys
    def made():
        if os.environ.get("K3V_PROBE_SIGNAL"):
            os.kill(os.getpid(), int(os.environ["K3V_PROBE_SIGNAL"]))
        seen = {"env": os.environ.get("K3V_PROBE"), "cwd": os.getcwd(), "random": random.random(),
                "pid": os.getpid(), "sid": os.getsid(0), "stdin": os.readlink("/proc/self/fd/0"),
                "numpy.random": "numpy.random" in sys.modules}
        raise RuntimeError("PROBE" + json.dumps(seen) + "PROBE")
""")


def _site(folder: Path, module: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{module}.py").write_text(_PROBE)
    return folder


def _seen(module: str) -> dict[str, Any]:
    """What a new worker that loads ``module`` sees (its own host, stopped afterwards)."""
    host = sandbox.Host([("probe", f"{module}:made")])
    try:
        with pytest.raises(sandbox.PluginError) as info:
            host.request({"op": "describe", "ep": 0, "spec": host.specs[0]}, "the probe")
    finally:
        host.stop()
    return json.loads(str(info.value).split("PROBE")[1])


@pytest.fixture
def on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    def add(name: str) -> None:
        monkeypatch.syspath_prepend(str(_site(tmp_path / name, name)))

    return add


def test_a_worker_sees_the_harness_as_it_is_now(on_path: Any, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment, working directory and ``sys.path`` changed after the zygote started (a
    module written then, in a folder added then) reach the next worker; each worker has its own
    session, /dev/null for input and its own random sequence."""
    on_path("probe_before")
    first = _seen("probe_before")  # starts the zygote if this process has none yet
    monkeypatch.setenv("K3V_PROBE", "set after the zygote started")
    work = tmp_path / "elsewhere"
    work.mkdir()
    monkeypatch.chdir(work)
    on_path("probe_after")
    second = _seen("probe_after")
    assert first["env"] is None
    assert second["env"] == "set after the zygote started"
    assert second["cwd"] == str(work)
    assert first["random"] != second["random"]
    for seen in (first, second):
        assert seen["sid"] == seen["pid"] and seen["stdin"] == os.devnull
        assert not seen["numpy.random"]  # else its global generator would need seeding in the fork


def test_a_worker_a_signal_ends_is_named_with_it(on_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash is reported with the signal's number, as ``subprocess`` reports it."""
    on_path("probe_crash")
    monkeypatch.setenv("K3V_PROBE_SIGNAL", str(int(signal.SIGSEGV)))
    host = sandbox.Host([("probe", "probe_crash:made")])
    with pytest.raises(sandbox.PluginError, match=rf"exit status -{int(signal.SIGSEGV)}\)"):
        host.request({"op": "describe", "ep": 0, "spec": host.specs[0]}, "the probe")


def test_a_zygote_that_died_is_started_again(on_path: Any) -> None:
    """Killed (out of memory, by hand), the zygote is started again by the next worker's start."""
    on_path("probe_again")
    _seen("probe_again")
    old = zygote._ZYGOTES[WORKER].proc
    assert old is not None
    os.kill(old.pid, signal.SIGKILL)
    old.wait()
    assert _seen("probe_again")["pid"] > 0  # a worker answered
    assert zygote._ZYGOTES[WORKER].proc is not None and zygote._ZYGOTES[WORKER].proc.pid != old.pid


def test_the_zygote_ends_with_the_harness(on_path: Any, tmp_path: Path) -> None:
    """Even a harness that ends without its exit handlers (``os._exit``) leaves no zygote."""
    site = _site(tmp_path / "probe_exit", "probe_exit")
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(site)!r})
        from k3verify.harness import sandbox, zygote
        host = sandbox.Host([("probe", "probe_exit:made")])
        try:
            host.request({{"op": "describe", "ep": 0, "spec": host.specs[0]}}, "the probe")
        except sandbox.PluginError:
            pass
        print(zygote._ZYGOTES[{WORKER!r}].proc.pid, flush=True)
        os._exit(0)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    pid = int(done.stdout.split()[-1])
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its reaper has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_zygote_that_cannot_start_says_so_at_once() -> None:
    """A worker target that does not import ends the zygote while it starts: the error names the
    target and its exit status (it said the zygote "did not start within 600 s")."""
    r, w = os.pipe()
    try:
        with pytest.raises(zygote.StartError, match=r"'no_such_module_k3v:run' ended while starting \(exit status 1"):
            zygote.fork_worker("no_such_module_k3v:run", r, w, 600.0)
    finally:
        os.close(r)
        os.close(w)
        zygote._ZYGOTES.pop("no_such_module_k3v:run", None)
