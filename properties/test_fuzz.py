"""Fuzzing the files and arguments k3verify accepts from outside: golden manifests and files,
report JSON, and command lines. Whatever Hypothesis makes of them, k3verify answers with a
problem list or an exit status (0, 1, 2) and one-line messages; it never raises another
exception, never passes an edited golden folder and never writes outside the folder it was
given.

Rules: structural. Each test fixes its example count (``FUZZ_EXAMPLES``, derandomised) instead of
taking the profile's, so CI runs the same adversarial cases on every host. ``K3V_FUZZ_EXAMPLES=N``
runs N fresh random examples per test instead (for a long exploring run).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from golden_memo import memoised_golden_cases
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3verify.cli import main
from k3verify.harness import golden, report, runner
from k3verify.harness.files import UsageError

# The harness around the rows is under test, not the kernels: Triton's interpreter off
# (conftest ``without_interpreter``).
pytestmark = pytest.mark.usefixtures("without_interpreter")

FUZZ_EXAMPLES = int(os.environ.get("K3V_FUZZ_EXAMPLES", "150"))
fuzz = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize="K3V_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# Values an attacker or an accident puts into a JSON document.
NASTY_STRINGS = st.sampled_from([
    "../x", "../../etc/passwd", "/dev/zero", "/proc/self/mem", "mla/../../x.safetensors", "", ".", "..",
    "k3verify.harness.environment:subprocess.run", "os:system", "k3verify.mla.cache:LatentCache",
    "mla/default.safetensors", "pass", "fail", "unavailable", "expected-nonfinite", "\x00", "a" * 300,
    "float64", "int64", "bfloat16", "NaN", "Infinity",
])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False,
                    allow_infinity=False), NASTY_STRINGS, st.text(max_size=12))
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                            st.dictionaries(NASTY_STRINGS, inner, max_size=3)),
                           max_leaves=6)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys and indices) into a JSON document, the root excluded."""
    out = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        out.append((*prefix, key))
        out += _paths(value, (*prefix, key))
    return out


@st.composite
def mutations(draw: st.DrawFn, doc: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A copy of ``doc`` with one value replaced, one key deleted or one key added somewhere."""
    new = copy.deepcopy(doc)
    path = draw(st.sampled_from(_paths(doc)))
    parent = new
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    kind = draw(st.sampled_from(["replace", "delete", "add"]))
    if kind == "replace":
        parent[last] = draw(JSON_VALUES)
    elif kind == "delete":
        del parent[last]
    elif isinstance(parent, dict):
        parent[draw(NASTY_STRINGS)] = draw(JSON_VALUES)
    else:
        parent.append(draw(JSON_VALUES))
    return new, f"{kind} {'/'.join(map(str, path))}"


# --- golden manifests and files ---------------------------------------------------------------


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """MLA's goldens; while the module's tests run, the check's regeneration of the cases is
    memoised per seed (it is deterministic, and 0.12 s of every example otherwise)."""
    out = tmp_path_factory.mktemp("fuzz") / "golden"
    golden.generate(out, modules=["mla"])
    with memoised_golden_cases():
        yield out


@contextlib.contextmanager
def _copy(made: Path) -> Iterator[Path]:
    """A golden folder sharing ``made``'s files (hard links: a test replaces, never edits, them)."""
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "golden"
        shutil.copytree(made, target, copy_function=os.link)
        (target / golden.MANIFEST).unlink()
        shutil.copy(made / golden.MANIFEST, target / golden.MANIFEST)
        yield target


def _problems(folder: Path) -> list[str]:
    try:
        return golden.check(folder)
    except golden.GoldenError as exc:
        return [str(exc)]


@pytest.mark.parametrize("reseal", [False, True], ids=["as edited", "digests resealed"])
def test_fuzzed_manifests_never_pass_or_crash(made: Path, reseal: bool) -> None:
    doc = json.loads((made / golden.MANIFEST).read_text())

    @fuzz
    @given(mutation=mutations(doc))
    def check(mutation: tuple[dict[str, Any], str]) -> None:
        new, what = mutation
        if reseal and isinstance(new.get("digests"), dict):
            new["digests"] = golden.digests(new)
        with _copy(made) as folder:
            (folder / golden.MANIFEST).write_text(json.dumps(new))
            problems = _problems(folder)
            only_platform = what.startswith(("replace platform/", "add platform")) and reseal
            if new != doc and not only_platform:
                assert problems, f"{what}: an edited manifest checks out"

    check()


@fuzz
@given(offset=st.integers(0, 10**7), bits=st.integers(1, 255), which=st.integers(0, 3))
def test_fuzzed_golden_bytes_are_caught(made: Path, offset: int, bits: int, which: int) -> None:
    files = sorted(p.relative_to(made) for p in made.rglob("*.safetensors"))
    rel = files[which % len(files)]
    with _copy(made) as folder:
        data = bytearray((folder / rel).read_bytes())
        data[offset % len(data)] ^= bits
        (folder / rel).unlink()
        (folder / rel).write_bytes(bytes(data))
        problems = _problems(folder)
        assert problems and any(str(folder / rel) in p for p in problems)


# --- reports ----------------------------------------------------------------------------------

BASELINE = Path(__file__).resolve().parents[1] / "reports" / "baseline" / "cpu"


def _small_report() -> dict[str, Any]:
    """The committed baseline cut to one row per status, and one of the oracle's rows (fuzzing
    the whole report is slow): a fresh copy on every call, the 2.4 MB baseline parsed once."""
    return copy.deepcopy(_small_report_once())


@functools.cache
def _small_report_once() -> dict[str, Any]:
    doc = json.loads((BASELINE / "report.json").read_text())
    rows, seen = [], set()
    for row in doc["rows"]:
        kind = (row["status"], row["implementation"] == "oracle")
        if kind not in seen:
            seen.add(kind)
            rows.append(row)
    return doc | {"rows": rows, "summary": report.summarize(rows)}


@pytest.mark.parametrize("side", ["base", "new"])
def test_fuzzed_reports_compare_or_are_refused(side: str, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _small_report()

    @fuzz
    @given(mutation=mutations(doc))
    def check(mutation: tuple[dict[str, Any], str]) -> None:
        new, what = mutation
        with tempfile.TemporaryDirectory() as tmp:
            good, bad = Path(tmp) / "good", Path(tmp) / "bad"
            for folder, content in ((good, doc), (bad, new)):
                folder.mkdir()
                (folder / "report.json").write_text(json.dumps(content))
            args = [str(bad), str(good)] if side == "base" else [str(good), str(bad)]
            code = main(["report", "compare", *args])
            err = capsys.readouterr().err
            assert code in (0, 1, 2), what
            assert "Traceback" not in err and len(err.strip().splitlines()) <= 1, (what, err)
            if side == "new" and re.fullmatch(r"delete rows/\d+", what):
                assert code in (1, 2), f"{what}: a removed row compared clean"

    check()


# --- command lines ----------------------------------------------------------------------------

ARGS = st.sampled_from([
    "run", "list", "overflow-map", "golden", "generate", "verify", "report", "compare", "render",
    "--modules", "--out", "--seed", "--maps", "--module", "--quick", "--dir", "--error-growth", "--margin-drop",
    "--error-factor", "kda", "mla", "attnres", "moe", "nope", "kda,nope", ",", "", "out", "a_file", "a_file/below",
    "../up", "/proc/k3verify", "/dev/null", "nan", "inf", "-1", "0", "1", str(2**64), "1e400", "-", "--",
    "--help-me", "report.json",
])


@fuzz
@given(argv=st.lists(ARGS, min_size=1, max_size=7))
def test_fuzzed_command_lines_end_in_an_exit_status(argv: list[str], monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Long computations are stubbed (a row per module, a tiny map): what is fuzzed is argument
    handling, path checks and error reporting. Nothing is written outside the working folder."""
    row = {"module": "mla", "implementation": "i", "form": "f", "dtype": "fp64", "params": {}, "case": "c",
           "rule": "fp64-agreement", "status": "pass", "verdict": {"err": 0.0, "limit": 1e-10}, "margin": 1.0}
    monkeypatch.setattr(runner, "run", lambda entries, seed, progress, **kw: iter([row]))
    monkeypatch.setattr(runner, "plan", lambda entries, *args, **kw: [row])  # one row planned, one made
    monkeypatch.setattr(golden, "generate", _no_generate)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "a" / "b"
        work.mkdir(parents=True)
        (work / "a_file").write_text("x")
        monkeypatch.chdir(work)
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse: usage errors and --help
            code = exc.code
        err = capsys.readouterr().err
        assert code in (0, 1, 2), (argv, code, err)
        assert "Traceback" not in err, (argv, err)
        assert (work / "a_file").read_text() == "x"
        outside = [p for p in Path(tmp).rglob("*") if work not in (p, *p.parents) and p.is_file()
                   and not p.name.endswith("k3verify-lock")]
        assert not [p for p in outside if p.parent != Path(tmp) / "a"], outside


def _no_generate(out_dir: Path, **kwargs: Any) -> dict[str, Any]:
    from k3verify.harness.files import check_output_folder

    check_output_folder(out_dir, "--dir")
    if kwargs.get("seed", 0) < 0:
        raise UsageError("negative seed")
    return {"files": {}}
